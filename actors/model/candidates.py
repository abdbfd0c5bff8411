"""The output head's last job, for any backend: penalties, then each row's top candidates.

What crosses from a backend to the sampler is small: per logits row, its `RowInputs.candidates`
most likely tokens after the penalties (ids and logits, most likely first, ties by lowest id,
as argmax breaks them) and, when asked, the row's log-partition value

    log_z = log(sum over the vocabulary of exp((logit - peak) * inv_temp)),  peak = the top logit,

so the sampler's logprobs and top-p mass stay exact without the row. Greedy rows need only
their argmax (one candidate). The penalties (llama.cpp's repetition penalty over the distinct
tokens of a window: a positive logit divided by it, a negative one multiplied; then OpenAI's
presence and frequency: `l -= presence * (count > 0) + frequency * count`) are applied to the
row in place, in float64 and rounded to float32, before anything else reads it; then each
token's `logit_bias` is added, in float64 and rounded to float32 again.

This module is the numpy reference (the CPU backend runs it, a GPU backend's kernels are
tested against it), and it also holds the row scans the sampler's full-row path shares:
a strided sample of a row guesses a logit threshold, one comparison pass gathers the tokens
above it, and only those are sorted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np

from actors.errors import InvalidRequest

# A row's candidate threshold is guessed from about this many of its logits (a strided sample).
SAMPLE_SIZE = 4096
# The partition function is summed in blocks of this many tokens (the sampler's full-row path
# inverts a CDF through the blocks' sums).
BLOCK = 1024
# Rows handled per exp pass, so the float32 scratch stays in cache.
_SCRATCH_BYTES = 2 << 20
# The first threshold aims for this many times the candidates a row needs: the guess from a
# sample is noisy, and a row that comes up short costs another comparison pass.
CANDIDATE_MARGIN = 4


class RowInputs(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend needs to turn one logits row into the sampler's candidates.

    The row's candidates are its most likely tokens: at least `candidates`, and more while
    they hold less than `mass` of the row's probability at `inv_temp` (their weights
    exp((logit - peak) * inv_temp) summing to less than mass * exp(log_z)), up to
    `max_candidates`; a backend may give a few more, never fewer (capped at the vocabulary).
    """

    candidates: int = 1
    mass: float = 0.0  # 0: `candidates` exactly; a top-p row asks for its nucleus this way
    max_candidates: int = 1
    inv_temp: float = 1.0  # 1 / temperature, for log_z and the mass
    want_log_z: bool = False
    # The sampler takes the row's first candidate (greedy, whatever it asks for logprobs): a
    # backend may feed that token to the next step before the sampler has seen it.
    greedy: bool = False
    repetition_penalty: float = 1.0
    repeated: tuple[int, ...] = ()  # distinct token ids the repetition penalty applies to
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    generated: tuple[int, ...] = ()  # distinct generated token ids
    generated_counts: tuple[int, ...] = ()  # how often each was generated
    # OpenAI's logit_bias: distinct token ids, ascending, and what is added to their logits.
    bias_tokens: tuple[int, ...] = ()
    bias_values: tuple[float, ...] = ()
    # Structured output: int32 words, bit t % 32 of word t // 32 set where token t may come
    # next (llguidance's layout); None: every token may.
    allowed: Any = None  # np.ndarray | None


class Candidates(msgspec.Struct, frozen=True, kw_only=True):
    """A step's candidates, one row per logits row: `ids` int32 and `logits` float32 of shape
    (rows, width), most likely first, valid up to `count[row]` (padding: id 0, logit -inf);
    `log_z` float64 (rows,), NaN where not asked for. A row whose top logit is not finite
    (NaN or inf) holds just its argmax with that value: the sampler fails that row alone."""

    ids: np.ndarray
    logits: np.ndarray
    count: np.ndarray
    log_z: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes these candidates take when they cross to the host."""
        return sum(a.nbytes for a in (self.ids, self.logits, self.count, self.log_z))


def mask_words(vocab: int) -> int:
    """int32 words of one row's token mask (`RowInputs.allowed`: a bit per token)."""
    return -(-vocab // 32)


# Row b: the bounds of the 8 tokens of a mask byte of value b (bit i: token i of the 8).
_BYTE_BOUNDS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") != 0,
    np.float32(np.inf), np.float32(-np.inf),
).astype(np.float32)


