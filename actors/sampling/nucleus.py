"""Top-p over the whole vocabulary (no top-k) on whole rows: one pass gives each row its
partition function and a guess of where its nucleus starts; a nucleus guessed too wide to
sort (a hot temperature, top_p near 1) is neither gathered nor sorted.

An exp pass sums a wide row's weights above a bracket of logits around the guessed cutoff by
blocks and gathers the few tokens inside the bracket; sorting only those finds the cutoff
token exactly, and the row is drawn in vocabulary order from its survivors' block sums. A
bracket that misses the cutoff is widened, for one more pass over its row.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from actors.model.candidates import BLOCK, sampled_logit, stride_of, weighed_chunks
from actors.model.candidates import n_blocks as block_count
from actors.sampling.batch import _WIDEN_FACTOR, _invert_cdf, _RowParams

# A top-p row without top-k whose nucleus is guessed to hold more than about this many tokens
# is drawn without sorting its nucleus (`_draw_from_wide_nuclei`): past it, sorting costs more
# than the bracket of the cutoff that it sorts instead.
_WIDE_NUCLEUS = 2048
# A wide nucleus's cutoff is looked for between the sampled logits this many sample positions
# either side of the guessed one: about 2 * this * stride tokens to sort. Wider costs more in
# every row than the rows whose guess was further off (on gemma3's hot rows, one in seven)
# lose to a second bracket.
_BRACKET = 16


class _Brackets(NamedTuple):
    """Per wide nucleus, a bracket of logits [low, high) that may hold its cutoff token: the
    block sums of the row's weights at or above `high`, and the tokens inside."""

    rows: np.ndarray  # the batch row of each bracket
    low: np.ndarray
    high: np.ndarray
    above_sums: np.ndarray  # (r, blocks)
    slot: np.ndarray  # the tokens inside, bracket by bracket and ascending ids: their bracket,
    ids: np.ndarray  # id,
    values: np.ndarray  # logit
    weights: np.ndarray  # and float32 weight, as `weighed_chunks` has it


class _Nuclei(NamedTuple):
    """What `_nucleus_pass` learns of the top-p rows without top-k, one entry per row."""

    log_z: np.ndarray
    wide: np.ndarray  # bool: guessed too wide to sort
    start: np.ndarray  # the sample position where the nucleus is guessed to start
    floor: np.ndarray  # `_min_p_floor`
    brackets: _Brackets | None  # the wide rows' first brackets, `_BRACKET` around `start`


