"""The candidates path: `start_choice` decides every row of a step that its candidates can
decide, and names the rows that need their whole row (`actors.sampling.whole_row`).

When a row's candidates decide it: greedy rows always; top-k rows whose k they hold; top-p
rows whose nucleus mass they reach; min-p rows whose floor they cross; unfiltered rows whose
uniform lands within their mass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from actors.compute.contract import Candidates
from actors.errors import ComputeError
from actors.sampling.batch import _invert_cdf, _RowParams
from actors.sampling.state import RowFailed, SequenceSampling, TokenChoice


class PendingChoice(msgspec.Struct, frozen=True, kw_only=True):
    """A step's choices as far as its candidates go: None where `needed_rows` (positions in
    the step's rows) need their whole row. Carries the rows' uniforms, drawn once."""

    choices: tuple[TokenChoice | RowFailed | None, ...]
    needed_rows: tuple[int, ...]
    uniforms: Any  # np.ndarray (rows,), 0 for rows that do not sample
    candidates: Candidates


def draw_uniforms(states: Sequence[SequenceSampling], drawn: np.ndarray) -> np.ndarray:
    """Exactly one uniform per drawn row, from the row's own Generator: its stream never
    depends on the batch, on the row's path or on how many widening rounds it needed."""
    return np.array([s.rng.random() if draw else 0.0 for s, draw in zip(states, drawn)])


def start_choice(candidates: Candidates, states: Sequence[SequenceSampling]) -> PendingChoice:
    """Decide every row its candidates can decide (see the module docstring)."""
    n = len(states)
    if candidates.ids.shape[0] != n:
        raise ComputeError(f"{candidates.ids.shape[0]} candidate rows for {n} sequences")
    if all(state.greedy for state in states):
        return _greedy_choice(candidates, states)
    rows = _RowParams.of(states)
    peak = candidates.logits[:, 0].astype(np.float64)
    finite = np.isfinite(peak)
    uniforms = draw_uniforms(states, ~rows.greedy & finite)
    width = candidates.ids.shape[1]
    count = candidates.count.astype(np.int64)
    real = np.arange(width) < count[:, None]
    with np.errstate(invalid="ignore"):
        scaled = np.where(
            real, (candidates.logits - peak[:, None]) * rows.inv_temp[:, None], -np.inf
        )
    weights = np.exp(scaled)
    cdf = np.cumsum(weights, axis=1)
    log_z = candidates.log_z
    z = np.exp(log_z)
    vocab = states[0].vocab_size

    sampled = ~rows.greedy
    whole_vocab = count >= vocab
    k_held = (rows.top_k > 0) & (rows.top_k <= count)
    no_top_k = rows.top_k == 0
    unfiltered = sampled & no_top_k & (rows.top_p >= 1) & ~np.isfinite(rows.log_min_p)
    mass_held = cdf[np.arange(n), count - 1]
    with np.errstate(invalid="ignore"):
        nucleus_held = no_top_k & (rows.top_p < 1) & (mass_held >= rows.top_p * z)
        floor_crossed = no_top_k & (scaled[np.arange(n), count - 1] < rows.log_min_p)
        uniform_held = unfiltered & (uniforms * z < mass_held)
    decided = finite & (
        ~sampled | whole_vocab | k_held | nucleus_held | floor_crossed | uniform_held
    )
    tokens = candidates.ids[:, 0].astype(np.int64)
    drawn = np.flatnonzero(decided & sampled)
    if drawn.size:
        tokens[drawn] = _draw_from_candidates(
            candidates.ids[drawn], cdf[drawn], scaled[drawn], count[drawn], z[drawn],
            rows.subset(drawn), uniforms[drawn], unfiltered[drawn] & ~whole_vocab[drawn],
        )
    token_scaled = scaled[np.arange(n), np.argmax(candidates.ids == tokens[:, None], axis=1)]
    choices: list[TokenChoice | RowFailed | None] = [None] * n
    for row in np.flatnonzero(decided).tolist():
        choices[row] = _choice(
            int(tokens[row]), token_scaled[row], candidates.ids[row], scaled[row], log_z[row],
            rows.n_top[row],
        )
    for row in np.flatnonzero(~finite):
        choices[row] = RowFailed(error=f"the logits row holds {peak[row]} values")
    return PendingChoice(
        choices=tuple(choices),
        needed_rows=tuple(np.flatnonzero(finite & ~decided).tolist()),
        uniforms=uniforms,
        candidates=candidates,
    )


