"""The project's error classes: every failure a caller sees is one of these.

Each message says what was wrong and, where it helps, what to do about it.
"""

from __future__ import annotations


class Q4KError(Exception):
    """Base class of every error this package raises on purpose."""


class ModelFormatError(Q4KError):
    """The model file is not a valid GGUF file (bad magic, truncated, inconsistent tables...)."""


class UnsupportedModelError(Q4KError):
    """A valid GGUF file this engine cannot run (architecture, tensor type, tokenizer...)."""


class InvalidRequest(Q4KError):
    """A request or parameter is malformed; the message names the field."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ContextLengthExceeded(InvalidRequest):
    """The prompt does not fit the model's context; it is never truncated silently."""


class EngineOverloaded(Q4KError):
    """Admission limits are reached; retry later or raise `max_sequences` / `max_queued`."""


class EngineClosed(Q4KError):
    """The engine has been closed (or never started); open a new one."""


class BackendUnavailable(Q4KError):
    """The compute backend asked for cannot run on this machine (the message says why).

    `backend` is the name asked for and `reason` why it cannot run, so a caller can say the
    same in its own words (the command line offers `--backend auto`)."""

    def __init__(self, message: str, *, backend: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.backend = backend
        self.reason = reason


class ComputeError(Q4KError):
    """A forward step failed and replaying it did not help."""


class TemplateError(Q4KError):
    """A chat template is missing, invalid, or tried to leave its sandbox."""


__all__ = [
    "Q4KError",
    "ModelFormatError",
    "UnsupportedModelError",
    "InvalidRequest",
    "ContextLengthExceeded",
    "EngineOverloaded",
    "EngineClosed",
    "BackendUnavailable",
    "ComputeError",
    "TemplateError",
]
