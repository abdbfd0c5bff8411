"""The whole-row path: `finish_choice` decides the rows of a step that their candidates
could not, from their whole penalized rows.

Rows never sort a whole row: a strided sample of each row guesses a logit threshold, one
comparison pass gathers the tokens above it into a small sorted candidate table, and a row's
threshold is lowered only while its table cannot decide it exactly (fewer than top_k or
logprobs tokens, or less mass than top-p's nucleus). A top-p nucleus without top-k that the
sample guesses wider than a few thousand tokens is drawn without sorting it
(`actors.sampling.nucleus`). An unfiltered row whose uniform fell past its candidates' mass
goes on through the rest of its row in id order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from actors.compute.contract import Candidates
from actors.errors import ComputeError
from actors.model.candidates import (
    CANDIDATE_MARGIN,
    block_sums,
    sampled_logit,
    sort_by_likelihood,
    sorted_sample,
    stride_of,
    tokens_above,
)
from actors.sampling.batch import _WIDEN_FACTOR, _invert_cdf, _RowParams
from actors.sampling.from_candidates import PendingChoice, _choice
from actors.sampling.nucleus import _draw_from_wide_nuclei, _nucleus_pass
from actors.sampling.state import RowFailed, SequenceSampling, TokenChoice

# A top-p row without top-k first assumes its nucleus has at most this many tokens.
_NUCLEUS_GUESS = 128
# Each widening also asks for this many times what a nucleus short of mass is known to lack.
_WIDEN_MARGIN = 2


def finish_choice(
    pending: PendingChoice, rows_logits: np.ndarray, states: Sequence[SequenceSampling]
) -> list[TokenChoice | RowFailed]:
    """Decide the rows `start_choice` could not, from their whole penalized rows
    (`rows_logits`, one per entry of `pending.needed_rows`, in that order)."""
    needed = np.asarray(pending.needed_rows, dtype=np.int64)
    rows_logits = np.ascontiguousarray(rows_logits, dtype=np.float32)
    if rows_logits.shape[0] != needed.size:
        raise ComputeError(f"{rows_logits.shape[0]} rows fetched for {needed.size} wanted")
    choices = list(pending.choices)
    rows = _RowParams.of([states[i] for i in needed])
    cands = pending.candidates
    unfiltered = ~rows.greedy & (rows.top_k == 0) & (rows.top_p >= 1) & ~np.isfinite(
        rows.log_min_p
    )
    past = np.flatnonzero(unfiltered)
    for at, choice in zip(past, _draw_past_candidates(
        rows_logits[past], cands, needed[past], rows.subset(past), pending.uniforms[needed[past]]
    )):
        choices[needed[at]] = choice
    filtered = np.flatnonzero(~unfiltered)
    if filtered.size:
        chosen = _choose(
            rows_logits[filtered], rows.subset(filtered), pending.uniforms[needed[filtered]]
        )
        for at, choice in zip(filtered, chosen):
            choices[needed[at]] = choice
    return choices


def _draw_past_candidates(
    rows_logits: np.ndarray,
    cands: Candidates,
    batch_rows: np.ndarray,
    rows: _RowParams,
    uniforms: np.ndarray,
) -> list[TokenChoice]:
    """Unfiltered rows whose uniform fell past their candidates' mass: the CDF goes on
    through the rest of the vocabulary in id order."""
    choices = []
    for logits, row, inv_temp, u, n_top in zip(
        rows_logits, batch_rows, rows.inv_temp, uniforms, rows.n_top
    ):
        count = int(cands.count[row])
        peak = float(cands.logits[row, 0])
        scaled = (logits.astype(np.float64) - peak) * inv_temp
        weights = np.exp(scaled)
        held = cands.ids[row, :count]
        held_mass = weights[held].sum()
        weights[held] = 0.0
        cdf = np.cumsum(weights)
        target = u * np.exp(cands.log_z[row]) - held_mass
        rest = weights > 0
        # The rest weighs nothing in float64 (only rounding sent u past the candidates):
        # the least likely candidate is where the CDF ends.
        token = (
            int(_invert_cdf(cdf[None], np.array([target]), rest[None])[0]) if rest.any()
            else int(held[-1])
        )
        cand_scaled = np.where(
            np.arange(cands.ids.shape[1]) < count,
            (cands.logits[row].astype(np.float64) - peak) * inv_temp, -np.inf,
        )
        choices.append(
            _choice(token, scaled[token], cands.ids[row], cand_scaled, cands.log_z[row], n_top)
        )
    return choices


def _choose(logits: np.ndarray, rows: _RowParams, uniforms: np.ndarray) -> list[TokenChoice]:
    """Choose from whole (penalized, finite) rows: the path of the rows whose candidates
    could not decide them, every one filtered (top-k, top-p or min-p)."""
    n = logits.shape[0]
    best = np.argmax(logits, axis=1)
    peak = logits[np.arange(n), best].astype(np.float64)
    sampled = ~rows.greedy
    wants_logprobs = rows.n_top >= 0
    # top-p over the whole vocabulary: its nucleus is a share of the partition function.
    nucleus = sampled & (rows.top_k == 0) & (rows.top_p < 1)
    tokens = best.copy()
    log_z = np.zeros(n)
    # A top-p row without top-k gets its partition function from `_nucleus_pass`.
    z_rows = np.flatnonzero(wants_logprobs & ~nucleus)
    if z_rows.size:
        log_z[z_rows] = np.log(block_sums(logits, z_rows, peak, rows.inv_temp).sum(axis=1))

    table_rows = np.flatnonzero(sampled | wants_logprobs)
    if not table_rows.size:
        return _token_choices(logits, tokens, peak, rows, log_z, None)
    sample = sorted_sample(logits, table_rows)
    wide = np.zeros(n, dtype=bool)
    in_nucleus = nucleus[table_rows]
    if in_nucleus.any():
        nucleus_rows, nucleus_sample = table_rows[in_nucleus], sample[in_nucleus]
        nuclei = _nucleus_pass(logits, nucleus_rows, nucleus_sample, peak, rows)
        log_z[nucleus_rows] = nuclei.log_z
        if nuclei.wide.any():
            wide_rows = nucleus_rows[nuclei.wide]
            wide[wide_rows] = True
            tokens[wide_rows] = _draw_from_wide_nuclei(
                logits, wide_rows, nuclei, nucleus_sample[nuclei.wide], peak, rows, log_z,
                uniforms,
            )
    # A wide nucleus's row stays in the table only for its logprobs, without its filters.
    in_table = ~wide[table_rows] | wants_logprobs[table_rows]
    table_params = rows._replace(
        top_p=np.where(wide, 1.0, rows.top_p), log_min_p=np.where(wide, -np.inf, rows.log_min_p)
    )
    table = None
    if in_table.any():
        table = _candidate_table(
            logits, table_rows[in_table], sample[in_table], peak, table_params, log_z
        )
        drawn = sampled[table.rows] & ~wide[table.rows]
        if drawn.any():
            tokens[table.rows[drawn]] = _draw_from_table(table, drawn, rows, log_z, uniforms)
    return _token_choices(logits, tokens, peak, rows, log_z, table)


class _Candidates(NamedTuple):
    """Each table row's most likely tokens, most likely first (ties: lowest id first)."""

    rows: np.ndarray  # (r,) the batch row of each table row
    ids: np.ndarray  # (r, w) token ids
    scaled: np.ndarray  # (r, w) (logit - peak) / T, float64; -inf past `count`
    count: np.ndarray  # (r,) real entries per table row


