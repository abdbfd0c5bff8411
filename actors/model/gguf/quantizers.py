"""llama.cpp's reference quantizers (ggml-quants.c, quantize_row_*_ref, no importance matrix)
for Q4_K, Q5_K, Q6_K, Q8_0, Q5_0 and Q5_1, byte for byte, in vectorized numpy.

llama.cpp accumulates sums in float32, one element after the other, so the quantizers loop over
the (16 or 32) positions inside a block, each step vectorized over all blocks, and keep every
intermediate in float32. Arrays are laid out (positions in a group, groups) so each sequential
float32 sum of llama.cpp is a loop over the few positions, vectorized over every group at once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from actors.errors import InvalidRequest, UnsupportedModelError
from actors.model.gguf.quants import F32, FORMATS

# llama.cpp's GROUP_MAX_EPS: a group whose largest magnitude is below this quantizes to zeros.
GROUP_MAX_EPS = F32(1e-15)
# Quantize this many elements at a time: bounds the float32 temporaries of the K-quant searches.
QUANTIZE_CHUNK_ELEMENTS = 1 << 18


def _nearest_int(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's nearest_int (the 1.5 * 2**23 trick): round half to even, in float32."""
    return np.rint(x, out=out)


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    """float32 (n,) -> the (n, 2) bytes of its round-to-nearest-even float16."""
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _sequential_sum(terms: np.ndarray) -> np.ndarray:
    """terms[0] + terms[1] + ... over the first axis, added left to right in float32 like
    llama.cpp's loops (numpy's own sum may pair the terms differently)."""
    total = terms[0].copy()
    for row in terms[1:]:
        total += row
    return total


def _clamped_levels(x_shifted: np.ndarray, iscale: np.ndarray, nmax: int) -> np.ndarray:
    """nearest_int(iscale * (x - min)) clamped to 0..nmax, as float32."""
    levels = x_shifted * iscale
    _nearest_int(levels, out=levels)
    np.maximum(levels, F32(0), out=levels)
    np.minimum(levels, F32(nmax), out=levels)
    return levels


def _weighted_square_error(
    x: np.ndarray, weights: np.ndarray, levels: np.ndarray, scale: np.ndarray, x_min: np.ndarray
) -> np.ndarray:
    """Sum of weights * (scale * level + min - x)**2 per group, in llama.cpp's order."""
    diff = levels * scale
    diff += x_min
    diff -= x
    np.square(diff, out=diff)
    diff *= weights
    return _sequential_sum(diff)


