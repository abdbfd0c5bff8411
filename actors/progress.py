"""Progress of long work (assembling the default model, loading and uploading weights,
quantizing): a rich progress bar on a terminal, `progress` log events always.

Library code reports through `Progress`; whether a bar shows is decided once, by whether
stderr is a terminal, so pipes and log files never get control characters.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import TracebackType

from actors.logs import get_logger

# Log a progress event at most this often, so a 10,000-step job doesn't flood the log.
LOG_INTERVAL_S = 1.0


class Progress:
    """Counts `done` of `total` units of one task; use as a context manager."""

    def __init__(self, task: str, total: int, *, show_bar: bool | None = None) -> None:
        self.task = task
        self.total = max(int(total), 0)
        self.done = 0
        self._show_bar = sys.stderr.isatty() if show_bar is None else show_bar
        self._bar = None
        self._bar_task = None
        self._last_log = 0.0
        self._log = get_logger("actors.progress")

    def __enter__(self) -> Progress:
        if self._show_bar:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                transient=True,
            )
            self._bar.start()
            self._bar_task = self._bar.add_task(self.task, total=self.total)
        self._log.info("progress", task=self.task, done=0, total=self.total)
        self._last_log = time.monotonic()
        return self

    def advance(self, units: int = 1) -> None:
        self.done += units
        if self._bar is not None:
            self._bar.update(self._bar_task, completed=self.done)
        now = time.monotonic()
        if now - self._last_log >= LOG_INTERVAL_S:
            self._last_log = now
            self._log.info("progress", task=self.task, done=self.done, total=self.total)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
        if exc_type is None:
            self._log.info("progress", task=self.task, done=self.done, total=self.total)


@contextmanager
def progress_callback(
    task: str, *, show_bar: bool | None = None
) -> Iterator[Callable[[int, int], None]]:
    """A `(done, total)` callback for code that reports its total along with its progress
    (such as `load_model`): the bar starts at the first call and ends with the block."""
    with ExitStack() as stack:
        current: list[Progress] = []

        def report(done: int, total: int) -> None:
            if not current:
                current.append(stack.enter_context(Progress(task, total, show_bar=show_bar)))
            current[0].advance(done - current[0].done)

        yield report
