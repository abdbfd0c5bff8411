"""How long the event loop went without running a task: a ticker that sleeps a short interval
and records the longest gap between its wake-ups (the interval's own length subtracted).

    async with watch_loop() as watch:
        ...  # anything that might block the loop
    print(watch.worst_stall_ms, watch.ticks)

The soak and the hostile-input stall commands report it; tests only check that it ticked.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio


@dataclass
class LoopWatch:
    """What the ticker saw: its wake-ups, and the worst delay past the interval."""

    interval_s: float
    ticks: int = 0
    worst_stall_s: float = 0.0
    last_tick: float = field(default_factory=time.perf_counter)

    @property
    def worst_stall_ms(self) -> float:
        return round(self.worst_stall_s * 1000.0, 1)

    async def run(self) -> None:
        while True:
            await anyio.sleep(self.interval_s)
            self.tick()
            self.ticks += 1

    def tick(self) -> None:
        """Record the gap since the last tick (also called once at the end: a stall that
        lasts until the block ends would otherwise go unseen)."""
        now = time.perf_counter()
        self.worst_stall_s = max(self.worst_stall_s, now - self.last_tick - self.interval_s)
        self.last_tick = now


@asynccontextmanager
async def watch_loop(interval_s: float = 0.005) -> AsyncIterator[LoopWatch]:
    """Tick every `interval_s` for the duration of the block."""
    watch = LoopWatch(interval_s)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(watch.run)
        try:
            yield watch
        finally:
            watch.tick()
            tasks.cancel_scope.cancel()


__all__ = ["LoopWatch", "watch_loop"]
