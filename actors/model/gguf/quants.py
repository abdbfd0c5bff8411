"""Block formats: the layout of each GGUF tensor type, and dequantize in vectorized numpy.

`dequantize` reproduces `gguf.quants.dequantize` bit for bit: the same float32 operations in
the same order, only without its temporaries. Blocks are decoded in chunks small enough for the
intermediate uint8 arrays and the float32 output chunk to stay in cache, so each output element
is written to memory once. The way back, `quantize`, is in `quantizers`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from actors.errors import ModelFormatError, UnsupportedModelError

QK_K = 256  # elements of a K-quant super-block
F32 = np.float32
# Decode this many elements per chunk: big enough to amortize numpy's per-call overhead, small
# enough that the chunk's uint8 intermediates and float32 output stay in L2.
CHUNK_ELEMENTS = 1 << 17


@dataclass(frozen=True)
class BlockFormat:
    """How one GGUF type lays out `block_size` elements in `type_size` bytes.

    Quantized types decode as `value * scale + offset`, where `scale` and `offset` are float32
    per group of `block_size // groups` elements (computed by `params` with gguf.quants'
    operations) and `value` is a small integer per element (unpacked by `fill`). Float types
    (no `params`) convert directly.
    """

    block_size: int
    type_size: int
    groups: int = 1
    # blocks (n, type_size) -> scale (n, groups), offset (n, groups) or None
    params: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]] | None = None
    # (blocks (n, type_size), dest float32 (n, groups, block_size // groups)): writes each
    # element's integer value into dest
    fill: Callable[[np.ndarray, np.ndarray], None] | None = None


# ---------------------------------------------------------------------------------------------
# Decoding. The products scale * value are exact or rounded exactly as gguf.quants rounds them:
# same operands, same order.

_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_LOW_2_BITS = np.uint64(0x0303030303030303)


def _f16_column(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 stored at byte `start` of every block, as a float32 column (n, 1)."""
    return blocks[:, start : start + 2].view(np.float16).astype(F32)


_NIBBLE_SHIFTS = np.array([[0], [4]], dtype=np.uint64)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(..., k) bytes -> (..., 2, k): low nibbles, then high nibbles.

    Works on 8 bytes at a time through uint64 words: an eighth of the elements per numpy call.
    """
    words = np.ascontiguousarray(packed).view(np.uint64)
    out = words[..., None, :] >> _NIBBLE_SHIFTS
    out &= _LOW_NIBBLES
    return out.view(np.uint8)


def _fifth_bits(blocks: np.ndarray, start: int) -> np.ndarray:
    """The 32 fifth bits of a Q5_0/Q5_1 block (a little-endian uint32 at `start`), as (n, 32)."""
    return np.unpackbits(blocks[:, start : start + 4], axis=1, bitorder="little")


def _fill_levels(dest: np.ndarray, levels: np.ndarray, offset: int) -> None:
    """dest = levels - offset, levels being uint8 (modified in place)."""
    if offset:
        levels -= np.uint8(offset)  # wraps modulo 256; the int8 view reads the signed value
        levels = levels.view(np.int8)
    np.copyto(dest, levels.reshape(dest.shape))


def _fill_q4(blocks: np.ndarray, dest: np.ndarray, start: int, offset: int) -> None:
    """Q4_0 / Q4_1: 16 packed bytes at `start`, minus `offset`."""
    _fill_levels(dest, _nibbles(blocks[:, start:]), offset)


def _fill_q5(blocks: np.ndarray, dest: np.ndarray, start: int, offset: int) -> None:
    """Q5_0 / Q5_1: fifth bits at `start`, 16 packed bytes after them, minus `offset`."""
    levels = _nibbles(blocks[:, start + 4 :]).reshape(-1, 32)
    levels |= _fifth_bits(blocks, start) << 4
    _fill_levels(dest, levels, offset)


def _fill_q8_0(blocks: np.ndarray, dest: np.ndarray) -> None:
    np.copyto(dest[:, 0], blocks[:, 2:].view(np.int8))


def _params_d(blocks: np.ndarray) -> tuple[np.ndarray, None]:
    return _f16_column(blocks, 0), None


def _params_d_m(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _f16_column(blocks, 0), _f16_column(blocks, 2)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 6-bit sub-block scales and mins from their 12 packed bytes: (n, 8) each.

    Bytes 0..3 hold scales 0..3 (+ the top bits of scales 4..7), bytes 4..7 mins 0..3 (+ the
    top bits of mins 4..7), bytes 8..11 the low nibbles of scales and mins 4..7; handled four
    bytes at a time as uint32 words.
    """
    low, mid, high = np.ascontiguousarray(packed).view("<u4").T
    scales = np.empty((packed.shape[0], 2), dtype=np.uint32)
    mins = np.empty_like(scales)
    scales[:, 0] = low & 0x3F3F3F3F
    scales[:, 1] = (high & 0x0F0F0F0F) | ((low >> 2) & 0x30303030)
    mins[:, 0] = mid & 0x3F3F3F3F
    mins[:, 1] = ((high >> 4) & 0x0F0F0F0F) | ((mid >> 2) & 0x30303030)
    return scales.view(np.uint8), mins.view(np.uint8)


