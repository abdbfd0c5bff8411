"""Benchmark of the CPU backend on gemma-3-270m: prefill, decode, batched decode, memory.

    python benchmarks/bench_forward.py [--model PATH] [--decode-tokens 64] [--repeats 3]
                                       [--ceiling]

Prints each figure with its ratio to the llama.cpp anchor measured on the 2-core target
(tests/reference/README.md), best and median of `--repeats` runs (best, because other work
on a shared machine only ever slows a run down). Steps go through the compute contract, as
the engine runs them (`CpuBackend.run`: the forward, then each row's candidates); decode is
greedy (the argmax candidate), as the engine's temperature-0 path; the 16 and 64 stream
figures step every stream together each step.
`--ceiling` adds, per figure, the rate its steps' float32 matmuls alone reach on the model's own
weights: the bound no arrangement of the rest of the forward can pass on this machine.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import actors  # noqa: F401  # first: it picks OpenBLAS's kernels before numpy loads them
import numpy as np

from actors.compute.contract import RowInputs
from actors.compute.cpu import CpuBackend
from actors.model.loaded import Model, load_model
from actors.model.step import StepItem

# llama.cpp on this machine class (2 threads, AVX2): llama-bench pp512 / tg128, and
# llama-server's aggregate throughput with 16 and 64 parallel clients.
ANCHORS = {"prefill_512": 501.0, "decode_1": 49.0, "decode_16": 155.0, "decode_64": 171.0}
TARGETS = {"prefill_512": 800.0, "decode_1": 22.0, "decode_16": 120.0, "decode_64": 280.0}
RSS_LIMIT_MB = 1600.0
PROMPT_TOKENS = 16
PREFILL_TOKENS = 512
DECODE_STREAMS = (1, 16, 64)
GREEDY = RowInputs(candidates=1)


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def best_rate(n_tokens: int, run: Callable[[], float], repeats: int) -> tuple[float, float]:
    """Best and median tokens/s of `repeats` runs; `run` returns the seconds it timed.
    Best, because other work on a shared machine only ever slows a run down."""
    rates = sorted(n_tokens / run() for _ in range(repeats))
    return rates[-1], rates[len(rates) // 2]


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def prefill_rate(model: Model, n_tokens: int, repeats: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    tokens = tuple(int(t) for t in rng.integers(1000, 200000, n_tokens))
    backend = CpuBackend(model, -(-n_tokens // 16), 16)
    item = StepItem(tokens, 0, tuple(range(backend.info.num_blocks)))
    return best_rate(n_tokens, lambda: timed(lambda: backend.run([item], [GREEDY])), repeats)


def decode_rate(model: Model, n_streams: int, n_decode: int, repeats: int) -> tuple[float, float]:
    """Tokens per second over `n_streams` sequences decoding `n_decode` tokens each, every
    step advancing all of them together (their prompts are prefilled first, untimed)."""
    block_size = 16
    blocks_per_seq = -(-(PROMPT_TOKENS + n_streams + n_decode) // block_size)
    backend = CpuBackend(model, n_streams * blocks_per_seq, block_size)
    tables = [tuple(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
              for s in range(n_streams)]
    rng = np.random.default_rng(1)
    # Prompt lengths differ per stream, as they would in a server.
    prompts = [tuple(int(t) for t in rng.integers(1000, 200000, PROMPT_TOKENS + s))
               for s in range(n_streams)]

    def run() -> float:
        candidates = backend.run([StepItem(p, 0, t) for p, t in zip(prompts, tables)],
                                 [GREEDY] * n_streams)
        lengths = [len(p) for p in prompts]
        started = time.perf_counter()
        for _ in range(n_decode):
            items = [StepItem((int(tok),), length, table)
                     for tok, length, table in zip(candidates.ids[:, 0], lengths, tables)]
            candidates = backend.run(items, [GREEDY] * n_streams)
            lengths = [length + 1 for length in lengths]
        return time.perf_counter() - started

    return best_rate(n_streams * n_decode, run, repeats)


def matmul_ceiling(model: Model, n_rows: int, n_logit_rows: int, repeats: int) -> float:
    """Tokens/s if a step of `n_rows` tokens did nothing but its float32 matmuls, on the
    model's own weight arrays (cold in cache, as in a real step): the most any layout of the
    rest of the forward could reach with these matmuls on this machine."""
    rng = np.random.default_rng(2)
    spec, weights = model.spec, model.weights

    def rows(width: int, n: int = n_rows) -> np.ndarray:
        return rng.standard_normal((n, width), dtype=np.float32)

    x, attn, gated, last = rows(spec.d_model), rows(spec.q_dim), rows(spec.ffn_dim), rows(
        spec.d_model, n_logit_rows)

    def matmuls() -> None:
        for layer in weights.layers:
            x @ layer.qkv
            attn @ layer.attn_out
            x @ layer.gate_up
            gated @ layer.down
        last @ weights.output

    matmuls()  # first touch of the outputs' pages is not part of the figure
    return best_rate(n_rows, lambda: timed(matmuls), repeats)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: gemma-3-270m)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ceiling", action="store_true",
                        help="also time each figure's matmuls alone (its ceiling here)")
    args = parser.parse_args()

    started = time.perf_counter()
    model = load_model(args.model)
    load_s = time.perf_counter() - started
    rss = resident_mb()
    print(f"model {model.path.name} ({model.spec.arch}), loaded in {load_s:.1f} s")
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}  "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"resident memory with the model loaded: {rss:.0f} MB "
          f"(limit {RSS_LIMIT_MB:.0f}; weights {model.weights.n_bytes / 2**20:.0f} MiB)")

    figures = {f"prefill_{PREFILL_TOKENS}": prefill_rate(model, PREFILL_TOKENS, args.repeats)}
    for streams in DECODE_STREAMS:
        figures[f"decode_{streams}"] = decode_rate(model, streams, args.decode_tokens,
                                                   args.repeats)
    # (rows a step carries, rows it projects to logits) for each figure's steps
    shapes = {f"prefill_{PREFILL_TOKENS}": (PREFILL_TOKENS, 1),
              **{f"decode_{streams}": (streams, streams) for streams in DECODE_STREAMS}}
    for name, (rate, median) in figures.items():
        ceiling = ""
        if args.ceiling:
            bound = matmul_ceiling(model, *shapes[name], max(args.repeats, 5))
            ceiling = f"   matmuls alone {bound:6.1f} ({rate / bound:.0%})"
        print(f"{name:12s} {rate:8.1f} tok/s (median {median:6.1f})   "
              f"x{rate / ANCHORS[name]:.2f} of llama.cpp "
              f"{ANCHORS[name]:.0f}   target {TARGETS[name]:.0f}"
              f"{'' if rate >= TARGETS[name] else '  (below target)'}{ceiling}")


if __name__ == "__main__":
    main()
