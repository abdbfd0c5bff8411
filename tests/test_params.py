"""SamplingParams: every bad value is refused with InvalidRequest naming its field, whether
the params are built in Python or converted from a dict."""

from __future__ import annotations

import math
from fractions import Fraction
from numbers import Real

import msgspec
import pytest

from actors.errors import InvalidRequest
from actors.params import SamplingParams

BAD_VALUES = [
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.5),
    ("max_tokens", "10"),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_k", -1),
    ("top_k", 1.5),
    ("top_k", True),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", math.nan),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_window", -1),
    ("repetition_window", 2**63),  # passed once, then overflowed after admission
    ("repetition_penalty", 1e-40),  # its logits leave float32
    ("repetition_penalty", 1e6),
    ("temperature", 2**1100),  # an int past float's range
    ("top_p", 10**400),
    ("max_tokens", 10**5000),  # its repr alone raises
    ("top_k", 2**70),
    ("presence_penalty", 2.5),
    ("presence_penalty", math.nan),
    ("frequency_penalty", -3.0),
    ("seed", -1),
    ("seed", 1.5),
    ("seed", "42"),
    ("seed", False),
    ("seed", 2**64),
    ("stop", ("",)),
    ("stop", tuple(f"s{i}" for i in range(17))),
    ("stop", ("x" * 257,)),
    ("stop", (1,)),
    ("stop_token_ids", (-1,)),
    ("stop_token_ids", ("2",)),
    ("stop_token_ids", tuple(range(1025))),
    ("stop_token_ids", (10**5000,)),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 2.0),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: -101}),
    ("logit_bias", {5: math.nan}),
    ("logit_bias", {5: True}),
    ("logit_bias", {5: "1"}),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {2**70: 1.0}),
    ("logit_bias", {token: 1.0 for token in range(1025)}),
    ("logit_bias", [5, 1.0]),
]


def _case_id(value: object) -> str | None:
    # pytest's own ids repr the value, and the repr of a 5,000-digit int raises.
    if isinstance(value, tuple) and len(value) == 1:
        value = value[0]
    if isinstance(value, int) and value.bit_length() > 64:
        return f"int{value.bit_length()}bits"
    return None


@pytest.mark.parametrize(("field", "value"), BAD_VALUES, ids=_case_id)
def test_a_bad_value_names_its_field(field, value):
    with pytest.raises(InvalidRequest) as error:
        SamplingParams(**{field: value})
    assert error.value.field == field
    assert field in str(error.value)


@pytest.mark.parametrize(("field", "value"), BAD_VALUES, ids=_case_id)
def test_a_bad_value_in_a_dict_names_its_field(field, value):
    if isinstance(value, tuple):
        value = list(value)
    with pytest.raises(InvalidRequest) as error:
        SamplingParams.from_dict({field: value})
    assert error.value.field == field


def test_the_defaults_are_valid_and_mean_plain_sampling():
    params = SamplingParams()
    params.validate(vocab_size=10)
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (256, 1.0, 0, 1.0)
    assert (params.min_p, params.repetition_penalty, params.logprobs) == (0.0, 1.0, None)


def test_good_edge_values_are_accepted():
    params = SamplingParams(
        max_tokens=1,
        temperature=0,
        top_k=0,
        top_p=1.0,
        min_p=1.0,
        repetition_penalty=0.5,
        repetition_window=0,
        presence_penalty=-2,
        frequency_penalty=2,
        seed=2**63,
        stop=tuple(f"s{i}" for i in range(16)),
        stop_token_ids=(0, 9),
        ignore_eos=True,
        logprobs=20,
    )
    params.validate(vocab_size=10)


def test_stop_token_ids_are_checked_against_the_vocabulary_when_known():
    params = SamplingParams(stop_token_ids=(3, 10))
    params.validate()
    with pytest.raises(InvalidRequest) as error:
        params.validate(vocab_size=10)
    assert error.value.field == "stop_token_ids"
    assert "10" in str(error.value)


def test_logit_bias_is_checked_against_the_vocabulary_when_known():
    params = SamplingParams(logit_bias={3: -100, 9: 100.0})
    params.validate(vocab_size=10)
    assert params.logit_bias == {3: -100, 9: 100.0}
    with pytest.raises(InvalidRequest) as error:
        SamplingParams(logit_bias={10: 1.0}).validate(vocab_size=10)
    assert error.value.field == "logit_bias"
    assert "vocabulary size 10" in str(error.value)


