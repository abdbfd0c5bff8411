"""The KV block manager: the block pool and every sequence's block table and hash chain.

The scheduler decides which sequences run and which one is preempted; this class decides which
blocks each one holds. Admission reuses the cached blocks of a sequence's longest known prefix,
a step's reservation extends its table, a computed step names the blocks it filled (so later
sequences can reuse them), and a release hands the blocks back to the pool, where the named
ones stay cached until space is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from actors.kv_blocks import ROOT_HASH, BlockPool, chain_hashes


@dataclass(eq=False)
class BlockTable:
    """One sequence's KV: the blocks it holds, in position order."""

    # KV positions [0, held) are computed and valid.
    held: int = 0
    blocks: list[int] = field(default_factory=list)
    # Hash chain over the full blocks of the sequence's tokens computed so far.
    hashes: list[bytes] = field(default_factory=list)


def _blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


class KVBlockManager:
    """Allocates, reuses, names and releases the blocks of every sequence's `BlockTable`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def admit(self, table: BlockTable, tokens: Sequence[int], first_chunk: int) -> bool:
        """Give a waiting sequence the cached blocks of its longest known prefix, if the pool
        then has room for its first chunk of up to `first_chunk` positions; False: it takes
        nothing and waits."""
        block_size = self.pool.block_size
        self._extend_hashes(table, tokens, len(tokens))
        # Keep at least the last token to compute, so there are logits to sample from.
        reusable = table.hashes[: (len(tokens) - 1) // block_size]
        matched = self.pool.match_prefix(reusable)
        first_chunk_end = min(len(tokens), len(matched) * block_size + first_chunk)
        if self.pool.available < _blocks_for(first_chunk_end, block_size) - len(matched):
            self.pool.release(matched)
            return False
        table.blocks = matched
        table.held = len(matched) * block_size
        return True

    def reserve(self, table: BlockTable, end: int) -> bool:
        """Make the table cover positions [0, end); False: the pool is short and it takes
        nothing."""
        needed = _blocks_for(end, self.pool.block_size) - len(table.blocks)
        if needed > 0:
            blocks = self.pool.allocate(needed)
            if blocks is None:
                return False
            table.blocks.extend(blocks)
        return True

    def step_blocks(self, table: BlockTable, end: int) -> tuple[int, ...]:
        """The blocks that hold positions [0, end), for a step item."""
        return tuple(table.blocks[: _blocks_for(end, self.pool.block_size)])

    def release(self, table: BlockTable) -> None:
        """The sequence holds nothing now: its blocks go back to the pool."""
        self.pool.release(table.blocks)
        table.blocks = []
        table.held = 0

    def computed(self, table: BlockTable, tokens: Sequence[int], start: int, end: int) -> None:
        """A step computed positions [start, end): the table holds them, and the blocks this
        step filled are named, so later sequences can reuse them."""
        table.held = end
        block_size = self.pool.block_size
        self._extend_hashes(table, tokens, table.held)
        for index in range(start // block_size, table.held // block_size):
            self.pool.publish(table.blocks[index], table.hashes[index])

    def _extend_hashes(self, table: BlockTable, tokens: Sequence[int], positions: int) -> None:
        """Extend the table's hash chain over the full blocks of the first `positions`."""
        block_size = self.pool.block_size
        done = len(table.hashes) * block_size
        full = positions // block_size * block_size
        if full > done:
            parent = table.hashes[-1] if table.hashes else ROOT_HASH
            table.hashes.extend(chain_hashes(tokens[done:full], block_size, parent))
