"""Structured logs: one JSON object per line to a file or pipe, readable lines on a terminal.

The package never touches structlog's global configuration (the embedding application may
own it): our loggers are wrapped privately and write to the destination chosen by
`configure_logging`. Until it is called, only warnings and errors go to stderr, so nothing the
library does ever prints to stdout.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, WrappedLogger

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


@dataclass
class _Destination:
    stream: TextIO
    level: int
    as_json: bool
    owns_stream: bool


_lock = threading.Lock()
_destination = _Destination(stream=sys.stderr, level=LEVELS["warning"], as_json=False, owns_stream=False)
_json_renderer = structlog.processors.JSONRenderer(sort_keys=False)
_console_renderer = structlog.dev.ConsoleRenderer(colors=False)


def configure_logging(
    level: str = "info",
    destination: str | os.PathLike[str] | TextIO | None = None,
    *,
    as_json: bool | None = None,
) -> None:
    """Send the package's logs to `destination` (a path, appended to; an open text stream; or
    None for stderr) from `level` up. `as_json=None` picks JSON lines unless the stream is a
    terminal."""
    previous = _swap_destination(_open_destination(level, destination, as_json))
    if previous.owns_stream:
        previous.stream.close()


@contextmanager
def logging_to(
    level: str = "info",
    destination: str | os.PathLike[str] | TextIO | None = None,
    *,
    as_json: bool | None = None,
) -> Iterator[None]:
    """`configure_logging` for the duration of a block (an engine's life), then back to the
    previous destination; a file opened here is closed, so no handle outlives the block."""
    ours = _open_destination(level, destination, as_json)
    previous = _swap_destination(ours)
    try:
        yield
    finally:
        _swap_destination(previous)
        if ours.owns_stream:
            ours.stream.close()


def _open_destination(
    level: str, destination: str | os.PathLike[str] | TextIO | None, as_json: bool | None
) -> _Destination:
    if level not in LEVELS:
        from actors.errors import InvalidRequest

        raise InvalidRequest(
            f"log level {level!r} is not one of {', '.join(LEVELS)}", field="log_level"
        )
    owns_stream = isinstance(destination, (str, os.PathLike))
    if owns_stream:
        Path(destination).parent.mkdir(parents=True, exist_ok=True)
        stream: TextIO = open(destination, "a", encoding="utf-8", buffering=1)
    else:
        stream = destination if destination is not None else sys.stderr
    if as_json is None:
        as_json = not stream.isatty()
    return _Destination(stream, LEVELS[level], as_json, owns_stream)


def _swap_destination(new: _Destination) -> _Destination:
    global _destination
    with _lock:
        previous, _destination = _destination, new
    return previous


def _drop_below_level(_logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    if LEVELS.get(method, 20) < _destination.level:
        raise structlog.DropEvent
    return event


def _render(logger: WrappedLogger, method: str, event: EventDict) -> str:
    renderer = _json_renderer if _destination.as_json else _console_renderer
    return renderer(logger, method, event)


class _Writer:
    """The wrapped logger: writes each rendered line to the current destination."""

    def msg(self, line: str) -> None:
        with _lock:
            stream = _destination.stream
            stream.write(line + "\n")
            stream.flush()

    debug = info = warning = error = critical = exception = msg


def get_logger(name: str, **bound: Any) -> Any:
    """A structlog logger for the package, with `bound` values on every event."""
    return structlog.wrap_logger(
        _Writer(),
        processors=[
            _drop_below_level,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _render,
        ],
        context_class=dict,
        logger_name=name,
        **bound,
    )
