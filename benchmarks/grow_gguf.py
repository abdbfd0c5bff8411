"""Grow a shrunk GGUF back to its model's full shape, for speed figures on a device run.

`../shared/cuda/models/gemma3-shrunk.gguf` keeps gemma-3-270m's first 6 of its 18 layers and
8,192 of its 262,144 vocabulary rows: the real file (253 MB) does not fit a device run's carry.
Grown, its layers repeat in order up to `--layers` (gemma-3's five sliding-window layers and one
global layer repeat every six), its embedding rows (and an untied output's) repeat up to
`--vocab`, and its tokenizer gains placeholder pieces up to the vocabulary. Grown to 18 layers
and 262,144 tokens it has the real file's tensors, shapes and count of each block type (8 of
its 236 tensors have the block type of another layer's), 253.3 MB against 253.1: a decode step
reads what the real model's does. Its outputs mean nothing.

    python benchmarks/grow_gguf.py SHRUNK.gguf OUT.gguf --layers 18 --vocab 262144
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.gguf_reader import ReaderTensor

LAYER = re.compile(r"blk\.(\d+)\.(.+)")
VOCAB_ROWS = ("token_embd.weight", "output.weight")  # a row per token (output: when untied)
NORMAL_TOKEN = 1  # GGUF token type


def grown_tokens(fields: dict[str, Any], vocab: int) -> dict[str, list[Any]]:
    """The tokenizer's arrays extended to `vocab` entries: "▁t<id>" placeholder pieces, normal
    tokens, each scored below every real one (where the file has scores: BPE files do not)."""
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    extra = range(len(tokens), vocab)
    grown = {"tokenizer.ggml.tokens": tokens + [f"\u2581t{i}" for i in extra]}
    if "tokenizer.ggml.token_type" in fields:
        types = list(fields["tokenizer.ggml.token_type"].contents())
        grown["tokenizer.ggml.token_type"] = types + [NORMAL_TOKEN] * len(extra)
    if "tokenizer.ggml.scores" in fields:
        scores = list(fields["tokenizer.ggml.scores"].contents())
        lowest = min(scores)
        grown["tokenizer.ggml.scores"] = scores + [lowest - 1.0 - n for n in range(len(extra))]
    return grown


def grown_tensors(reader: GGUFReader, layers: int,
                  vocab: int) -> list[tuple[str, ReaderTensor, np.ndarray]]:
    """(name, the source tensor, data rows) of every tensor of the grown file: the
    embedding's (and an untied output's) rows repeated to `vocab`, layer i a copy of the
    shrunk layer i % its layer count, the rest as they are."""
    by_layer: dict[int, list[tuple[str, Any]]] = {}
    others = []
    for tensor in reader.tensors:
        match = LAYER.fullmatch(tensor.name)
        if match:
            by_layer.setdefault(int(match.group(1)), []).append((match.group(2), tensor))
        else:
            others.append(tensor)
    out = []
    for tensor in others:
        data = np.asarray(tensor.data)
        if tensor.name in VOCAB_ROWS:
            if vocab < data.shape[0]:
                raise SystemExit(f"--vocab {vocab} is below the file's {data.shape[0]} rows")
            data = np.resize(data, (vocab, *data.shape[1:]))  # rows repeated in order
        out.append((tensor.name, tensor, data))
    for layer in range(layers):
        for suffix, tensor in by_layer[layer % len(by_layer)]:
            out.append((f"blk.{layer}.{suffix}", tensor, np.asarray(tensor.data)))
    return out


def grow(source: Path, destination: Path, layers: int, vocab: int) -> dict[str, int]:
    """Write the grown model to `destination`; returns its shape (layers, vocab, tensors)."""
    reader = GGUFReader(source)
    fields = reader.fields
    arch = fields["general.architecture"].contents()
    writer = GGUFWriter(destination, arch)
    replaced = {f"{arch}.block_count": layers, f"{arch}.vocab_size": vocab,
                **grown_tokens(fields, vocab)}  # vocab_size: where the file states it
    for key, field in fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the reader's header fields and what the writer adds itself
        value = replaced.get(key, field.contents())
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type)
    tensors = grown_tensors(reader, layers, vocab)
    for name, tensor, data in tensors:
        # the shape in elements, numpy order (rows first); the bytes as they are
        elements = [int(n) for n in reversed(tensor.shape)]
        if name in VOCAB_ROWS:
            elements[0] = vocab
        writer.add_tensor_info(name, elements, np.dtype(np.float32), data.nbytes,
                               raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, data in tensors:
        writer.write_tensor_data(data)
    writer.close()
    return {"layers": layers, "vocab": vocab, "tensors": len(tensors)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    args = parser.parse_args()
    started = time.perf_counter()
    shape = grow(args.source, args.output, args.layers, args.vocab)
    print(f"wrote {args.output} ({args.output.stat().st_size / 2**20:.0f} MiB, {shape}) in "
          f"{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
