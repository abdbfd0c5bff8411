"""The registry of compute backends: one list of names, one factory per name.

`choose_backend("auto")` takes the first backend in `PREFERENCE` that can run here and says
why it passed over the others; naming a backend that cannot run is an error, never a silent
change of backend. Importing this module is cheap (the command line lists the names): each
factory imports its backend when it builds one.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from actors.compute.cuda_ahead import RUN_AHEAD_MAX_ROWS
from actors.errors import BackendUnavailable, InvalidRequest

if TYPE_CHECKING:
    from actors.compute.contract import BackendFactory, ComputeBackend, KVRequest
    from actors.model.loaded import OpenedModel


class CpuFactory:
    """The numpy backend: runs everywhere."""

    name = "cpu"

    def __init__(self, notices: Sequence[str] = ()) -> None:
        self._notices = tuple(notices)

    def unavailable_reason(self) -> str | None:
        return None

    def build(self, model: OpenedModel, kv: KVRequest) -> ComputeBackend:
        from actors.compute.cpu import build_cpu_backend

        return build_cpu_backend(model, kv, self._notices)


# What installing the CUDA extra takes: it builds PyCUDA from source (docs/gpu.md, "Installing
# the CUDA extra").
CUDA_EXTRA_NEEDS = (
    "pip install 'q4k-actors[cuda]' builds it from source and needs the CUDA toolkit (nvcc and "
    "cuda.h) and an NVIDIA driver: check first with `nvcc --version` and `nvidia-smi`"
)
# The kernels' tensor-core tiles (WMMA on bfloat16 / float16) need sm_80 or newer.
MIN_COMPUTE_CAPABILITY = (8, 0)
# Share of the device's free memory (measured before loading) the CUDA backend may use.
DEFAULT_GPU_MEMORY_FRACTION = 0.9


class CudaFactory:
    """The CUDA backend's entry: whether PyCUDA, nvcc and a capable device are here."""

    name = "cuda"

    def __init__(self, memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION,
                 notices: Sequence[str] = (),
                 run_ahead_rows: int = RUN_AHEAD_MAX_ROWS) -> None:
        if run_ahead_rows < 0:
            raise InvalidRequest(f"run_ahead_rows must be >= 0 (0: none), got {run_ahead_rows}",
                                 field="run_ahead_rows")
        self._memory_fraction = memory_fraction
        self._notices = tuple(notices)
        # The most rows of a greedy decode step after which the next is queued (0: none).
        self._run_ahead_rows = run_ahead_rows

    def unavailable_reason(self) -> str | None:
        try:
            import pycuda.driver as cuda
        except ImportError as exc:
            if "libcuda" in str(exc):
                return "no CUDA driver on this machine (libcuda.so.1 not found)"
            return f"pycuda is not installed ({CUDA_EXTRA_NEEDS})"
        try:
            cuda.init()
            if cuda.Device.count() == 0:
                return "the CUDA driver sees no device"
            capability = cuda.Device(0).compute_capability()
        except cuda.Error as exc:
            return f"CUDA cannot start: {exc}"
        if tuple(capability) < MIN_COMPUTE_CAPABILITY:
            return (f"the GPU's compute capability {capability[0]}.{capability[1]} is below "
                    f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]}, which the "
                    "kernels' tensor-core tiles need")
        if shutil.which("nvcc") is None:
            return "nvcc is not on the PATH (PyCUDA compiles the kernels with it once)"
        return None

    def build(self, model: OpenedModel, kv: KVRequest) -> ComputeBackend:
        from actors.compute.cuda import build_cuda_backend

        return build_cuda_backend(model, kv, self._memory_fraction, self._notices,
                                  self._run_ahead_rows)


def nvidia_gpu_present() -> bool:
    """Whether the machine shows an NVIDIA GPU (its kernel driver is loaded), whatever PyCUDA
    can make of it: only there does running on the CPU need saying."""
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


BACKENDS: dict[str, BackendFactory] = {"cuda": CudaFactory(), "cpu": CpuFactory()}
# What "auto" tries, best first.
PREFERENCE = ("cuda", "cpu")
BACKEND_NAMES = ("auto", *BACKENDS)


def choose_backend(requested: str) -> tuple[BackendFactory, tuple[str, ...]]:
    """The factory to build for `requested` ("auto" or a name of BACKENDS) and the notices
    that explain the choice. Raises `InvalidRequest` for an unknown name and
    `BackendUnavailable` for a named backend that cannot run here."""
    if requested not in BACKEND_NAMES:
        raise InvalidRequest(
            f"backend {requested!r} is not one of {', '.join(BACKEND_NAMES)}", field="backend"
        )
    if requested != "auto":
        factory = BACKENDS[requested]
        reason = factory.unavailable_reason()
        if reason is not None:
            raise BackendUnavailable(
                f"backend {requested!r} cannot run here: {reason}; use backend='auto' to "
                "fall back to what can",
                backend=requested,
                reason=reason,
            )
        return factory, ()
    passed_over = []
    for name in PREFERENCE[:-1]:
        reason = BACKENDS[name].unavailable_reason()
        if reason is None:
            return BACKENDS[name], ()
        passed_over.append((name, reason))
    # The last choice, the CPU, always runs; it reports why it was chosen.
    notices = tuple(
        f"backend auto: {name} not used ({reason}); running on the CPU"
        for name, reason in passed_over
    )
    return CpuFactory(notices), notices
