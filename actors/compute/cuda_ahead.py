"""The decode step the CUDA backend runs ahead, as data: no pycuda, no device.

Between two decode steps the host hands each sequence its token, the sequence asks for the
next, the scheduler builds the step and the backend packs it; the GPU waits all that time.
After a decode step whose every row takes its first candidate (`takes_its_candidate`: a
greedy row, logprobs or not, or one asking for a single candidate; no penalty, mask or logit
bias) and whose every item's next
position lies in a block its own table holds and no other item of the step uses
(`next_items`), the backend queues the step that follows if every sequence goes on with that
token: the same items one position on, the tokens fed on the device from the step's candidate
records, the same rows. When the next step comes and is that one (`is_ahead_step`: same
sequences, positions, tokens, tables and rows), its candidates are already there or on the
way; otherwise they are dropped and the step runs as usual. A dropped step cost the device a
whole step, so after one the backend queues none until the step it expects next comes true
(a sequence that ended, one that joined or missed the step: each costs at most one step), and
it runs ahead only steps of up to its limit of rows (RUN_AHEAD_MAX_ROWS unless told). A
dropped step's only lasting
effect is the K/V it wrote one position past what each of its sequences holds, in a block of
that sequence's own: nothing reads a position before the step that computes it writes it
again, and a block handed to another sequence is written by that sequence's steps after this
one (one stream: the device runs them in order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from actors.model.candidates import RowInputs
from actors.model.step import StepItem

# The most rows of a step run ahead, unless the backend is told otherwise: by measurement over
# the emulated device that keeps a GPU's time (docs/gpu.md, the figures and their command),
# running ahead pays at 1 and 8 rows whatever the requests' lengths; past 8 a sequence joins
# or ends every few steps, each drop a whole device step against the host's ~1 ms hidden, and
# it pays only for long requests (16 rows: -6% to +13%; 64: -1% to -3%). To be measured again
# on a device (bench_cuda's `llama3_8b_engine_other_run_ahead`).
RUN_AHEAD_MAX_ROWS = 8


@dataclass(frozen=True)
class AheadStep:
    """A step run ahead: its items (tokens: the ones fed) and the rows it was run with."""

    items: tuple[StepItem, ...]
    rows: tuple[RowInputs, ...]


def takes_its_candidate(row: RowInputs) -> bool:
    """Whether the sampler must choose the row's first candidate (a greedy row, whatever it
    asks for logprobs, or one asking for one candidate and no mass) and nothing changes its
    logits from step to step (no penalty, no mask, no logit bias)."""
    first = row.greedy or (row.candidates <= 1 and row.max_candidates <= 1 and row.mass == 0)
    return (first and row.allowed is None and row.repetition_penalty == 1.0
            and row.presence_penalty == 0 and row.frequency_penalty == 0
            and not row.bias_tokens)


def next_items(items: Sequence[StepItem], rows: Sequence[RowInputs], block_size: int,
               num_blocks: int, context_length: int,
               max_rows: int = RUN_AHEAD_MAX_ROWS) -> tuple[StepItem, ...] | None:
    """The items of the step after `items` (a validated decode step: one token an item, every
    item wanting logits) if every sequence goes on with its candidate, their tokens left
    empty; None where the step has more than `max_rows` items, a row may not take its
    candidate, or an item's next position is past the context or needs a block its table
    lacks, or that block is also in another item's table."""
    if len(items) > max_rows or not all(map(takes_its_candidate, rows)):
        return None
    positions = [item.start + 1 for item in items]
    if any(p >= context_length or len(item.blocks) <= p // block_size
           for item, p in zip(items, positions)):
        return None
    tables = [tuple(item.blocks[: p // block_size + 1]) for item, p in zip(items, positions)]
    named = np.fromiter(chain.from_iterable(tables), np.int64)
    if named.size and (named.min() < 0 or named.max() >= num_blocks):
        return None
    written = np.array([table[-1] for table in tables], dtype=np.int64)
    ids, counts = np.unique(named, return_counts=True)
    if (counts[np.searchsorted(ids, written)] != 1).any():
        return None  # a block shared with another item: its positions are not this one's
    return tuple(StepItem((), p, table, True, item.seq_id)
                 for item, p, table in zip(items, positions, tables))


def ahead_step(items: Sequence[StepItem], tokens: np.ndarray,
               rows: Sequence[RowInputs]) -> AheadStep:
    """`next_items`' items with the tokens the device fed them (each row's first candidate)."""
    return AheadStep(tuple(StepItem((int(token),), item.start, item.blocks, True, item.seq_id)
                           for item, token in zip(items, tokens.tolist())), tuple(rows))


def is_ahead_step(ahead: AheadStep, items: Sequence[StepItem],
                  rows: Sequence[RowInputs]) -> bool:
    """Whether the step asked for is the one run ahead: the same sequences at the same
    positions with the fed tokens, wanting logits, tables that agree on every block it used,
    and the same rows."""
    # Rows that must take their candidate first: no mask array to compare.
    return (len(items) == len(ahead.items) and all(map(takes_its_candidate, rows))
            and tuple(rows) == ahead.rows
            and all(type(item) is StepItem and item.tokens == expected.tokens
                    and item.start == expected.start and item.want_logits
                    and item.seq_id == expected.seq_id
                    and tuple(item.blocks[: len(expected.blocks)]) == expected.blocks
                    for item, expected in zip(items, ahead.items)))
