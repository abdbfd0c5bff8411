"""One sequence's sampling state (its params, seeded Generator, token history, constraint and
what its next logits row needs from the backend) and what a row's choice comes to: a
TokenChoice, or a RowFailed that fails only its own sequence's step."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

import msgspec
import numpy as np

from actors.compute.contract import RowInputs
from actors.errors import InvalidRequest
from actors.params import SamplingParams
from actors.structured import Constraint

# Temperatures below this are greedy (as in vLLM): 1 / T would overflow float32 long before 0.
_GREEDY_BELOW = 1e-5
# Candidates a sampled row without top-k asks for at least (a top-p row: and its nucleus).
DEFAULT_CANDIDATES = 64
# The most candidates a row asks for (8 KB, under 1% of a gemma-3 row's 1 MB); a larger top_k
# or nucleus is decided from the whole row.
MAX_CANDIDATES = 1024
# An unfiltered row's candidates hold this much of its probability: only a uniform past it
# needs the whole row.
UNFILTERED_MASS = 0.99


class TokenChoice(msgspec.Struct, frozen=True):
    """The token chosen for one row, and its logprobs when the request asked for them."""

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


class RowFailed(msgspec.Struct, frozen=True):
    """No token could be chosen for this row (its logits are NaN or infinite); only its
    sequence's step failed."""

    error: str


class SequenceSampling:
    """One sequence's sampling state: its params, its own random Generator, the token history
    its penalties look at and its structured-output constraint, if any. The caller `record`s
    every token it keeps."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        vocab_size: int,
        constraint: Constraint | None = None,
    ) -> None:
        params.validate(vocab_size)
        self.params = params
        self.constraint = constraint
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(params.seed)
        self.greedy = params.temperature < _GREEDY_BELOW
        # 1 / T; 1 for greedy rows (their logprobs use T = 1).
        self.inv_temp = 1.0 if self.greedy else 1.0 / params.temperature
        window = params.repetition_window if params.repetition_penalty != 1.0 else 0
        tail = prompt_ids[max(0, len(prompt_ids) - window) :] if window else ()
        self._recent = deque((self._checked(t) for t in tail), maxlen=window)
        self._counts_generated = params.presence_penalty != 0 or params.frequency_penalty != 0
        self._generated: Counter[int] = Counter()
        self._inputs = self._fixed_inputs()

    def record(self, token_id: int) -> None:
        """Add a generated token to the history the penalties see."""
        token_id = self._checked(token_id)
        self._recent.append(token_id)
        if self._counts_generated:
            self._generated[token_id] += 1

    def recent_tokens(self) -> np.ndarray:
        """The repetition window (empty when the repetition penalty is off)."""
        return np.fromiter(self._recent, dtype=np.int64, count=len(self._recent))

    def generated_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """Distinct generated tokens and their counts (empty when presence and frequency
        penalties are off)."""
        ids = np.fromiter(self._generated.keys(), dtype=np.int64, count=len(self._generated))
        counts = np.fromiter(self._generated.values(), dtype=np.int64, count=len(self._generated))
        return ids, counts

    @property
    def decided_inline(self) -> bool:
        """Its token is its row's first candidate: a greedy row (a constraint then takes the
        token in a constraint worker's thread, never on the event loop)."""
        return self.greedy

    def row_inputs(self) -> RowInputs:
        """What the backend needs for this sequence's next logits row: its allowed tokens
        and penalties as they stand, how many candidates the sampler will look at and
        whether it needs log_z."""
        inputs = self._inputs
        if self.constraint is not None:
            inputs = msgspec.structs.replace(inputs, allowed=self.constraint.allowed)
        if not self._recent and not self._generated:
            return inputs
        return msgspec.structs.replace(
            inputs,
            repeated=tuple(dict.fromkeys(self._recent)),
            generated=tuple(self._generated),
            generated_counts=tuple(self._generated.values()),
        )

    def _fixed_inputs(self) -> RowInputs:
        params = self.params
        n_top = params.logprobs or 0
        mass = 0.0
        if self.greedy:
            candidates, want_log_z = max(1, n_top), params.logprobs is not None
        else:
            wanted = params.top_k if params.top_k else DEFAULT_CANDIDATES
            candidates = min(max(wanted, n_top), MAX_CANDIDATES, self.vocab_size)
            # top-k's survivors are weighed among themselves; everything else needs Z.
            want_log_z = params.logprobs is not None or not 0 < params.top_k <= candidates
            if not params.top_k:
                # A top-p row asks for its nucleus; a min-p row for most of its mass, which
                # its floor usually cuts.
                mass = UNFILTERED_MASS if params.top_p >= 1 else params.top_p
        bias = sorted((params.logit_bias or {}).items())
        return RowInputs(
            candidates=candidates,
            mass=mass,
            max_candidates=MAX_CANDIDATES if mass else candidates,
            inv_temp=self.inv_temp,
            want_log_z=want_log_z,
            greedy=self.greedy,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            bias_tokens=tuple(token for token, _ in bias),
            bias_values=tuple(float(value) for _, value in bias),
        )

    def _checked(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise InvalidRequest(
                f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})",
                field="token_id",
            )
        return int(token_id)
