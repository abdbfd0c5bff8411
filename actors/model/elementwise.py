"""The element-wise pieces of a transformer block over float32 rows, compiled: RMS norm, a
vectorized exp, the gated activations."""

from __future__ import annotations

import math

import numpy as np
from numba import njit


def rms_norm(
    x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray | None = None
) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (Gemma's +1 is in the GGUF), for
    x of 1 to 3 axes; `weight` (width,) or, for x (T, heads, width), one row a head. `out`
    may be x itself. One compiled call: a decode step makes a few per layer, each of which
    cost numpy five passes and their dispatch."""
    if out is None:
        out = np.empty_like(x)
    elif out.strides[-1] != out.itemsize:  # rms_norm_rows writes contiguous rows only
        out[...] = rms_norm(x, weight, eps)
        return out
    rms_norm_rows(_as_3d(x), weight.reshape(-1, x.shape[-1]), np.float32(eps), _as_3d(out))
    return out


def _as_3d(array: np.ndarray) -> np.ndarray:
    # Leading axes of length 1 never copy, so `out` stays a view of the caller's array.
    return array.reshape((1,) * (3 - array.ndim) + array.shape)


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _sum_of_squares(row):  # pragma: no cover - compiled
    # Reassociated, so that the sum vectorizes.
    total = np.float32(0.0)
    for i in range(row.size):
        total += row[i] * row[i]
    return total


@njit(nogil=True, cache=True)
def rms_norm_rows(x, weight, eps, out):  # pragma: no cover - compiled
    """out[a, b] = x[a, b] / sqrt(mean(x[a, b]^2) + eps) * weight[b % rows of weight]. The
    scaling runs in place in out (x copied there first where out is not x): a loop reading
    one array and writing another vectorizes only where the two cannot overlap, which the
    compiled code cannot tell for out = x; without fast-math here, the scale stays one
    multiply (fast-math had turned it into a division an element). out's rows must be
    contiguous (rms_norm sees to it)."""
    width = x.shape[2]
    inverse_width = np.float32(1.0 / width)
    for a in range(x.shape[0]):
        for b in range(x.shape[1]):
            # Views as contiguous rows where they are (the loops then vectorize), else a copy.
            row = np.ascontiguousarray(x[a, b])
            target = np.ascontiguousarray(out[a, b])
            scaled_by = weight[b % weight.shape[0]]
            scale = np.float32(1.0) / np.sqrt(_sum_of_squares(row) * inverse_width + eps)
            if target.ctypes.data != row.ctypes.data:
                target[:] = row
            for i in range(width):
                target[i] = target[i] * scale * scaled_by[i]


_GELU_C = math.sqrt(2.0 / math.pi)
# gelu_tanh's exponent is (GELU_CUBE * x^2 - GELU_LINEAR) * x.
GELU_CUBE = np.float32(-2.0 * _GELU_C * 0.044715)
GELU_LINEAR = np.float32(2.0 * _GELU_C)
# ModelSpec.activation -> the code the compiled gates take.
SILU, GELU_TANH = 0, 1
ACTIVATION_CODES = {"silu": SILU, "gelu_tanh": GELU_TANH}

# exp(x) = 2^n * e^r with n = round(x / ln 2) and r = x - n ln 2 in [-ln2/2, ln2/2]: ln 2 in
# two parts (Cody and Waite) keeps r exact to float32, and e^r is its Taylor series to r^7
# (truncation under 1.2e-7 relative: measured within 7.4e-8 of float64 exp over [-87, 88]).
_LOG2_E = np.float32(1.4426950408889634)
_LN2_HIGH = np.float32(0.693359375)  # 8 significant bits: n * _LN2_HIGH is exact
_LN2_LOW = np.float32(math.log(2.0) - 0.693359375)
_TAYLOR = tuple(np.float32(1.0 / math.factorial(k)) for k in range(8))
# Below _EXP_LOW exp is 0 (true values are under 1.7e-38); above _EXP_HIGH, n = 128 makes the
# exponent field all ones: inf (the true value passes float32's limit from 88.72).
_EXP_LOW = np.float32(-87.0)
_EXP_HIGH = np.float32(89.0)


@njit(nogil=True, cache=True, fastmath={"contract"})
def exp_in_place(values, scratch):  # pragma: no cover - compiled
    """values = exp(values) for a contiguous float32 row, in two loops that vectorize (numba
    has no vector exp: its scalar one costs 3-5 ns an element); `scratch` an int32 row at
    least as long. NaN stays NaN, -inf gives 0, +inf gives inf."""
    powers = scratch[: values.size]
    for i in range(values.size):
        x = values[i]
        clamped = _EXP_LOW if x < _EXP_LOW else x
        clamped = _EXP_HIGH if clamped > _EXP_HIGH else clamped
        n = np.floor(clamped * _LOG2_E + np.float32(0.5))
        r = clamped - n * _LN2_HIGH - n * _LN2_LOW
        series = _TAYLOR[6] + r * _TAYLOR[7]
        series = _TAYLOR[5] + r * series
        series = _TAYLOR[4] + r * series
        series = _TAYLOR[3] + r * series
        series = _TAYLOR[2] + r * series
        series = _TAYLOR[1] + r * series
        series = _TAYLOR[0] + r * series
        values[i] = np.float32(0.0) if x < _EXP_LOW else series
        # 2^n as its bit pattern: the biased exponent in bits 23-30.
        powers[i] = (np.int32(n) + np.int32(127)) << np.int32(23)
    scale = powers.view(np.float32)
    for i in range(values.size):
        values[i] *= scale[i]


@njit(nogil=True, cache=True)
def _activation_exponent(gate, activation, out):  # pragma: no cover - compiled
    """out = the exponent whose exp makes act(x) = x / (1 + exp(exponent))."""
    for i in range(gate.size):
        g = gate[i]
        out[i] = -g if activation == SILU else (g * g * GELU_CUBE - GELU_LINEAR) * g


# numpy's error model: python's checks every division for zero, and that check keeps the loop
# from vectorizing (1 + exp is never 0 here).
@njit(nogil=True, cache=True, error_model="numpy")
def gate_rows(gate_up, activation, gated):  # pragma: no cover - compiled
    """gated = act(gate) * up, for gate_up (T, 2 * ffn) holding each row's gate then up,
    gated (T, ffn) C-order; a row at a time, in L1. silu is x / (1 + exp(-x)), gelu_tanh
    0.5 x (1 + tanh(c (x + 0.044715 x^3))) as the identical x / (1 + exp(-2c (x + 0.044715
    x^3))): one exp and no tanh."""
    ffn = gated.shape[1]
    scratch = np.empty(ffn, dtype=np.int32)
    for t in range(gated.shape[0]):
        gate = gate_up[t, :ffn]
        up = gate_up[t, ffn:]
        target = gated[t]
        _activation_exponent(gate, activation, target)
        exp_in_place(target, scratch)
        for i in range(ffn):
            target[i] = gate[i] / (target[i] + np.float32(1.0)) * up[i]

