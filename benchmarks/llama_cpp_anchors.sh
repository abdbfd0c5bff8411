#!/usr/bin/env bash
# Re-measure the llama.cpp anchors of tests/reference/README.md on this machine, so our figures
# can be given as ratios to llama.cpp on the same hardware.
#
#   bash benchmarks/llama_cpp_anchors.sh [WORKDIR]      (default WORKDIR: /tmp/llama-anchors)
#
# Builds llama-bench and llama-server from the llama.cpp vendored in llama-cpp-python 0.3.36's
# sdist (the version the reference data came from) as the anchors were built: CPU only, AVX2,
# 2 threads. Nothing is installed into the project; the build lives in WORKDIR.
set -euo pipefail
work=${1:-/tmp/llama-anchors}
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
model=$("$python" -c "from actors.model.default_model import default_model_path; print(default_model_path())")
mkdir -p "$work" && cd "$work"
[ -f llama_cpp_python-0.3.36.tar.gz ] || \
    "$python" -m pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .
[ -d llama_cpp_python-0.3.36 ] || tar xzf llama_cpp_python-0.3.36.tar.gz
src=llama_cpp_python-0.3.36/vendor/llama.cpp
if [ ! -x "$src/build/bin/llama-server" ]; then
    cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
        -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF > cmake.log
    cmake --build "$src/build" -j2 --target llama-bench llama-server > build.log
fi
bin=$src/build/bin
"$bin/llama-bench" -m "$model" -t 2 -p 512 -n 128 -r 3
"$bin/llama-server" -m "$model" -t 2 -tb 2 -np 64 -c 8192 --port 8089 > server.log 2>&1 &
server=$!
trap 'kill $server' EXIT
until grep -q "listening on" server.log; do sleep 1; done
"$python" "$here/benchmarks/llama_server_load.py" --url http://127.0.0.1:8089
