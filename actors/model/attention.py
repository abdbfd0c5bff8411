"""Scaled dot-product attention with grouped KV heads over gathered, masked keys."""

from __future__ import annotations

import numpy as np
from numba import njit

from actors.model.elementwise import exp_in_place


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
    masked_softmax(scores.reshape(batch, heads, n, -1), bias)
    out = np.matmul(scores.reshape(batch, kv_heads, group * n, -1), v.transpose(0, 2, 1, 3))
    out = out.reshape(batch, kv_heads, group, n, head_dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, n, heads * head_dim)


@njit(nogil=True, cache=True, fastmath={"reassoc"})
def softmax_in_place(row, scratch):  # pragma: no cover - compiled
    """row = softmax(row) for a contiguous float32 row with at least one finite entry (-inf
    entries get 0); `scratch` an int32 row at least as long (exp_in_place's)."""
    top = row[0]
    for j in range(row.size):
        top = max(top, row[j])
    for j in range(row.size):
        row[j] -= top
    exp_in_place(row, scratch)
    total = np.float32(0.0)
    for j in range(row.size):
        total += row[j]
    inverse = np.float32(1.0) / total
    for j in range(row.size):
        row[j] *= inverse


@njit(nogil=True, cache=True)
def masked_softmax(scores, bias):  # pragma: no cover - compiled
    """scores (B, heads, n, S) += bias (B, n, S), then softmax over S, in place: one pass
    of a row in L1 where numpy made five over the whole array."""
    scratch = np.empty(scores.shape[3], dtype=np.int32)
    for b in range(scores.shape[0]):
        for h in range(scores.shape[1]):
            for i in range(scores.shape[2]):
                row = scores[b, h, i]
                row += bias[b, i]
                softmax_in_place(row, scratch)


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def attend_decode(q, keys, values, table, bias, rows, out):  # pragma: no cover - compiled
    """Attention of B sequences' single queries, read straight from the KV pool's blocks.

    q: (T, heads, head_dim) the step's queries, already scaled; row rows[b] is sequence b's.
    keys, values: (num_blocks, block_size, kv_heads, head_dim) one layer's pool; key j of
    sequence b is at block table[b, j // block_size], offset j % block_size; bias (B, keys)
    is 0 where the query may attend to key j and -inf elsewhere. Writes the (heads *
    head_dim) outputs to out[rows[b]]. Each key is read once for its KV head's group of query
    heads; the sums may be reordered (vectorized), as BLAS reorders them."""
    heads, head_dim = q.shape[1], q.shape[2]
    block_size, kv_heads = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    n_keys = bias.shape[1]
    scores = np.empty((heads, n_keys), dtype=np.float32)
    scratch = np.empty(n_keys, dtype=np.int32)
    acc = np.empty((heads, head_dim), dtype=np.float32)
    for b in range(rows.size):
        query = q[rows[b]]
        # Position by position, every KV head's row of it (contiguous in the pool) at once.
        for j in range(n_keys):
            if bias[b, j] < 0:
                scores[:, j] = -np.inf
                continue
            position = keys[table[b, j // block_size], j % block_size]
            for g in range(kv_heads):
                key = position[g]
                for h in range(g * group, (g + 1) * group):
                    total = np.float32(0.0)
                    for t in range(head_dim):
                        total += query[h, t] * key[t]
                    scores[h, j] = total
        for h in range(heads):
            softmax_in_place(scores[h], scratch)
        acc[:] = 0.0
        for j in range(n_keys):
            if bias[b, j] < 0:
                continue
            position = values[table[b, j // block_size], j % block_size]
            for g in range(kv_heads):
                value = position[g]
                for h in range(g * group, (g + 1) * group):
                    weight = scores[h, j]
                    for t in range(head_dim):
                        acc[h, t] += weight * value[t]
        for h in range(heads):
            out[rows[b], h * head_dim : (h + 1) * head_dim] = acc[h]


@njit(nogil=True, cache=True)
def key_span(tables, query_pos, block_size, window):  # pragma: no cover - compiled
    """The keys B sequences' queries at `query_pos` (B, n) may see, from their block `tables`
    (B, at least the blocks their queries reach): (the blocks to read (B, blocks), each
    query's bias over those blocks' positions (B, n, blocks * block_size): 0 where it may
    attend to the key, -inf elsewhere). With a window (0: none), blocks wholly before it are
    left out. Sequences reading fewer blocks than the widest read their last one again, which
    the bias hides."""
    n_seqs, n_queries = query_pos.shape
    first = np.zeros(n_seqs, dtype=np.int64)
    last = np.empty(n_seqs, dtype=np.int64)
    width = 1
    for b in range(n_seqs):
        last[b] = query_pos[b].max() // block_size
        if window:
            first[b] = max(query_pos[b].min() - window + 1, 0) // block_size
        width = max(width, last[b] - first[b] + 1)
    blocks = np.empty((n_seqs, width), dtype=np.int64)
    bias = np.empty((n_seqs, n_queries, width * block_size), dtype=np.float32)
    for b in range(n_seqs):
        for k in range(width):
            blocks[b, k] = tables[b, min(first[b] + k, last[b])]
        start = first[b] * block_size
        for i in range(n_queries):
            for j in range(width * block_size):
                distance = query_pos[b, i] - (start + j)
                visible = distance >= 0 and (window == 0 or distance < window)
                bias[b, i, j] = 0.0 if visible else -np.inf
    return blocks, bias