def apply_token_masks(logits: np.ndarray, rows: Sequence[RowInputs]) -> None:
    """Set to -inf, in place, the logits of the tokens each constrained row's `allowed` mask
    leaves out; runs before the penalties, so nothing after it sees a forbidden token."""
    vocab = logits.shape[1]
    for row, inputs in enumerate(rows):
        if inputs.allowed is not None:
            words = np.ascontiguousarray(inputs.allowed, dtype=np.int32).ravel()
            if words.size != mask_words(vocab):
                raise InvalidRequest(f"a token mask of {words.size} words for a vocabulary "
                                     f"of {vocab} tokens (needs {mask_words(vocab)})",
                                     field="allowed")
            # Each mask byte picks its 8 bounds (+inf: allowed, -inf: not); the minimum with
            # them leaves an allowed logit exactly as it was. ~7x faster than a boolean mask.
            bounds = _BYTE_BOUNDS.take(words.view(np.uint8), axis=0).reshape(-1)[:vocab]
            np.minimum(logits[row], bounds, out=logits[row])


def apply_penalties(logits: np.ndarray, rows: Sequence[RowInputs]) -> None:
    """Penalize `logits` (n, vocab) float32 in place, row i by `rows[i]`, then add its logit
    biases; touches only the few (row, token) pairs of the rows' histories and biases."""
    _penalize(logits, rows)
    _add_biases(logits, rows)


def _penalize(logits: np.ndarray, rows: Sequence[RowInputs]) -> None:
    vocab = logits.shape[1]
    repeated = [
        i * vocab + np.asarray(r.repeated, dtype=np.int64)
        for i, r in enumerate(rows) if r.repetition_penalty != 1.0
    ]
    counted = [
        (i * vocab + np.asarray(r.generated, dtype=np.int64),
         np.asarray(r.generated_counts, dtype=np.int64))
        for i, r in enumerate(rows) if r.presence_penalty != 0 or r.frequency_penalty != 0
    ]
    if not repeated and not counted:
        return  # no row penalizes (the usual step): spares the empty set operations below
    # (row, token) pairs are keyed row * vocab + token, so one sorted array covers the batch.
    repeated_keys = np.unique(np.concatenate([np.zeros(0, np.int64), *repeated]))
    counted_keys = np.concatenate([np.zeros(0, np.int64), *(keys for keys, _ in counted)])
    counts_of_keys = np.concatenate([np.zeros(0, np.int64), *(c for _, c in counted)])
    keys = np.union1d(repeated_keys, counted_keys)
    if keys.size == 0:
        return
    row, ids = np.divmod(keys, vocab)
    repetition, presence, frequency = (
        np.array([getattr(r, name) for r in rows], dtype=np.float64)[row]
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")
    )
    values = logits[row, ids].astype(np.float64)
    in_window = np.isin(keys, repeated_keys, assume_unique=True)
    values = np.where(
        in_window, np.where(values > 0, values / repetition, values * repetition), values
    )
    counts = np.zeros(keys.size)
    counts[np.searchsorted(keys, counted_keys)] = counts_of_keys
    values -= presence * (counts > 0) + frequency * counts
    # A value past float32 becomes inf: its row is then not finite and fails alone.
    with np.errstate(over="ignore"):
        logits[row, ids] = values.astype(np.float32)


