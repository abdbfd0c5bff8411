#!/usr/bin/env bash
# llama.cpp's CUDA benchmarks (llama-bench, llama-batched-bench), so that our GPU figures stand
# beside llama.cpp's on the same GPU in the same sitting (benchmarks/llama_cpp_cuda_anchors.py).
#
#   bash benchmarks/llama_cpp_cuda.sh build SOURCE.tar.xz WORKDIR   # the tools, in WORKDIR/build/bin
#   bash benchmarks/llama_cpp_cuda.sh libs                          # the folders to run them with
#
# SOURCE.tar.xz is the llama.cpp vendored in llama-cpp-python 0.3.36 (the version the reference
# data and the CPU anchors come from), cut to what the two tools need (tests/gpu/prepare_carry.sh
# makes it, builds the tools here and carries them: on 2 cores the build takes about an hour).
# Built as llama.cpp's README builds CUDA (its defaults: CUDA graphs, flash attention, MMQ where
# it picks it), for sm_90 alone (H100 / H200; CUDA_ARCHS overrides) and AVX2 host code.
# ggml-cuda links cuBLAS and the driver: cuBLAS from the CUDA toolkit or, where the toolkit lacks
# it, an nvidia-cublas wheel's folder (CUBLAS_DIR, else the first found under /usr/local, /opt
# and the Python site folders); the driver from its own folder (CUDA_DRIVER_DIR: a stub's, to
# build where no driver is). `libs` prints the folders of cuBLAS, the CUDA runtime and the
# driver, ':'-joined, for LD_LIBRARY_PATH.
set -euo pipefail

# The first file named $1 under the folders $2...; empty where none is.
first_file() {
    local name=$1; shift
    find "$@" -maxdepth 4 -name "$name" 2>/dev/null | sort | head -1 || true
}

# The first library named $1 in the CUDA toolkit's or the Python packages' folders, or in
# $2 where given.
cuda_library() {
    local search=(${2:-/usr/local/cuda*/ /usr/local/lib /opt \
        $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)})
    first_file "$1" "${search[@]}"
}

# ggml-cuda links the driver (its VMM pool); a driver's folder holds only libcuda.so.1.
cuda_driver_library() {
    local search=(${CUDA_DRIVER_DIR:-/usr/local/nvidia/lib64 /usr/local/nvidia/lib \
        /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/cuda*/lib*/stubs})
    first_file 'libcuda.so*' "${search[@]}"
}

case ${1:-} in
libs)
    cublas=$(cuda_library 'libcublas.so*' "${CUBLAS_DIR:-}")
    [ -n "$cublas" ] || { echo "llama_cpp_cuda: no libcublas.so found" >&2; exit 1; }
    folders=$(for library in "$cublas" "$(cuda_library 'libcudart.so.13*')" "$(cuda_driver_library)"; do
        [ -n "$library" ] && dirname "$library"; done | awk '!seen[$0]++' | paste -sd:)
    echo "$folders"
    ;;
build)
    source_tarball=$2
    work=$3
    jobs=${JOBS:-$(nproc)}
    mkdir -p "$work"
    [ -d "$work/llama.cpp" ] || tar xJf "$source_tarball" -C "$work"
    cublas=$(cuda_library 'libcublas.so*' "${CUBLAS_DIR:-}")
    [ -n "$cublas" ] || { echo "llama_cpp_cuda: no libcublas.so found" >&2; exit 1; }
    driver=$(cuda_driver_library)
    [ -n "$driver" ] || { echo "llama_cpp_cuda: no libcuda.so found" >&2; exit 1; }
    lib_dir=$(dirname "$cublas")
    include_dir=$(cd "$lib_dir/.." && pwd)/include
    cmake_args=(-DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DGGML_CUDA_NCCL=OFF
        -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" -DGGML_NATIVE=OFF
        -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
        -DCUDA_cublas_LIBRARY="$cublas"
        -DCUDA_cublasLt_LIBRARY="$(first_file 'libcublasLt.so*' "$lib_dir")"
        -DCUDA_cuda_driver_LIBRARY="$driver")
    # A wheel's cuBLAS keeps its headers beside its library, outside the toolkit's include folder.
    [ -f "$include_dir/cublas_v2.h" ] &&
        cmake_args+=(-DCMAKE_CUDA_FLAGS="-I$include_dir" -DCMAKE_CXX_FLAGS="-I$include_dir")
    command -v ninja > /dev/null && cmake_args+=(-G Ninja)
    cmake -S "$work/llama.cpp" -B "$work/build" "${cmake_args[@]}" > "$work/cmake.log" 2>&1 ||
        { tail -30 "$work/cmake.log" >&2; exit 1; }
    cmake --build "$work/build" -j "$jobs" --target llama-bench llama-batched-bench \
        > "$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
    echo "$work/build/bin"
    ;;
*)
    echo "usage: llama_cpp_cuda.sh build SOURCE.tar.xz WORKDIR | libs" >&2
    exit 2
    ;;
esac
