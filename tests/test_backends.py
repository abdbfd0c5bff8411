"""The backend registry: "auto" says why it passed a backend over, a named backend that cannot
run is an error at `Engine.open`, and nothing imports pycuda until a CUDA backend is asked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from actors import BackendUnavailable, InvalidRequest
from actors.compute.backends import BACKEND_NAMES, BACKENDS, choose_backend
from actors.engine import Engine
from actors.params import SamplingParams

CUDA_REASON = BACKENDS["cuda"].unavailable_reason()
needs_no_cuda = pytest.mark.skipif(CUDA_REASON is None, reason="CUDA can run on this machine")

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_one_list_of_names() -> None:
    assert BACKEND_NAMES == ("auto", *BACKENDS)
    assert all(factory.name == name for name, factory in BACKENDS.items())


@needs_no_cuda
def test_auto_falls_back_to_the_cpu_and_says_why() -> None:
    factory, notices = choose_backend("auto")
    assert factory.name == "cpu"
    (notice,) = notices
    assert "cuda not used" in notice and CUDA_REASON in notice


@needs_no_cuda
def test_a_named_backend_that_cannot_run_is_an_error() -> None:
    with pytest.raises(BackendUnavailable, match="backend 'cuda' cannot run here") as caught:
        choose_backend("cuda")
    # The parts, for a caller (the command line) to say it in its own words.
    assert (caught.value.backend, caught.value.reason) == ("cuda", CUDA_REASON)
    assert "backend='auto'" in str(caught.value)


def test_without_pycuda_the_reason_says_what_the_extra_needs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("pycuda", "pycuda.driver"):  # `import pycuda.driver` fails
        monkeypatch.setitem(sys.modules, module, None)
    reason = BACKENDS["cuda"].unavailable_reason()
    assert "pycuda is not installed" in reason
    for needed in ("q4k-actors[cuda]", "nvcc", "cuda.h", "driver", "nvidia-smi"):
        assert needed in reason


def test_an_unknown_backend_names_the_field() -> None:
    with pytest.raises(InvalidRequest) as caught:
        choose_backend("tpu")
    assert caught.value.field == "backend"


@needs_no_cuda
async def test_engine_open_refuses_cuda_here_and_reports_the_auto_fallback(
    tiny_model_paths: dict[str, Path],
) -> None:
    path = tiny_model_paths["llama-q4k-tiny"]
    with pytest.raises(BackendUnavailable, match=re.escape(CUDA_REASON)):
        async with Engine.open(path, backend="cuda"):
            pass
    async with Engine.open(path) as engine:
        assert not engine.info.on_gpu
        assert any("cuda not used" in notice for notice in engine.notices)
        done = await engine.complete([1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
        assert done.finish_reason == "length"


def test_importing_the_engine_never_imports_pycuda() -> None:
    code = (
        "import sys, actors, actors.engine, actors.compute.backends, actors.cli;"
        "assert 'pycuda' not in sys.modules, 'pycuda was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
