"""The CUDA backend's host work a decode step, timed without a GPU.

`CudaBackend.run` over the emulated device of the tests (tests/cuda_emulator.py) with no
kernel run: what is timed is the host's part of a step (plan_step, the step and row arrays,
their pinned copies, the decode graph's replay call, the candidate kernels' launches, the
records' way back), which a device step must not wait for. Per row count: the step's
`ms_per_step` (best of --repeats runs of --steps steps), and of it `plan_ms` (plan_step, before
the forward launches) and `row_arrays_ms` (packed while the forward runs); `ahead_ms_per_step`
a greedy decode whose every step was run ahead (actors.compute.cuda_ahead: the step is
recognized, the next one queued, the records read), over AHEAD_STEPS steps.

`--engine-streams`: the whole Engine over the same device, its stream keeping time as a GPU
whose every decode step takes `--device-ms` (one value, or one a stream count; the work done
at once, each wait sleeping until the work queued before it would be done; the candidate
kernels' twins run, so every row answers token 0). That many concurrent greedy requests of
ENGINE_TOKENS tokens, one step at a time and with every step run ahead: `ms_per_step` a
decode step, and `device_idle_ms` what of it the device waits for the host (the actors and
the backend's host work). With `--staggered LOW HIGH`: instead, a closed loop of four times
the streams' requests of LOW to HIGH tokens (staggered), `tok_s` one step at a time and with
every step run ahead, each twice in turn: where running ahead pays once sequences join and
end (each costing a dropped step) — cuda_ahead.RUN_AHEAD_MAX_ROWS's measurement.

    python benchmarks/bench_cuda_host.py [--model PATH] [--rows 1 32 64] [--steps 300]
                                         [--engine-streams 1 32 64] [--device-ms 2 ...]
                                         [--staggered LOW HIGH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' emulator

from actors import Engine, SamplingParams  # noqa: E402
from actors.compute import cuda_packing as packing  # noqa: E402
from actors.compute.contract import KVRequest, RowInputs, StepItem  # noqa: E402
from actors.model.loaded import load_model  # noqa: E402
from actors.model.step import plan_step  # noqa: E402
from tests.conftest import TINY_MODELS  # noqa: E402
from tests.cuda_emulator import EmulatedDevice, install  # noqa: E402
from tests.test_engine_fake import FakeTokenizer  # noqa: E402

BLOCK_SIZE = 16
AHEAD_STEPS = 100
ENGINE_TOKENS = 64


def best_ms(work: Callable[[], object], steps: int, repeats: int) -> float:
    """The best of `repeats` timings of `steps` calls, in ms a call."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(steps):
            work()
        best = min(best, (time.perf_counter() - started) / steps)
    return best * 1e3


