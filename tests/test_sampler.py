"""choose_tokens against a plain float64 reference of the same rules (actors/sampling's
docstring): greedy, penalties, temperature, top-k, top-p, min-p, seeds and logprobs."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.model import candidates
from actors.errors import ComputeError, InvalidRequest
from actors.params import SamplingParams
from actors.sampling import RowFailed, SequenceSampling, TokenChoice, choose_tokens
from actors.sampling import nucleus, whole_row
from actors.sampling import state as sampling_state


class FixedUniforms:
    """Stands in for a sequence's Generator: hands out the given uniforms in order."""

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def penalized(row: np.ndarray, state: SequenceSampling) -> np.ndarray:
    """The reference penalties, one token at a time in float64, rounded to float32."""
    params = state.params
    logits = row.astype(np.float64)
    for token in set(state.recent_tokens().tolist()):
        value = logits[token]
        penalty = params.repetition_penalty
        logits[token] = value / penalty if value > 0 else value * penalty
    for token, count in zip(*(a.tolist() for a in state.generated_counts())):
        logits[token] -= params.presence_penalty + params.frequency_penalty * count
    # The penalized row is float32, as the backend hands it over (a penalty of 1e-95 moves
    # nothing).
    return logits.astype(np.float32).astype(np.float64)


def reference_log_softmax(row: np.ndarray, state: SequenceSampling) -> np.ndarray:
    temperature = state.params.temperature or 1.0
    scaled = penalized(row, state) / temperature
    return scaled - np.logaddexp.reduce(scaled)


