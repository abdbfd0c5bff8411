"""Token choice: each row's candidates + its sequence's SamplingParams -> the next tokens.

The backend hands over, per logits row, its most likely tokens after the penalties and the
row's log-partition value (see actors.model.candidates); most rows are decided from those
alone. A row its candidates cannot decide asks for its whole (penalized) row, and only that
row crosses: `start_choice` decides what it can and names the rows it needs,
`finish_choice` decides those from their rows. `choose_tokens` runs the whole pipeline on
full rows (the reference for tests and benchmarks); `SamplerActor` runs it for the engine.

One row goes through (the Hugging Face / vLLM order):

1. penalties on the raw logits (applied by the backend: repetition over the distinct tokens
   of the last `repetition_window` of prompt + generated, then presence and frequency over
   the generated tokens);
2. temperature: `l / T`; T = 0 (or below 1e-5) is greedy: the argmax of the penalized logits,
   lowest id on ties;
3. top-k; then top-p over the distribution renormalized to the top-k survivors (to the whole
   vocabulary when top_k is 0); then min-p: keep tokens at least `min_p` times as likely as the
   most likely one. The most likely token always survives;
4. one uniform from the sequence's own Generator, inverted through the survivors' CDF, so a
   seeded sequence gets the same tokens whatever else shares its batch. The CDF runs most
   likely first (ties by id); an unfiltered row's runs through its candidates first, then the
   rest of the vocabulary in id order (so only a uniform past the candidates' mass needs the
   row); a top-p nucleus too wide to sort is inverted in vocabulary order (see Cost). Which
   order a row uses depends on its own logits and params alone.

When a row's candidates decide it: greedy rows always; top-k rows whose k they hold; top-p
rows whose nucleus mass they reach; min-p rows whose floor they cross; unfiltered rows whose
uniform lands within their mass.

Logprobs are the log-softmax, over the whole vocabulary, of step 2's distribution (penalties and
temperature applied, before top-k/top-p/min-p); greedy rows use T = 1, i.e. the penalized model
distribution.

Cost of a whole row (`finish_choice`): rows never sort a whole row: a strided sample of each row
guesses a logit threshold, one comparison pass gathers the tokens above it into a small sorted
candidate table, and a row's threshold is lowered only while its table cannot decide it exactly
(fewer than top_k or logprobs tokens, or less mass than top-p's nucleus). A top-p nucleus
without top-k that the sample guesses wider than a few thousand tokens (a hot temperature, top_p
near 1) is neither gathered nor sorted: an exp pass sums its row's weights above a bracket
of logits around the guessed cutoff by blocks and gathers the few tokens inside the bracket;
sorting only those finds the cutoff token exactly, and the row is drawn in vocabulary order
from its survivors' block sums. A bracket that misses the cutoff is widened, for one more pass
over its row.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

import msgspec
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.compute.actor import LoopPortal, receive_from_loop, run_in_own_thread, send_to_loop
from actors.compute.contract import (
    Candidates,
    RowInputs,
    apply_penalties,
    apply_token_masks,
    top_candidates,
)
from actors.errors import ComputeError, InvalidRequest
from actors.model.candidates import (
    BLOCK,
    CANDIDATE_MARGIN,
    block_sums,
    sampled_logit,
    sort_by_likelihood,
    sorted_sample,
    stride_of,
    tokens_above,
    weighed_chunks,
)
from actors.model.candidates import n_blocks as block_count
from actors.params import SamplingParams
from actors.structured import Constraint, advance_constraints

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
# A top-p row without top-k first assumes its nucleus has at most this many tokens.
_NUCLEUS_GUESS = 128
# Each widening asks for at least this many times more candidates, and this many times what
# a nucleus short of mass is known to lack.
_WIDEN_FACTOR = 2
_WIDEN_MARGIN = 2
# A top-p row without top-k whose nucleus is guessed to hold more than about this many tokens
# is drawn without sorting its nucleus (`_draw_from_wide_nuclei`): past it, sorting costs more
# than the bracket of the cutoff that it sorts instead.
_WIDE_NUCLEUS = 2048
# A wide nucleus's cutoff is looked for between the sampled logits this many sample positions
# either side of the guessed one: about 2 * this * stride tokens to sort. Wider costs more in
# every row than the rows whose guess was further off (on gemma3's hot rows, one in seven)
# lose to a second bracket.
_BRACKET = 16


class TokenChoice(msgspec.Struct, frozen=True):
    """The token chosen for one row, and its logprobs when the request asked for them; for a
    constrained row, the tokens its grammar forces after it (they join the sequence without
    a decode step each) and whether the grammar is complete."""

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    forced: tuple[int, ...] = ()
    done: bool = False


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
        """Its token is its row's first candidate and nothing is left to do after: a greedy
        row without a constraint (a constraint's next mask is computed in the sampler's
        thread, never on the event loop)."""
        return self.greedy and self.constraint is None

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
        return RowInputs(
            candidates=candidates,
            mass=mass,
            max_candidates=MAX_CANDIDATES if mass else candidates,
            inv_temp=self.inv_temp,
            want_log_z=want_log_z,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
        )

    def _checked(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise InvalidRequest(
                f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})",
                field="token_id",
            )
        return int(token_id)


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


# --- choosing from candidates ---------------------------------------------------------------


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


def _invert_cdf(cdf: np.ndarray, target: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Per row, the first column whose cumulative weight exceeds `target`; rounding past the
    end lands on the row's last allowed column (each row has at least one)."""
    position = (cdf <= target[:, None]).sum(axis=1)
    last_allowed = allowed.shape[1] - 1 - np.argmax(allowed[:, ::-1], axis=1)
    return np.minimum(position, last_allowed)


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