def _make_qkx2_quants(
    x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's make_qkx2_quants (use_mad false) over x (n, groups).

    Returns levels (n, groups) in 0..nmax as float32, scale (groups,), and the_min (groups,):
    x ~ scale * level - the_min. Like llama.cpp, a better candidate's min also shifts the
    search of the candidates after it.
    """
    x_min = np.minimum(x.min(axis=0), F32(0))
    x_max = x.max(axis=0)
    sum_w = _sequential_sum(weights)
    sum_x = _sequential_sum(weights * x)
    flat = x_max == x_min
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(nmax) / (x_max - x_min)
        scale = F32(1) / iscale
        levels = _clamped_levels(x - x_min, iscale, nmax)
        best_error = _weighted_square_error(x, weights, levels, scale, x_min)
        # The best levels are recomputed at the end from the (iscale, min) that made them:
        # cheaper than selecting whole level arrays at every step.
        best_iscale, best_shift = iscale, x_min
        for step in range(nstep + 1):
            iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (x_max - x_min)
            trial = _clamped_levels(x - x_min, iscale, nmax)
            weighted = weights * trial
            sum_l = _sequential_sum(weighted)
            sum_l2 = _sequential_sum(weighted * trial)
            sum_xl = _sequential_sum(weighted * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive_min = this_min > 0
            this_scale = np.where(positive_min, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive_min, F32(0), this_min)
            error = _weighted_square_error(x, weights, trial, this_scale, this_min)
            better = (det > 0) & (error < best_error)
            best_iscale = np.where(better, iscale, best_iscale)
            best_shift = np.where(better, x_min, best_shift)
            best_error = np.where(better, error, best_error)
            scale = np.where(better, this_scale, scale)
            x_min = np.where(better, this_min, x_min)
        levels = _clamped_levels(x - best_shift, best_iscale, nmax)
    levels[:, flat] = 0
    scale[flat] = 0
    return levels, scale, -x_min


def _quantize_k_asymmetric(
    x: np.ndarray, nmax: int, rmin: float, nstep: int
) -> tuple[np.ndarray, np.ndarray]:
    """The shared part of quantize_row_q4_K_ref / q5_K_ref: x (blocks, 256) ->
    header bytes (blocks, 16: d, dmin, 12 packed 6-bit scales and mins) and levels
    (blocks, 8, 32) in 0..nmax."""
    n_blocks = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(-1, 32).T)  # (32, blocks * 8)
    sum_x2 = _sequential_sum(sub * sub)
    weights = np.sqrt(sum_x2 / F32(32)) + np.abs(sub)
    levels, scales, mins = _make_qkx2_quants(sub, weights, nmax, rmin, 0.1, nstep)
    scales = scales.reshape(n_blocks, 8)
    mins = mins.reshape(n_blocks, 8)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    # llama.cpp stores nearest_int(...) in a uint8 before clamping to 63: keep the wrap-around.
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales).astype(np.int64) & 0xFF, 63)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins).astype(np.int64) & 0xFF, 63)
    d = (max_scale / F32(63)).astype(np.float16)
    dmin = (max_min / F32(63)).astype(np.float16)

    # Requantize with the rounded scales; a sub-block whose scale rounds to 0 keeps its levels.
    d_sub = (d.astype(F32)[:, None] * ls.astype(F32)).reshape(1, -1)
    min_sub = (dmin.astype(F32)[:, None] * lm.astype(F32)).reshape(1, -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        requantized = np.clip(_nearest_int((sub + min_sub) / d_sub), 0, nmax)
    levels = np.where(d_sub != 0, requantized, levels)

    ls8, lm8 = ls.astype(np.uint8), lm.astype(np.uint8)
    header = np.concatenate(
        [
            _fp16_bytes(d),
            _fp16_bytes(dmin),
            ls8[:, :4] | ((ls8[:, 4:] >> 4) << 6),
            lm8[:, :4] | ((lm8[:, 4:] >> 4) << 6),
            (ls8[:, 4:] & 0x0F) | ((lm8[:, 4:] & 0x0F) << 4),
        ],
        axis=1,
    )
    return header, levels.T.astype(np.uint8).reshape(n_blocks, 8, 32)


def _pack_low_nibbles(levels: np.ndarray) -> np.ndarray:
    """K-quant levels (blocks, 8, 32) -> 128 bytes: sub-block 2g in the low nibbles of group
    g's 32 bytes, sub-block 2g + 1 in the high nibbles."""
    pairs = levels.reshape(-1, 4, 2, 32)
    return ((pairs[:, :, 0] & 0x0F) | ((pairs[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref: x (blocks, 256) -> (blocks, 144) bytes."""
    header, levels = _quantize_k_asymmetric(x, 15, -1.0, 20)
    return np.concatenate([header, _pack_low_nibbles(levels)], axis=1)


_FIFTH_BIT_WEIGHTS = (1 << np.arange(8, dtype=np.uint8))[:, None]


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_K_ref: x (blocks, 256) -> (blocks, 176) bytes."""
    header, levels = _quantize_k_asymmetric(x, 31, -0.5, 15)
    # Bit s of qh[l] is the fifth bit of element l of sub-block s.
    qh = ((levels >> 4) * _FIFTH_BIT_WEIGHTS).sum(axis=1, dtype=np.uint8)
    return np.concatenate([header, qh, _pack_low_nibbles(levels)], axis=1)


def _make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's make_qx_quants with rmse_type 1 (weights x**2) over x (n, groups).

    Returns levels + nmax (n, groups) in 0..2*nmax-1 as float32, and scale (groups,).
    """
    first_max = np.abs(x).argmax(axis=0)
    x_max = np.take_along_axis(x, first_max[None, :], axis=0)[0]
    zero = np.abs(x_max) < GROUP_MAX_EPS
    weights = x * x
    weighted_x = weights * x

    def levels_for(iscale: np.ndarray) -> np.ndarray:
        levels = x * iscale
        _nearest_int(levels, out=levels)
        return np.clip(levels, -nmax, nmax - 1, out=levels)

    def sums(levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # llama.cpp: sumlx += w*x*l; suml2 += w*l*l, left to right.
        weighted_l = weights * levels
        weighted_l *= levels
        return _sequential_sum(weighted_x * levels), _sequential_sum(weighted_l)

    with np.errstate(divide="ignore", invalid="ignore"):
        best_iscale = F32(-nmax) / x_max
        sum_lx, sum_l2 = sums(levels_for(best_iscale))
        scale = np.where(sum_l2 != 0, sum_lx / sum_l2, F32(0))
        best = scale * sum_lx
        for step in range(-9, 10):
            if step == 0:
                continue
            iscale = -(F32(nmax) + F32(0.1) * F32(step)) / x_max
            sum_lx, sum_l2 = sums(levels_for(iscale))
            better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
            best_iscale = np.where(better, iscale, best_iscale)  # its levels are rebuilt below
            scale = np.where(better, sum_lx / sum_l2, scale)
            best = np.where(better, scale * sum_lx, best)
        levels = levels_for(best_iscale)
    levels += F32(nmax)
    levels[:, zero] = 0
    scale[zero] = 0
    return levels, scale


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref: x (blocks, 256) -> (blocks, 210) bytes."""
    n_blocks = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(-1, 16).T)  # (16, blocks * 16)
    levels, scales = _make_qx_quants_rmse1(sub, 32)
    scales = scales.reshape(n_blocks, 16)
    first_max = np.abs(scales).argmax(axis=1)
    max_scale = np.take_along_axis(scales, first_max[:, None], axis=1)[:, 0]
    zero_block = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(-128) / max_scale
        d = (F32(1) / iscale).astype(np.float16)
        q_scales = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
        d_sub = (d.astype(F32)[:, None] * q_scales.astype(F32)).reshape(1, -1)
        requantized = np.clip(_nearest_int(sub / d_sub), -32, 31) + F32(32)
    levels = np.where(d_sub != 0, requantized, levels)
    levels = levels.T.astype(np.uint8).reshape(n_blocks, 2, 4, 32)  # (half, quarter, l)

    ql = (levels[:, :, 0:2] & 0x0F) | ((levels[:, :, 2:4] & 0x0F) << 4)
    qh = (
        (levels[:, :, 0] >> 4)
        | ((levels[:, :, 1] >> 4) << 2)
        | ((levels[:, :, 2] >> 4) << 4)
        | ((levels[:, :, 3] >> 4) << 6)
    )
    out = np.concatenate(
        [
            ql.reshape(n_blocks, 128),
            qh.reshape(n_blocks, 64),
            q_scales.view(np.uint8),
            _fp16_bytes(d),
        ],
        axis=1,
    )
    out[zero_block] = 0
    return out


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: round half away from zero, exactly (no x + 0.5 rounding error)."""
    magnitude = np.abs(x)
    whole = np.floor(magnitude)
    return np.copysign(whole + (magnitude - whole >= F32(0.5)), x)


def _quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_0_ref: x (blocks, 32) -> (blocks, 34) bytes."""
    d = np.abs(x).max(axis=1) / F32(127)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d != 0, F32(1) / d, F32(0))
    qs = _round_half_away(x * inv_d[:, None]).astype(np.int8)
    return np.concatenate([_fp16_bytes(d), qs.view(np.uint8)], axis=1)


def _quantize_q5_0(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_0_ref: x (blocks, 32) -> (blocks, 22) bytes."""
    first_max = np.abs(x).argmax(axis=1)
    d = np.take_along_axis(x, first_max[:, None], axis=1)[:, 0] / F32(-16)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d != 0, F32(1) / d, F32(0))
    # C converts x * id + 16.5 to int8 (truncation toward zero), then clamps to 31.
    q = np.minimum(np.trunc(x * inv_d[:, None] + F32(16.5)), 31).astype(np.uint8)
    qs = (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)
    qh = np.packbits((q >> 4) & 1, axis=1, bitorder="little")
    return np.concatenate([_fp16_bytes(d), qh, qs], axis=1)


def _quantize_q5_1(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_1_ref: x (blocks, 32) -> (blocks, 24) bytes."""
    x_min = x.min(axis=1)
    d = (x.max(axis=1) - x_min) / F32(31)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d != 0, F32(1) / d, F32(0))
    # C converts (x - min) * id + 0.5 to uint8 (truncation) and keeps 5 bits, unclamped.
    q = np.trunc((x - x_min[:, None]) * inv_d[:, None] + F32(0.5)).astype(np.uint8)
    qs = (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)
    qh = np.packbits((q >> 4) & 1, axis=1, bitorder="little")
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(x_min), qh, qs], axis=1)


QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_K": _quantize_q4_k,
    "Q6_K": _quantize_q6_k,
    "Q8_0": _quantize_q8_0,
    "Q5_0": _quantize_q5_0,
    "Q5_K": _quantize_q5_k,
    "Q5_1": _quantize_q5_1,
}


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """Quantize float32 rows (..., n) to `type_name` blocks: uint8 (..., n // block * bytes).

    Byte-identical to llama.cpp's reference quantizer (no importance matrix). Supports the
    types in QUANTIZERS; `n` must be a multiple of the type's block size.
    """
    if type_name not in QUANTIZERS:
        raise UnsupportedModelError(
            f"cannot quantize to {type_name!r} (supported: {', '.join(QUANTIZERS)})"
        )
    x = np.asarray(x)
    if x.ndim == 0 or x.dtype != F32:
        raise InvalidRequest(
            f"quantize needs a float32 array with at least one axis, got {x.dtype} {x.shape}",
            field="x",
        )
    fmt = FORMATS[type_name]
    if x.shape[-1] % fmt.block_size:
        raise InvalidRequest(
            f"rows of {x.shape[-1]} elements are not a whole number of {type_name} blocks "
            f"({fmt.block_size} elements)",
            field="x",
        )
    if not np.isfinite(x).all():
        # llama.cpp refuses these too (ggml_validate_row_data): no scale can represent them.
        raise InvalidRequest("cannot quantize NaN or infinite values", field="x")
    blocks = np.ascontiguousarray(x).reshape(-1, fmt.block_size)
    out = np.empty((blocks.shape[0], fmt.type_size), dtype=np.uint8)
    step = max(QUANTIZE_CHUNK_ELEMENTS // fmt.block_size, 1)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = QUANTIZERS[type_name](blocks[start : start + step])
    return out.reshape(*x.shape[:-1], x.shape[-1] // fmt.block_size * fmt.type_size)