def test_each_answer_has_its_own_reproducible_seed():
    params = SamplingParams(seed=7, temperature=0.8)
    seeds = [params.for_answer(index).seed for index in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    assert seeds == [params.for_answer(index).seed for index in range(4)]
    assert all(0 <= seed < 2**64 for seed in seeds)
    assert SamplingParams().for_answer(3).seed is None


def test_lists_and_a_single_stop_string_become_tuples():
    params = SamplingParams(stop=["\n\n", "END"], stop_token_ids=[1, 2])
    assert params.stop == ("\n\n", "END") and params.stop_token_ids == (1, 2)
    assert SamplingParams(stop="###").stop == ("###",)
    assert hash(params) == hash(SamplingParams(stop=("\n\n", "END"), stop_token_ids=(1, 2)))


def test_from_dict_converts_json_and_keeps_the_rules():
    params = SamplingParams.from_dict(
        msgspec.json.decode(b'{"max_tokens": 8, "temperature": 1, "stop": "\\n", "seed": 7}')
    )
    assert params == SamplingParams(max_tokens=8, temperature=1.0, stop=("\n",), seed=7)
    assert isinstance(params.temperature, float)


def test_from_dict_names_an_unknown_field():
    with pytest.raises(InvalidRequest) as error:
        SamplingParams.from_dict({"max_token": 5})
    assert error.value.field == "max_token"


def test_an_unknown_keyword_is_named_like_a_bad_value():
    with pytest.raises(InvalidRequest) as error:
        SamplingParams(max_tokens=5, foo=1)
    assert error.value.field == "foo"
    assert "max_tokens" in str(error.value)  # lists what there is


def test_positional_arguments_are_refused_with_a_request_error():
    with pytest.raises(InvalidRequest, match="keyword arguments only") as error:
        SamplingParams(5)
    assert error.value.field == "args"


def test_from_dict_refuses_what_is_not_a_mapping():
    with pytest.raises(InvalidRequest) as error:
        SamplingParams.from_dict([("max_tokens", 5)])
    assert error.value.field == "params"
    assert "object" in str(error.value)


def test_replace_validates_again():
    with pytest.raises(InvalidRequest) as error:
        msgspec.structs.replace(SamplingParams(), top_p=2.0)
    assert error.value.field == "top_p"


class _RaisingFloat(float):
    """A float whose conversions and comparisons all raise."""

    def _raise(self, *args: object) -> bool:
        raise ArithmeticError("hostile float")

    __float__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = __bool__ = _raise
    __hash__ = float.__hash__


class _RaisingInt(int):
    """An int whose conversions and comparisons all raise."""

    def _raise(self, *args: object) -> bool:
        raise LookupError("hostile int")

    __index__ = __int__ = __float__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__ = _raise
    __ne__ = __bool__ = _raise
    __hash__ = int.__hash__


class _UnreadableNumber:
    """Claims to be a number (registered as Real) but cannot be converted to one."""

    def __float__(self) -> float:
        raise OSError("no value")


Real.register(_UnreadableNumber)


class _RaisingText(str):
    def __len__(self) -> int:
        raise MemoryError("hostile str")

    def __eq__(self, other: object) -> bool:
        raise MemoryError("hostile str")

    __hash__ = str.__hash__


def test_number_subclasses_are_read_as_the_plain_numbers_they_hold():
    params = SamplingParams(temperature=_RaisingFloat(0.25), top_p=_RaisingFloat(0.5),
                            max_tokens=_RaisingInt(7), top_k=_RaisingInt(3), seed=_RaisingInt(11),
                            logprobs=_RaisingInt(2), stop_token_ids=[_RaisingInt(4)],
                            stop=[_RaisingText("END")])
    assert (params.temperature, params.top_p, params.max_tokens, params.top_k) == (0.25, 0.5, 7, 3)
    plain = (params.temperature, params.max_tokens, params.seed, params.logprobs,
             *params.stop_token_ids, *params.stop)
    assert [type(value) for value in plain] == [float, int, int, int, int, str]
    params.validate(vocab_size=10)


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", _RaisingFloat(-1.0)),  # refused by its value, read without its overrides
    ("top_p", _RaisingFloat(math.nan)),
    ("max_tokens", _RaisingInt(0)),
    ("seed", _RaisingInt(-3)),
    ("stop_token_ids", (_RaisingInt(-1),)),
    ("min_p", _UnreadableNumber()),
    ("top_k", _UnreadableNumber()),
    ("temperature", Fraction(10**400)),
])
def test_a_number_that_lies_about_itself_is_a_request_error(field, value):
    with pytest.raises(InvalidRequest) as error:
        SamplingParams(**{field: value})
    assert error.value.field == field
