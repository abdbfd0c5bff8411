"""Structured logs: one JSON object per line to a file or pipe, readable lines on a terminal.

The package never touches structlog's global configuration (the embedding application may
own it): our loggers are wrapped privately and write to the destination chosen by
`configure_logging`, or hand their events to the standard `logging` module after
`log_to_stdlib()`. Until the application chooses one of them, the library is silent.
"""

from __future__ import annotations

import logging
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
    stream: TextIO | None  # None: records of the standard logging module
    level: int
    as_json: bool
    owns_stream: bool
    failed_lines: int = 0  # lines the stream refused (a full disk, a closed pipe)


_lock = threading.Lock()
# Until the application configures logging: nothing, not even errors (they are raised anyway).
_destination = _Destination(stream=None, level=LEVELS["critical"] + 1, as_json=True,
                            owns_stream=False)
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
    _close_if_owned(previous)


def log_to_stdlib() -> None:
    """Hand every event to the standard `logging` module: a record of the logger named after
    the event's source (`actors.engine`, `actors.session`, ...) at the event's level, whose
    message is the event as one JSON object (also in the record's `event_dict` attribute).
    Which records are kept, and where they go, is then the application's logging setup."""
    previous = _swap_destination(
        _Destination(stream=None, level=LEVELS["debug"], as_json=True, owns_stream=False)
    )
    _close_if_owned(previous)


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
        _close_if_owned(ours)


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


def _close_if_owned(destination: _Destination) -> None:
    """Close a file we opened; its last flush failing (a full disk) is a failed write too."""
    if not destination.owns_stream:
        return
    try:
        destination.stream.close()
    except (OSError, ValueError) as error:
        _report_failed_write(destination, error)


def _swap_destination(new: _Destination) -> _Destination:
    global _destination
    with _lock:
        previous, _destination = _destination, new
    return previous


def failed_log_lines() -> int:
    """Log lines the current destination failed to take (they are dropped, never raised: a
    full disk must not fail the requests being logged)."""
    return _destination.failed_lines


def _report_failed_write(destination: _Destination, error: Exception) -> None:
    """Count a line the stream refused; say so on stderr the first time only."""
    destination.failed_lines += 1
    if destination.failed_lines > 1:
        return
    try:
        sys.stderr.write(
            f"q4k: the log destination failed ({type(error).__name__}: {error}); requests go "
            "on, and log lines are dropped and counted (actors.logs.failed_log_lines())\n"
        )
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # stderr itself is the failing stream, or is gone


def enabled_for(name: str, level: str) -> bool:
    """Whether an event at `level` from the logger `name` is written anywhere now: a caller
    checks it before building an event it would send on every step."""
    return _level_enabled(name, LEVELS[level])


def _level_enabled(name: str, level: int) -> bool:
    destination = _destination
    return level >= destination.level and (
        destination.stream is not None or logging.getLogger(name).isEnabledFor(level)
    )


def _drop_below_level(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    if not _level_enabled(logger.name, LEVELS.get(method, LEVELS["info"])):
        raise structlog.DropEvent
    return event


def _render(
    logger: WrappedLogger, method: str, event: EventDict
) -> tuple[tuple[str], dict[str, EventDict]]:
    """The line, and the event itself for the standard logging module's records (structlog
    passes a final (args, kwargs) pair to the writer's method)."""
    renderer = _json_renderer if _destination.as_json else _console_renderer
    return (renderer(logger, method, dict(event)),), {"event_dict": event}


class _Writer:
    """The wrapped logger: writes each rendered line to the current destination."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _write(self, level: str, line: str, event: EventDict) -> None:
        with _lock:
            stream = _destination.stream
            if stream is not None:
                try:
                    stream.write(line + "\n")
                    stream.flush()
                except (OSError, ValueError) as error:  # ValueError: a closed stream
                    _report_failed_write(_destination, error)
                return
        logging.getLogger(self.name).log(LEVELS[level], line, extra={"event_dict": event})

    def debug(self, line: str, event_dict: EventDict) -> None:
        self._write("debug", line, event_dict)

    def info(self, line: str, event_dict: EventDict) -> None:
        self._write("info", line, event_dict)

    def warning(self, line: str, event_dict: EventDict) -> None:
        self._write("warning", line, event_dict)

    def error(self, line: str, event_dict: EventDict) -> None:
        self._write("error", line, event_dict)

    def critical(self, line: str, event_dict: EventDict) -> None:
        self._write("critical", line, event_dict)

    msg = info
    exception = error


def get_logger(name: str, **bound: Any) -> Any:
    """A structlog logger for the package, with `bound` values on every event."""
    return structlog.wrap_logger(
        _Writer(name),
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
