"""Opening GGUF files: our reader against gguf.GGUFReader on the real and tiny models, and our
open time on sparse files whose one tensor declares 1 GiB to 256 GiB of data (flat = the data
is mapped, never read).

Run: python benchmarks/bench_gguf_open.py [MODEL.gguf ...] [--repeats 5] [--skip-gguf-reader]
(default models: the two tiny reference models and the default gemma3-270m model)

Times are the best of `--repeats` runs (gguf.GGUFReader: one run on files over 200 MiB, which
take it seconds).
On a shared 2-core machine expect +-20% noise.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from actors.model.default_model import default_model_path
from actors.model.gguf.reader import open_gguf

TINY_MODELS = Path(__file__).resolve().parents[1] / "tests" / "reference" / "models"


def best_of(repeats: int, action: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


def ours(path: Path) -> None:
    open_gguf(path).close()


def sparse_model(directory: Path, data_bytes: int) -> Path:
    """A GGUF whose single F32 tensor declares `data_bytes`, written as a sparse file."""
    path = directory / f"sparse-{data_bytes >> 30}GiB.gguf"
    cols = 4096
    rows = data_bytes // (cols * 4)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor_info("big.weight", (rows, cols), np.dtype(np.float32), rows * cols * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    os.truncate(path, 4096 + rows * cols * 4)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", type=Path, metavar="MODEL.gguf")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-gguf-reader", action="store_true")
    args = parser.parse_args()

    models = args.models or [*sorted(TINY_MODELS.glob("*.gguf")), default_model_path()]
    print(f"{'model':<32} {'file':>10} {'ours ms':>9} {'GGUFReader ms':>14} {'ratio':>7}")
    for path in models:
        mine = best_of(args.repeats, lambda: ours(path))
        if args.skip_gguf_reader:
            theirs_text, ratio_text = "-", "-"
        else:
            repeats = 1 if path.stat().st_size > 200 << 20 else args.repeats
            theirs = best_of(repeats, lambda: gguf.GGUFReader(path))
            theirs_text, ratio_text = f"{theirs * 1e3:.1f}", f"{theirs / mine:.0f}x"
        size = f"{path.stat().st_size / 2**20:.1f} MiB"
        print(f"{path.name[:32]:<32} {size:>10} {mine * 1e3:>9.2f} {theirs_text:>14} "
              f"{ratio_text:>7}")

    print(f"\n{'declared data':<16} {'ours ms':>9}")
    with tempfile.TemporaryDirectory() as directory:
        for gib in (1, 16, 256):
            path = sparse_model(Path(directory), gib << 30)
            print(f"{gib:>12} GiB {best_of(args.repeats, lambda: ours(path)) * 1e3:>9.3f}")
            path.unlink()


if __name__ == "__main__":
    main()