def reference_sorted_survivors(
    row: np.ndarray, state: SequenceSampling
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids most likely first, their renormalized probabilities) after top-k, top-p
    and min-p; ties are ordered by id."""
    params = state.params
    probs = np.exp(reference_log_softmax(row, state))
    # Ranked by logit, which is exact: two logits a hair apart can round to one probability.
    order = np.lexsort((np.arange(row.size), -penalized(row, state)))
    ranked = probs[order]
    keep = row.size
    if params.top_k:
        keep = min(params.top_k, keep)
    if params.top_p < 1:
        cumulative = np.cumsum(ranked[:keep]) / ranked[:keep].sum()
        keep = min(keep, int(np.searchsorted(cumulative, params.top_p)) + 1)
    if params.min_p > 0:
        keep = min(keep, int((ranked >= params.min_p * ranked[0]).sum()))
    survivors = ranked[:keep]
    return order[:keep], survivors / survivors.sum()


def reference_survivors_by_id(
    row: np.ndarray, state: SequenceSampling
) -> tuple[np.ndarray, np.ndarray]:
    """The survivors of `reference_sorted_survivors` in vocabulary order: the order a wide
    nucleus is drawn in."""
    order, probs = reference_sorted_survivors(row, state)
    by_id = np.argsort(order)
    return order[by_id], probs[by_id]


def reference_unfiltered_order(
    row: np.ndarray, state: SequenceSampling
) -> tuple[np.ndarray, np.ndarray]:
    """Every token in the order an unfiltered row is drawn: its candidates (the row's
    `row_inputs().candidates` most likely, ties by id) first, then the rest by id."""
    probs = np.exp(reference_log_softmax(row, state))
    ranked = np.lexsort((np.arange(row.size), -penalized(row, state)))
    held = ranked[: state.row_inputs().candidates]
    rest = np.setdiff1d(np.arange(row.size), held)
    order = np.concatenate([held, rest])
    return order, probs[order]


def is_nucleus(params: SamplingParams) -> bool:
    """top-p over the whole vocabulary: a row that the sampler draws in vocabulary order when
    its nucleus is wide."""
    return params.temperature > 0 and params.top_k == 0 and params.top_p < 1


@pytest.fixture(params=["sorted", "wide"])
def nucleus_path(request, monkeypatch) -> str:
    """Force every top-p row without top-k down one path: its survivors sorted, or its
    nucleus bracketed and drawn in vocabulary order (a sample of every logit makes the guess
    exact: every nucleus is then wider than none)."""
    if request.param == "wide":
        monkeypatch.setattr(nucleus, "_WIDE_NUCLEUS", 0)
        monkeypatch.setattr(candidates, "SAMPLE_SIZE", 2**62)
        # One candidate: every nucleus wider than one token needs its whole row.
        monkeypatch.setattr(sampling_state, "DEFAULT_CANDIDATES", 1)
        monkeypatch.setattr(sampling_state, "MAX_CANDIDATES", 1)
    else:
        monkeypatch.setattr(nucleus, "_WIDE_NUCLEUS", 2**62)
    return request.param


def plausible_tokens(
    order: np.ndarray, probs: np.ndarray, u: float, slack: float = 1e-5
) -> set[int]:
    """The tokens whose CDF interval (in `order`) comes within `slack` of `u`."""
    upper = np.cumsum(probs)
    lower = upper - probs
    near = (upper >= u - slack) & (lower <= u + slack)
    return set(order[near].tolist())


def states_for(
    params: SamplingParams, vocab: int, n: int = 1, prompt=(), generated=()
) -> list[SequenceSampling]:
    states = [SequenceSampling(params, list(prompt), vocab) for _ in range(n)]
    for state in states:
        for token in generated:
            state.record(token)
    return states


def lm_like_logits(rows: int, vocab: int, seed: int) -> np.ndarray:
    """A broad Gaussian tail with a few hundred standout tokens, like a language model's row."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.5, size=(rows, vocab)).astype(np.float32)
    standout = rng.integers(0, vocab, size=(rows, min(300, vocab // 4)))
    boost = (rng.exponential(3.0, size=standout.shape) + 6.0).astype(np.float32)
    np.put_along_axis(logits, standout, np.take_along_axis(logits, standout, 1) + boost, 1)
    return logits


@pytest.fixture(scope="module")
def lm_rows() -> np.ndarray:
    return lm_like_logits(8, 262144, seed=1)


# --- greedy ---------------------------------------------------------------------------


def test_greedy_is_argmax_and_leaves_the_logits_alone(lm_rows):
    states = states_for(SamplingParams(temperature=0.0), lm_rows.shape[1], n=len(lm_rows))
    before = lm_rows.copy()
    choices = choose_tokens(lm_rows, states)
    assert [c.token for c in choices] == np.argmax(lm_rows, axis=1).tolist()
    assert all(c.logprob is None and c.top_logprobs is None for c in choices)
    np.testing.assert_array_equal(lm_rows, before)


def test_greedy_rows_choose_alike_alone_and_beside_a_sampled_row(lm_rows):
    """A batch of greedy rows only takes a path of its own; its choices (tokens, logprobs,
    failed rows) are those the sampled rows' path gives the same rows."""
    vocab = lm_rows.shape[1]
    logits = lm_rows[:5].copy()
    logits[3, 17] = np.nan
    greedy = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
    ]

    def greedy_states() -> list[SequenceSampling]:
        return [states_for(p, vocab, prompt=[int(np.argmax(row))], generated=[7])[0]
                for p, row in zip(greedy, logits)]

    alone = choose_tokens(logits, greedy_states())
    sampled = states_for(SamplingParams(temperature=0.8, seed=3), vocab)
    beside = choose_tokens(np.concatenate([logits, lm_rows[5:6]]), greedy_states() + sampled)
    assert alone == beside[:5]
    assert isinstance(alone[3], RowFailed)
    assert alone[1].top_logprobs is not None and alone[0].logprob is None


def test_greedy_ties_go_to_the_lowest_id():
    logits = np.zeros((2, 1000), dtype=np.float32)
    logits[0, [700, 3, 500]] = 5.0
    logits[1, [999, 998]] = 1.0
    states = states_for(SamplingParams(temperature=0.0, logprobs=3), 1000, n=2)
    choices = choose_tokens(logits, states)
    assert [c.token for c in choices] == [3, 998]
    assert [t for t, _ in choices[0].top_logprobs] == [3, 500, 700]


def test_greedy_with_penalties_is_the_argmax_of_the_penalized_row(lm_rows):
    vocab = lm_rows.shape[1]
    leaders = np.argsort(-lm_rows, axis=1)[:, :3]
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.8, presence_penalty=1.5, frequency_penalty=1.0
    )
    states = [
        states_for(params, vocab, prompt=[int(row[0])], generated=[int(row[1]), int(row[1])])[0]
        for row in leaders
    ]
    choices = choose_tokens(lm_rows, states)
    expected = [int(np.argmax(penalized(row, s))) for row, s in zip(lm_rows, states)]
    assert [c.token for c in choices] == expected
    assert expected != np.argmax(lm_rows, axis=1).tolist()  # the penalties did bite


# --- penalties --------------------------------------------------------------------------


def test_penalties_change_exactly_the_intended_logits():
    vocab = 20  # small enough that logprobs=20 shows every token
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 3, size=(1, vocab)).astype(np.float32)
    logits[0, 2], logits[0, 5] = 4.0, -3.0  # one positive, one negative repeated logit
    params = SamplingParams(
        temperature=0.0,
        logprobs=20,
        repetition_penalty=1.5,
        repetition_window=3,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    # The window holds the last 3 of prompt + generated: 2, 5 and 9 (not 11, which fell out).
    state = states_for(params, vocab, prompt=[11, 2, 5], generated=[9])[0]
    plain = states_for(SamplingParams(temperature=0.0, logprobs=20), vocab)[0]
    got = dict(choose_tokens(logits, [state])[0].top_logprobs)
    base = dict(choose_tokens(logits, [plain])[0].top_logprobs)
    # Differences of logprobs are differences of logits: the normalizer cancels.
    shift = {t: (got[t] - got[0]) - (base[t] - base[0]) for t in range(vocab)}
    expected = np.zeros(vocab)
    expected[2] = 4.0 / 1.5 - 4.0
    expected[5] = -3.0 * 1.5 + 3.0
    value = float(logits[0, 9])
    expected[9] = (value / 1.5 if value > 0 else value * 1.5) - value
    expected[9] -= 0.5 + 0.25  # generated once: presence + one frequency
    np.testing.assert_allclose([shift[t] for t in range(vocab)], expected, atol=1e-5)


def test_frequency_penalty_counts_every_generated_occurrence():
    vocab = 20
    logits = np.linspace(0, 1, vocab, dtype=np.float32)[None, :]
    params = SamplingParams(temperature=0.0, logprobs=20, frequency_penalty=0.5)
    state = states_for(params, vocab, prompt=[3, 3, 3], generated=[3, 3, 7])[0]
    got = dict(choose_tokens(logits, [state])[0].top_logprobs)
    reference = reference_log_softmax(logits[0], state)
    np.testing.assert_allclose([got[t] for t in range(vocab)], reference, atol=1e-5)
    assert reference[3] - reference[0] == pytest.approx(logits[0, 3] - logits[0, 0] - 1.0, abs=1e-6)


def test_penalties_work_on_read_only_logits():
    logits = np.arange(50, dtype=np.float32)[None, :]
    logits.setflags(write=False)
    state = states_for(SamplingParams(temperature=0.0, presence_penalty=2.0), 50, generated=[49])[0]
    assert choose_tokens(logits, [state])[0].token == 48


# --- sampling: exact against the reference ------------------------------------------------

SAMPLING_CASES = {
    "top_k": SamplingParams(temperature=0.8, top_k=40),
    "wide top_k": SamplingParams(temperature=2.0, top_k=3000),  # past the first guess
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "min_p": SamplingParams(temperature=1.0, min_p=0.05),
    "top_k+top_p+min_p": SamplingParams(temperature=0.7, top_k=50, top_p=0.95, min_p=0.02),
    "top_p+penalties": SamplingParams(
        temperature=1.2, top_p=0.8, repetition_penalty=1.3, presence_penalty=0.4
    ),
    "no filter": SamplingParams(temperature=1.0),
}


@pytest.mark.parametrize("case", SAMPLING_CASES)
def test_sampled_tokens_invert_the_reference_cdf(case, lm_rows, nucleus_path):
    """Fed chosen uniforms, each row picks the token the reference's CDF gives for them."""
    params = SAMPLING_CASES[case]
    vocab = lm_rows.shape[1]
    rows = lm_rows[:4]
    leaders = np.argsort(-rows, axis=1)[:, :4]
    states = [
        states_for(params, vocab, prompt=row[:2].tolist(), generated=row[2:].tolist())[0]
        for row in leaders
    ]
    unfiltered = params.top_k == 0 and params.top_p == 1 and params.min_p == 0
    references = []
    for row, state in zip(rows, states):
        if unfiltered:
            references.append(reference_unfiltered_order(row, state))
        elif nucleus_path == "wide" and is_nucleus(params):
            references.append(reference_survivors_by_id(row, state))
        else:
            references.append(reference_sorted_survivors(row, state))
    uniforms = np.random.default_rng(3).random((12, len(rows)))
    for state, column in zip(states, uniforms.T):
        state.rng = FixedUniforms(column.tolist())
    for draw in uniforms:
        choices = choose_tokens(rows, states)
        for choice, u, (order, probs) in zip(choices, draw, references):
            assert choice.token in plausible_tokens(order, probs, u)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=3.0, top_p=0.95),
        SamplingParams(temperature=3.0, top_p=0.95, min_p=0.0005),  # min-p cuts the nucleus
        SamplingParams(temperature=1.5, top_p=0.999, logprobs=3),
    ],
    ids=["top_p", "top_p+min_p", "top_p+logprobs"],
)
@pytest.mark.parametrize("bracket", [None, 1], ids=["first bracket", "widened brackets"])
def test_a_wide_nucleus_is_drawn_in_vocabulary_order(params, bracket, lm_rows, monkeypatch):
    """A hot top-p keeps tens of thousands of tokens: they are not sorted but drawn in
    vocabulary order, and low, middle and high uniforms land where the reference puts them,
    whether the first bracket held the cutoff or (one sample position wide) had to widen."""
    passes = []
    if bracket is not None:
        monkeypatch.setattr(nucleus, "_BRACKET", bracket)
        bracket_pass = nucleus._bracket_pass
        monkeypatch.setattr(nucleus, "_bracket_pass", lambda *a: passes.append(a) or bracket_pass(*a))
    vocab = lm_rows.shape[1]
    uniforms = [0.0001, 0.3, 0.5, 0.9999]
    states = states_for(params, vocab, n=len(uniforms))
    order, probs = reference_survivors_by_id(lm_rows[0], states[0])
    assert order.size > 10_000
    for row_state, u in zip(states, uniforms):
        row_state.rng = FixedUniforms([u])
    rows = np.repeat(lm_rows[:1], len(uniforms), axis=0)
    choices = choose_tokens(rows, states)
    for choice, u in zip(choices, uniforms):
        assert choice.token in plausible_tokens(order, probs, u)
    if params.min_p == 0:  # with it, min-p's floor holds the cutoff of this row
        assert bool(passes) == (bracket is not None)
    if params.logprobs is not None:
        reference = reference_log_softmax(lm_rows[0], states[0])
        top = np.lexsort((np.arange(vocab), -reference))[: params.logprobs]
        assert [t for t, _ in choices[0].top_logprobs] == top.tolist()
        assert choices[0].logprob == pytest.approx(reference[choices[0].token], abs=1e-4)


