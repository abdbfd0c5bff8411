"""Tokenizer throughput: encode 1 MB of mixed English and code with gemma3 (SPM, 262k vocab)
and SmolLM2 (byte-level BPE), plus load time, decode and streaming decode.

The text never repeats a line (repeats would flatter the encoders' word caches): English is
the package descriptions of the installed distributions (dist-info METADATA), code is the
standard library's Python sources, interleaved in paragraphs up to `--megabytes` MB. Best of
`--repeat` runs; the machine is shared, so expect noise.

    python benchmarks/bench_tokenizer.py [--megabytes 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from actors.model.default_model import default_model_path
from actors.model.gguf.reader import open_gguf
from actors.model.packaged import CHAT_MODEL, resolve_model
from actors.model.text.tokenizer import Tokenizer


def _paragraphs(texts: Iterator[str]) -> Iterator[str]:
    for text in texts:
        yield from (part for part in text.split("\n\n") if part.strip())


def mixed_text(n_bytes: int) -> str:
    """About `n_bytes` of UTF-8: English and code paragraphs alternating, no line twice."""
    english = _paragraphs(
        dist.read_text("METADATA") or "" for dist in importlib.metadata.distributions()
    )
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = _paragraphs(
        path.read_text(encoding="utf-8", errors="replace")
        for path in sorted(stdlib.glob("*.py"))
    )
    seen: set[str] = set()
    parts: list[str] = []
    size = 0
    for paragraph in itertools.chain.from_iterable(zip(english, code)):
        lines = [line for line in paragraph.splitlines() if line not in seen or not line.strip()]
        seen.update(lines)
        part = "\n".join(lines) + "\n\n"
        parts.append(part)
        size += len(part.encode())
        if size >= n_bytes:
            break
    return "".join(parts)


def best_seconds(run: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    text = mixed_text(int(args.megabytes * 1_000_000))
    megabytes = len(text.encode()) / 1e6
    print(f"text: {megabytes:.2f} MB, {len(text.splitlines())} lines")
    models = (("gemma3-270m (SPM)", default_model_path()), ("smollm2 (BPE)", resolve_model(CHAT_MODEL)))
    for name, path in models:
        start = time.perf_counter()
        tokenizer = Tokenizer.from_gguf(open_gguf(path))
        load = time.perf_counter() - start
        tokenizer.encode("warm up")  # builds the encoder
        build = time.perf_counter() - start - load
        ids = tokenizer.encode(text)
        encode = best_seconds(lambda: tokenizer.encode(text), args.repeat)
        decode = best_seconds(lambda: tokenizer.decode(ids), args.repeat)

        def stream(tokenizer: Tokenizer = tokenizer, ids: list[int] = ids) -> None:
            decoder = tokenizer.incremental_decoder()
            for token in ids:
                decoder.push(token)
            decoder.flush()

        streaming = best_seconds(stream, 1)
        print(
            f"{name:18s} load {load:4.2f} s + encoder {build:4.2f} s | "
            f"encode {megabytes / encode:5.2f} MB/s "
            f"({len(ids) / encode / 1e3:6.0f} k tok/s, {len(ids)} tokens) | "
            f"decode {megabytes / decode:6.1f} MB/s | "
            f"stream {len(ids) / streaming / 1e3:5.0f} k tok/s"
        )


if __name__ == "__main__":
    main()
