"""The KV block pool's accounting and the prefix cache, kept on the host (actors.kv_manager).

The compute actor owns the K/V arrays; this module only decides which block ids a sequence
holds. A full block is named by a hash chain over its tokens and every token before it, so a
new sequence that starts with the same tokens can reuse the blocks instead of recomputing them.
Blocks nobody references but that hold a named prefix stay cached until space is needed, and
are then evicted least recently used first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

# The hash of the (empty) prefix before a sequence's first block.
ROOT_HASH = b"\x00" * 16


def chain_hashes(tokens: Sequence[int], block_size: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    """Hashes of the full blocks of `tokens`, each one chained on the hash before it."""
    n_full = len(tokens) // block_size
    rows = np.asarray(tokens[: n_full * block_size], dtype=np.int64).reshape(n_full, block_size)
    hashes = []
    for row in rows:
        parent = hashlib.blake2b(parent + row.tobytes(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    """Which of `num_blocks` blocks are referenced, cached (named, unreferenced) or empty."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcount = np.zeros(num_blocks, dtype=np.int64)
        # Pop from the end: low ids are handed out first, which keeps tests readable.
        self._empty = list(range(num_blocks - 1, -1, -1))
        self._block_of_hash: dict[bytes, int] = {}
        self._hash_of_block: dict[int, bytes] = {}
        # Unreferenced named blocks, least recently used first.
        self._cached: OrderedDict[int, None] = OrderedDict()

    @property
    def used(self) -> int:
        """Blocks some sequence references."""
        return self.num_blocks - len(self._empty) - len(self._cached)

    @property
    def cached(self) -> int:
        """Unreferenced blocks that still hold a reusable prefix."""
        return len(self._cached)

    @property
    def empty(self) -> int:
        """Blocks that hold nothing."""
        return len(self._empty)

    @property
    def available(self) -> int:
        """Blocks an allocation can take (empty ones, then evicted cached ones)."""
        return len(self._empty) + len(self._cached)

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` blocks for one sequence, or none at all if there are not enough."""
        if count > self.available:
            return None
        blocks = []
        for _ in range(count):
            if self._empty:
                block = self._empty.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._block_of_hash[self._hash_of_block.pop(block)]
            self._refcount[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; unreferenced named blocks stay cached."""
        for block in blocks:
            self._refcount[block] -= 1
            if self._refcount[block] > 0:
                continue
            if block in self._hash_of_block:
                self._cached[block] = None
            else:
                self._empty.append(block)

    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Reference the cached blocks holding the longest run of `hashes` from the start."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of_hash.get(block_hash)
            if block is None:
                break
            if self._refcount[block] == 0:
                del self._cached[block]
            self._refcount[block] += 1
            blocks.append(block)
        return blocks

    def publish(self, block: int, block_hash: bytes) -> None:
        """Name a block that now holds a full, computed block of tokens, for later reuse.

        If another block already holds the same prefix, that one stays the named copy."""
        if block in self._hash_of_block or block_hash in self._block_of_hash:
            return
        self._block_of_hash[block_hash] = block
        self._hash_of_block[block] = block_hash
