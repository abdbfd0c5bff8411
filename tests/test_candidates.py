"""Token candidates instead of whole rows: the backend's numpy reference (penalties, top
candidates, log-partition) and the sampler deciding from candidates, fetching a whole row only
when they cannot decide it, with exactly the distribution the rules define."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from actors.errors import InvalidRequest
from actors.model.candidates import RowInputs, apply_penalties, top_candidates
from actors.params import SamplingParams
from actors.sampling import state as sampling_state
from actors.sampling import (
    RowFailed,
    SequenceSampling,
    TokenChoice,
    choose_tokens,
    finish_choice,
    start_choice,
)


def ranked(row: np.ndarray) -> np.ndarray:
    """Token ids most likely first, ties by lowest id."""
    return np.lexsort((np.arange(row.size), -row))


@pytest.mark.parametrize("vocab", [7, 1000, 262144])
def test_candidates_are_the_top_tokens_with_their_log_partition(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((6, vocab)) * 3).astype(np.float32)
    logits[1] = np.round(logits[1])  # many ties
    logits[2, : vocab // 2] = -np.inf
    asked = [1, 2, 16, 64, 128, 5000]
    rows = [RowInputs(candidates=k, want_log_z=i % 2 == 0, inv_temp=1 / 0.7)
            for i, k in enumerate(asked)]
    got = top_candidates(logits, rows)
    for i, k in enumerate(asked):
        k = min(k, vocab)
        order = ranked(logits[i])[:k]
        assert got.count[i] == k
        np.testing.assert_array_equal(got.ids[i, :k], order)
        np.testing.assert_array_equal(got.logits[i, :k], logits[i, order])
        assert (got.logits[i, k:] == -np.inf).all() and (got.ids[i, k:] == 0).all()
        if rows[i].want_log_z:
            scaled = (logits[i].astype(np.float64) - logits[i].max()) / 0.7
            assert got.log_z[i] == pytest.approx(np.log(np.exp(scaled).sum()), abs=1e-5)
        else:
            assert np.isnan(got.log_z[i])


def test_logit_biases_shift_exactly_their_tokens_after_the_penalties() -> None:
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((3, 200)) * 4).astype(np.float32)
    logits[2, 50] = -np.inf  # masked: a bias cannot bring it back
    rows = [
        RowInputs(bias_tokens=(3, 17, 199), bias_values=(-100.0, 2.5, 100.0)),
        RowInputs(),
        RowInputs(repetition_penalty=1.5, repeated=(17, 50), presence_penalty=0.5,
                  generated=(17,), generated_counts=(2,), bias_tokens=(17, 50),
                  bias_values=(-0.75, 100.0)),
    ]
    penalized = logits.copy()
    apply_penalties(penalized, [RowInputs(), RowInputs(), msgspec.structs.replace(
        rows[2], bias_tokens=(), bias_values=())])
    got = logits.copy()
    apply_penalties(got, rows)
    expected = penalized.copy()
    for row, inputs in enumerate(rows):
        for token, bias in zip(inputs.bias_tokens, inputs.bias_values):
            expected[row, token] = np.float32(np.float64(penalized[row, token]) + bias)
    np.testing.assert_array_equal(got, expected)
    assert got[2, 50] == -np.inf
    changed = np.argwhere(got != penalized)
    assert changed.tolist() == [[0, 3], [0, 17], [0, 199], [2, 17]]
    # +100 makes a token the only candidate a row has; -100 leaves it last.
    assert top_candidates(got, [RowInputs()] * 3).ids[0, 0] == 199
    assert ranked(got[0])[-1] == 3


def test_a_logit_bias_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(InvalidRequest) as error:
        apply_penalties(np.zeros((1, 10), np.float32),
                        [RowInputs(bias_tokens=(10,), bias_values=(1.0,))])
    assert error.value.field == "bias_tokens"


def test_a_row_that_is_not_finite_holds_only_its_argmax() -> None:
    logits = np.zeros((3, 50), dtype=np.float32)
    logits[1, 7] = np.nan
    logits[2, 9] = np.inf
    got = top_candidates(logits, [RowInputs(candidates=8, want_log_z=True)] * 3)
    assert got.count.tolist() == [8, 1, 1]
    assert np.isnan(got.logits[1, 0]) and got.logits[2, 0] == np.inf and got.ids[2, 0] == 9


def test_penalties_match_a_one_at_a_time_reference() -> None:
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((3, 40)) * 2).astype(np.float32)
    rows = [
        RowInputs(repetition_penalty=1.3, repeated=(1, 2, 3, 30)),
        RowInputs(presence_penalty=0.4, frequency_penalty=0.2, generated=(2, 5),
                  generated_counts=(1, 4)),
        RowInputs(repetition_penalty=0.8, repeated=(5,), presence_penalty=-0.5,
                  generated=(5, 6), generated_counts=(2, 1)),
    ]
    expected = logits.astype(np.float64)
    for row, inputs in zip(expected, rows):
        for token in inputs.repeated:
            penalty = inputs.repetition_penalty
            row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
        for token, count in zip(inputs.generated, inputs.generated_counts):
            row[token] -= inputs.presence_penalty + inputs.frequency_penalty * count
    apply_penalties(logits, rows)
    np.testing.assert_array_equal(logits, expected.astype(np.float32))


# --- the sampler on candidates -------------------------------------------------------------


def lm_rows(n: int, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, vocab)) * 2.5).astype(np.float32)


def engine_path(logits: np.ndarray, states: list[SequenceSampling]) -> tuple[list, int]:
    """Choose as the engine does across its actors: candidates, then whole rows only for the
    rows the sampler asks for. Returns the choices and how many rows crossed."""
    inputs = [s.row_inputs() for s in states]
    penalized = logits.copy()
    apply_penalties(penalized, inputs)
    pending = start_choice(top_candidates(penalized, inputs), states)
    if not pending.needed_rows:
        return list(pending.choices), 0
    rows = penalized[list(pending.needed_rows)]
    return finish_choice(pending, rows, states), len(pending.needed_rows)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05),
    ],
    ids=["greedy", "greedy+logprobs", "top_k", "top_k+top_p+min_p"],
)
def test_rows_the_candidates_decide_never_cross(params: SamplingParams) -> None:
    logits = lm_rows(64, 262144, seed=2)
    states = [SequenceSampling(params.__class__(**{**_fields(params), "seed": i}), [], 262144)
              for i in range(64)]
    choices, crossed = engine_path(logits, states)
    assert crossed == 0
    assert all(isinstance(choice, TokenChoice) for choice in choices)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__struct_fields__}


def test_a_seed_gives_the_same_tokens_whatever_else_is_in_the_batch() -> None:
    vocab = 5000
    logits = lm_rows(8, vocab, seed=3)
    hot = SamplingParams(temperature=1.5, top_p=0.99, seed=11)  # needs its whole row
    others = [SamplingParams(temperature=t, seed=s)
              for t, s in ((0.0, 1), (1.0, 2), (0.7, 3), (2.0, 4))]
    alone = [SequenceSampling(hot, [], vocab)]
    batch = [SequenceSampling(hot, [], vocab)] + [SequenceSampling(p, [], vocab) for p in others]
    for _ in range(5):
        solo, _ = engine_path(logits[:1], alone)
        mixed, _ = engine_path(np.concatenate([logits[:1], logits[1:5]]), batch)
        assert solo[0] == mixed[0]


def exact_distribution(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The probabilities the sampling rules give each token of `row` (float64)."""
    scaled = row.astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    order = ranked(row)
    keep = row.size
    if params.top_k:
        keep = min(params.top_k, keep)
    if params.top_p < 1:
        cumulative = np.cumsum(probs[order][:keep]) / probs[order][:keep].sum()
        keep = min(keep, int(np.searchsorted(cumulative, params.top_p)) + 1)
    if params.min_p > 0:
        keep = min(keep, int((probs[order] >= params.min_p * probs[order][0]).sum()))
    out = np.zeros(row.size)
    out[order[:keep]] = probs[order[:keep]]
    return out / out.sum()


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile for a normal quantile `z` (3.719: p = 1e-4), by Wilson and
    Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    ("params", "path"),
    [
        (SamplingParams(temperature=1.0), "both"),
        (SamplingParams(temperature=1.3, top_p=0.85), "rows"),
        (SamplingParams(temperature=0.3, top_p=0.5), "candidates"),
        # A nucleus of 5: past the 4 candidates a row asks for at least, within the cap of 8.
        (SamplingParams(temperature=0.4, top_p=0.7), "candidates"),
        # A nucleus of 9: the 8 candidates hold 87% of the mass, just short of it.
        (SamplingParams(temperature=0.4, top_p=0.9), "rows"),
        (SamplingParams(temperature=1.0, min_p=0.03), "rows"),
        (SamplingParams(temperature=0.5, min_p=0.6), "candidates"),
        (SamplingParams(temperature=0.9, top_k=6, top_p=0.9), "candidates"),
        (SamplingParams(temperature=1.0, top_k=30), "rows"),
        (SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.5,
                        presence_penalty=0.3), "rows"),
    ],
    ids=["unfiltered", "wide top_p", "narrow top_p", "top_p within the cap",
         "top_p just past the cap", "wide min_p", "narrow min_p",
         "top_k+top_p", "top_k past the candidates", "penalties"],
)
def test_sampled_tokens_follow_the_exact_distribution(
    params: SamplingParams, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chi-square test on a 40-token vocabulary, with so few candidates (at least 4, at most
    8: a top_k or nucleus past 8 is decided from the whole row) that rows are decided both
    from candidates and from whole rows. The penalties apply to a prompt's tokens."""
    monkeypatch.setattr(sampling_state, "DEFAULT_CANDIDATES", 4)
    monkeypatch.setattr(sampling_state, "MAX_CANDIDATES", 8)
    vocab, draws = 40, 40_000
    row = np.linspace(2.0, -2.0, vocab).astype(np.float32)
    row[[3, 17]] = row[[17, 3]]  # not in id order
    row[20] = row[21]  # a tie
    prompt = [0, 2, 17]
    states = [
        SequenceSampling(params.__class__(**{**_fields(params), "seed": seed}), prompt, vocab)
        for seed in range(2000)
    ]
    penalized = row.copy()[None]
    apply_penalties(penalized, [states[0].row_inputs()])
    counts = np.zeros(vocab)
    crossed = 0
    logits = np.broadcast_to(row, (len(states), vocab)).copy()
    for _ in range(draws // len(states)):
        choices, fetched = engine_path(logits, states)
        crossed += fetched
        np.add.at(counts, [c.token for c in choices], 1)
    expected = exact_distribution(penalized[0], params) * draws
    assert counts[expected == 0].sum() == 0, "a token outside the survivors was drawn"
    kept = expected > 0
    statistic = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum()
    assert statistic < chi_square_critical(max(int(kept.sum()) - 1, 1))
    took = {0: "candidates", draws: "rows"}.get(crossed, "both")
    assert took == path


def test_only_the_failed_row_fails() -> None:
    logits = lm_rows(3, 100, seed=4)
    logits[1, 3] = np.nan
    states = [SequenceSampling(SamplingParams(temperature=t, seed=1), [], 100)
              for t in (0.0, 1.0, 1.0)]
    choices = choose_tokens(logits, states)
    assert isinstance(choices[0], TokenChoice) and isinstance(choices[2], TokenChoice)
    assert isinstance(choices[1], RowFailed) and "nan" in choices[1].error