def _add_biases(logits: np.ndarray, rows: Sequence[RowInputs]) -> None:
    """Add each row's `bias_values` to its `bias_tokens`' logits (after the penalties: a
    masked token stays at -inf whatever its bias)."""
    biased = [(i, r) for i, r in enumerate(rows) if r.bias_tokens]
    if not biased:
        return
    row = np.concatenate([np.full(len(r.bias_tokens), i, dtype=np.int64) for i, r in biased])
    ids = np.concatenate([np.asarray(r.bias_tokens, dtype=np.int64) for _, r in biased])
    values = np.concatenate([np.asarray(r.bias_values, dtype=np.float64) for _, r in biased])
    mismatched = any(len(r.bias_tokens) != len(r.bias_values) for _, r in biased)
    if mismatched or ids.min() < 0 or ids.max() >= logits.shape[1]:
        raise InvalidRequest(f"bias_tokens must be as many token ids in [0, {logits.shape[1]}) "
                             "as bias_values", field="bias_tokens")
    with np.errstate(over="ignore"):
        logits[row, ids] = (logits[row, ids].astype(np.float64) + values).astype(np.float32)


def top_candidates(logits: np.ndarray, rows: Sequence[RowInputs]) -> Candidates:
    """The candidates of every row of `logits` (n, vocab) float32, already penalized."""
    n, vocab = logits.shape
    least = np.minimum(np.array([max(1, r.candidates) for r in rows], dtype=np.int64), vocab)
    most = np.minimum(
        np.array([max(r.candidates, r.max_candidates, 1) for r in rows], dtype=np.int64), vocab
    )
    mass = np.array([r.mass for r in rows], dtype=np.float64)
    inv_temp = np.array([r.inv_temp for r in rows], dtype=np.float64)
    best = np.argmax(logits, axis=1)
    peak = logits[np.arange(n), best]
    finite = np.isfinite(peak)
    log_z = np.full(n, np.nan)
    asks_z = np.array([r.want_log_z or r.mass > 0 for r in rows], dtype=bool)
    z_rows = np.flatnonzero(finite & asks_z)
    if z_rows.size:
        log_z[z_rows] = np.log(block_sums(logits, z_rows, peak, inv_temp).sum(axis=1))
    count = np.ones(n, dtype=np.int64)
    gathered = np.flatnonzero(finite & (most > 1))
    ids = values = None
    if gathered.size:
        with np.errstate(invalid="ignore"):  # log_z is NaN where no mass is asked
            target = np.where(mass > 0, mass * np.exp(log_z), 0.0)
        tops = _gather_tops(logits, gathered, least[gathered], most[gathered],
                            target[gathered], peak, inv_temp)
        count[gathered], ids, values = tops
    width = int(count.max()) if n else 1
    out_ids = np.zeros((n, width), dtype=np.int32)
    out_values = np.full((n, width), -np.inf, dtype=np.float32)
    out_ids[:, 0], out_values[:, 0] = best, peak
    if gathered.size:
        real = np.arange(ids.shape[1]) < count[gathered, None]
        keep = min(width, ids.shape[1])
        out_ids[gathered, :keep] = np.where(real, ids, 0)[:, :keep]
        out_values[gathered, :keep] = np.where(real, values, np.float32(-np.inf))[:, :keep]
    return Candidates(ids=out_ids, logits=out_values, count=count.astype(np.int32), log_z=log_z)