# --- the actor --------------------------------------------------------------------------------


class SampleStep(msgspec.Struct, frozen=True, kw_only=True):
    """One step's candidates and, row by row, the sampling state of the sequence each row
    belongs to."""

    step_id: int
    candidates: Candidates
    samplers: tuple[Any, ...]  # SequenceSampling


class RowsWanted(msgspec.Struct, frozen=True, kw_only=True):
    """The candidates could not decide these rows: the scheduler fetches their whole rows
    from the backend and answers `SampleRows` with them."""

    step_id: int
    pending: PendingChoice


class SampleRows(msgspec.Struct, frozen=True, kw_only=True):
    """The rows a `RowsWanted` asked for (float32 (rows, vocab), penalized, in its order)."""

    step_id: int
    pending: PendingChoice
    logits: Any  # np.ndarray
    samplers: tuple[Any, ...]  # SequenceSampling, as in the step's SampleStep


class StepSampled(msgspec.Struct, frozen=True, kw_only=True):
    """One choice per row of the step, in row order; each TokenChoice is recorded in its
    sequence, a RowFailed fails only its own sequence's step."""

    step_id: int
    choices: tuple[TokenChoice | RowFailed, ...]


class SamplingFailed(msgspec.Struct, frozen=True, kw_only=True):
    """The sampler raised; nothing was recorded and the whole step counts as failed."""

    step_id: int
    error: str


class SamplerActor:
    """Chooses and records each step's tokens in one dedicated thread of its own.

    Off the event loop because deciding a batch of rows takes milliseconds, which the
    sessions' streaming would otherwise wait behind. A dedicated thread rather than a pooled
    worker per step: it is joined when the engine closes (no pooled thread outlives the
    engine), and no other user of the default thread limiter can make a step wait for a slot.
    """

    def __init__(
        self,
        inbox: MemoryObjectReceiveStream[SampleStep | SampleRows],
        outbox: MemoryObjectSendStream[StepSampled | RowsWanted | SamplingFailed],
    ) -> None:
        self._inbox = inbox
        self._outbox = outbox

    async def run(self) -> None:
        """The actor task: until the inbox closes (or the engine is cancelled)."""
        with self._inbox, self._outbox:
            async with LoopPortal() as portal:
                await run_in_own_thread("q4k-sampler", partial(self._serve, portal))

    def _serve(self, portal: LoopPortal) -> None:
        while (message := receive_from_loop(portal, self._inbox)) is not None:
            if not send_to_loop(portal, self._outbox, sample(message)):
                return


def sample(message: SampleStep | SampleRows) -> StepSampled | RowsWanted | SamplingFailed:
    """Choose what can be chosen (recording the step's tokens once all are chosen), or ask
    for the rows still needed; any failure is an answer, never a crash."""
    try:
        if isinstance(message, SampleStep):
            pending = start_choice(message.candidates, message.samplers)
            if pending.needed_rows:
                return RowsWanted(step_id=message.step_id, pending=pending)
            choices = list(pending.choices)
        else:
            choices = finish_choice(message.pending, message.logits, message.samplers)
        _advance_constraints(message.samplers, choices)
        for sampler, choice in zip(message.samplers, choices):
            if isinstance(choice, TokenChoice):
                for token in (choice.token, *choice.forced):
                    sampler.record(token)
    except Exception as exc:
        return SamplingFailed(step_id=message.step_id, error=f"{type(exc).__name__}: {exc}")
    return StepSampled(step_id=message.step_id, choices=tuple(choices))


def _advance_constraints(
    samplers: Sequence[SequenceSampling], choices: list[TokenChoice | RowFailed]
) -> None:
    """Feed each constrained row's chosen token to its constraint, in place in `choices`:
    the tokens it forces then, whether it is complete, or a failed row if it refused."""
    rows = [row for row, (sampler, choice) in enumerate(zip(samplers, choices))
            if sampler.constraint is not None and isinstance(choice, TokenChoice)]
    if not rows:
        return
    advanced = advance_constraints(
        [samplers[row].constraint for row in rows], [choices[row].token for row in rows]
    )
    for row, result in zip(rows, advanced):
        choices[row] = (
            RowFailed(error=result.error) if result.error is not None else
            msgspec.structs.replace(choices[row], forced=result.forced, done=result.done)
        )


__all__ = [
    "PendingChoice",
    "RowFailed",
    "RowsWanted",
    "SampleRows",
    "SampleStep",
    "SamplerActor",
    "SamplingFailed",
    "SequenceSampling",
    "StepSampled",
    "TokenChoice",
    "choose_tokens",
    "finish_choice",
    "sample",
    "start_choice",
]
