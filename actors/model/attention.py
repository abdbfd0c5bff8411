"""Scaled dot-product attention with grouped KV heads over gathered, masked keys."""

from __future__ import annotations

import numpy as np


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Attention for B sequences at once.

    q: (B, n, heads, head_dim), already scaled; k, v: (B, S, kv_heads, head_dim);
    bias: (B, n, S) float32 added to the scores, 0 where query i may attend to key j and
    -inf elsewhere (every query sees at least itself). Query head h reads KV head
    h // (heads / kv_heads). Returns (B, n, heads * head_dim) float32.
    """
    batch, n, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    # (B, kv_heads, group * n, head_dim): one matmul per KV head covers its whole group.
    q_grouped = q.reshape(batch, n, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    q_grouped = q_grouped.reshape(batch, kv_heads, group * n, head_dim)
    scores = np.matmul(q_grouped, k.transpose(0, 2, 3, 1))
    scores = scores.reshape(batch, kv_heads, group, n, -1)
    scores += bias[:, None, None]
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores.reshape(batch, kv_heads, group * n, -1), v.transpose(0, 2, 1, 3))
    out = out.reshape(batch, kv_heads, group, n, head_dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, n, heads * head_dim)