@asynccontextmanager
async def warm_engine(module: Any, model: Any, streams: int, run_ahead_rows: int,
                      longest: int) -> AsyncIterator[Engine]:
    """An Engine over the emulated device's CUDA backend for `streams` sequences of up to
    8 + `longest` tokens, its first request (the graphs' capture) done."""
    per_stream = -(-(8 + longest + 1) // BLOCK_SIZE) + 1
    kv = KVRequest(blocks=streams * per_stream, block_size=BLOCK_SIZE, max_sequences=streams)
    async with Engine.open_backend(
            lambda: module.build_cuda_backend(model, kv, 0.9, run_ahead_rows=run_ahead_rows),
            FakeTokenizer(model.spec.vocab_size), max_sequences=streams) as engine:
        await engine.complete([2, 3, 4], SamplingParams(max_tokens=4, temperature=0.0))
        yield engine


async def engine_step_ms(module: Any, model: Any, streams: int, run_ahead_rows: int) -> float:
    """A decode step's wall time through an Engine over the timed emulated device: `streams`
    concurrent greedy requests, from the last one's first token to the end."""
    params = SamplingParams(max_tokens=ENGINE_TOKENS, temperature=0.0, ignore_eos=True)
    firsts: list[float] = []

    async def one(engine: Engine, index: int) -> None:
        first = True
        async for chunk in engine.generate([2 + index % 50] * 8, params):
            if first and chunk.token_id is not None:
                firsts.append(time.perf_counter())
                first = False

    async with warm_engine(module, model, streams, run_ahead_rows, ENGINE_TOKENS) as engine:
        async with anyio.create_task_group() as tasks:
            for index in range(streams):
                tasks.start_soon(one, engine, index)
        ended = time.perf_counter()
    return (ended - max(firsts)) / (ENGINE_TOKENS - 1) * 1e3


async def staggered_tok_s(module: Any, model: Any, streams: int, run_ahead_rows: int,
                          lengths: tuple[int, int]) -> float:
    """Tokens a second through an Engine over the timed emulated device: four times `streams`
    greedy requests, `streams` at a time (one starts as one ends), of lengths staggered from
    lengths[0] to lengths[1] tokens."""
    low, high = lengths
    requests = 4 * streams
    sizes = [low + 7 * index % (high - low + 1) for index in range(requests)]
    produced = 0

    async def one(engine: Engine, index: int, slots: anyio.Semaphore) -> None:
        nonlocal produced
        params = SamplingParams(max_tokens=sizes[index], temperature=0.0, ignore_eos=True)
        async with slots:
            async for chunk in engine.generate([2 + index % 50] * 8, params):
                produced += chunk.token_id is not None

    async with warm_engine(module, model, streams, run_ahead_rows, high) as engine:
        slots = anyio.Semaphore(streams)
        started = time.perf_counter()
        async with anyio.create_task_group() as tasks:
            for index in range(requests):
                tasks.start_soon(one, engine, index, slots)
        return produced / (time.perf_counter() - started)


def engine_figures(module: Any, model: Any, streams: int, device_ms: float,
                   staggered: tuple[int, int] | None) -> None:
    """Prints the Engine's figures at `streams` one step at a time and with every step run
    ahead: the decode step and the device's idle time, or with `staggered` the tok/s of that
    workload (twice each, in turn)."""
    runs = (0, streams, 0, streams) if staggered else (0, streams)
    figures: dict[int, list[float]] = {}
    for rows in runs:
        if staggered:
            figure = anyio.run(staggered_tok_s, module, model, streams, rows, staggered)
        else:
            figure = anyio.run(engine_step_ms, module, model, streams, rows)
        figures.setdefault(rows, []).append(round(figure, 3))
    for rows, values in figures.items():
        line = {"engine_streams": streams, "run_ahead": rows > 0, "device_ms": device_ms}
        if staggered:
            line |= {"lengths": list(staggered), "tok_s": values}
        else:
            line |= {"ms_per_step": values[0], "device_idle_ms": round(values[0] - device_ms, 3)}
        print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(TINY_MODELS["llama-q4k-tiny"]),
                        help="GGUF path (default: the tests' tiny llama)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine-streams", type=int, nargs="*", default=[],
                        help="stream counts through the Engine over a timed device")
    parser.add_argument("--device-ms", type=float, nargs="+", default=[2.0],
                        help="the timed device's decode step (ms): one, or one a stream count")
    parser.add_argument("--staggered", type=int, nargs=2, metavar=("LOW", "HIGH"),
                        help="tok/s of requests of LOW to HIGH tokens in a closed loop")
    args = parser.parse_args()
    with pytest.MonkeyPatch.context() as patches:
        module = install(patches, EmulatedDevice(run_kernels=False))
        model = load_model(args.model)
        spec = model.spec
        for rows in args.rows:
            per_row = -(-(20 + AHEAD_STEPS + 1) // BLOCK_SIZE)
            blocks = per_row * rows + 1
            backend = module.build_cuda_backend(
                model, KVRequest(blocks=blocks, block_size=BLOCK_SIZE, max_sequences=rows),
                0.9)
            tables = [tuple(range(i * per_row, (i + 1) * per_row)) for i in range(rows)]
            # Every row a decode token at position 20 of its own blocks, greedy: the same step
            # again and again (the step queued after the first is dropped, none after it).
            items = [StepItem((5,), 20, table, seq_id=i) for i, table in enumerate(tables)]
            inputs = [RowInputs(candidates=1)] * rows
            backend.run(items, inputs)  # the graph's capture
            step_ms = best_ms(lambda: backend.run(items, inputs), args.steps, args.repeats)
            # The emulated records name token 0: steps feeding it go on as run ahead.
            started = time.perf_counter()
            for position in range(20, 20 + AHEAD_STEPS):
                backend.run([StepItem((0,), position, table, seq_id=i)
                             for i, table in enumerate(tables)], inputs)
            ahead_ms = (time.perf_counter() - started) / AHEAD_STEPS * 1e3
            assert backend.steps_run_ahead >= AHEAD_STEPS - 3
            plan_ms = best_ms(lambda: plan_step(items, spec, blocks, BLOCK_SIZE), args.steps,
                              args.repeats)
            rows_ms = best_ms(lambda: packing.row_arrays(inputs, spec.vocab_size), args.steps,
                              args.repeats)
            backend.close()
            print(json.dumps({"rows": rows, "ms_per_step": round(step_ms, 3),
                              "plan_ms": round(plan_ms, 3), "row_arrays_ms": round(rows_ms, 3),
                              "ahead_ms_per_step": round(ahead_ms, 3)}), flush=True)
    device_ms = (args.device_ms if len(args.device_ms) > 1
                 else args.device_ms * len(args.engine_streams))
    if len(device_ms) != len(args.engine_streams):
        parser.error("--device-ms takes one value, or one for each of --engine-streams")
    for streams, step_ms in zip(args.engine_streams, device_ms):
        with pytest.MonkeyPatch.context() as patches:
            module = install(patches, EmulatedDevice(run_kernels=False, run_candidates=True,
                                                     graph_seconds=step_ms / 1e3))
            engine_figures(module, model, streams, step_ms, args.staggered)


if __name__ == "__main__":
    main()
