"""The element-wise pieces of a transformer block over float32 rows: RMS norm (compiled) and
the gated activations (numpy, and compiled for compiled callers)."""

from __future__ import annotations

import math
from collections.abc import Callable

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
# ModelSpec.activation -> the code gate_rows takes.
SILU, GELU_TANH = 0, 1
ACTIVATION_CODES = {"silu": SILU, "gelu_tanh": GELU_TANH}


def silu(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), written as x / (1 + exp(-x)): one exp pass, into `out`."""
    np.negative(x, out=out)
    with np.errstate(over="ignore"):  # exp overflows to inf for x << 0: x / inf = 0, right
        np.exp(out, out=out)
    out += np.float32(1.0)
    return np.divide(x, out, out=out)


def gelu_tanh(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """0.5 x (1 + tanh(c (x + 0.044715 x^3))), rewritten as the identical
    x / (1 + exp(-2c (x + 0.044715 x^3))) so it costs one exp and no tanh; into `out`."""
    np.multiply(x, x, out=out)
    out *= GELU_CUBE
    out -= GELU_LINEAR
    out *= x
    with np.errstate(over="ignore"):
        np.exp(out, out=out)
    out += np.float32(1.0)
    return np.divide(x, out, out=out)


# ModelSpec.activation -> the gate's function over many rows (numpy's exp is vectorized: 3 ns
# an element over a prefill's rows against 4.8 for gate_rows' scalar one).
ACTIVATIONS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "silu": silu,
    "gelu_tanh": gelu_tanh,
}


@njit(nogil=True, cache=True)
def gate_rows(gate_up, activation, gated):  # pragma: no cover - compiled
    """gated = act(gate) * up, for gate_up (T, 2 * ffn) holding each row's gate then up: silu
    and gelu_tanh operation for operation, in one pass, for compiled callers (the decoding
    block: a few rows)."""
    ffn = gated.shape[1]
    one = np.float32(1.0)
    for t in range(gated.shape[0]):
        for i in range(ffn):
            g = gate_up[t, i]
            if activation == SILU:
                denominator = np.exp(-g) + one
            else:
                denominator = np.exp((g * g * GELU_CUBE - GELU_LINEAR) * g) + one
            gated[t, i] = g / denominator * gate_up[t, ffn + i]
