"""SamplingParams: every field, built from Python keywords and from a dict. A value is either
refused with InvalidRequest naming its field, or accepted and then usable: the sampler state
a session builds from it right after admission builds too (a value that passed validation
and overflowed there once locked the engine)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from actors.errors import InvalidRequest
from actors.params import SamplingParams
from actors.sampling import SequenceSampling
from tests.fuzz.target import Escape, Target, only_project_errors
from tests.fuzz.values import hostile, plausible_or_hostile

VOCAB = 1024
PROMPT = list(range(1, 40))

_probability = st.floats(0, 1)


def _count(low: int) -> st.SearchStrategy[int]:
    """Small counts, and the edges of the allowed range (2**31 - 1) on both sides."""
    return st.one_of(st.integers(low, 300), st.sampled_from([low - 1, 2**31 - 1, 2**31, 2**63]))


FIELD_VALUES: dict[str, st.SearchStrategy] = {
    "max_tokens": _count(1),
    "temperature": st.one_of(st.floats(0, 5), st.floats()),
    "top_k": _count(0),
    "top_p": _probability,
    "min_p": _probability,
    "repetition_penalty": st.one_of(st.floats(0.01, 100), st.floats()),
    "repetition_window": _count(0),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "seed": st.one_of(st.none(), st.integers(0, 2**64 - 1), st.sampled_from([-1, 2**64])),
    "stop": st.one_of(st.text(max_size=300), st.lists(st.text(max_size=20), max_size=20)),
    "stop_token_ids": st.lists(st.integers(-1, VOCAB), max_size=5),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(-1, 21)),
    # As a dict (what JSON brings; as a keyword it must be a StructuredOutput instead).
    "structured": st.one_of(st.none(), st.fixed_dictionaries({}, optional={
        "json_schema": st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
        "json_object": st.booleans(),
        "regex": st.text(max_size=10),
        "choice": st.lists(st.text(max_size=5), max_size=3),
        "grammar": st.text(max_size=10),
        "fast_forward": st.booleans(),
    })),
    # Ids about the vocabulary's end and below 0, biases about the range's edges.
    "logit_bias": st.one_of(st.none(), st.dictionaries(
        st.integers(-1, VOCAB), st.one_of(st.floats(-101, 101), st.floats()), max_size=5)),
}
assert set(FIELD_VALUES) == set(SamplingParams.__struct_fields__), "a field is not fuzzed"

# Half the cases keep to each field's own kind (its edges included), half mix in anything.
plausible_keywords = st.fixed_dictionaries({}, optional=FIELD_VALUES)
known_keywords = st.fixed_dictionaries(
    {}, optional={name: plausible_or_hostile(values) for name, values in FIELD_VALUES.items()}
)
keywords = st.one_of(
    plausible_keywords,
    known_keywords,
    st.builds(lambda known, extra: {**known, "unknown_field": extra}, known_keywords, hostile),
    st.dictionaries(st.text(max_size=4), hostile, max_size=3),
)
# A positional argument in 1 case of 8: it alone decides the outcome.
positional = st.one_of(*[st.just(())] * 7, st.tuples(hostile))
cases = st.tuples(keywords, st.booleans(), positional)

def check(case: tuple[dict[str, Any], bool, tuple[Any, ...]]) -> str:
    kwargs, as_dict, positional = case
    with only_project_errors(case) as outcome:
        try:
            if as_dict:
                params = SamplingParams.from_dict(kwargs)
            else:
                params = SamplingParams(*positional, **kwargs)
        except InvalidRequest as exc:
            # A nested field is named by its path: structured.regex. An unknown one is named as
            # given, dots and all.
            top = None if exc.field is None else exc.field.split(".")[0]
            if top is None or (exc.field not in kwargs and top not in kwargs
                               and top not in ("args", "params")):
                raise Escape(f"InvalidRequest names {exc.field!r}, not a field given: {exc}") from exc
            raise
        SequenceSampling(params, PROMPT, VOCAB)
    return outcome[0]


TARGET = Target("SamplingParams (every field)", cases, check)
