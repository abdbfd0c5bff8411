"""Write a synthetic GGUF of Llama-3-8B's shapes, quantized as Q4_K_M, with random weights.

The blocks are random but valid, written as bytes directly (no float32 detour): random quants
and sub-block scales, float16 super-block scales drawn from a sane range so weights come out
around +-0.05. Tensor types follow llama.cpp's Q4_K_M recipe as this project implements it
(`actors.model.gguf.quantize_file.plan_tensor_types`): Q4_K, with Q6_K for the output and for the
attn_v / ffn_down tensors of the layers `use_more_bits` picks; norms are F32 ones.

    python benchmarks/synthetic_gguf.py OUT.gguf [--layers N] [--vocab N] [--seed N]

Its tokenizer is a placeholder SentencePiece vocabulary (the control tokens, the 256 byte
tokens, then pieces named by their id), enough for the Engine to serve it token ids in and
out; `actors.load_model` opens it. The full 32-layer file is 4.6 GiB; each tensor is generated and
written in turn, so memory stays at about the largest tensor.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_VERSION, GGMLQuantizationType

from actors.model.gguf.quantize_file import plan_tensor_types
from actors.model.gguf.quants import FORMATS
from actors.model.gguf.reader import TensorInfo


@dataclass(frozen=True)
class LlamaShape:
    """The hyperparameters of a llama-architecture model."""

    layers: int = 32
    d_model: int = 4096
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336
    vocab: int = 128256
    context: int = 8192
    rope_base: float = 500000.0
    rms_eps: float = 1e-5

    @property
    def kv_dim(self) -> int:
        return self.d_model // self.heads * self.kv_heads


# Byte offset of each float16 scale field of a block, and the range its magnitude is drawn
# from: Q4_K weights are q * d * sc - dmin * m with q < 16 and sc, m < 64; Q6_K weights are
# (q - 32) * d * sc with |sc| <= 128. The ranges keep |w| below about 0.05.
SCALE_FIELDS: dict[str, dict[int, tuple[float, float]]] = {
    "Q4_K": {0: (1e-5, 5e-5), 2: (1e-5, 5e-5)},
    "Q6_K": {208: (2e-6, 1.2e-5)},
}


def tensor_shapes(shape: LlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape: rows last) of every tensor, in llama.cpp's file order."""
    d, kv, ffn = shape.d_model, shape.kv_dim, shape.ffn
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape.vocab, d))]
    for i in range(shape.layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (d,)),
            (f"blk.{i}.attn_q.weight", (d, d)),
            (f"blk.{i}.attn_k.weight", (kv, d)),
            (f"blk.{i}.attn_v.weight", (kv, d)),
            (f"blk.{i}.attn_output.weight", (d, d)),
            (f"blk.{i}.ffn_norm.weight", (d,)),
            (f"blk.{i}.ffn_gate.weight", (ffn, d)),
            (f"blk.{i}.ffn_up.weight", (ffn, d)),
            (f"blk.{i}.ffn_down.weight", (d, ffn)),
        ]
    tensors += [("output_norm.weight", (d,)), ("output.weight", (shape.vocab, d))]
    return tensors


def q4_k_m_types(shape: LlamaShape) -> dict[str, str]:
    """Tensor name -> block type under this project's Q4_K_M recipe."""
    infos = [TensorInfo(name, "F32", int(GGMLQuantizationType.F32), dims, 0, 0)
             for name, dims in tensor_shapes(shape)]
    return plan_tensor_types(infos, "Q4_K_M")


def random_blocks(rng: np.random.Generator, type_name: str, n_blocks: int) -> np.ndarray:
    """n_blocks random valid blocks of a K-quant type, (n_blocks, type_size) uint8: every
    byte random (any quant and 6/8-bit scale pattern is valid), then each float16 scale field
    overwritten with a random value of its sane range."""
    blocks = rng.integers(0, 256, (n_blocks, FORMATS[type_name].type_size), dtype=np.uint8)
    for offset, (low, high) in SCALE_FIELDS[type_name].items():
        halves = rng.uniform(low, high, n_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks


def tensor_bytes(rng: np.random.Generator, type_name: str, dims: tuple[int, ...]) -> np.ndarray:
    """The data of one tensor: F32 ones for norms, random blocks for matrices."""
    if type_name == "F32":
        return np.ones(dims, dtype=np.float32).view(np.uint8)
    n_blocks = int(np.prod(dims)) // FORMATS[type_name].block_size
    return random_blocks(rng, type_name, n_blocks)


# GGUF token types: normal, unknown, control, byte.
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def add_placeholder_tokenizer(writer: GGUFWriter, vocab: int) -> None:
    """A SentencePiece vocabulary of `vocab` tokens: <unk>, <s>, </s>, the byte tokens, then
    "▁t<id>" pieces (so the Engine can open the file and detokenize what it generates)."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    first_piece = len(specials) + len(byte_tokens)
    tokens = [*specials, *byte_tokens, *(f"\u2581t{i}" for i in range(first_piece, vocab))]
    types = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * (vocab - first_piece)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens[:vocab])
    writer.add_token_scores([-float(i) for i in range(vocab)])
    writer.add_token_types(types[:vocab])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_synthetic_gguf(path: Path, shape: LlamaShape, seed: int = 0) -> dict[str, int]:
    """Write the model to `path`; returns its type mix (type -> tensor count)."""
    types = q4_k_m_types(shape)
    writer = GGUFWriter(path, "llama")
    writer.add_name("synthetic Llama-3-8B shapes (random weights)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.d_model)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_rope_dimension_count(shape.d_model // shape.heads)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(int(LlamaFileType.MOSTLY_Q4_K_M))
    writer.add_quantization_version(GGML_QUANT_VERSION)
    add_placeholder_tokenizer(writer, shape.vocab)
    tensors = tensor_shapes(shape)
    for name, dims in tensors:
        fmt = FORMATS[types[name]]
        n_bytes = int(np.prod(dims)) // fmt.block_size * fmt.type_size
        writer.add_tensor_info(name, dims, np.dtype(np.float32), n_bytes,
                               raw_dtype=GGMLQuantizationType[types[name]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in tensors:
        writer.write_tensor_data(tensor_bytes(rng, types[name], dims))
    writer.close()
    mix: dict[str, int] = {}
    for type_name in types.values():
        mix[type_name] = mix.get(type_name, 0) + 1
    return mix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--layers", type=int, default=LlamaShape.layers)
    parser.add_argument("--vocab", type=int, default=LlamaShape.vocab)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    mix = write_synthetic_gguf(args.output, LlamaShape(layers=args.layers, vocab=args.vocab),
                               args.seed)
    size = args.output.stat().st_size
    print(f"wrote {args.output} ({size / 2**30:.2f} GiB, {mix}) in "
          f"{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