@pytest.mark.parametrize(
    ("params", "survivors"),
    [
        (SamplingParams(temperature=1.5, top_k=5, seed=11), 5),
        (SamplingParams(temperature=1.5, top_p=0.6, seed=12), 6),
        (SamplingParams(temperature=1.5, min_p=0.3, seed=13), 8),
        (SamplingParams(temperature=1.5, top_p=0.9, min_p=0.3, seed=14), 8),
    ],
    ids=["top_k", "top_p", "min_p", "top_p+min_p"],
)
def test_filters_never_choose_outside_the_allowed_set(params, survivors, nucleus_path):
    """Many seeded draws: every token is a survivor, and the survivors' frequencies follow
    their renormalized probabilities."""
    vocab, draws = 2000, 3000
    # Geometric probabilities in a shuffled vocabulary: at T=1.5, p(rank) ~ exp(-rank / 6),
    # so top_k=5 keeps 5 tokens, top_p=0.6 keeps 6 (1 - e^-1 > 0.6) and min_p=0.3 keeps 8.
    row = np.random.default_rng(5).permutation(-0.25 * np.arange(vocab)).astype(np.float32)
    logits = np.repeat(row[None, :], draws, axis=0)
    states = [
        SequenceSampling(msgspec.structs.replace(params, seed=params.seed + i), [], vocab)
        for i in range(draws)
    ]
    tokens = np.array([c.token for c in choose_tokens(logits, states)])
    order, probs = reference_sorted_survivors(row, states[0])
    assert order.size == survivors
    assert set(tokens.tolist()) <= set(order.tolist())
    observed = np.array([(tokens == t).sum() for t in order]) / draws
    np.testing.assert_allclose(observed, probs, atol=0.03)