def _greedy_choice(candidates: Candidates, states: Sequence[SequenceSampling]) -> PendingChoice:
    """`start_choice` for a batch of greedy rows only, which their candidates always decide:
    each row's first candidate (its argmax), without the sampled rows' arrays."""
    n = len(states)
    peak = candidates.logits[:, 0].astype(np.float64)
    finite = np.isfinite(peak).tolist()
    tokens = candidates.ids[:, 0].tolist()
    choices: list[TokenChoice | RowFailed | None] = []
    for row, state in enumerate(states):
        if not finite[row]:
            choices.append(RowFailed(error=f"the logits row holds {peak[row]} values"))
        elif state.params.logprobs is None:
            choices.append(TokenChoice(token=tokens[row]))
        else:  # greedy rows weigh their candidates at T = 1
            real = np.arange(candidates.ids.shape[1]) < candidates.count[row]
            scaled = np.where(real, candidates.logits[row] - peak[row], -np.inf)
            choices.append(_choice(tokens[row], scaled[0], candidates.ids[row], scaled,
                                   candidates.log_z[row], state.params.logprobs))
    return PendingChoice(
        choices=tuple(choices), needed_rows=(), uniforms=np.zeros(n), candidates=candidates
    )


def _draw_from_candidates(
    ids: np.ndarray,
    cdf: np.ndarray,
    scaled: np.ndarray,
    count: np.ndarray,
    z: np.ndarray,
    rows: _RowParams,
    uniforms: np.ndarray,
    unfiltered: np.ndarray,
) -> np.ndarray:
    """Apply top-k, top-p and min-p within each row's candidates and sample the survivors;
    an unfiltered row's uniform is a share of the whole vocabulary's mass `z`."""
    width = cdf.shape[1]
    keep_k = np.where(rows.top_k > 0, np.minimum(rows.top_k, count), count)
    # top-p's mass is relative to the top-k survivors, or to the whole vocabulary without top-k.
    k_mass = np.take_along_axis(cdf, (keep_k - 1)[:, None], axis=1)[:, 0]
    total = np.where(rows.top_k > 0, k_mass, z)
    keep_p = np.where(
        rows.top_p < 1, (cdf < (rows.top_p * total)[:, None]).sum(axis=1) + 1, width
    )
    keep_min_p = (scaled >= rows.log_min_p[:, None]).sum(axis=1)
    keep = np.maximum(np.minimum(np.minimum(keep_k, keep_p), keep_min_p), 1)
    survivors_mass = np.take_along_axis(cdf, (keep - 1)[:, None], axis=1)[:, 0]
    target = uniforms * np.where(unfiltered, z, survivors_mass)
    allowed = (np.arange(width) < keep[:, None]) & (scaled > -np.inf)
    column = _invert_cdf(cdf, target, allowed)
    return np.take_along_axis(ids, column[:, None], axis=1)[:, 0].astype(np.int64)


def _choice(
    token: int,
    token_scaled: float,
    ids: np.ndarray,
    scaled: np.ndarray,
    log_z: float,
    n_top: int,
) -> TokenChoice:
    """A row's TokenChoice, with its logprobs from its candidates when asked for."""
    if n_top < 0:
        return TokenChoice(token=token)
    top = tuple(zip(ids[:n_top].tolist(), (scaled[:n_top] - log_z).tolist()))
    return TokenChoice(token=token, logprob=float(token_scaled - log_z), top_logprobs=top)