def _candidate_table(
    logits: np.ndarray,
    table_rows: np.ndarray,
    sample: np.ndarray,
    peak: np.ndarray,
    rows: _RowParams,
    log_z: np.ndarray,
) -> _Candidates:
    """The tokens above a per-row threshold, lowered until the table decides every row:
    it holds top-k's k tokens, the logprobs' n, min-p's survivors and top-p's nucleus.
    `sample` is the rows' `sorted_sample`."""
    vocab = logits.shape[1]
    stride = stride_of(vocab)
    inv_temp = rows.inv_temp[table_rows]
    top_k = rows.top_k[table_rows]
    row_peak = peak[table_rows]
    # min-p's survivors are exactly the tokens at or above this logit.
    min_p_floor = row_peak + rows.log_min_p[table_rows] / inv_temp
    # Without top-k, a min-p row's survivors all lie above its floor: take them all at once.
    highest_start = np.where((top_k == 0) & (min_p_floor > -np.inf), min_p_floor, np.inf)
    need = np.maximum(np.maximum(top_k, rows.n_top[table_rows]), 1)
    # Rows whose top-p is over the whole vocabulary: the table must hold the nucleus's mass.
    nucleus = (top_k == 0) & (rows.top_p[table_rows] < 1)
    nucleus_mass = np.where(nucleus, rows.top_p[table_rows] * np.exp(log_z[table_rows]), 0.0)
    wanted = CANDIDATE_MARGIN * np.maximum(need, np.where(nucleus, _NUCLEUS_GUESS, 0))
    threshold_at = np.ceil(wanted / stride).astype(np.int64)

    slot_of = np.zeros(logits.shape[0], dtype=np.int64)  # batch row -> table row
    slot_of[table_rows] = np.arange(table_rows.size)
    decided_parts = []
    count = np.zeros(table_rows.size, dtype=np.int64)
    pending = np.ones(table_rows.size, dtype=bool)
    threshold = np.empty(table_rows.size)
    while pending.any():
        # About `threshold_at * stride` tokens of a row lie above this sampled logit.
        at = sampled_logit(sample, sample.shape[1] - threshold_at)
        guess = np.minimum(at, highest_start)
        threshold[pending] = guess[pending]
        bound = np.full(logits.shape[0], np.inf)  # decided rows keep what they gathered
        bound[table_rows[pending]] = threshold[pending]
        batch_row, ids = tokens_above(logits, bound)
        table_row = slot_of[batch_row]
        values = logits.reshape(-1)[batch_row * vocab + ids]
        count = np.where(pending, np.bincount(table_row, minlength=count.size), count)
        weights = np.exp((values - row_peak[table_row]) * inv_temp[table_row])
        missing = nucleus_mass - np.bincount(table_row, weights=weights, minlength=count.size)
        short = (count < need) | ((missing > 0) & (threshold > min_p_floor))
        decided = pending & ~(short & (threshold > -np.inf))
        chosen = decided[table_row]
        decided_parts.append((table_row[chosen], ids[chosen], values[chosen]))
        pending &= ~decided
        # Every token below a threshold weighs less than one at it, so a nucleus short of
        # mass needs at least `missing / that weight` more tokens: a wide nucleus (hot
        # temperature, top_p near 1) of tens of thousands is reached in a few widenings.
        weight_at_threshold = np.exp((threshold - row_peak) * inv_temp)
        # A weight of 0 (or one so small the quotient overflows): inf more.
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            more = np.where(missing > 0, missing / weight_at_threshold, 0.0)
        at_least = np.minimum(_WIDEN_MARGIN * (count + more), vocab)
        wider = np.maximum(threshold_at * _WIDEN_FACTOR, np.ceil(at_least / stride))
        threshold_at = np.where(pending, wider, threshold_at).astype(np.int64)
    table_row, ids, values = (np.concatenate(part) for part in zip(*decided_parts))
    sorted_ids, sorted_logits = sort_by_likelihood(table_row, ids, values, count)
    scaled = (sorted_logits - peak[table_rows, None]) * rows.inv_temp[table_rows, None]
    return _Candidates(rows=table_rows, ids=sorted_ids.astype(np.int64), scaled=scaled,
                       count=count)