# --- seeds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.9, 3.0], ids=["narrow nucleus", "wide nucleus"])
def test_a_seed_gives_the_same_tokens_whatever_shares_the_batch(temperature, lm_rows):
    vocab = lm_rows.shape[1]
    seeded = SamplingParams(
        temperature=temperature, top_p=0.95, seed=1234, repetition_penalty=1.1
    )
    neighbours = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, min_p=0.1, logprobs=4),
        SamplingParams(temperature=2.5, top_p=0.99),  # a wide nucleus
        SamplingParams(temperature=0.7, top_p=0.8),  # a narrow one
    ]

    def run(batch_params: list[SamplingParams], seeded_at: int) -> list[int]:
        states = [SequenceSampling(p, [1, 2, 3], vocab) for p in batch_params]
        rng = np.random.default_rng(99)
        out = []
        for step in range(6):
            rows = lm_rows[rng.permutation(len(lm_rows))[: len(states)]].copy()
            rows[seeded_at] = lm_rows[step]  # the seeded row always sees the same logits
            choices = choose_tokens(rows, states)
            for state, choice in zip(states, choices):
                state.record(choice.token)
            out.append(choices[seeded_at].token)
        return out

    alone = run([seeded], 0)
    crowded = run(neighbours[:2] + [seeded] + neighbours[2:], 2)
    assert alone == crowded
    assert run([seeded], 0) == alone
    other_seed = msgspec.structs.replace(seeded, seed=4321)
    assert run([other_seed], 0) != alone


