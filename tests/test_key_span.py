"""Which keys a group of queries may see (actors.model.attention.key_span), against the rule
spelled out key by key."""

from __future__ import annotations

import numpy as np
import pytest

from actors.model.attention import key_span

BLOCK_SIZE = 16


@pytest.mark.parametrize("window", [0, 1, 40, 512])
@pytest.mark.parametrize(("n_seqs", "n_queries"), [(1, 1), (5, 1), (1, 37), (2, 128)])
def test_each_query_sees_the_keys_at_and_before_it_within_the_window(
    window: int, n_seqs: int, n_queries: int
) -> None:
    rng = np.random.default_rng(window * 1000 + n_seqs * 10 + n_queries)
    tables = rng.permutation(4000)[: n_seqs * 80].reshape(n_seqs, 80)
    query_pos = rng.integers(0, 80 * BLOCK_SIZE - n_queries, (n_seqs, 1)) + np.arange(n_queries)
    blocks, bias = key_span(tables, query_pos, BLOCK_SIZE, window)
    assert blocks.shape[1] * BLOCK_SIZE == bias.shape[2]
    for b in range(n_seqs):
        last = query_pos[b].max() // BLOCK_SIZE
        first = max(query_pos[b].min() - window + 1, 0) // BLOCK_SIZE if window else 0
        read = list(blocks[b])
        # The sequence's blocks from the first the window reaches to its last, then its last
        # again for padding.
        assert read == [tables[b, min(k, last)] for k in range(first, first + len(read))]
        for i, position in enumerate(query_pos[b]):
            for j, value in enumerate(bias[b, i]):
                key = first * BLOCK_SIZE + j
                visible = key <= position and (window == 0 or position - key < window)
                assert value == (0.0 if visible else -np.inf), (b, i, j)
