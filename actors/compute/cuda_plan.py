"""Host-side planning for the CUDA backend: pure Python and numpy, no pycuda.

Everything the CUDA actor decides before it touches the device lives here, so it is tested on
every machine: where the kernel sources are, which CUDA-graph batch bucket a step uses, how the
device memory splits into weights, workspace and KV pool, the launch geometry of each kernel,
and how a step's int32 arrays are packed into one buffer for a single host-to-device copy.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def kernel_source_dir() -> Path:
    """The folder holding the .cu/.cuh kernel sources: `actors/_cuda_src` in an installed
    wheel, the checkout's top-level `cuda_src/` otherwise (including editable installs)."""
    for candidate in (_PACKAGE_DIR / "_cuda_src", _PACKAGE_DIR.parent / "cuda_src"):
        if any(candidate.glob("*.cu")):
            return candidate
    raise FileNotFoundError(
        f"no CUDA kernel sources next to {_PACKAGE_DIR} (looked for _cuda_src/ in the package "
        "and cuda_src/ beside it); reinstall q4k-actors"
    )
