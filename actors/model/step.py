"""One step of batched stepping, laid out for any backend: what each token is, where it sits
and where its K/V go.

A step advances any mix of sequences (whole prompts, prefill chunks, single decode tokens).
`plan_step` validates the items once and flattens them into arrays over the step's T tokens:
token ids, positions, the KV slot each token's K/V is written to, each item's block table and
the rows whose logits are wanted. A backend runs the plan its own way (the CPU groups its
attention in numpy, a GPU packs the same arrays for its kernels), as vLLM hands its workers
attention metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from dataclasses import dataclass

import msgspec
import numpy as np

from actors.errors import ContextLengthExceeded, InvalidRequest
from actors.model.arch import ModelSpec


class StepItem(msgspec.Struct, frozen=True):
    """One sequence's part of a step.

    The sequence's KV holds positions [0, start); `tokens` go at positions start, start+1...
    `blocks` is its block table: block i of the pool holds positions
    [i * block_size, (i + 1) * block_size) and must cover every position up to the last token.
    `want_logits=False` (a non-final prefill chunk) skips the output projection. `seq_id`
    names the sequence for backends that keep per-sequence state, and for tests.
    """

    tokens: tuple[int, ...]
    start: int
    blocks: tuple[int, ...]
    want_logits: bool = True
    seq_id: int = 0


@dataclass(frozen=True)
class StepPlan:
    """A validated step laid out as flat arrays over its T tokens and n items."""

    token_ids: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64
    slot_blocks: np.ndarray  # (T,) pool block each token's K/V is written to
    slot_offsets: np.ndarray  # (T,) position within that block
    starts: np.ndarray  # (n,) positions each item's KV already holds
    lengths: np.ndarray  # (n,) tokens each item advances
    first_rows: np.ndarray  # (n,) the row of each item's first token
    block_tables: np.ndarray  # (n, max blocks needed) int64, padded with 0
    logit_rows: np.ndarray  # rows of the last token of each item that wants logits
    block_size: int

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def _check_item(
    item: object, index: int, spec: ModelSpec, block_size: int
) -> tuple[int, int]:
    """Validate one item's shape (not its token values); return (start, end)."""
    if not isinstance(item, StepItem):
        raise InvalidRequest(f"items[{index}] is a {type(item).__name__}, not a StepItem",
                             field="items")
    if not isinstance(item.tokens, (tuple, list)) or not isinstance(item.blocks, (tuple, list)):
        raise InvalidRequest(f"items[{index}] tokens and blocks must be tuples of ints",
                             field="tokens")
    start, n = item.start, len(item.tokens)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise InvalidRequest(f"items[{index}].start must be an integer >= 0, got {start!r}",
                             field="start")
    if n == 0:
        raise InvalidRequest(f"items[{index}] has no tokens to advance", field="tokens")
    end = start + n
    if end > spec.context_length:
        raise ContextLengthExceeded(
            f"items[{index}] reaches position {end}, past the model's context length "
            f"{spec.context_length}",
            field="tokens",
        )
    needed = -(-end // block_size)
    if len(item.blocks) < needed:
        raise InvalidRequest(
            f"items[{index}] covers positions up to {end - 1} and needs {needed} blocks of "
            f"{block_size}, but its block table has {len(item.blocks)}",
            field="blocks",
        )
    return start, end


def _int_array(values: np.ndarray, what: str, field: str, low: int, high: int) -> np.ndarray:
    """`values` (from np.asarray of the caller's sequence) as int64 in [low, high), or
    InvalidRequest naming `what`. Floats, bools and strings are refused, not truncated."""
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise InvalidRequest(f"{what} must all be integers", field=field)
    if values.size and (values.min() < low or values.max() >= high):
        bad = int(values[(values < low) | (values >= high)][0])
        raise InvalidRequest(f"{what} contain {bad}, outside [{low}, {high})", field=field)
    return values.astype(np.int64, copy=False)


def _flat_ints(groups: Sequence[Sequence[int]]) -> np.ndarray:
    """The groups' values in one 1-d array: at once where all are Python ints, else group by
    group (numpy ints as they are); an object array where a group is not a flat sequence of
    integers (a float, a bool, a nested sequence), for _int_array to refuse."""
    flat = list(chain.from_iterable(groups))
    if set(map(type, flat)) <= {int}:
        return np.array(flat)  # int64 (object past its range: refused as not integers)
    arrays = [np.asarray(group) for group in groups]
    if all(array.ndim == 1 and array.dtype.kind in "iu" for array in arrays):
        return np.concatenate(arrays)
    return np.array(flat, dtype=object)


def _well_formed(items: Sequence[StepItem]) -> bool:
    """Whether every item is a StepItem of tuples and an int start: the exact types the
    scheduler builds, checked in one cheap pass (anything else takes _check_item's)."""
    sequence = (tuple, list)
    return all(type(item) is StepItem and type(item.start) is int
               and type(item.tokens) in sequence and type(item.blocks) in sequence
               for item in items)


def _first_bad_item(bad: np.ndarray, items: Sequence[StepItem], spec: ModelSpec,
                    block_size: int) -> None:
    """_check_item's error for the first item flagged in `bad`, if any is."""
    if bad.any():
        index = int(np.argmax(bad))
        _check_item(items[index], index, spec, block_size)


def plan_step(
    items: Sequence[StepItem], spec: ModelSpec, num_blocks: int, block_size: int
) -> StepPlan:
    """Validate `items` against the model and a pool of `num_blocks` blocks of `block_size`
    positions, and lay the step out as flat arrays.

    Raises `InvalidRequest` (naming the field) for a malformed item, a token id outside the
    vocabulary, a block table too short or naming blocks outside the pool, or two items
    writing the same slot; `ContextLengthExceeded` past the context length.
    """
    if len(items) == 0:
        raise InvalidRequest("a step needs at least one item", field="items")
    if not _well_formed(items):
        for i, item in enumerate(items):
            _check_item(item, i, spec, block_size)
    n_items = len(items)
    # Whole-step arrays, then the checks on them (a decode step of 64 items is on the
    # backend's critical path: no numpy call per item).
    starts = np.fromiter((item.start for item in items), np.int64, n_items)
    lengths = np.fromiter((len(item.tokens) for item in items), np.int64, n_items)
    ends = starts + lengths
    blocks_needed = -(-ends // block_size)
    table_lengths = np.fromiter((len(item.blocks) for item in items), np.int64, n_items)
    _first_bad_item((starts < 0) | (lengths == 0) | (ends > spec.context_length) |
                    (table_lengths < blocks_needed), items, spec, block_size)
    first_rows = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    n_tokens = int(lengths.sum())
    token_ids = _int_array(_flat_ints([item.tokens for item in items]), "token ids", "tokens",
                           0, spec.vocab_size)
    needed = blocks_needed.tolist()
    named = _flat_ints([item.blocks[:n] for item, n in zip(items, needed)])
    if named.dtype.kind not in "iu" or (
            named.size and (named.min() < 0 or named.max() >= num_blocks)):
        # Name the first item whose table is at fault, as the check of each item does.
        for i, (item, n) in enumerate(zip(items, needed)):
            _int_array(np.asarray(item.blocks[:n]), f"items[{i}].blocks", "blocks", 0,
                       num_blocks)
    tables = np.zeros((n_items, int(blocks_needed.max())), dtype=np.int64)
    tables[np.arange(tables.shape[1]) < blocks_needed[:, None]] = named

    item_of_row = np.repeat(np.arange(len(items)), lengths)
    positions = np.arange(n_tokens) - first_rows[item_of_row] + starts[item_of_row]
    slot_blocks = tables[item_of_row, positions // block_size]
    slot_offsets = positions % block_size
    slots = slot_blocks * block_size + slot_offsets
    if np.unique(slots).size != n_tokens:
        raise InvalidRequest("two items of one step write the same KV slot", field="blocks")

    want = np.array([item.want_logits for item in items], dtype=bool)
    return StepPlan(
        token_ids=token_ids,
        positions=positions,
        slot_blocks=slot_blocks,
        slot_offsets=slot_offsets,
        starts=starts,
        lengths=lengths,
        first_rows=first_rows,
        block_tables=tables,
        logit_rows=(first_rows + lengths - 1)[want],
        block_size=block_size,
    )
