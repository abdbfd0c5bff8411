"""The element-wise pieces of a transformer block, over float32 rows: RMS norm (compiled)
and the gate activations (numpy, into a given output)."""

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
    rms_norm_rows(_as_3d(x), weight.reshape(-1, x.shape[-1]), np.float32(eps), _as_3d(out))
    return out


def _as_3d(array: np.ndarray) -> np.ndarray:
    # Leading axes of length 1 never copy, so `out` stays a view of the caller's array.
    return array.reshape((1,) * (3 - array.ndim) + array.shape)


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def rms_norm_rows(x, weight, eps, out):  # pragma: no cover - compiled
    width = x.shape[2]
    inverse_width = np.float32(1.0 / width)
    for a in range(x.shape[0]):
        for b in range(x.shape[1]):
            row, target, scaled_by = x[a, b], out[a, b], weight[b % weight.shape[0]]
            total = np.float32(0.0)
            for i in range(width):
                total += row[i] * row[i]
            scale = np.float32(1.0) / np.sqrt(total * inverse_width + eps)
            for i in range(width):
                target[i] = row[i] * scale * scaled_by[i]


def silu(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), written as x / (1 + exp(-x)): one exp pass, into `out`."""
    np.negative(x, out=out)
    with np.errstate(over="ignore"):  # exp overflows to inf for x << 0: x / inf = 0, right
        np.exp(out, out=out)
    out += np.float32(1.0)
    return np.divide(x, out, out=out)


_GELU_C = math.sqrt(2.0 / math.pi)
# gelu_tanh's exponent is (GELU_CUBE * x^2 - GELU_LINEAR) * x.
GELU_CUBE = np.float32(-2.0 * _GELU_C * 0.044715)
GELU_LINEAR = np.float32(2.0 * _GELU_C)


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


# ModelSpec.activation -> the gate's function.
ACTIVATIONS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "silu": silu,
    "gelu_tanh": gelu_tanh,
}


