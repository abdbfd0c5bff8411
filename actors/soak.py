"""A soak and overload run against an open engine: hundreds of requests arriving over a few
seconds with random prompt lengths, budgets and sampling, a share of them cancelled after a
few chunks or cut by a deadline, against small `max_sequences` / `max_queued`, so the engine
refuses, queues, preempts and cancels all the time. Then it checks that nothing is held and
that a reference greedy request still gives exactly the tokens it gave before.

`benchmarks/soak.py` is the command; the tests run it tiny on the tiny model.
"""

from __future__ import annotations

import random
import resource
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio
import numpy as np

from actors.engine import Engine
from actors.errors import EngineOverloaded, Q4KError
from actors.loop_stall import watch_loop
from actors.messages import Chunk
from actors.params import SamplingParams

REFERENCE_PROMPT = "The three primary colors are"
# How long the engine may take to release everything once the last request ended.
SETTLE_S = 30.0


@dataclass(frozen=True)
class SoakPlan:
    """What to throw at the engine. Arrivals are spread uniformly over `arrival_s` per wave."""

    requests: int = 400
    waves: int = 4  # memory is sampled after each; growth is measured past the first
    arrival_s: float = 2.0
    max_prompt_tokens: int = 96
    max_new_tokens: int = 32
    cancel_share: float = 0.2  # closed after a random number of chunks
    deadline_share: float = 0.2  # cut by anyio.move_on_after after a random delay
    max_deadline_s: float = 1.5
    seed: int = 0


@dataclass
class SoakReport:
    requests: int = 0
    completed: int = 0
    rejected: int = 0
    cancelled: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0
    peak_rss_mib: float = 0.0
    rss_growth_mib_per_1000: float = 0.0
    leaked: dict[str, int] = field(default_factory=dict)  # what the engine still held
    reference_exact: bool = False
    worst_loop_stall_ms: float = 0.0
    seconds: float = 0.0


async def soak(engine: Engine, plan: SoakPlan) -> SoakReport:
    """Run `plan` against `engine` and report; the engine is left open."""
    started = time.perf_counter()
    reference = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = (await engine.complete(REFERENCE_PROMPT, reference)).token_ids
    rng = random.Random(plan.seed)
    report = SoakReport()
    latencies: list[float] = []
    rss_after_wave: list[tuple[int, float]] = []
    async with watch_loop() as watch:
        per_wave = -(-plan.requests // plan.waves)
        for wave in range(plan.waves):
            count = min(per_wave, plan.requests - report.requests)
            async with anyio.create_task_group() as tasks:
                for _ in range(count):
                    tasks.start_soon(_one_request, engine, plan, rng.random(), report, latencies)
            report.requests += count
            await _held_after_settling(engine)  # each wave starts from an idle engine
            rss_after_wave.append((report.requests, _rss_mib()))
        report.worst_loop_stall_ms = watch.worst_stall_ms
    report.leaked = await _held_after_settling(engine)
    report.reference_exact = (await engine.complete(REFERENCE_PROMPT, reference)).token_ids == expected
    if latencies:
        report.latency_p50_ms, report.latency_p99_ms = (
            float(v) for v in np.percentile(latencies, [50, 99])
        )
    report.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report.rss_growth_mib_per_1000 = _growth_per_1000(rss_after_wave)
    report.seconds = time.perf_counter() - started
    return report


async def _one_request(
    engine: Engine, plan: SoakPlan, draw: float, report: SoakReport, latencies: list[float]
) -> None:
    """One request of the plan; `draw` seeds everything random about it."""
    rng = random.Random(draw)
    await anyio.sleep(rng.uniform(0, plan.arrival_s))
    vocab = engine.info.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, plan.max_prompt_tokens))]
    params = SamplingParams(
        max_tokens=rng.randint(1, plan.max_new_tokens),
        temperature=rng.choice([0.0, 0.8]),
        top_k=rng.choice([0, 40]),
        seed=rng.randrange(2**32),
    )
    fate = rng.random()
    cancel_after = rng.randint(0, 8) if fate < plan.cancel_share else None
    deadline = (
        rng.uniform(0.01, plan.max_deadline_s)
        if plan.cancel_share <= fate < plan.cancel_share + plan.deadline_share
        else float("inf")
    )
    began = time.perf_counter()
    finished = False
    try:
        with anyio.move_on_after(deadline):
            async with aclosing(engine.generate(prompt, params)) as chunks:
                async for index, chunk in _enumerate(chunks):
                    if chunk.finish_reason is not None:
                        finished = True
                    elif cancel_after is not None and index >= cancel_after:
                        break
    except EngineOverloaded:
        report.rejected += 1
        return
    except Q4KError as exc:
        report.failed += 1
        kind = type(exc).__name__
        report.failures[kind] = report.failures.get(kind, 0) + 1
        return
    if finished:
        report.completed += 1
        latencies.append((time.perf_counter() - began) * 1000.0)
    else:
        report.cancelled += 1


async def _enumerate(chunks: AsyncIterator[Chunk]) -> AsyncIterator[tuple[int, Chunk]]:
    index = 0
    async for chunk in chunks:
        yield index, chunk
        index += 1


async def _held_after_settling(engine: Engine) -> dict[str, int]:
    """What the engine still holds once idle (waiting up to SETTLE_S for closes in flight)."""
    with anyio.move_on_after(SETTLE_S):
        while True:
            stats = engine.stats()
            held = {
                "running": stats.running,
                "waiting": stats.waiting,
                "kv_blocks_used": stats.kv_blocks_used,
            }
            if not any(held.values()):
                return held
            await anyio.sleep(0.05)
    return held


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _growth_per_1000(samples: list[tuple[int, float]]) -> float:
    """RSS growth per 1,000 requests past the first wave (which warms caches and pools)."""
    if len(samples) < 2:
        return 0.0
    (first_count, first_rss), (last_count, last_rss) = samples[0], samples[-1]
    return (last_rss - first_rss) / (last_count - first_count) * 1000.0


__all__ = ["SoakPlan", "SoakReport", "soak"]
