"""Block formats: dequantize and quantize GGUF tensor bytes in vectorized numpy.

`dequantize` reproduces `gguf.quants.dequantize` bit for bit: the same float32 operations in
the same order, only without its temporaries. Blocks are decoded in chunks small enough for the
intermediate uint8 arrays and the float32 output chunk to stay in cache, so each output element
is written to memory once.

`quantize` reproduces llama.cpp's reference quantizers (ggml-quants.c, no importance matrix)
for Q4_K, Q6_K, Q8_0 and Q5_0 byte for byte. llama.cpp accumulates sums in float32, one element
after the other, so the quantizers loop over the (16 or 32) positions inside a block, each step
vectorized over all blocks, and keep every intermediate in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from actors.errors import ModelFormatError, UnsupportedModelError

QK_K = 256  # elements of a K-quant super-block
F32 = np.float32
# Decode this many elements per chunk: big enough to amortize numpy's per-call overhead, small
# enough that the chunk's uint8 intermediates and float32 output stay in L2.
CHUNK_ELEMENTS = 1 << 16
# llama.cpp's GROUP_MAX_EPS: a group whose largest magnitude is below this quantizes to zeros.
GROUP_MAX_EPS = F32(1e-15)



@dataclass(frozen=True)
class BlockFormat:
    """How one GGUF type lays out `block_size` elements in `type_size` bytes.

    Quantized types decode as `value * scale + offset`, where `scale` and `offset` are float32
    per group of `block_size // groups` elements (computed by `params` with gguf.quants'
    operations) and `value` is a small integer per element (unpacked by `values`). Float types
    (no `params`) convert directly.
    """

    block_size: int
    type_size: int
    groups: int = 1
    # blocks (n, type_size) -> scale (n, groups), offset (n, groups) or None
    params: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]] | None = None
    # blocks (n, type_size) -> integers (n, groups, block_size // groups)
    values: Callable[[np.ndarray], np.ndarray] | None = None


# ---------------------------------------------------------------------------------------------
# Decoding. The products scale * value are exact or rounded exactly as gguf.quants rounds them:
# same operands, same order.

_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_LOW_2_BITS = np.uint64(0x0303030303030303)


def _f16_column(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 stored at byte `start` of every block, as a float32 column (n, 1)."""
    return blocks[:, start : start + 2].view(np.float16).astype(F32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(..., k) bytes -> (..., 2, k): low nibbles, then high nibbles.

    Works on 8 bytes at a time through uint64 words: a quarter of the numpy calls' elements.
    """
    words = np.ascontiguousarray(packed).view(np.uint64)
    out = np.empty((*words.shape[:-1], 2, words.shape[-1]), dtype=np.uint64)
    np.bitwise_and(words, _LOW_NIBBLES, out=out[..., 0, :])
    np.right_shift(words, 4, out=out[..., 1, :])
    out[..., 1, :] &= _LOW_NIBBLES
    return out.view(np.uint8)


def _fifth_bits(blocks: np.ndarray, start: int) -> np.ndarray:
    """The 32 fifth bits of a Q5_0/Q5_1 block (a little-endian uint32 at `start`), as (n, 32)."""
    return np.unpackbits(blocks[:, start : start + 4], axis=1, bitorder="little")


def _values_q4(blocks: np.ndarray, start: int, offset: int) -> np.ndarray:
    """Q4_0 / Q4_1 values: 16 packed bytes at `start`, minus `offset` (as int8 when signed)."""
    q = _nibbles(blocks[:, start:]).reshape(-1, 1, 32)
    if offset:
        q -= np.uint8(offset)  # wraps modulo 256; the int8 view reads the signed value
        return q.view(np.int8)
    return q


def _values_q5(blocks: np.ndarray, start: int, offset: int) -> np.ndarray:
    """Q5_0 / Q5_1 values: fifth bits at `start`, 16 packed bytes after them, minus `offset`."""
    q = _nibbles(blocks[:, start + 4 :]).reshape(-1, 1, 32)
    q |= (_fifth_bits(blocks, start) << 4)[:, None, :]
    if offset:
        q -= np.uint8(offset)
        return q.view(np.int8)
    return q


def _params_d(blocks: np.ndarray) -> tuple[np.ndarray, None]:
    return _f16_column(blocks, 0), None


def _params_d_m(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _f16_column(blocks, 0), _f16_column(blocks, 2)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 6-bit sub-block scales and mins from their 12 packed bytes: (n, 8) each."""
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], axis=1)
    mins = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], axis=1)
    return scales, mins