# --- logprobs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.7, logprobs=20, seed=1),
        SamplingParams(temperature=1.3, top_p=0.9, logprobs=3, repetition_penalty=1.2, seed=2),
        SamplingParams(temperature=0.5, top_k=2, logprobs=10, seed=3),
        SamplingParams(temperature=1.0, min_p=0.2, logprobs=0, seed=4),
    ],
    ids=["greedy", "plain", "top_p+penalty", "top_k<logprobs", "zero alternatives"],
)
def test_logprobs_match_a_float64_log_softmax(params, lm_rows):
    vocab = lm_rows.shape[1]
    states = states_for(params, vocab, n=4, prompt=[5, 6, 7])
    choices = choose_tokens(lm_rows[:4], states)
    for row, state, choice in zip(lm_rows, states, choices):
        reference = reference_log_softmax(row, state)
        assert choice.logprob == pytest.approx(reference[choice.token], abs=1e-4)
        top = np.lexsort((np.arange(vocab), -reference))[: params.logprobs]
        assert [t for t, _ in choice.top_logprobs] == top.tolist()
        np.testing.assert_allclose(
            [lp for _, lp in choice.top_logprobs], reference[top], atol=1e-4
        )


def test_no_logprobs_unless_asked(lm_rows):
    states = states_for(SamplingParams(top_k=10, seed=0), lm_rows.shape[1], n=2)
    assert all(
        c == TokenChoice(token=c.token) for c in choose_tokens(lm_rows[:2], states)
    )


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_or_infinite_logits_fail_only_their_own_row(temperature):
    logits = np.zeros((4, 100), dtype=np.float32)
    logits[1, 17] = np.nan
    logits[2, :] = -np.inf
    logits[3, 5] = np.inf
    states = states_for(SamplingParams(temperature=temperature, seed=1), 100, n=4)
    choices = choose_tokens(logits, states)
    assert isinstance(choices[0], TokenChoice)
    assert all(isinstance(choice, RowFailed) for choice in choices[1:])


