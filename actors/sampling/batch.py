"""What the paths of a step's choice share: the batch's SamplingParams as arrays, one entry
per row, the inversion of per-row CDFs and how much each widening asks for."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from actors.sampling.state import SequenceSampling

# Each widening (of a candidate table's threshold, of a wide nucleus's bracket) asks for at
# least this many times more tokens.
_WIDEN_FACTOR = 2


class _RowParams(NamedTuple):
    """The batch's SamplingParams as arrays, one entry per row."""

    greedy: np.ndarray  # bool
    inv_temp: np.ndarray  # 1 / T; 1 for greedy rows (their logprobs use T = 1)
    top_k: np.ndarray  # 0 = off, else clamped to the vocabulary
    top_p: np.ndarray
    log_min_p: np.ndarray  # -inf = off
    n_top: np.ndarray  # top logprobs wanted; -1 = no logprobs

    @classmethod
    def of(cls, states: Sequence[SequenceSampling]) -> _RowParams:
        params = [s.params for s in states]
        vocab = states[0].vocab_size

        def column(name: str) -> np.ndarray:
            return np.array([getattr(p, name) for p in params], dtype=np.float64)

        greedy = np.array([s.greedy for s in states], dtype=bool)
        with np.errstate(divide="ignore"):
            log_min_p = np.log(column("min_p"))
        # Filters mean nothing to a greedy row: switching them off keeps its logprobs simple.
        return cls(
            greedy=greedy,
            inv_temp=np.array([s.inv_temp for s in states], dtype=np.float64),
            top_k=np.where(greedy, 0, np.minimum(column("top_k"), vocab)).astype(np.int64),
            top_p=np.where(greedy, 1.0, column("top_p")),
            log_min_p=np.where(greedy, -np.inf, log_min_p),
            n_top=np.array([-1 if p.logprobs is None else p.logprobs for p in params]),
        )

    def subset(self, rows: np.ndarray) -> _RowParams:
        return _RowParams(*(column[rows] for column in self))


def _invert_cdf(cdf: np.ndarray, target: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Per row, the first column whose cumulative weight exceeds `target`; rounding past the
    end lands on the row's last allowed column (each row has at least one)."""
    position = (cdf <= target[:, None]).sum(axis=1)
    last_allowed = allowed.shape[1] - 1 - np.argmax(allowed[:, ::-1], axis=1)
    return np.minimum(position, last_allowed)
