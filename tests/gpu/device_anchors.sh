#!/usr/bin/env bash
# llama.cpp's CUDA figures on the same GPU and model files as our benchmark, and ours as ratios
# to them: run on the GPU machine from the repo root as the call right after
# tests/gpu/device_check.sh, on the same machine (it stays warm 30 s), with
# `carry: [".llamacarry", ".cudacarry/wheels"]` (.llamacarry made here by
# tests/gpu/prepare_llama_cpp.sh; llama.cpp's tools do not fit device_check's carry beside the
# shrunk models, 64 MiB a call).
# It takes the model files device_check left in /tmp and our bench_cuda.json (/tmp/device_check).
# On a fresh machine (the first went back) it writes the 8B-shaped file again and leaves out
# gemma-3 and the ratios; `python benchmarks/llama_cpp_cuda_anchors.py --theirs
# llama_cpp_cuda.json --ours bench_cuda.json` sets the two calls' figures side by side here.
# Results under $OUT: device_anchors.log and llama_cpp_cuda.json
# (benchmarks/llama_cpp_cuda_anchors.py), within ANCHORS_S (150 s).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
py=${PY:-python3}
work=${WORK:-/tmp/device_check}
mkdir -p "$work"
exec > >(tee -a "$OUT/device_anchors.log") 2>&1
started=$(date +%s)

tar xJf .llamacarry/llama-cuda.tar.xz -C "$work" || exit 1
libs=$(bash benchmarks/llama_cpp_cuda.sh libs) || exit 1
# The checkout's actors and the wheels device_check installed (bench_cuda's shapes import them).
export PYTHONPATH=".:${SITE:-/tmp/site}${PYTHONPATH:+:$PYTHONPATH}"
bash tests/gpu/install_carried_wheels.sh "$py" || exit 1
model_8b="" gemma3=""
[ -f "$work/models.env" ] && . "$work/models.env"
if [ -z "$model_8b" ] || [ ! -f "$model_8b" ]; then
    echo "device_anchors: no 8B-shaped file from device_check here (a fresh machine?): writing one"
    model_8b=/tmp/llama3-8b-synthetic.gguf
    "$py" benchmarks/synthetic_gguf.py "$model_8b" || exit 1
fi
[ -n "$gemma3" ] && [ ! -f "$gemma3" ] && gemma3=""
args=(--model-8b "$model_8b" --json "$OUT/llama_cpp_cuda.json")
[ -n "$gemma3" ] && args+=(--gemma3 "$gemma3")
[ -f "$work/bench_cuda.json" ] && args+=(--ours "$work/bench_cuda.json")
LD_LIBRARY_PATH="$work/llama-cuda/bin:$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    timeout "${ANCHORS_S:-150}" "$py" benchmarks/llama_cpp_cuda_anchors.py \
    "$work/llama-cuda/bin" "${args[@]}"
rc=$?
echo "device_anchors: exit $rc in $(( $(date +%s) - started )) s"
exit $rc
