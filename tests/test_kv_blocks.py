"""The KV block pool's accounting and the prefix hash chain."""

from __future__ import annotations

from actors.kv_blocks import BlockPool, chain_hashes


def test_hash_chain_names_a_block_by_everything_before_it() -> None:
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    c = chain_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a == b
    # Same tokens in block 1, different block 0: a different name.
    assert c[0] != a[0] and c[1] != a[1]
    # Extending a chain from its last hash gives the same names as hashing in one go.
    assert chain_hashes([5, 6, 7, 8], 4, a[0]) == a[1:]


def test_allocation_is_all_or_nothing() -> None:
    pool = BlockPool(4, 16)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert (pool.used, pool.empty, pool.cached) == (3, 1, 0)


def test_released_named_blocks_stay_cached_and_are_reused() -> None:
    pool = BlockPool(4, 4)
    hashes = chain_hashes(list(range(8)), 4)
    blocks = pool.allocate(2)
    for block, block_hash in zip(blocks, hashes):
        pool.publish(block, block_hash)
    pool.release(blocks)
    assert (pool.used, pool.cached, pool.empty) == (0, 2, 2)
    assert pool.match_prefix(hashes) == blocks
    assert (pool.used, pool.cached) == (2, 0)
    # A second sequence shares them: two references, both must go before they are free.
    assert pool.match_prefix(hashes[:1]) == blocks[:1]
    pool.release(blocks)
    pool.release(blocks[:1])
    assert (pool.used, pool.cached) == (0, 2)


def test_match_stops_at_the_first_unknown_block() -> None:
    pool = BlockPool(4, 4)
    hashes = chain_hashes(list(range(12)), 4)
    (block,) = pool.allocate(1)
    pool.publish(block, hashes[0])
    assert pool.match_prefix([hashes[1], hashes[0]]) == []
    assert pool.match_prefix(hashes) == [block]


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    pool = BlockPool(2, 4)
    first, second = chain_hashes(list(range(4)), 4), chain_hashes(list(range(4, 8)), 4)
    for block_hash in (first[0], second[0]):
        (block,) = pool.allocate(1)
        pool.publish(block, block_hash)
        pool.release([block])
    assert pool.cached == 2 and pool.available == 2
    (taken,) = pool.allocate(1)
    assert taken == 0  # the older one
    assert pool.match_prefix(first) == []
    assert pool.match_prefix(second) == [1]


def test_the_first_named_copy_of_a_prefix_wins() -> None:
    pool = BlockPool(2, 4)
    (block_hash,) = chain_hashes([1, 2, 3, 4], 4)
    a, b = pool.allocate(2)
    pool.publish(a, block_hash)
    pool.publish(b, block_hash)
    pool.release([a, b])
    assert (pool.cached, pool.empty) == (1, 1)
