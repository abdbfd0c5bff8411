"""Aggregate generation throughput through the engine vs bare stepping of its backend.

For each concurrency N: N requests with distinct prompts, each generating --tokens tokens
(greedy, EOS ignored), all at once. "bare" drives the CPU backend through the compute contract
(run -> candidates -> the sampler's choice) directly with the same batches (prompts prefilled
under the same token budget, then one decode step for all N per token); "engine" runs the same
requests through Engine.complete. Overhead = how much longer the engine takes than the bare
loop. `row_share` is what crossed from the compute actor to the host per token chosen, as a
share of a whole float32 logits row (the contract's goal: at most 1%). Each figure is the best of --repeats runs, bare and
engine interleaved, because the machine may be shared. Anchors (llama-server, same machine class):
49 / 155 / 171 tok/s at 1 / 16 / 64 clients.

    python benchmarks/bench_engine.py [--model PATH] [--concurrency 1 4 16 64] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

import anyio

from actors import Engine, SamplingParams, load_model
from actors.compute.cpu import CpuBackend
from actors.model.loaded import Model
from actors.model.step import StepItem
from actors.sampler import SequenceSampling, start_choice

BLOCK_SIZE = 16
PREFILL_CHUNK = 512


def prompts_for(model: Model, count: int) -> list[list[int]]:
    base = model.tokenizer.encode("Write a short story about a robot who learns to paint, number")
    return [base + model.tokenizer.encode(f" {index}.", add_bos=False) for index in range(count)]


def bare(model: Model, prompts: list[list[int]], tokens: int) -> float:
    """Seconds to generate `tokens` for every prompt by stepping the CPU backend directly."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    per_seq = -(-(max(map(len, prompts)) + tokens) // BLOCK_SIZE)
    backend = CpuBackend(model, per_seq * len(prompts), BLOCK_SIZE)
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    states = [SequenceSampling(params, prompt, model.spec.vocab_size) for prompt in prompts]

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
    positions = [len(prompt) for prompt in prompts]
    for _ in range(tokens - 1):
        last = choose([StepItem((t,), p, table) for t, p, table in zip(last, positions, tables)],
                      states)
        positions = [p + 1 for p in positions]
    return time.perf_counter() - started


async def through_engine(
    model: Model, prompts: list[list[int]], tokens: int
) -> tuple[float, int]:
    """Seconds for the requests through the engine, and the bytes that crossed from its
    compute actor meanwhile."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    async with Engine.open(model, max_sequences=64, prefill_chunk=PREFILL_CHUNK) as engine:
        await engine.complete([2, 3, 4], SamplingParams(max_tokens=2))  # warm the thread
        bytes_before = engine.stats().bytes_from_compute
        started = time.perf_counter()
        async with anyio.create_task_group() as tasks:
            for prompt in prompts:
                tasks.start_soon(engine.complete, prompt, params)
        seconds = time.perf_counter() - started
        return seconds, engine.stats().bytes_from_compute - bytes_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: gemma-3-270m)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many, interleaved")
    args = parser.parse_args()
    model = load_model(args.model)
    bare(model, prompts_for(model, 1), 2)  # first-call costs (thread pools, page faults)
    rows = []
    for count in args.concurrency:
        prompts = prompts_for(model, count)
        # Interleaved and best-of: other load on the machine hits both sides alike.
        bare_s = engine_s = float("inf")
        for _ in range(args.repeats):
            bare_s = min(bare_s, bare(model, prompts, args.tokens))
            seconds, crossed = anyio.run(through_engine, model, prompts, args.tokens)
            engine_s = min(engine_s, seconds)
        generated = count * args.tokens
        row_bytes = model.spec.vocab_size * 4
        rows.append(
            {
                "concurrency": count,
                "bare_tok_s": round(generated / bare_s, 1),
                "engine_tok_s": round(generated / engine_s, 1),
                "overhead_pct": round((engine_s / bare_s - 1) * 100, 1),
                "bytes_per_token": round(crossed / generated, 1),
                "row_share_pct": round(crossed / generated / row_bytes * 100, 4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    by_n = {row["concurrency"]: row["engine_tok_s"] for row in rows}
    if 1 in by_n and 16 in by_n:
        print(f"engine 16 / engine 1 = {by_n[16] / by_n[1]:.2f} (goal >= 4)")
    if 64 in by_n:
        print(f"engine 64 / llama-server 171 = {by_n[64] / 171:.2f} (goal >= 1.5)")


if __name__ == "__main__":
    main()
