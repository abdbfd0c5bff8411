"""Rotary position embedding (RoPE) in llama.cpp's two layouts, as one complex multiply.

NORM (llama) rotates adjacent pairs (x[2i], x[2i+1]); NEOX (qwen2, gemma3) rotates the two
halves (x[i], x[i + rope_dim/2]). GGUF llama weights are permuted at conversion so that NORM
on them equals Hugging Face's rotate-half on the originals. The loader stores q and k in
`pair_order`, which puts every rotated pair side by side in both layouts: a pair is then one
complex64 number and the rotation one in-place multiply (attention scores are dot products
of q and k, unchanged when both are permuted alike).
"""

from __future__ import annotations

import numpy as np
from numba import njit


def inverse_frequencies(
    base: float, rope_dim: int, freq_factors: np.ndarray | None = None
) -> np.ndarray:
    """theta_i = base^(-2i/rope_dim), divided by the optional per-frequency factors; float64."""
    inv_freq = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    return inv_freq


def pair_order(head_dim: int, rope_dim: int, neox: bool) -> np.ndarray:
    """Order of one head's features that puts rotated pair i at (2i, 2i+1): for NEOX the
    halves interleaved, for NORM the identity; features past rope_dim keep their place."""
    order = np.arange(head_dim)
    if neox:
        half = rope_dim // 2
        order[:rope_dim] = np.stack([np.arange(half), np.arange(half) + half], axis=1).ravel()
    return order


def rotation(positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """e^(i * angle) of every (position, frequency), (T, 1, rope_dim/2) complex64, shaped to
    broadcast over heads. Angles are formed in float64 so long positions lose no precision."""
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.exp(1j * angles).astype(np.complex64)[:, None, :]


def apply_rope(x: np.ndarray, rotation: np.ndarray) -> None:
    """Rotate the first rope_dim features of every head of x (T, heads, head_dim) float32 in
    place by `rotation` (T, 1, rope_dim/2); x's features are in `pair_order`."""
    rotate_pairs(x, np.ascontiguousarray(rotation[:, 0]))


@njit(nogil=True, cache=True)
def rotate_pairs(x, rotation):  # pragma: no cover - compiled
    """x[t, h]'s pairs (2i, 2i + 1) times rotation[t, i] (T, pairs) complex64, in place, as a
    complex multiply (ac - bd, ad + bc); also called from compiled code (the decoding block)."""
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            for i in range(rotation.shape[1]):
                a, b = x[t, h, 2 * i], x[t, h, 2 * i + 1]
                c, d = rotation[t, i].real, rotation[t, i].imag
                x[t, h, 2 * i] = a * c - b * d
                x[t, h, 2 * i + 1] = a * d + b * c
