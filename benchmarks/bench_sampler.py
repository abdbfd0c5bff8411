"""Token choice on a full decode batch of real logits, next to the forward step that made them.

Run: python benchmarks/bench_sampler.py [--model PATH] [--rows 64] [--repeats 10]

It prefills `rows` short prompts on the model (the default gemma3-270m: 262,144 logits per row),
times one decode step of all rows on the CPU forward, then for each sampling setting times
choose_tokens on that step's logits (the whole pipeline: penalties, candidates, choice, whole
rows where candidates cannot decide) in milliseconds per call (median and min) and as a share
of the decode step, and counts what would cross from the compute actor: the rows that need
their whole logits, and the bytes against whole rows. Two shared cores make every figure
noisy: compare the columns of one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from actors.model.candidates import apply_penalties, top_candidates
from actors.model.loaded import load_model
from actors.model.step import StepItem
from actors.params import SamplingParams
from actors.sampling import SequenceSampling, choose_tokens, start_choice

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy + all penalties": SamplingParams(
        temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2
    ),
    "T=0.8 top_p=0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "T=0.8 top_k=40 top_p=0.9": SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
    "T=0.8 top_k=40 top_p=0.95 min_p=0.05": SamplingParams(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05
    ),
    "T=0.8 min_p=0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "T=1 (no filter)": SamplingParams(temperature=1.0),
    "T=0.8 top_p=0.9 logprobs=5": SamplingParams(temperature=0.8, top_p=0.9, logprobs=5),
    "T=1.5 top_p=0.98 (wide nucleus)": SamplingParams(temperature=1.5, top_p=0.98),
    "T=2 top_p=0.99 (half the vocabulary)": SamplingParams(temperature=2.0, top_p=0.99),
}

OPENINGS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "In 1492, Columbus",
    "My favourite food is",
    "The quick brown fox",
    "Dear Sir or Madam,",
    "import numpy as np\n",
]
TOPICS = ["the sea", "a robot", "the market", "winter", "my sister", "music", "a city", "space"]
BLOCK_SIZE = 16


def prompts(rows: int) -> list[str]:
    return [f"{OPENINGS[i % 8]} {TOPICS[(i // 8) % 8]}" for i in range(rows)]


def timed(call: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: gemma3-270m)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    model = load_model(args.model)
    vocab = model.spec.vocab_size
    encoded = [model.tokenizer.encode(text) for text in prompts(args.rows)]
    longest = max(len(ids) for ids in encoded) + 1
    per_row = -(-longest // BLOCK_SIZE)
    kv = model.new_kv_pool(args.rows * per_row, BLOCK_SIZE)  # the forward alone, as the yardstick
    tables = [tuple(range(i * per_row, (i + 1) * per_row)) for i in range(args.rows)]
    prefill = [StepItem(tuple(ids), 0, table) for ids, table in zip(encoded, tables)]
    next_tokens = np.argmax(model.step(prefill, kv), axis=1)
    decode = [
        StepItem((int(token),), len(ids), table)
        for token, ids, table in zip(next_tokens, encoded, tables)
    ]
    logits = model.step(decode, kv)
    step_ms = statistics.median(timed(lambda: model.step(decode, kv), 3))

    print(f"choose_tokens on {args.rows} x {vocab} logits of {model.spec.arch} (one decode step)")
    print(f"  forward decode step of {args.rows} rows: median {step_ms:.0f} ms")
    full_bytes = logits.nbytes
    for name, params in SETTINGS.items():
        states = [SequenceSampling(params, ids, vocab) for ids in encoded]
        choose_tokens(logits, states)  # warm-up
        times = timed(lambda: choose_tokens(logits, states), args.repeats)
        median = statistics.median(times)
        rows_fetched, crossed = what_crosses(logits, states)
        print(
            f"  {name:38s} median {median:6.1f} ms  min {min(times):6.1f} ms"
            f"  = {100 * median / step_ms:4.1f}% of the step;  whole rows {rows_fetched:2d}"
            f"  crossed {crossed / 1024:7.1f} KiB = {100 * crossed / full_bytes:5.2f}% of the rows"
        )


def what_crosses(logits: np.ndarray, states: list[SequenceSampling]) -> tuple[int, int]:
    """How many whole rows one step of these states asks for, and the bytes that cross from
    the compute actor for it (candidates and those rows)."""
    inputs = [state.row_inputs() for state in states]
    penalized = logits.copy()
    apply_penalties(penalized, inputs)
    candidates = top_candidates(penalized, inputs)
    needed = start_choice(candidates, states).needed_rows
    return len(needed), candidates.nbytes + len(needed) * logits.shape[1] * 4


if __name__ == "__main__":
    main()
