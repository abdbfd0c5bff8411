"""tests/gpu/ runs only where PyCUDA imports and a CUDA device answers; everywhere else each of
its tests is skipped with the reason. Fixtures: a CUDA context for the session and the kernels
compiled from cuda_src/ (each file once)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.compute.cuda_plan import kernel_source_dir, source_module_options

GPU_DIR = Path(__file__).parent

# GPU_TESTS_EMULATED=1: the tests run over the emulated device (tests/cuda_emulator.py: each
# kernel's numpy twin, checking its launch's arguments), which rehearses the device tests'
# own code (arguments, shapes, fixtures) without a GPU; their figures then mean nothing.
if os.environ.get("GPU_TESTS_EMULATED") == "1":
    from tests.cuda_emulator import EmulatedDevice, install

    install(pytest.MonkeyPatch(), EmulatedDevice(run_kernels=True))


def cuda_unavailable_reason() -> str | None:
    """None where a CUDA device can be used, else why not (the check docs/gpu.md gives)."""
    try:
        import pycuda.driver as cuda
    except ImportError as exc:
        return f"pycuda is not importable here ({exc}); tests/gpu/device_check.sh installs it"
    try:
        cuda.init()
        count = cuda.Device.count()
    except cuda.Error as exc:
        return f"the CUDA driver cannot be used ({exc})"
    return None if count else "no CUDA device on this machine"


# The device tests in groups, each run in a process of its own by device_check.sh (the
# environment's GPU_TEST_GROUP names one): a kernel's fault that leaves the CUDA context
# unusable then costs only its own group. In that order: the products of a decode step, the
# mma matvec's (up to 8 rows) and the batched product's (more rows, and the logits), then
# the other kernels one by one (most of them measured on a device before), then the backend
# end to end (both regimes, the engine).
GPU_TEST_GROUPS = ("mma_matvec", "batched", "kernels", "backend")


def device_group(item: pytest.Item) -> str:
    """The group of a tests/gpu test (GPU_TEST_GROUPS), from its id."""
    if Path(item.path).name == "test_cuda_backend.py":
        return "backend"
    if "matvec_mma" in item.nodeid:  # not "mma": gemma3 holds it
        return "mma_matvec"
    if "batched" in item.nodeid:
        return "batched"
    return "kernels"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_unavailable_reason()
    if reason is None:
        group = os.environ.get("GPU_TEST_GROUP")
        if group is not None and group not in GPU_TEST_GROUPS:
            raise pytest.UsageError(f"GPU_TEST_GROUP={group!r} is none of {GPU_TEST_GROUPS}")
        order = {item: GPU_TEST_GROUPS.index(device_group(item)) for item in items
                 if GPU_DIR in Path(item.path).parents}
        if group is not None:
            others = [item for item, index in order.items() if GPU_TEST_GROUPS[index] != group]
            config.hook.pytest_deselected(items=others)
            left_out = set(others)
            items[:] = [item for item in items if item not in left_out]
        # In one process, the groups in order: a fault leaves the context unusable for every
        # test after it, so the kernels measured before come first.
        items.sort(key=lambda item: order.get(item, 0))  # stable: each group keeps its order
        return
    for item in items:
        if GPU_DIR in Path(item.path).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def cuda_context() -> Any:
    """Device 0's primary context, current for the session; PyCUDA releases it at exit, after
    the tests' device arrays are gone."""
    import pycuda.autoprimaryctx

    return pycuda.autoprimaryctx.context


@pytest.fixture(scope="session")
def kernel(cuda_context: Any) -> Callable[[str, str], Any]:
    """kernel(file name, entry point) -> the compiled function (each file compiled once, into
    the backend's own cache folder: the backend's tests then compile nothing again)."""
    from pycuda.compiler import SourceModule

    from actors.compute.cuda import entry_function

    modules: dict[str, Any] = {}
    capability = cuda_context.get_device().compute_capability()

    def get(file_name: str, name: str) -> Any:
        if file_name not in modules:
            source = (kernel_source_dir() / file_name).read_text()
            modules[file_name] = SourceModule(source, **source_module_options(capability))
        return entry_function(modules[file_name], name)

    return get


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The figures the tests recorded (`record_property`), a line a test, at the end of the
    log: a device run then shows how close each check came, not only that it passed, in the
    one log device_check.sh keeps."""
    figures = [(report.nodeid, report.user_properties)
               for reports in terminalreporter.stats.values() for report in reports
               if getattr(report, "when", None) == "call"
               and getattr(report, "user_properties", None)]
    if figures:
        terminalreporter.section("figures recorded by the device tests")
        for node_id, properties in sorted(figures):
            terminalreporter.write_line(
                f"{node_id}: " + ", ".join(f"{name}={value}" for name, value in properties))
