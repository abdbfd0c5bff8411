"""Benchmark of the CPU backend on gemma-3-270m: prefill, decode, batched decode, memory.

    python benchmarks/bench_forward.py [--model PATH] [--weights quantized|float32]
                                       [--decode-tokens 64] [--prefill-tokens 512]
                                       [--streams 1 16 64] [--repeats 3] [--ceiling]
                                       [--crossover] [--bandwidth]

Prints each figure with its ratio to the llama.cpp anchor measured on the 2-core target
(tests/reference/README.md), best and median of `--repeats` runs (best, because other work
on a shared machine only ever slows a run down). Steps go through the compute contract, as
the engine runs them (`CpuBackend.run`: the forward, then each row's candidates); decode is
greedy (the argmax candidate), as the engine's temperature-0 path; the 16 and 64 stream
figures step every stream together each step.
`--weights` picks how the model holds its weights: the file's blocks (the CPU backend's default)
or float32 (the reference path); run it once each for the ratio. Resident memory is printed
after loading and after the figures (quantized weights are read in place from the mapped file,
so they become resident as the steps read them).
`--ceiling` adds, per figure, the rate its steps' float32 matmuls alone reach on the model's own
weights (float32 only): the bound no arrangement of the rest of the forward can pass here.
`--crossover` times, for each shape of the model's quantized matrices, the direct product
against dequantizing slabs for BLAS at 1 to 64 rows of x, and prints where the slab route
starts to win (what `actors.model.quantized.DIRECT_ROWS_LIMIT` encodes).
`--bandwidth` compares the direct product's bytes/s (one row of x through every matrix of the
model, as one decode step reads them) with the machine's copy bandwidth (numpy copying 1 GiB:
bytes read plus bytes written, per second).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import actors  # noqa: F401  # first: it picks OpenBLAS's kernels before numpy loads them
import numpy as np

from actors.compute.contract import RowInputs
from actors.compute.cpu import CpuBackend, resident_bytes
from actors.model.default_model import default_model_path
from actors.model.loaded import WEIGHT_KINDS, Model, load_model
from actors.model.quantized import QuantizedMatrix
from actors.model.step import StepItem
from actors.model.weights import DenseMatrix

# llama.cpp on this machine class (2 threads, AVX2), gemma-3-270m: llama-bench pp512 / tg128,
# and llama-server's aggregate throughput with 16 and 64 parallel clients.
ANCHORS = {"prefill_512": 501.0, "decode_1": 49.0, "decode_16": 155.0, "decode_64": 171.0}
TARGETS = {"prefill_512": 750.0, "decode_1": 49.0, "decode_16": 120.0, "decode_64": 280.0}
# Resident memory with the model loaded and stepped: the float32 path's and the goal of the
# quantized one (gemma-3-270m).
RSS_LIMIT_MB = {"float32": 1600.0, "quantized": 600.0}
CROSSOVER_ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
COPY_BYTES = 1 << 30
PROMPT_TOKENS = 16
PREFILL_TOKENS = 512
DECODE_STREAMS = (1, 16, 64)
GREEDY = RowInputs(candidates=1)


def resident_mb() -> float:
    resident = resident_bytes()
    if resident is None:
        raise RuntimeError("this platform does not say a process's resident memory")
    return resident / 2**20


def peak_resident_mb() -> float:
    """The process's peak resident memory (Linux's VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def best_rate(n_tokens: int, run: Callable[[], float], repeats: int) -> tuple[float, float]:
    """Best and median tokens/s of `repeats` runs; `run` returns the seconds it timed.
    Best, because other work on a shared machine only ever slows a run down."""
    rates = sorted(n_tokens / run() for _ in range(repeats))
    return rates[-1], rates[len(rates) // 2]


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def token_limit(model: Model) -> int:
    """Random prompts take ids from 1000 up to this."""
    return min(200000, model.spec.vocab_size)


def prefill_rate(model: Model, n_tokens: int, repeats: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    tokens = tuple(int(t) for t in rng.integers(1000, token_limit(model), n_tokens))
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
    prompts = [tuple(int(t) for t in rng.integers(1000, token_limit(model), PROMPT_TOKENS + s))
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

    def product(matrix: DenseMatrix, rows: np.ndarray) -> np.ndarray:
        return rows @ matrix.transposed

    def matmuls() -> None:
        for layer in weights.layers:
            product(layer.qkv, x)
            product(layer.attn_out, attn)
            product(layer.gate_up, x)
            product(layer.down, gated)
        product(weights.output, last)

    matmuls()  # first touch of the outputs' pages is not part of the figure
    return best_rate(n_rows, lambda: timed(matmuls), repeats)[0]


def model_matrices(model: Model) -> list[QuantizedMatrix]:
    """Every quantized matrix a decode step multiplies, in step order."""
    weights = model.weights
    matrices = [matrix for layer in weights.layers
                for matrix in (layer.qkv, layer.attn_out, layer.gate_up, layer.down)]
    return [m for m in (*matrices, weights.output) if isinstance(m, QuantizedMatrix)]


def product_seconds(matrix: QuantizedMatrix, x: np.ndarray, limit: int, repeats: int) -> float:
    """Best seconds of `matrix.apply(x)` with the direct route taken up to `limit` rows."""
    out = np.empty((len(x), matrix.out_features), dtype=np.float32)
    saved, matrix.direct_rows_limit = matrix.direct_rows_limit, limit
    try:
        matrix.apply(x, out)
        return min(timed(lambda: matrix.apply(x, out)) for _ in range(repeats))
    finally:
        matrix.direct_rows_limit = saved


def print_crossover(model: Model, repeats: int) -> None:
    """Per matrix shape: ms of the direct and the slab route at each row count of x, and the
    first row count where the slab route is faster."""
    shapes: dict[tuple[str, int, int], QuantizedMatrix] = {}
    for matrix in model_matrices(model):
        types = "+".join(dict.fromkeys(part.type_name for part in matrix.parts))
        shapes.setdefault((types, matrix.out_features, matrix.in_features), matrix)
    rng = np.random.default_rng(3)
    for (types, out_features, in_features), matrix in shapes.items():
        cells, crossover = [], None
        for n_rows in CROSSOVER_ROWS:
            x = rng.standard_normal((n_rows, in_features), dtype=np.float32)
            direct = product_seconds(matrix, x, n_rows, repeats)
            slab = product_seconds(matrix, x, 0, repeats)
            cells.append(f"{n_rows}:{direct * 1e3:.2f}/{slab * 1e3:.2f}")
            if crossover is None and slab < direct:
                crossover = n_rows
        print(f"{types:12s} ({out_features}, {in_features})  slab wins from "
              f"{crossover or '>' + str(CROSSOVER_ROWS[-1])} rows   "
              f"[rows:direct/slab ms] {' '.join(cells)}")


def print_bandwidth(model: Model, repeats: int) -> None:
    """The direct product's bytes/s over one decode step's matrices, against numpy's copy."""
    source = np.ones(COPY_BYTES // 4, dtype=np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)
    copy_s = min(timed(lambda: np.copyto(target, source)) for _ in range(repeats))
    del source, target
    matrices = model_matrices(model)
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal((1, m.in_features), dtype=np.float32) for m in matrices]
    outputs = [np.empty((1, m.out_features), dtype=np.float32) for m in matrices]

    def step() -> None:
        for matrix, x, out in zip(matrices, inputs, outputs):
            matrix.apply(x, out)

    step()
    step_s = min(timed(step) for _ in range(repeats))
    step_bytes = sum(m.nbytes for m in matrices)
    copy_rate = 2 * COPY_BYTES / copy_s
    print(f"copy bandwidth (numpy, 1 GiB, read + written): {copy_rate / 1e9:.1f} GB/s")
    print(f"direct product, 1 row through every matrix ({step_bytes / 1e6:.0f} MB): "
          f"{step_s * 1e3:.2f} ms = {step_bytes / step_s / 1e9:.1f} GB/s "
          f"({step_bytes / step_s / copy_rate:.0%} of the copy bandwidth; the matrices alone "
          f"allow {1 / step_s:.0f} tok/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: gemma-3-270m)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS,
                        help="the prefill figure's prompt (0: none)")
    parser.add_argument("--streams", type=int, nargs="*", default=list(DECODE_STREAMS),
                        help="the decode figures' stream counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", choices=list(WEIGHT_KINDS), default="quantized")
    parser.add_argument("--ceiling", action="store_true",
                        help="also time each figure's matmuls alone (float32 weights only)")
    parser.add_argument("--crossover", action="store_true",
                        help="time the direct and the slab route per matrix shape, then stop")
    parser.add_argument("--bandwidth", action="store_true",
                        help="the direct product's bytes/s against numpy's copy, then stop")
    args = parser.parse_args()
    if args.ceiling and args.weights != "float32":
        parser.error("--ceiling times float32 matmuls: use it with --weights float32")

    started = time.perf_counter()
    model = load_model(args.model, weights=args.weights)
    load_s = time.perf_counter() - started
    rss = resident_mb()
    print(f"model {model.path.name} ({model.spec.arch}), {args.weights} weights "
          f"({model.weights.n_bytes / 2**20:.0f} MiB), loaded in {load_s:.1f} s")
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}  "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"resident memory with the model loaded: {rss:.0f} MB")
    if args.crossover or args.bandwidth:
        if args.crossover:
            print_crossover(model, max(args.repeats, 5))
        if args.bandwidth:
            print_bandwidth(model, max(args.repeats, 5))
        return

    # The anchors are gemma-3-270m's: another model's figures print without them.
    anchored = model.path.name == default_model_path().name
    figures = {}
    if args.prefill_tokens:
        figures[f"prefill_{args.prefill_tokens}"] = prefill_rate(model, args.prefill_tokens,
                                                                 args.repeats)
    for streams in args.streams:
        figures[f"decode_{streams}"] = decode_rate(model, streams, args.decode_tokens,
                                                   args.repeats)
    # (rows a step carries, rows it projects to logits) for each figure's steps
    shapes = {f"prefill_{args.prefill_tokens}": (args.prefill_tokens, 1),
              **{f"decode_{streams}": (streams, streams) for streams in args.streams}}
    for name, (rate, median) in figures.items():
        ceiling = ""
        if args.ceiling:
            bound = matmul_ceiling(model, *shapes[name], max(args.repeats, 5))
            ceiling = f"   matmuls alone {bound:6.1f} ({rate / bound:.0%})"
        anchor = ""
        if name in ANCHORS and anchored:
            anchor = (f"   x{rate / ANCHORS[name]:.2f} of llama.cpp {ANCHORS[name]:.0f}   target "
                      f"{TARGETS[name]:.0f}{'' if rate >= TARGETS[name] else '  (below target)'}")
        print(f"{name:12s} {rate:8.1f} tok/s (median {median:6.1f}){anchor}{ceiling}")
    limit = RSS_LIMIT_MB[args.weights]
    print(f"resident memory after the figures: {resident_mb():.0f} MB, at most "
          f"{peak_resident_mb():.0f} MB (gemma-3-270m's goal {limit:.0f}; the figures' KV pools "
          f"included)  load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
