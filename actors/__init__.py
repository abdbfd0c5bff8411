"""q4k-actors: an embeddable async engine for Q4_K-family GGUF language models."""

from __future__ import annotations

from typing import Any

from actors.compute.openblas_env import configure_openblas

# Before anything imports numpy: OpenBLAS reads its settings once, when numpy loads it.
configure_openblas()

from actors.errors import (  # noqa: E402
    BackendUnavailable,
    ComputeError,
    ContextLengthExceeded,
    EngineClosed,
    EngineOverloaded,
    InvalidRequest,
    ModelFormatError,
    Q4KError,
    TemplateError,
    UnsupportedModelError,
)

# Heavier names load on first use, so `import actors` stays cheap for the CLI and tests.
_LAZY = {
    "load_model": "actors.model.loaded",
    "load_tokenizer": "actors.model.text.tokenizer",
    "Model": "actors.model.loaded",
    "Engine": "actors.engine",
    "SamplingParams": "actors.params",
    "StructuredOutput": "actors.params",
    "Completion": "actors.messages",
    "Chunk": "actors.messages",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)


__all__ = [
    "BackendUnavailable",
    "ComputeError",
    "ContextLengthExceeded",
    "EngineClosed",
    "EngineOverloaded",
    "InvalidRequest",
    "ModelFormatError",
    "Q4KError",
    "TemplateError",
    "UnsupportedModelError",
    *_LAZY,
]
