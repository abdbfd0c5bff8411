#!/usr/bin/env bash
# Run HERE (the dev machine, where PyPI is reachable), from the repo root, before a device run
# that should measure llama.cpp beside us: builds llama.cpp's CUDA tools (llama-bench,
# llama-batched-bench; benchmarks/llama_cpp_cuda.sh) and packs them with their libraries,
# stripped, into .llamacarry/llama-cuda.tar.xz (about 40 MB; git-ignored), which
# tests/gpu/device_anchors.sh runs on the GPU machine right after device_check.sh, on the same
# files. The build takes about half an hour on 2 cores (the GPU machine's time is too dear to
# build there): start it early, in the background. Kept in WORK (default /tmp/llama-cuda), so
# a second run only packs. No driver or cuBLAS is needed here: the link
# takes a stub driver (the PyCUDA bundle's make_libcuda_stub.sh) and the pinned nvidia-cublas
# wheel's library, whose SONAME (libcublas.so.13) the GPU image's cuBLAS answers.
set -euo pipefail
here=$(pwd)
work=${WORK:-/tmp/llama-cuda}
bundle=${BUNDLE:-../shared/cuda/pycuda-bundle}
python=${PYTHON:-$here/.venv/bin/python}
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.llamacarry/' "$exclude" 2>/dev/null || echo '/.llamacarry/' >> "$exclude"
mkdir -p "$work/download"
cd "$work"

# llama.cpp as vendored in llama-cpp-python 0.3.36, cut to what the two tools build from.
if [ ! -f llama.cpp-src.tar.xz ]; then
    "$python" -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d download
    tar xzf download/llama_cpp_python-0.3.36.tar.gz -C download
    unused=(docs models tests examples benches tools/ui tools/server pocs gguf-py media app
            ggml/src/ggml-sycl ggml/src/ggml-vulkan ggml/src/ggml-opencl ggml/src/ggml-metal
            ggml/src/ggml-hexagon ggml/src/ggml-et)
    tar cJf llama.cpp-src.tar.xz -C download/llama_cpp_python-0.3.36/vendor \
        "${unused[@]/#/--exclude=llama.cpp/}" llama.cpp
fi
# cuBLAS as the build will look for it (the toolkit, the Python packages); else the wheel's.
if ! bash "$here/benchmarks/llama_cpp_cuda.sh" libs > /dev/null 2>&1; then
    [ -d cublas ] || {
        "$python" -m pip download -q --no-deps --only-binary=:all: nvidia-cublas==13.0.0.19 -d download
        mkdir -p cublas && unzip -q -o download/nvidia_cublas-*.whl -d cublas
    }
    export CUBLAS_DIR=$work/cublas/nvidia/cu13
fi
if ! find /usr/local/nvidia /usr/lib/x86_64-linux-gnu -maxdepth 2 -name 'libcuda.so*' 2>/dev/null | grep -q .; then
    [ -f stub/libcuda.so ] || bash "$here/$bundle/make_libcuda_stub.sh" stub
    export CUDA_DRIVER_DIR=$work/stub
fi
bin=$(bash "$here/benchmarks/llama_cpp_cuda.sh" build llama.cpp-src.tar.xz "$work")
rm -rf pack && mkdir -p pack/llama-cuda/bin
cp -a "$bin"/llama-bench "$bin"/llama-batched-bench "$bin"/*.so* pack/llama-cuda/bin/
find pack -type f -name '*.so*' -exec strip --strip-unneeded {} +
mkdir -p "$here/.llamacarry"
XZ_OPT="-9 -T0" tar cJf "$here/.llamacarry/llama-cuda.tar.xz" -C pack llama-cuda
ls -la "$here/.llamacarry/llama-cuda.tar.xz"