def _nucleus_pass(
    logits: np.ndarray,
    nucleus_rows: np.ndarray,
    sample: np.ndarray,
    peak: np.ndarray,
    rows: _RowParams,
) -> _Nuclei:
    """One pass over the top-p rows without top-k: each row's partition function then, once
    that tells how much mass top-p drops, the guess of where its nucleus starts in its
    `sorted_sample` and, for a nucleus guessed too wide to sort, a first bracket, while the
    row's weights are still in cache."""
    vocab = logits.shape[1]
    stride = stride_of(vocab)
    size = sample.shape[1]
    inv_temp = rows.inv_temp[nucleus_rows]
    log_min_p = rows.log_min_p[nucleus_rows]
    z = np.empty(nucleus_rows.size)
    start = np.zeros(nucleus_rows.size, dtype=np.int64)
    wide = np.zeros(nucleus_rows.size, dtype=bool)
    floor = _min_p_floor(peak[nucleus_rows], log_min_p, inv_temp)
    low = np.full(nucleus_rows.size, np.inf)  # narrow rows: an empty bracket, nothing above it
    high = np.full(nucleus_rows.size, np.inf)
    above_sums = np.zeros((nucleus_rows.size, block_count(vocab)))
    # The nucleus is guessed to start where the sampled logits below it, each standing for
    # `stride` tokens, weigh what top-p drops; it is wide when that is below the top sampled
    # logits that stand for `_WIDE_NUCLEUS` tokens, and min-p keeps them. A guess from the row
    # alone: so is the path it picks.
    shift = peak[nucleus_rows, None].astype(np.float32)  # float32: a guess, and a cheap one
    scaled = (sample - shift) * inv_temp[:, None].astype(np.float32)
    sample_weights = stride * np.exp(scaled)
    wide_below = size - min(size, -(-_WIDE_NUCLEUS // stride))  # a sample position
    can_be_wide = (scaled < log_min_p[:, None]).sum(axis=1) < wide_below
    mass_below_wide = sample_weights[:, :wide_below].sum(axis=1)
    dropped_share = 1 - rows.top_p[nucleus_rows]
    parts = []
    for part, chunk_logits, weights in weighed_chunks(logits, nucleus_rows, peak, rows.inv_temp):
        z[part] = weights.sum(axis=2).sum(axis=1, dtype=np.float64)
        dropped = dropped_share[part] * z[part]
        wide[part] = can_be_wide[part] & (mass_below_wide[part] > dropped)
        if wide[part].any():
            mass_below = np.cumsum(sample_weights[part], axis=1)
            start[part] = (mass_below <= dropped[:, None]).sum(axis=1)
            bounds = _bracket_bounds(sample[part], start[part], _BRACKET, floor[part])
            low[part], high[part] = (np.where(wide[part], bound, np.inf) for bound in bounds)
            above_sums[part], entries = _bracket_chunk(
                chunk_logits, weights, low[part], high[part], part.start
            )
            parts.append(entries)
    brackets = None
    if wide.any():
        row, *inside = (np.concatenate(column) for column in zip(*parts))
        slot = (np.cumsum(wide) - 1)[row]  # position among the wide rows
        brackets = _Brackets(
            nucleus_rows[wide], low[wide], high[wide], above_sums[wide], slot, *inside
        )
    return _Nuclei(np.log(z), wide, start, floor, brackets)


def _bracket_bounds(
    sample: np.ndarray, start: np.ndarray, half_width: int, floor: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The brackets `half_width` sample positions either side of `start`, raised to min-p's
    floor: float32 values, or infinite past the sample's ends."""
    low = sampled_logit(sample, start - half_width)
    high = sampled_logit(sample, start + half_width)
    return np.maximum(low, floor), np.maximum(high, floor)


def _bracket_chunk(
    chunk_logits: np.ndarray, weights: np.ndarray, low: np.ndarray, high: np.ndarray, offset: int
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """For a chunk of `weighed_chunks` (whose `weights` it overwrites): the block sums of each
    row's weights at or above its `high`, and (row + offset, id, logit, weight) of its tokens
    in [low, high). The bounds are float32 values, so the float32 comparisons are exact."""
    vocab = chunk_logits.shape[1]
    at_or_above = chunk_logits >= high.astype(np.float32)[:, None]
    inside = chunk_logits >= low.astype(np.float32)[:, None]
    np.greater(inside, at_or_above, out=inside)  # and not at or above `high`
    flat = np.flatnonzero(inside)
    row, ids = np.divmod(flat, vocab)
    padded = weights.reshape(weights.shape[0], -1)
    in_padded = flat + row * (padded.shape[1] - vocab)
    entries = (row + offset, ids, chunk_logits.reshape(-1)[flat], padded.reshape(-1)[in_padded])
    padded[:, :vocab] *= at_or_above
    return weights.sum(axis=2), entries


def _bracket_pass(
    logits: np.ndarray,
    bracket_rows: np.ndarray,
    peak: np.ndarray,
    inv_temp: np.ndarray,
    low: np.ndarray,
    high: np.ndarray,
) -> _Brackets:
    """The brackets [low, high) of `bracket_rows`, in one pass over their weights."""
    above_sums = np.empty((bracket_rows.size, block_count(logits.shape[1])))
    parts = []
    for part, chunk_logits, weights in weighed_chunks(logits, bracket_rows, peak, inv_temp):
        above_sums[part], entries = _bracket_chunk(
            chunk_logits, weights, low[part], high[part], part.start
        )
        parts.append(entries)
    inside = (np.concatenate(column) for column in zip(*parts))
    return _Brackets(bracket_rows, low, high, above_sums, *inside)


def _draw_from_wide_nuclei(
    logits: np.ndarray,
    wide_rows: np.ndarray,
    nuclei: _Nuclei,
    sample: np.ndarray,
    peak: np.ndarray,
    rows: _RowParams,
    log_z: np.ndarray,
    uniforms: np.ndarray,
) -> np.ndarray:
    """Sample top-p nuclei too wide to sort: the survivors `_draw_from_table` would keep, but
    inverted in vocabulary order through their block sums, as an unfiltered row is.

    The cutoff token, where the mass from the top reaches top_p * Z, is looked for in a bracket
    of logits around the guessed start of the nucleus (`sample` is the rows' sorted sample):
    only the tokens inside it are sorted, those above it are summed by blocks. A row whose
    cutoff is not inside its bracket tries one twice as wide. min-p's floor bounds the brackets
    from below, so the survivors are the tokens above both cutoffs.
    """
    wide = nuclei.wide
    start, floor = nuclei.start[wide], nuclei.floor[wide]
    nucleus_mass = rows.top_p[wide_rows] * np.exp(log_z[wide_rows])
    cut_logit = np.empty(wide_rows.size)
    cut_id = np.empty(wide_rows.size, dtype=np.int64)
    survivor_sums = np.empty((wide_rows.size, block_count(logits.shape[1])))
    pending = np.arange(wide_rows.size)  # positions in wide_rows
    brackets = nuclei.brackets
    half_width = _BRACKET
    while True:
        decided, *found = _cutoffs(brackets, nucleus_mass[pending], floor[pending], peak, rows)
        done = pending[decided]
        cut_logit[done], cut_id[done], survivor_sums[done] = (part[decided] for part in found)
        pending = pending[~decided]
        if not pending.size:
            break
        half_width *= _WIDEN_FACTOR
        low, high = _bracket_bounds(sample[pending], start[pending], half_width, floor[pending])
        brackets = _bracket_pass(logits, wide_rows[pending], peak, rows.inv_temp, low, high)
    return _draw_from_blocks(
        logits, wide_rows, survivor_sums, peak, rows.inv_temp, uniforms, cut_logit, cut_id
    )


def _cutoffs(
    brackets: _Brackets,
    nucleus_mass: np.ndarray,
    floor: np.ndarray,
    peak: np.ndarray,
    rows: _RowParams,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per bracket: whether it decides its row's cutoff, the cutoff token (logit, id) and the
    block sums of the survivors' weights.

    Only the logits inside a bracket are sorted (float32, far faster than sorting them with
    their ids): equal logits weigh the same, so the cutoff's logit and its rank among the
    tokens of that logit come from them, and its id from the few tokens at that logit.
    """
    n_brackets, n_blocks = brackets.above_sums.shape
    slot, ids, values = brackets.slot, brackets.ids, brackets.values
    count = np.bincount(slot, minlength=n_brackets)
    width = max(int(count.max()), 1)
    negated = np.full((n_brackets, width), np.inf, dtype=np.float32)  # padding sorts last
    negated[slot, np.arange(slot.size) - (np.cumsum(count) - count)[slot]] = -values
    negated.sort(axis=1)
    descending = -negated
    # The same float32 weights as `weighed_chunks`, so the mass above the bracket and its
    # tokens' add up as the partition function does.
    shift = peak[brackets.rows, None].astype(np.float32)
    scale = rows.inv_temp[brackets.rows, None].astype(np.float32)
    sorted_weights = np.exp((descending - shift) * scale).astype(np.float64)
    mass_above = brackets.above_sums.sum(axis=1)
    cdf = mass_above[:, None] + np.cumsum(sorted_weights, axis=1)
    keep = (cdf < nucleus_mass[:, None]).sum(axis=1) + 1  # as `_draw_from_table` counts
    found = keep <= count
    # The cutoff is above the bracket while the mass above it reaches top_p * Z, and below it
    # while the bracket ends short, unless min-p's floor (or the row's end) is there: then
    # every token at or above the bracket survives.
    decided = (mass_above < nucleus_mass) & (found | (brackets.low <= floor))
    cut_logit = np.where(
        found, descending[np.arange(n_brackets), np.minimum(keep, width) - 1], brackets.low
    )
    # Ties go by id: the cutoff is the `rank`-th token (in id order) of its logit.
    rank = keep - (descending > cut_logit[:, None].astype(np.float32)).sum(axis=1)
    survives = values > cut_logit[slot]
    tied = np.flatnonzero(values == cut_logit[slot])
    tied_slot = slot[tied]
    rank_in_row = np.arange(tied.size) - np.searchsorted(tied_slot, tied_slot) + 1
    is_cut = found[tied_slot] & (rank_in_row == rank[tied_slot])
    cut_id = np.full(n_brackets, np.iinfo(np.int64).max)  # not found: every tie survives
    cut_id[tied_slot[is_cut]] = ids[tied[is_cut]]
    survives[tied[rank_in_row <= np.where(found, rank, tied.size)[tied_slot]]] = True
    prefix_sums = np.bincount(
        (slot * n_blocks + ids // BLOCK)[survives],
        brackets.weights[survives],
        minlength=n_brackets * n_blocks,
    ).reshape(n_brackets, n_blocks)
    return decided, cut_logit, cut_id, brackets.above_sums + prefix_sums


def _draw_from_blocks(
    logits: np.ndarray,
    drawn_rows: np.ndarray,
    block_sums: np.ndarray,
    peak: np.ndarray,
    inv_temp: np.ndarray,
    uniforms: np.ndarray,
    cut_logit: np.ndarray,
    cut_id: np.ndarray,
) -> np.ndarray:
    """Sample each of `drawn_rows` in vocabulary order among its survivors: the tokens up to a
    cutoff token in (logit desc, id asc) order (`cut_logit` -inf and `cut_id` past the
    vocabulary: every token), whose weights `block_sums` sums by blocks of `BLOCK` tokens.
    Picks the block holding u * (the survivors' mass), then re-reads that one block."""
    vocab = logits.shape[1]
    cdf = np.cumsum(block_sums, axis=1)
    target = uniforms[drawn_rows] * cdf[:, -1]
    block = _invert_cdf(cdf, target, block_sums > 0)
    before = np.where(block > 0, np.take_along_axis(cdf, (block - 1)[:, None], 1)[:, 0], 0.0)
    ids = block[:, None] * BLOCK + np.arange(BLOCK)
    block_logits = logits[drawn_rows[:, None], np.minimum(ids, vocab - 1)]
    scaled = (block_logits - peak[drawn_rows, None]) * inv_temp[drawn_rows, None]
    cut = cut_logit[:, None]
    survives = (block_logits > cut) | ((block_logits == cut) & (ids <= cut_id[:, None]))
    weights = np.where(survives & (ids < vocab), np.exp(scaled), 0.0)
    offset = _invert_cdf(np.cumsum(weights, axis=1), target - before, weights > 0)
    return block * BLOCK + offset


def _min_p_floor(peak: np.ndarray, log_min_p: np.ndarray, inv_temp: np.ndarray) -> np.ndarray:
    """Per row, the lowest float32 logit that min-p keeps, decided as `_draw_from_table` does
    ((logit - peak) * inv_temp >= log_min_p, in float64); -inf when min-p is off."""

    def kept(logit: np.ndarray) -> np.ndarray:
        return (logit - peak) * inv_temp >= log_min_p

    floor = (peak + log_min_p / inv_temp).astype(np.float32)
    # Rounded to float32, the float64 floor can be an ulp or two off either way.
    while (too_high := ~kept(floor)).any():
        floor = np.where(too_high, np.nextafter(floor, np.float32(np.inf)), floor)
    lower = np.nextafter(floor, np.float32(-np.inf))
    while (too_low := kept(lower) & (lower < floor)).any():
        floor = np.where(too_low, lower, floor)
        lower = np.nextafter(floor, np.float32(-np.inf))
    return floor
