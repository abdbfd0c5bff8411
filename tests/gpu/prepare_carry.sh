#!/usr/bin/env bash
# Run HERE (the dev machine, where a package index is reachable), from the repo root, before a
# device run: fills the git-ignored .cudacarry/ with what tests/gpu/device_check.sh needs on
# the GPU machine, which has no index: the PyCUDA bundle (../shared/cuda/pycuda-bundle) and,
# in .cudacarry/wheels, the project's dependencies its image lacks (gguf, msgspec, structlog;
# numpy, pyyaml, tqdm, requests, anyio, jinja2, tokenizers and rich are there). Then pass
# `carry: [".cudacarry"]` to the device run.
set -euo pipefail
bundle=${BUNDLE:-../shared/cuda/pycuda-bundle}
rm -rf .cudacarry
cp -r "$bundle" .cudacarry
chmod -R u+w .cudacarry
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.cudacarry/' "$exclude" 2>/dev/null || echo '/.cudacarry/' >> "$exclude"
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014; do platforms+=(--platform "${p}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .cudacarry/wheels gguf==0.19.0 msgspec==0.23.0 structlog==26.1.0
# The shrunk real models (../shared/cuda/models), which tests/gpu and the benchmark use where
# the full files are absent (a device run carries at most 64 MiB).
mkdir -p .cudacarry/models
cp "${MODELS:-../shared/cuda/models}"/*.gguf .cudacarry/models/
chmod u+w .cudacarry/models/*
ls -la .cudacarry .cudacarry/wheels .cudacarry/models