def test_logits_that_do_not_match_the_sequences_are_refused():
    states = states_for(SamplingParams(), 100, n=2)
    with pytest.raises(ComputeError, match="do not match"):
        choose_tokens(np.zeros((3, 100), dtype=np.float32), states)
    with pytest.raises(ComputeError, match="vocabulary"):
        choose_tokens(np.zeros((2, 99), dtype=np.float32), states)


def test_an_empty_batch_chooses_nothing():
    assert choose_tokens(np.zeros((0, 10), dtype=np.float32), []) == []


def test_out_of_vocabulary_history_is_refused():
    with pytest.raises(InvalidRequest) as error:
        SequenceSampling(SamplingParams(repetition_penalty=1.2), [3, 100], 100)
    assert error.value.field == "token_id"
    state = SequenceSampling(SamplingParams(), [], 100)
    with pytest.raises(InvalidRequest):
        state.record(-1)


def test_bad_params_are_refused_when_the_sequence_starts():
    with pytest.raises(InvalidRequest) as error:
        SequenceSampling(SamplingParams(stop_token_ids=(500,)), [], 100)
    assert error.value.field == "stop_token_ids"


# --- properties --------------------------------------------------------------------------

finite_logit = st.floats(-30, 30, width=32)


@st.composite
def sampling_cases(draw: st.DrawFn) -> tuple[np.ndarray, SamplingParams, list[int], list[int]]:
    vocab = draw(st.integers(1, 300))
    logit = st.one_of(finite_logit, st.just(-np.inf))  # -inf: a masked token
    values = draw(st.lists(logit, min_size=vocab, max_size=vocab))
    values[draw(st.integers(0, vocab - 1))] = draw(finite_logit)  # at least one finite logit
    params = SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.floats(0.05, 5.0))),
        top_k=draw(st.integers(0, vocab + 5)),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 0.9))),
        repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(0.5, 2.0))),
        repetition_window=draw(st.integers(0, 8)),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        frequency_penalty=draw(st.floats(-2.0, 2.0)),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        seed=draw(st.integers(0, 2**32)),
    )
    history = st.lists(st.integers(0, vocab - 1), max_size=12)
    return np.array([values], dtype=np.float32), params, draw(history), draw(history)


@settings(max_examples=200, deadline=None)
@given(sampling_cases())
def test_any_choice_is_a_survivor_with_the_right_logprobs(case):
    logits, params, prompt, generated = case
    vocab = logits.shape[1]
    state = states_for(params, vocab, prompt=prompt, generated=generated)[0]
    choice = choose_tokens(logits, [state])[0]
    if params.temperature == 0:
        assert choice.token == int(np.argmax(penalized(logits[0], state)))
    else:
        # Rounding may decide a survivor exactly at a top-p or min-p boundary either way.
        loose = msgspec.structs.replace(
            params, top_p=min(1.0, params.top_p + 1e-6), min_p=max(0.0, params.min_p - 1e-6)
        )
        loose_state = states_for(loose, vocab, prompt=prompt, generated=generated)[0]
        survivors, _ = reference_sorted_survivors(logits[0], loose_state)
        assert choice.token in set(survivors.tolist())
    if params.logprobs is None:
        assert choice.logprob is None and choice.top_logprobs is None
    else:
        reference = reference_log_softmax(logits[0], state)
        assert choice.logprob == pytest.approx(reference[choice.token], abs=1e-4)
        shown = min(params.logprobs, vocab)
        assert len(choice.top_logprobs) == shown
        assert [lp for _, lp in choice.top_logprobs] == pytest.approx(
            np.sort(reference)[::-1][:shown].tolist(), abs=1e-4
        )