def _params_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: scale d * sc and offset -(dmin * m) per 32-element sub-block."""
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    scale = _f16_column(blocks, 0) * scales.astype(F32)
    offset = _f16_column(blocks, 2) * mins.astype(F32)
    np.negative(offset, out=offset)  # x + (-y) rounds exactly like gguf's x - y
    return scale, offset


def _values_q4_k(blocks: np.ndarray) -> np.ndarray:
    # Bytes 16..143 are 4 groups of 32: low nibbles -> sub-block 2g, high nibbles -> 2g + 1.
    return _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32)


_BIT_SHIFTS_8 = np.arange(8, dtype=np.uint8)[:, None]


def _values_q5_k(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    # Bit s of qh[l] is the fifth bit of element l of sub-block s.
    q |= ((blocks[:, None, 16:48] >> _BIT_SHIFTS_8) & 1) << 4
    return q


def _params_q6_k(blocks: np.ndarray) -> tuple[np.ndarray, None]:
    return _f16_column(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(F32), None


def _values_q6_k(blocks: np.ndarray) -> np.ndarray:
    # Each 128-element half has 64 ql bytes [a | b] and 32 qh bytes. Elements 0..31 take a's
    # low nibbles, 32..63 b's, 64..95 a's high nibbles, 96..127 b's; qh holds their top two
    # bits at shifts 0, 2, 4, 6 in that order.
    n = blocks.shape[0]
    q = _nibbles(blocks[:, :128].reshape(n, 2, 64))  # (n, half, low/high, a|b bytes)
    words = q.view(np.uint64).reshape(n, 2, 2, 2, 4)  # (n, half, low/high, a/b, 4 words)
    high = np.ascontiguousarray(blocks[:, 128:192]).view(np.uint64).reshape(n, 2, 1, 1, 4)
    for nibble in (0, 1):
        for part in (0, 1):
            shift = 4 * nibble + 2 * part
            words[:, :, nibble, part] |= ((high[:, :, 0, 0] >> shift) & _LOW_2_BITS) << 4
    q -= np.uint8(32)
    return q.view(np.int8).reshape(n, 16, 16)


FORMATS: dict[str, BlockFormat] = {
    "F32": BlockFormat(1, 4),
    "F16": BlockFormat(1, 2),
    "BF16": BlockFormat(1, 2),
    "Q4_0": BlockFormat(32, 18, 1, _params_d, lambda b: _values_q4(b, 2, 8)),
    "Q4_1": BlockFormat(32, 20, 1, _params_d_m, lambda b: _values_q4(b, 4, 0)),
    "Q5_0": BlockFormat(32, 22, 1, _params_d, lambda b: _values_q5(b, 2, 16)),
    "Q5_1": BlockFormat(32, 24, 1, _params_d_m, lambda b: _values_q5(b, 4, 0)),
    "Q8_0": BlockFormat(32, 34, 1, _params_d, lambda b: b[:, None, 2:].view(np.int8)),
    "Q4_K": BlockFormat(QK_K, 144, 8, _params_k, _values_q4_k),
    "Q5_K": BlockFormat(QK_K, 176, 8, _params_k, _values_q5_k),
    "Q6_K": BlockFormat(QK_K, 210, 16, _params_q6_k, _values_q6_k),
}


def _decode_floats(raw: np.ndarray, type_name: str) -> np.ndarray:
    if type_name == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(F32)
    return raw.view("<f4" if type_name == "F32" else "<f2").astype(F32)


def _decode_blocks(fmt: BlockFormat, blocks: np.ndarray) -> np.ndarray:
    """All blocks -> float32 (n, block_size), in chunks that stay in cache."""
    scale, offset = fmt.params(blocks)
    out = np.empty((blocks.shape[0], fmt.groups, fmt.block_size // fmt.groups), dtype=F32)
    step = max(CHUNK_ELEMENTS // fmt.block_size, 1)
    for start in range(0, blocks.shape[0], step):
        chunk = slice(start, start + step)
        dest = out[chunk]
        np.copyto(dest, fmt.values(blocks[chunk]))
        dest *= scale[chunk, :, None]
        if offset is not None:
            dest += offset[chunk, :, None]
    return out


def block_format(type_name: str) -> BlockFormat:
    """The layout of `type_name`; UnsupportedModelError for a type this engine cannot decode."""
    try:
        return FORMATS[type_name]
    except (KeyError, TypeError):
        supported = ", ".join(FORMATS)
        raise UnsupportedModelError(
            f"tensor type {type_name!r} is not supported (supported: {supported})"
        ) from None


def row_bytes(type_name: str, row_length: int) -> int:
    """Bytes of one row of `row_length` elements; ModelFormatError if blocks don't tile it."""
    fmt = block_format(type_name)
    if row_length % fmt.block_size:
        raise ModelFormatError(
            f"a {type_name} row of {row_length} elements is not a whole number of "
            f"{fmt.block_size}-element blocks"
        )
    return row_length // fmt.block_size * fmt.type_size


def dequantize(raw: np.ndarray, type_name: str, shape: Sequence[int]) -> np.ndarray:
    """Decode the bytes of a tensor of `type_name` into a new float32 array of `shape`.

    `shape` is in elements, rows last (numpy order); `raw` holds exactly its bytes (any shape,
    e.g. the (rows, row_bytes) view of `GGUFFile.raw`).
    """
    fmt = block_format(type_name)
    shape = tuple(int(dim) for dim in shape)
    if not shape or min(shape) < 0:
        raise ModelFormatError(f"invalid {type_name} tensor shape {shape}")
    n_elements = int(np.prod(shape, dtype=np.int64))
    expected = n_elements // shape[-1] * row_bytes(type_name, shape[-1]) if shape[-1] else 0
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ModelFormatError(f"{type_name} tensor data must be uint8 bytes, got {raw.dtype}")
    if raw.size != expected:
        raise ModelFormatError(
            f"{type_name} tensor of shape {shape} needs {expected} bytes, got {raw.size}"
        )
    raw = np.ascontiguousarray(raw).reshape(-1)
    if fmt.params is None:
        return _decode_floats(raw, type_name).reshape(shape)
    return _decode_blocks(fmt, raw.reshape(-1, fmt.type_size)).reshape(shape)