def _params_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: scale d * sc and offset -(dmin * m) per 32-element sub-block."""
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    scale = _f16_column(blocks, 0) * scales.astype(F32)
    offset = _f16_column(blocks, 2) * mins.astype(F32)
    np.negative(offset, out=offset)  # x + (-y) rounds exactly like gguf's x - y
    return scale, offset


def _fill_q4_k(blocks: np.ndarray, dest: np.ndarray) -> None:
    # Bytes 16..143 are 4 groups of 32: low nibbles -> sub-block 2g, high nibbles -> 2g + 1.
    # Unpacked as two contiguous arrays converted straight into their places: cheaper than
    # interleaving the bytes first.
    # A copy even where the slice is contiguous already (one block): it is shifted in place.
    words = np.array(blocks[:, 16:], order="C").view(np.uint64)
    pairs = dest.reshape(-1, 4, 2, 32)
    np.copyto(pairs[:, :, 0], (words & _LOW_NIBBLES).view(np.uint8).reshape(-1, 4, 32))
    words >>= np.uint64(4)
    words &= _LOW_NIBBLES
    np.copyto(pairs[:, :, 1], words.view(np.uint8).reshape(-1, 4, 32))


_BIT_SHIFTS_8 = np.arange(8, dtype=np.uint8)[:, None]


def _fill_q5_k(blocks: np.ndarray, dest: np.ndarray) -> None:
    levels = _nibbles(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    # Bit s of qh[l] is the fifth bit of element l of sub-block s.
    levels |= ((blocks[:, None, 16:48] >> _BIT_SHIFTS_8) & 1) << 4
    np.copyto(dest, levels)


def _params_q6_k(blocks: np.ndarray) -> tuple[np.ndarray, None]:
    return _f16_column(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(F32), None


# Shifts of the top two bits in qh, indexed [low/high nibble][first/second 32 bytes of ql].
_Q6_HIGH_SHIFTS = np.array([[0, 2], [4, 6]], dtype=np.uint64)[:, :, None]


def _fill_q6_k(blocks: np.ndarray, dest: np.ndarray) -> None:
    # Each 128-element half has 64 ql bytes [a | b] and 32 qh bytes. Elements 0..31 are a's low
    # nibbles, 32..63 b's, 64..95 a's high nibbles, 96..127 b's, each with two top bits from qh
    # at shift 0, 2, 4, 6. The bits are assembled quarter-major, (nibble, a/b, blocks...), so
    # every numpy call runs one long loop; the final copy puts the quarters in place.
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 2, 32).transpose(2, 0, 1, 3)  # (a/b, block, half, 32)
    words = np.ascontiguousarray(ql).view(np.uint64).reshape(2, -1)
    levels = np.empty((2, *words.shape), dtype=np.uint64)  # (low/high nibble, a/b, words)
    np.bitwise_and(words, _LOW_NIBBLES, out=levels[0])
    np.right_shift(words, np.uint64(4), out=levels[1])
    levels[1] &= _LOW_NIBBLES
    high = np.ascontiguousarray(blocks[:, 128:192]).view(np.uint64).reshape(-1)
    top = high >> _Q6_HIGH_SHIFTS  # (low/high nibble, a/b, words)
    top &= _LOW_2_BITS
    top <<= np.uint64(4)
    levels |= top
    signed = levels.view(np.uint8)
    signed -= np.uint8(32)  # wraps modulo 256; the int8 view reads the signed value
    quarters = signed.view(np.int8).reshape(2, 2, n, 2, 32).transpose(2, 3, 0, 1, 4)
    np.copyto(dest.reshape(n, 2, 2, 2, 32), quarters)


FORMATS: dict[str, BlockFormat] = {
    "F32": BlockFormat(1, 4),
    "F16": BlockFormat(1, 2),
    "BF16": BlockFormat(1, 2),
    "Q4_0": BlockFormat(32, 18, 1, _params_d, lambda b, d: _fill_q4(b, d, 2, 8)),
    "Q4_1": BlockFormat(32, 20, 1, _params_d_m, lambda b, d: _fill_q4(b, d, 4, 0)),
    "Q5_0": BlockFormat(32, 22, 1, _params_d, lambda b, d: _fill_q5(b, d, 2, 16)),
    "Q5_1": BlockFormat(32, 24, 1, _params_d_m, lambda b, d: _fill_q5(b, d, 4, 0)),
    "Q8_0": BlockFormat(32, 34, 1, _params_d, _fill_q8_0),
    "Q4_K": BlockFormat(QK_K, 144, 8, _params_k, _fill_q4_k),
    "Q5_K": BlockFormat(QK_K, 176, 8, _params_k, _fill_q5_k),
    "Q6_K": BlockFormat(QK_K, 210, 16, _params_q6_k, _fill_q6_k),
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
        fmt.fill(blocks[chunk], dest)
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
    expected = math.prod(shape[:-1]) * row_bytes(type_name, shape[-1])
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
