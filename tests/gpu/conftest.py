"""tests/gpu/ runs only where PyCUDA imports and a CUDA device answers; everywhere else each of
its tests is skipped with the reason. Fixtures: a CUDA context for the session and the kernels
compiled from cuda_src/ (each file once)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.compute.cuda_plan import kernel_source_dir, source_module_options

GPU_DIR = Path(__file__).parent


def cuda_unavailable_reason() -> str | None:
    """None where a CUDA device can be used, else why not (the check the README gives)."""
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


def never_run_on_a_device(item: pytest.Item) -> bool:
    """The tests of the kernels no device has run yet (the mma matvec and its route)."""
    return "mma" in item.nodeid


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_unavailable_reason()
    if reason is None:
        # Never-run kernels last: a fault in one leaves the context unusable for every test
        # after it, so the proven kernels' results come first.
        items.sort(key=never_run_on_a_device)  # stable: the rest keep their order
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

    modules: dict[str, Any] = {}
    capability = cuda_context.get_device().compute_capability()

    def get(file_name: str, name: str) -> Any:
        if file_name not in modules:
            source = (kernel_source_dir() / file_name).read_text()
            modules[file_name] = SourceModule(source, **source_module_options(capability))
        return modules[file_name].get_function(name)

    return get
