"""A few threads for the numpy work between matmuls.

OpenBLAS spreads each matmul over every core, but norms, activations, RoPE and attention
are single-threaded numpy calls; numpy releases the GIL inside them, so splitting their rows
(or attention groups) over threads uses the cores that would otherwise sit idle.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache

# Fewer rows than this per thread are not worth a thread hand-off (~50 us).
MIN_ROWS_PER_THREAD = 32


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Workers:
    """Runs independent tasks on `n_threads` threads, the caller's included."""

    def __init__(self, n_threads: int | None = None) -> None:
        self.n_threads = max(1, n_threads or available_cores())
        self._pool = (
            ThreadPoolExecutor(self.n_threads - 1, thread_name_prefix="forward")
            if self.n_threads > 1 else None
        )

    def run(self, tasks: Sequence[Callable[[], object]]) -> None:
        """Run every task; the caller's thread takes the first. Re-raises a task's error."""
        if self._pool is None or len(tasks) == 1:
            for task in tasks:
                task()
            return
        futures = [self._pool.submit(task) for task in tasks[1:]]
        try:
            tasks[0]()
        finally:
            for future in futures:
                future.result()

    def row_slices(self, n_rows: int) -> list[slice]:
        """Split [0, n_rows) into one contiguous slice per thread that is worth one."""
        parts = max(1, min(self.n_threads, n_rows // MIN_ROWS_PER_THREAD))
        bounds = [n_rows * i // parts for i in range(parts + 1)]
        return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    def for_rows(self, n_rows: int, work: Callable[[slice], object]) -> None:
        """Call work(rows) for row slices covering [0, n_rows), in parallel."""
        self.run([lambda rows=rows: work(rows) for rows in self.row_slices(n_rows)])


@cache
def shared_workers() -> Workers:
    """One set of threads for every model in the process: more would only compete."""
    return Workers()