def _gather_tops(
    logits: np.ndarray,
    some_rows: np.ndarray,
    least: np.ndarray,
    most: np.ndarray,
    target: np.ndarray,
    peak: np.ndarray,
    inv_temp: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each of `some_rows`' candidates: (count, ids, logits), sorted most likely first, the
    columns past a row's count holding whatever sorted next. Gathers the tokens above a
    threshold guessed from the row's sorted sample, lowered until every row holds at least
    `least` tokens and `target` weight (or `most` tokens, or the whole row)."""
    vocab = logits.shape[1]
    stride = stride_of(vocab)
    sample = sorted_sample(logits, some_rows)
    row_peak = peak[some_rows].astype(np.float64)
    row_scale = inv_temp[some_rows]
    threshold_at = np.ceil(CANDIDATE_MARGIN * least / stride).astype(np.int64)
    parts = []
    pending = np.ones(some_rows.size, dtype=bool)
    while pending.any():
        threshold = sampled_logit(sample, sample.shape[1] - threshold_at)
        bound = np.full(logits.shape[0], np.inf)  # rows not pending gather nothing
        bound[some_rows[pending]] = threshold[pending]
        batch_row, ids = tokens_above(logits, bound)
        # A row's +inf logits pass even an infinite bound: keep only the pending rows' tokens.
        asked = bound[batch_row] < np.inf
        batch_row, ids = batch_row[asked], ids[asked]
        slot = np.searchsorted(some_rows, batch_row)
        values = logits[batch_row, ids]
        count = np.bincount(slot, minlength=some_rows.size)
        weights = np.exp((values - row_peak[slot]) * row_scale[slot])
        missing = target - np.bincount(slot, weights=weights, minlength=some_rows.size)
        whole_row = threshold == -np.inf
        enough = pending & (whole_row | ((count >= least) & ((missing <= 0) | (count >= most))))
        keep = enough[slot]
        parts.append((slot[keep], ids[keep], values[keep]))
        pending &= ~enough
        # Every token below a threshold weighs less than one at it: a row short of weight
        # needs at least `missing / that weight` more tokens.
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            weight_at = np.exp((threshold - row_peak) * row_scale)
            more = np.where(missing > 0, missing / weight_at, 0.0)
        # Never more than `most` are kept: a row whose target lies past them stops there.
        wanted = np.minimum(
            CANDIDATE_MARGIN * np.maximum(least, np.minimum(count + more, most)), vocab
        )
        threshold_at = np.maximum(threshold_at * 2, np.ceil(wanted / stride)).astype(np.int64)
    slot, ids, values = (np.concatenate(part) for part in zip(*parts))
    gathered = np.bincount(slot, minlength=some_rows.size)
    sorted_ids, sorted_values = sort_by_likelihood(slot, ids, values, gathered)
    # How many of the sorted tokens reach the target weight, plus one against rounding.
    weights = np.exp((sorted_values - row_peak[:, None]) * row_scale[:, None])
    reach = (np.cumsum(weights, axis=1) < target[:, None]).sum(axis=1) + 2
    count = np.minimum(np.maximum(least, np.minimum(reach, most)), gathered)
    width = int(count.max())
    return count, sorted_ids[:, :width], sorted_values[:, :width]


def n_blocks(vocab: int) -> int:
    return -(-vocab // BLOCK)


def block_sums(
    logits: np.ndarray, some_rows: np.ndarray, peak: np.ndarray, inv_temp: np.ndarray
) -> np.ndarray:
    """Per row of `some_rows`, the sums of exp((logit - peak) * inv_temp) over blocks of
    `BLOCK` tokens (float64, shape (len(some_rows), blocks)); their total is the partition
    function."""
    sums = np.empty((some_rows.size, n_blocks(logits.shape[1])))
    for part, _, weights in weighed_chunks(logits, some_rows, peak, inv_temp):
        sums[part] = weights.sum(axis=2)
    return sums


def weighed_chunks(
    logits: np.ndarray, some_rows: np.ndarray, peak: np.ndarray, inv_temp: np.ndarray
) -> Iterator[tuple[slice, np.ndarray, np.ndarray]]:
    """`some_rows` a few at a time, so the float32 scratch stays in cache: yields the chunk's
    slice of `some_rows`, its logits, and its weights exp((logit - peak) * inv_temp) as (rows,
    blocks, `BLOCK`), the last block padded with zeros. The next chunk overwrites the weights."""
    vocab = logits.shape[1]
    blocks = n_blocks(vocab)
    chunk = max(1, _SCRATCH_BYTES // (4 * blocks * BLOCK))
    scratch = np.empty((chunk, blocks * BLOCK), dtype=np.float32)
    shift = peak.astype(np.float32)
    scale = inv_temp.astype(np.float32)
    for start in range(0, some_rows.size, chunk):
        part = some_rows[start : start + chunk]
        buf = scratch[: part.size]
        chunk_logits = _rows_of(logits, part)
        # Subtract before scaling: a small temperature would magnify the rounding of l / T.
        np.subtract(chunk_logits, shift[part, None], out=buf[:, :vocab])
        buf[:, :vocab] *= scale[part, None]
        buf[:, vocab:] = -np.inf  # the last block's padding weighs exp(-inf) = 0
        np.exp(buf, out=buf)
        weights = buf.reshape(part.size, blocks, BLOCK)
        yield slice(start, start + part.size), chunk_logits, weights


def _rows_of(logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`logits[rows]`, as a view (no copy) when the rows are consecutive."""
    if rows[-1] - rows[0] == rows.size - 1:
        return logits[rows[0] : rows[-1] + 1]
    return logits[rows]


def stride_of(vocab: int) -> int:
    """A row's sample takes every `stride_of(vocab)`-th logit: about `SAMPLE_SIZE` of them."""
    return max(1, vocab // SAMPLE_SIZE)


def sorted_sample(logits: np.ndarray, sample_rows: np.ndarray) -> np.ndarray:
    """Every `stride_of`-th logit of each of `sample_rows`, sorted ascending: about
    `stride * (size - position)` tokens of a row lie at or above its `position`-th."""
    return np.sort(logits[sample_rows, :: stride_of(logits.shape[1])], axis=1)


def sampled_logit(sample: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Each row's sampled logit at `position` (float64); -inf at or below the sample's first
    position (the row's lower tokens were not sampled), +inf past its last."""
    size = sample.shape[1]
    at = np.take_along_axis(sample, np.clip(position, 0, size - 1)[:, None], axis=1)[:, 0]
    at = at.astype(np.float64)
    return np.where(position <= 0, -np.inf, np.where(position >= size, np.inf, at))


def tokens_above(logits: np.ndarray, threshold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, token id) of every logit at or above its row's threshold (+inf: none), row by
    row and ascending ids within a row: one comparison pass over the batch, no sort and no
    copy of its rows."""
    # Rounded down to float32, so no token at or above the float64 threshold is missed.
    bound = threshold.astype(np.float32)
    bound = np.where(bound > threshold, np.nextafter(bound, np.float32(-np.inf)), bound)
    return np.divmod(np.flatnonzero(logits >= bound[:, None]), logits.shape[1])


def sort_by_likelihood(
    slot: np.ndarray, ids: np.ndarray, values: np.ndarray, count: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Sort each slot's gathered tokens most likely first, ties by lowest id (as argmax
    does): (ids, logits) of shape (slots, max count), padded with id 0 and logit -inf.

    One int64 key per token, (the logit's bits in descending order, id), sorted by value:
    far faster than an argsort when a hot top-p makes a row's table as wide as the
    vocabulary, and the sorted keys give back both the ids and the logits.
    """
    keys = (~_float_order(values + np.float32(0.0))).astype(np.int64) << 32 | ids  # -0.0 -> 0.0
    # One padded row per slot (any column order will do: the rows get sorted); the padding
    # key sorts last.
    width = max(int(count.max()), 1) if count.size else 1
    grouped = np.argsort(slot, kind="stable")
    column = np.empty_like(grouped)
    column[grouped] = np.arange(grouped.size) - (np.cumsum(count) - count)[slot[grouped]]
    dense = np.full((count.size, width), np.iinfo(np.int64).max)
    dense.reshape(-1)[slot * width + column] = keys
    dense.sort(axis=1)
    real = np.arange(width) < count[:, None]
    sorted_logits = _float_order(~(dense >> 32).astype(np.int32)).view(np.float32)
    return (
        np.where(real, dense & 0xFFFFFFFF, 0).astype(np.int32),
        np.where(real, sorted_logits, np.float32(-np.inf)),
    )


def _float_order(bits: np.ndarray) -> np.ndarray:
    """float32 values (viewed as int32) -> int32 in the same order, and back: the map is its
    own inverse."""
    as_int = bits.view(np.int32)
    return np.where(as_int >= 0, as_int, as_int ^ np.int32(0x7FFFFFFF))