@st.composite
def nucleus_cases(draw: st.DrawFn) -> tuple[np.ndarray, SamplingParams, list[float], int, int]:
    """A top-p row without top-k, with ties and masked tokens, uniforms to draw it with, and
    a sample size and bracket small enough that the guesses miss and the brackets widen."""
    vocab = draw(st.integers(1, 1000))
    tied = st.sampled_from([0.0, 1.0, 2.5])
    logit = st.one_of(finite_logit, tied, st.just(-np.inf))
    values = draw(st.lists(logit, min_size=vocab, max_size=vocab))
    values[draw(st.integers(0, vocab - 1))] = draw(st.one_of(finite_logit, tied))
    params = SamplingParams(
        temperature=draw(st.floats(0.05, 5.0)),
        top_p=draw(st.floats(0.05, 0.999)),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 0.9))),
        seed=0,
    )
    uniforms = draw(st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=1, max_size=4))
    sample_size = draw(st.sampled_from([2, 5, 16, 2**62]))
    bracket = draw(st.sampled_from([1, 1, 2, 32]))
    return np.array([values], dtype=np.float32), params, uniforms, sample_size, bracket


@settings(max_examples=300, deadline=None)
@given(nucleus_cases())
def test_a_wide_nucleus_keeps_exactly_the_reference_survivors(case):
    """Down the wide path, each uniform picks the token that the reference survivors' CDF in
    vocabulary order gives it; a row whose guess says narrow is drawn from its sorted
    survivors instead, the path being the row's own either way."""
    logits, params, uniforms, sample_size, bracket = case
    vocab = logits.shape[1]
    wide_rows = []
    draw_wide = whole_row._draw_from_wide_nuclei

    def spied(logits, rows, *rest):
        wide_rows.extend(rows.tolist())
        return draw_wide(logits, rows, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nucleus, "_WIDE_NUCLEUS", 0)
        patch.setattr(candidates, "SAMPLE_SIZE", sample_size)
        patch.setattr(sampling_state, "DEFAULT_CANDIDATES", 1)
        patch.setattr(sampling_state, "MAX_CANDIDATES", 1)
        patch.setattr(nucleus, "_BRACKET", bracket)
        patch.setattr(whole_row, "_draw_from_wide_nuclei", spied)
        states = states_for(params, vocab, n=len(uniforms))
        for state, u in zip(states, uniforms):
            state.rng = FixedUniforms([u])
        choices = choose_tokens(np.repeat(logits, len(uniforms), axis=0), states)
    assert wide_rows in ([], list(range(len(uniforms))))  # the same row takes the same path
    reference = reference_survivors_by_id if wide_rows else reference_sorted_survivors
    # Rounding may decide a survivor exactly at a top-p or min-p boundary either way: the
    # draws are pinned only where that cannot happen.
    tight, loose = (
        msgspec.structs.replace(
            params,
            top_p=float(np.clip(params.top_p - slack, 1e-9, 1.0)),
            min_p=float(np.clip(params.min_p + slack, 0.0, 1.0)),
        )
        for slack in (1e-6, -1e-6)
    )
    tight_order, _ = reference(logits[0], states_for(tight, vocab)[0])
    loose_order, _ = reference(logits[0], states_for(loose, vocab)[0])
    order, probs = reference(logits[0], states[0])
    for choice, u in zip(choices, uniforms):
        assert choice.token in set(loose_order.tolist())
        if np.array_equal(tight_order, loose_order):
            assert choice.token in plausible_tokens(order, probs, u)