def _draw_from_table(
    table: _Candidates,
    drawn: np.ndarray,
    rows: _RowParams,
    log_z: np.ndarray,
    uniforms: np.ndarray,
) -> np.ndarray:
    """Apply top-k, top-p and min-p to the `drawn` table rows and sample their survivors."""
    batch_rows = table.rows[drawn]
    scaled = table.scaled[drawn]
    width = scaled.shape[1]
    weights = np.exp(scaled)
    cdf = np.cumsum(weights, axis=1)
    top_k = rows.top_k[batch_rows]
    keep_k = np.where(top_k > 0, top_k, width)
    # top-p's mass is relative to the top-k survivors, or to the whole vocabulary without top-k.
    k_mass = np.take_along_axis(cdf, (np.minimum(keep_k, width) - 1)[:, None], axis=1)[:, 0]
    total = np.where(top_k > 0, k_mass, np.exp(log_z[batch_rows]))
    top_p = rows.top_p[batch_rows]
    keep_p = np.where(top_p < 1, (cdf < (top_p * total)[:, None]).sum(axis=1) + 1, width)
    keep_min_p = (scaled >= rows.log_min_p[batch_rows, None]).sum(axis=1)
    keep = np.maximum(np.minimum(np.minimum(keep_k, keep_p), keep_min_p), 1)
    allowed = (np.arange(width) < keep[:, None]) & (weights > 0)
    survivors_mass = np.take_along_axis(cdf, (keep - 1)[:, None], axis=1)[:, 0]
    target = uniforms[batch_rows] * survivors_mass
    column = _invert_cdf(cdf, target, allowed)
    return np.take_along_axis(table.ids[drawn], column[:, None], axis=1)[:, 0]


def _token_choices(
    logits: np.ndarray,
    tokens: np.ndarray,
    peak: np.ndarray,
    rows: _RowParams,
    log_z: np.ndarray,
    table: _Candidates | None,
) -> list[TokenChoice]:
    n = tokens.size
    chosen = (logits[np.arange(n), tokens] - peak) * rows.inv_temp
    logprob = (chosen - log_z).tolist()
    top: list[tuple[tuple[int, float], ...] | None] = [None] * n
    if table is not None:
        top_logprob = table.scaled - log_z[table.rows, None]
        for slot, row in enumerate(table.rows.tolist()):
            if rows.n_top[row] >= 0:
                shown = min(int(rows.n_top[row]), int(table.count[slot]))
                top[row] = tuple(
                    zip(table.ids[slot, :shown].tolist(), top_logprob[slot, :shown].tolist())
                )
    return [
        TokenChoice(
            token=token,
            logprob=logprob[i] if rows.n_top[i] >= 0 else None,
            top_logprobs=top[i],
        )
        for i, token in enumerate(tokens.tolist())
    ]
