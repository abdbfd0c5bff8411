"""`choose_tokens`: a step's whole pipeline on full rows in one call (penalties, candidates,
choice), as the engine runs it across the backend and the sampler actor; the reference for
tests and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from actors.compute.contract import apply_penalties, apply_token_masks, top_candidates
from actors.errors import ComputeError
from actors.sampling.from_candidates import start_choice
from actors.sampling.state import RowFailed, SequenceSampling, TokenChoice
from actors.sampling.whole_row import finish_choice


def choose_tokens(
    logits: np.ndarray, states: Sequence[SequenceSampling]
) -> list[TokenChoice | RowFailed]:
    """Choose one token per row of `logits` (n, vocab) for the n sequences of `states`: the
    whole pipeline of a step on full rows (penalties, candidates, choice), as the engine runs
    it across the backend and the sampler actor. Does not `record` the choices (the caller
    keeps or drops them); `logits` is left as it was given."""
    logits = _checked_logits(logits, states)
    if not states:
        return []
    inputs = [s.row_inputs() for s in states]
    changed = any(r.repeated or r.generated or r.allowed is not None for r in inputs)
    penalized = logits.copy() if changed else logits
    apply_token_masks(penalized, inputs)
    apply_penalties(penalized, inputs)
    candidates = top_candidates(penalized, inputs)
    pending = start_choice(candidates, states)
    if not pending.needed_rows:
        return list(pending.choices)
    return finish_choice(pending, penalized[list(pending.needed_rows)], states)


def _checked_logits(logits: np.ndarray, states: Sequence[SequenceSampling]) -> np.ndarray:
    logits = np.ascontiguousarray(logits, dtype=np.float32)  # no copy when it already is
    vocab_sizes = {s.vocab_size for s in states}
    if logits.ndim != 2 or logits.shape[0] != len(states) or len(vocab_sizes) > 1:
        raise ComputeError(
            f"logits of shape {logits.shape} do not match {len(states)} sequences "
            f"of vocabulary sizes {sorted(vocab_sizes)}"
        )
    if vocab_sizes and logits.shape[1] != vocab_sizes.pop():
        raise ComputeError(
            f"logits rows have {logits.shape[1]} entries but the sequences' vocabulary "
            f"has {states[0].vocab_size} tokens"
        )
    return logits
