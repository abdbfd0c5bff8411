"""Rotary position embedding (RoPE) in llama.cpp's two layouts.

NORM (llama) rotates adjacent pairs (x[2i], x[2i+1]); NEOX (qwen2, gemma3) rotates the two
halves (x[i], x[i + rope_dim/2]). GGUF llama weights are permuted at conversion so that NORM
on them equals Hugging Face's rotate-half on the originals.
"""

from __future__ import annotations

import numpy as np


def inverse_frequencies(
    base: float, rope_dim: int, freq_factors: np.ndarray | None = None
) -> np.ndarray:
    """theta_i = base^(-2i/rope_dim), divided by the optional per-frequency factors; float64."""
    inv_freq = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    return inv_freq


def rotation(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every (position, frequency) angle, (T, 1, rope_dim/2) float32, shaped to
    broadcast over heads. Angles are formed in float64 so long positions lose no precision."""
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return (
        np.cos(angles).astype(np.float32)[:, None, :],
        np.sin(angles).astype(np.float32)[:, None, :],
    )


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> None:
    """Rotate the first rope_dim features of every head of x (T, heads, head_dim) in place."""
    half = cos.shape[-1]
    if neox:
        first, second = x[..., :half], x[..., half : 2 * half]
    else:
        first, second = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
    rotated_first = first * cos - second * sin
    second[...] = first * sin + second * cos
    first[...] = rotated_first
