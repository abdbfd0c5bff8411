"""Aggregate generation throughput through the engine vs bare stepping of its backend.

For each concurrency N: N requests with distinct prompts, each generating --tokens tokens
(greedy, EOS ignored), all at once. "bare" drives the backend through the compute contract
(run -> candidates -> the sampler's choice) directly with the same batches (prompts prefilled
under the same token budget, then one decode step for all N per token); "engine" runs the same
requests through the Engine. Overhead = how much longer the engine takes than the bare loop;
`engine_ms_per_step` is a decode step through the engine (from the last request's first token
to the end, over the steps taken meanwhile), `bare_ms_per_step` the bare loop's;
`backend_busy_share` the share of the engine run's wall time its backend spent in its run calls
(EngineStats.compute_busy_s): the rest, the backend waited for the actors. `row_share`
is what crossed from the compute actor to the host per token chosen, as a share of a whole
float32 logits row (the contract's goal: at most 1%). Each figure is the best of --repeats
runs, bare and engine interleaved, because the machine may be shared. Anchors (llama-server,
same machine class): 49 / 155 / 171 tok/s at 1 / 16 / 64 clients.

`--backend-cost zero` swaps the CPU backend for one that does no math (`ZeroCostBackend`: each
row's greedy candidate at once), so the engine's figures are what its actors alone cost a step,
with the model's own tokenizer decoding the tokens.

`--weights float32` runs the CPU backend on float32 weights (the reference path) instead of the
file's quantized blocks. `--memory` prints the resident memory of an engine opened on the
model file with its default KV pool, after loading and after a request of --tokens tokens a
concurrency (one process a model: run it apart from the speed figures).

    python benchmarks/bench_engine.py [--model PATH] [--concurrency 1 4 16 64] [--tokens 64]
                                      [--backend-cost cpu|zero] [--weights quantized|float32]
                                      [--memory]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from contextlib import aclosing
from typing import NamedTuple

import anyio
import numpy as np

from actors import Engine, SamplingParams, load_model
from actors.compute.contract import Candidates, ComputeBackend, ComputeInfo, RowInputs
from actors.compute.cpu import CpuBackend, resident_bytes
from actors.model.loaded import WEIGHT_KINDS, OpenedModel, open_model
from actors.model.step import StepItem
from actors.sampling import SequenceSampling, start_choice

BLOCK_SIZE = 16
PREFILL_CHUNK = 512
MAX_SEQUENCES = 64
# The zero-cost backend's answers cycle through these ids: ordinary tokens of any vocabulary
# the project runs, so the tokenizer decodes text as it would for a model.
_ZERO_COST_TOKENS = np.arange(1000, 1256, dtype=np.int32)


class ZeroCostBackend:
    """A backend that does no math: every row's one candidate is the next id of a fixed
    cycle. Greedy rows without logprobs only (they ask for one candidate and no log_z)."""

    def __init__(self, model: OpenedModel, num_blocks: int, block_size: int) -> None:
        self.info = ComputeInfo.of_model(
            model.spec, on_gpu=False, num_blocks=num_blocks, block_size=block_size
        )
        self._steps = 0

    def run(self, items: Sequence[StepItem], rows: Sequence[RowInputs]) -> Candidates:
        n = len(rows)
        self._steps += 1
        token = _ZERO_COST_TOKENS[self._steps % _ZERO_COST_TOKENS.size]
        return Candidates(
            ids=np.full((n, 1), token, dtype=np.int32),
            logits=np.zeros((n, 1), dtype=np.float32),
            count=np.ones(n, dtype=np.int32),
            log_z=np.full(n, np.nan),
        )

    def fetch_rows(self, indices: Sequence[int]) -> np.ndarray:
        raise NotImplementedError("the zero-cost backend answers greedy rows only")

    def close(self) -> None:
        pass


def backend_maker(
    cost: str, path: str | None, weights: str
) -> tuple[OpenedModel, Callable[[int], ComputeBackend]]:
    """The model (weights loaded only for the CPU backend) and a factory of its backend with
    a given number of KV blocks."""
    if cost == "zero":
        opened = open_model(path)
        return opened, lambda blocks: ZeroCostBackend(opened, blocks, BLOCK_SIZE)
    model = load_model(path, weights=weights)
    return model, lambda blocks: CpuBackend(model, blocks, BLOCK_SIZE)


def prompts_for(model: OpenedModel, count: int) -> list[list[int]]:
    base = model.tokenizer.encode("Write a short story about a robot who learns to paint, number")
    return [base + model.tokenizer.encode(f" {index}.", add_bos=False) for index in range(count)]


def bare(
    make_backend: Callable[[int], ComputeBackend], vocab_size: int, prompts: list[list[int]],
    tokens: int,
) -> tuple[float, float]:
    """Seconds to generate `tokens` for every prompt by stepping the backend directly, and
    the seconds of one decode step."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    per_seq = -(-(max(map(len, prompts)) + tokens) // BLOCK_SIZE)
    backend = make_backend(per_seq * len(prompts))
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    states = [SequenceSampling(params, prompt, vocab_size) for prompt in prompts]

    def choose(items: list[StepItem], some: list[SequenceSampling]) -> list[int]:
        candidates = backend.run(items, [state.row_inputs() for state in some])
        choices = start_choice(candidates, some).choices  # greedy: candidates decide all
        for state, choice in zip(some, choices):
            state.record(choice.token)
        return [choice.token for choice in choices]

    started = time.perf_counter()
    last: list[int] = []
    per_step = max(1, PREFILL_CHUNK // len(prompts[0]))
    for first in range(0, len(prompts), per_step):
        batch = range(first, min(len(prompts), first + per_step))
        last += choose([StepItem(tuple(prompts[i]), 0, tables[i]) for i in batch],
                       [states[i] for i in batch])
    decode_started = time.perf_counter()
    positions = [len(prompt) for prompt in prompts]
    for _ in range(tokens - 1):
        last = choose([StepItem((t,), p, table) for t, p, table in zip(last, positions, tables)],
                      states)
        positions = [p + 1 for p in positions]
    ended = time.perf_counter()
    return ended - started, (ended - decode_started) / max(1, tokens - 1)


class EngineRun(NamedTuple):
    seconds: float  # all the requests, from the first sent to the last answered
    bytes_from_compute: int  # what crossed from the compute actor meanwhile
    decode_step_s: float  # a step once every request has its first token
    backend_busy_share: float  # of `seconds`, the backend's own time in its run calls


async def through_engine(
    model: OpenedModel,
    prompts: list[list[int]],
    tokens: int,
    make_backend: Callable[[int], ComputeBackend] | None = None,
) -> EngineRun:
    """The requests through an engine over the CPU backend (over `make_backend`'s, given)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    if make_backend is None:
        opened = Engine.open(model, max_sequences=MAX_SEQUENCES, prefill_chunk=PREFILL_CHUNK)
    else:
        blocks = MAX_SEQUENCES * -(-(max(map(len, prompts)) + tokens) // BLOCK_SIZE)
        opened = Engine.open_backend(
            lambda: make_backend(blocks), model.tokenizer, max_sequences=MAX_SEQUENCES,
            prefill_chunk=PREFILL_CHUNK,
        )
    async with opened as engine:
        await engine.complete([2, 3, 4], params)  # warm the threads
        before = engine.stats()
        firsts: list[tuple[float, int]] = []  # (when, steps taken by then) per first token

        async def one(prompt: list[int]) -> None:
            async with aclosing(engine.generate(prompt, params)) as chunks:
                await chunks.__anext__()
                firsts.append((time.perf_counter(), engine.stats().steps))
                async for _ in chunks:
                    pass

        started = time.perf_counter()
        async with anyio.create_task_group() as tasks:
            for prompt in prompts:
                tasks.start_soon(one, prompt)
        ended = time.perf_counter()
        last_first, steps_then = max(firsts)
        after = engine.stats()
        return EngineRun(
            seconds=ended - started,
            bytes_from_compute=after.bytes_from_compute - before.bytes_from_compute,
            decode_step_s=(ended - last_first) / max(1, after.steps - steps_then),
            backend_busy_share=(after.compute_busy_s - before.compute_busy_s) / (ended - started),
        )


async def engine_memory(path: str | None, concurrency: list[int], tokens: int) -> None:
    """Resident memory of an engine opened on the file with its default KV pool: after
    loading, then after each concurrency's requests (the pool's pages count as they fill)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    before = resident_bytes() or 0
    async with Engine.open(path, backend="cpu", max_sequences=MAX_SEQUENCES) as engine:
        pool = engine.info.num_blocks * engine.info.block_size
        print(f"KV pool: {pool:,} positions; resident before the engine "
              f"{before / 2**20:.0f} MiB", flush=True)
        print(json.dumps({"after": "loading", "resident_mib": (resident_bytes() or 0) >> 20}),
              flush=True)
        for count in concurrency:
            base = engine.tokenize("Write a short story about a robot who learns to paint")
            async with anyio.create_task_group() as tasks:
                for index in range(count):
                    prompt = base + engine.tokenize(f" {index}.", add_bos=False)
                    tasks.start_soon(engine.complete, prompt, params)
            print(json.dumps({"after": f"{count} requests of {tokens} tokens",
                              "resident_mib": (resident_bytes() or 0) >> 20}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: gemma-3-270m)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many, interleaved")
    parser.add_argument("--backend-cost", choices=["cpu", "zero"], default="cpu",
                        help="zero: a backend that does no math, to time the actors alone")
    parser.add_argument("--weights", choices=list(WEIGHT_KINDS), default="quantized")
    parser.add_argument("--memory", action="store_true",
                        help="the resident memory of an engine with its default pool, then stop")
    args = parser.parse_args()
    if args.memory:
        anyio.run(engine_memory, args.model, args.concurrency, args.tokens)
        return
    model, make_backend = backend_maker(args.backend_cost, args.model, args.weights)
    vocab = model.spec.vocab_size
    bare(make_backend, vocab, prompts_for(model, 1), 2)  # first-call costs (thread pools...)
    engine_backend = make_backend if args.backend_cost == "zero" else None
    rows = []
    for count in args.concurrency:
        prompts = prompts_for(model, count)
        # Interleaved and best-of: other load on the machine hits both sides alike.
        bare_s = bare_step_s = float("inf")
        best: EngineRun | None = None
        decode_step_s = float("inf")
        for _ in range(args.repeats):
            seconds, step_s = bare(make_backend, vocab, prompts, args.tokens)
            bare_s, bare_step_s = min(bare_s, seconds), min(bare_step_s, step_s)
            run = anyio.run(through_engine, model, prompts, args.tokens, engine_backend)
            best = run if best is None or run.seconds < best.seconds else best
            decode_step_s = min(decode_step_s, run.decode_step_s)
        generated = count * args.tokens
        row_bytes = vocab * 4
        rows.append(
            {
                "concurrency": count,
                "bare_tok_s": round(generated / bare_s, 1),
                "engine_tok_s": round(generated / best.seconds, 1),
                "overhead_pct": round((best.seconds / bare_s - 1) * 100, 1),
                "bare_ms_per_step": round(bare_step_s * 1e3, 3),
                "engine_ms_per_step": round(decode_step_s * 1e3, 3),
                # Of the best engine run's wall time, the share its backend was busy; the
                # rest the backend waited for the actors.
                "backend_busy_share": round(best.backend_busy_share, 3),
                "bytes_per_token": round(best.bytes_from_compute / generated, 1),
                "row_share_pct": round(best.bytes_from_compute / generated / row_bytes * 100, 4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    by_n = {row["concurrency"]: row["engine_tok_s"] for row in rows}
    if args.backend_cost == "cpu" and 1 in by_n and 16 in by_n:
        print(f"engine 16 / engine 1 = {by_n[16] / by_n[1]:.2f} (goal >= 4)")
    if args.backend_cost == "cpu" and 64 in by_n:
        print(f"engine 64 / llama-server 171 = {by_n[64] / 171:.2f} (goal >= 1.5)")


if __name__ == "__main__":
    main()
