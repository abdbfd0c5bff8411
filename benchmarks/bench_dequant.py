"""Dequantization throughput: actors.model.gguf.quants.dequantize against gguf.quants.dequantize.

Runs both on the same whole tensors of the default model (gemma3-270m: Q4_K, Q6_K, Q5_0,
Q8_0) and SmolLM2 (Q4_1, Q8_0), checks they agree bit for bit, and prints elements per second
and the speed ratio per type. Best of `--repeat` interleaved rounds, to damp noise from other
work on the machine.

    python benchmarks/bench_dequant.py [--repeat 5] [--types Q4_K Q6_K]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType

from actors.model.default_model import default_model_path
from actors.model.gguf.quants import dequantize
from actors.model.gguf.reader import TensorInfo, open_gguf
from actors.model.packaged import CHAT_MODEL, resolve_model


def best_seconds(runs: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Best wall time of each run over `repeat` rounds, the runs interleaved within a round so
    that load from other work on the machine hits both sides alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def measure(tensors: list[tuple[np.ndarray, TensorInfo]], type_name: str, repeat: int) -> str:
    qtype = GGMLQuantizationType[type_name]

    def ours() -> None:
        for raw, info in tensors:
            dequantize(raw, type_name, info.shape)

    def theirs() -> None:
        for raw, _ in tensors:
            gguf_quants.dequantize(np.asarray(raw), qtype)

    for raw, info in tensors:  # warms the page cache, and checks agreement once
        expected = gguf_quants.dequantize(np.asarray(raw), qtype).reshape(info.shape)
        got = dequantize(raw, type_name, info.shape)
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), info.name
    seconds = best_seconds({"ours": ours, "gguf": theirs}, repeat)
    n = sum(info.n_elements for _, info in tensors)
    return (
        f"{type_name:6} {len(tensors):7d} {n / 1e6:8.1f} {n / seconds['ours'] / 1e6:13.0f} "
        f"{n / seconds['gguf'] / 1e6:13.0f} {seconds['gguf'] / seconds['ours']:6.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--types", nargs="*", default=["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"])
    args = parser.parse_args()

    files = [open_gguf(default_model_path()), open_gguf(resolve_model(CHAT_MODEL))]
    print(f"{'type':6} {'tensors':>7} {'Melem':>8} {'ours Melem/s':>13} {'gguf Melem/s':>13} ratio")
    for type_name in args.types:
        tensors = [
            (gguf_file.raw(info.name), info)
            for gguf_file in files
            for info in gguf_file.tensors.values()
            if info.type_name == type_name
        ]
        if tensors:
            print(measure(tensors, type_name, args.repeat))


if __name__ == "__main__":
    main()
