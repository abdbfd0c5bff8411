"""Many requests at once on one engine: per-request latency and aggregate tokens/s.

The scheduler batches every running request into each forward step, so N requests take far
less than N times as long as one.

    python examples/concurrent_requests.py [N]

(Not named concurrent.py: a script directory is first on sys.path, and that name would
shadow the standard library package `concurrent` for every script here.)
"""

from __future__ import annotations

import sys
import time

import anyio

from actors import Engine, SamplingParams

TOPICS = ["the sea", "a robot", "autumn", "a library", "the moon", "coffee", "trains", "a cat"]


async def main(count: int) -> None:
    async with Engine.open() as engine:
        params = SamplingParams(max_tokens=32, temperature=0.8, seed=7)
        latencies: dict[int, tuple[float, int]] = {}

        async def one(index: int) -> None:
            started = time.perf_counter()
            prompt = f"Write one sentence about {TOPICS[index % len(TOPICS)]}:"
            done = await engine.complete(prompt, params)
            latencies[index] = (time.perf_counter() - started, done.usage.completion_tokens)

        started = time.perf_counter()
        async with anyio.create_task_group() as tasks:
            for index in range(count):
                tasks.start_soon(one, index)
        wall = time.perf_counter() - started
    for index, (seconds, tokens) in sorted(latencies.items()):
        print(f"request {index:3d}: {tokens:3d} tokens in {seconds:6.2f} s")
    total = sum(tokens for _, tokens in latencies.values())
    print(f"{count} requests, {total} tokens in {wall:.2f} s: {total / wall:.1f} tok/s aggregate")


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 8)
