#!/usr/bin/env bash
# The project's dependencies the GPU image lacks (gguf, msgspec, structlog), from the wheels
# tests/gpu/prepare_carry.sh carried in .cudacarry/wheels, into SITE (default /tmp/site), where
# the interpreter $1 (default python3) cannot import them yet. For device_check.sh and
# device_anchors.sh, from the repo root; the caller puts SITE on PYTHONPATH.
set -uo pipefail
py=${1:-python3}
PYTHONPATH="${SITE:-/tmp/site}${PYTHONPATH:+:$PYTHONPATH}" "$py" -c 'import gguf, msgspec, structlog' \
    2>/dev/null && exit 0
exec "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --disable-pip-version-check --upgrade --target "${SITE:-/tmp/site}" .cudacarry/wheels/*.whl
