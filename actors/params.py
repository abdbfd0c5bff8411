"""SamplingParams: how one request chooses its tokens, validated at the door.

Every bad value raises `InvalidRequest` whose `.field` names the parameter, both when the
params are built in Python (`SamplingParams(top_p=2)`) and when they arrive as a dict or
decoded JSON (`SamplingParams.from_dict(...)`), so no bad value ever reaches a running step.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from numbers import Integral, Real
from typing import Any

import msgspec
import numpy as np

from actors.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # the session holds back text that could start a stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20
# Bounds on a structured-output constraint's source: beyond these it is no real request, and
# compiling it would tie up a worker thread.
MAX_CHOICES = 1024
MAX_CONSTRAINT_CHARS = 1 << 20
# Counts reach numpy as int64 (and ranges of positions): anything past this is no real request.
MAX_COUNT = (1 << 31) - 1
MAX_SEED = (1 << 64) - 1  # numpy's generators take any int; a u64 is what APIs pass around
# A penalty divides or multiplies logits; outside this range the logits leave float32.
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
# OpenAI's range for a logit bias: -100 bans a token, +100 makes it the only choice.
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS_TOKENS = 1024


class _CheckedCall(type(msgspec.Struct)):  # type: ignore[misc]
    """Makes `SamplingParams(...)` with an unknown keyword or a positional argument raise
    `InvalidRequest` naming it, like every other bad value, instead of msgspec's TypeError."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise InvalidRequest(
                f"{cls.__name__} takes keyword arguments only (e.g. max_tokens=64), got "
                f"{len(args)} positional: {_shown(args[0])}",
                field="args",
            )
        unknown = sorted(set(kwargs) - set(cls.__struct_fields__))
        if unknown:
            raise InvalidRequest(
                f"{cls.__name__} has no field {unknown[0]!r}; the fields are "
                f"{', '.join(cls.__struct_fields__)}",
                field=unknown[0],
            )
        return super().__call__(**kwargs)


class StructuredOutput(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    metaclass=_CheckedCall,
):
    """What the answer must be, enforced token by token (see `actors.structured`): exactly
    one of `json_schema` (a JSON Schema as a dict), `json_object=True` (any JSON object),
    `regex` (matched in full), `choice` (one of these strings) or `grammar` (llguidance's Lark
    syntax, or a llama.cpp GBNF grammar, converted).

    `fast_forward`: tokens the constraint forces (a JSON key, a closing brace) join the
    sequence as one prefill chunk instead of a decode step each.
    """

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    fast_forward: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            msgspec.structs.force_setattr(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            msgspec.structs.force_setattr(self, name, _plain_text(f"structured.{name}",
                                                                  getattr(self, name)))
        if isinstance(self.choice, tuple):
            msgspec.structs.force_setattr(self, "choice", tuple(
                _plain_text("structured.choice", text) for text in self.choice))
        self.validate()

    @property
    def kind(self) -> str:
        """The one field that holds the constraint."""
        return next(name for name in _CONSTRAINT_FIELDS if _given(self, name))

    def validate(self) -> None:
        """Raise `InvalidRequest(field="structured.<name>")` for the first bad value."""
        given = [name for name in _CONSTRAINT_FIELDS if _given(self, name)]
        if len(given) != 1:
            named = f"got {len(given)}: {', '.join(given)}" if given else "got none"
            raise InvalidRequest(
                "structured output takes exactly one of json_schema, json_object, regex, "
                f"choice or grammar; {named}",
                field=f"structured.{given[1] if given else 'json_schema'}",
            )
        if not isinstance(self.json_object, bool):
            raise InvalidRequest(f"json_object must be true or false, got "
                                 f"{_shown(self.json_object)}", field="structured.json_object")
        if not isinstance(self.fast_forward, bool):
            raise InvalidRequest(f"fast_forward must be true or false, got "
                                 f"{_shown(self.fast_forward)}", field="structured.fast_forward")
        kind = given[0]
        value = getattr(self, kind)
        field = f"structured.{kind}"
        if kind == "json_schema":
            if not isinstance(value, dict):
                raise InvalidRequest(f"json_schema must be a JSON object (a dict), got "
                                     f"{_shown(value)}", field=field)
            try:
                size = len(msgspec.json.encode(value))
            except RecursionError:  # nested past Python's own limit, or holding itself
                raise InvalidRequest("json_schema is nested too deeply to encode (or contains "
                                     "itself)", field=field) from None
            except Exception as error:  # not JSON, or a dict subclass that raises
                raise InvalidRequest(f"json_schema is not JSON: {error}", field=field) from None
            _check_size(field, size)
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise InvalidRequest(f"{kind} must be a non-empty string, got {_shown(value)}",
                                     field=field)
            _check_size(field, len(value))
        elif kind == "choice":
            if not isinstance(value, tuple) or not all(isinstance(c, str) and c for c in value):
                raise InvalidRequest(f"choice must be a list of non-empty strings, got "
                                     f"{_shown(value)}", field=field)
            if not value or len(value) > MAX_CHOICES:
                raise InvalidRequest(f"choice must hold 1..{MAX_CHOICES} strings, got "
                                     f"{len(value)}", field=field)
            _check_size(field, sum(map(len, value)))


_CONSTRAINT_FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def _given(structured: StructuredOutput, name: str) -> bool:
    value = getattr(structured, name)
    return value is not False and value is not None


def _check_size(field: str, size: int) -> None:
    if size > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(f"{field.split('.')[-1]} is {size:,} characters; at most "
                             f"{MAX_CONSTRAINT_CHARS:,} are allowed", field=field)


class SamplingParams(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    metaclass=_CheckedCall,
):
    """Per-request sampling settings; see `actors.sampling` for the order they apply in.

    temperature 0 (or below 1e-5) means greedy; top_k 0, top_p 1 and min_p 0 switch those
    filters off; repetition_penalty 1 and presence/frequency 0 switch the penalties off.
    `stop` also accepts a list or a single string (normalized to a tuple). `logit_bias` maps
    token ids to what is added to their logits after the penalties, in [-100, 100] as OpenAI
    takes it (-100 bans a token, +100 forces it); a params holding one is not hashable.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredOutput | None = None
    logit_bias: Mapping[int, float] | None = None

    def __post_init__(self) -> None:
        # Lists are the natural spelling in Python; keep the frozen struct hashable.
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._make_values_plain()
        self.validate()

    def _make_values_plain(self) -> None:
        """Numbers and strings of other types (subclasses, numpy scalars) become the built-in
        value they hold, so no conversion or comparison a type overrides runs after this."""
        for name in _NUMBER_FIELDS:
            msgspec.structs.force_setattr(self, name, _plain_number(name, getattr(self, name)))
        if isinstance(self.stop, tuple):
            msgspec.structs.force_setattr(self, "stop", tuple(
                _plain_text("stop", text) for text in self.stop))
        if isinstance(self.stop_token_ids, tuple):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(
                _plain_number("stop_token_ids", token) for token in self.stop_token_ids))
        if isinstance(self.logit_bias, Mapping):
            msgspec.structs.force_setattr(self, "logit_bias", _plain_logit_bias(self.logit_bias))

    def for_answer(self, index: int) -> SamplingParams:
        """The params of answer `index` of a request for several: answer 0 keeps `seed`, each
        other gets a seed of its own derived from it (reproducible, distinct streams); without
        a seed every answer draws fresh entropy."""
        if index == 0 or self.seed is None:
            return self
        seed = int(np.random.SeedSequence([self.seed, index]).generate_state(1, np.uint64)[0])
        return msgspec.structs.replace(self, seed=seed)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build from a plain dict (e.g. decoded JSON); type errors name the field too."""
        if isinstance(data, Mapping) and isinstance(data.get("stop"), str):
            # msgspec checks the type before __post_init__ could wrap the string.
            data = {**data, "stop": [data["stop"]]}
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as error:
            raise InvalidRequest(
                f"invalid sampling parameters: {error}", field=field_of(error) or "params"
            ) from None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidRequest(field=...)` for the first bad value; `vocab_size`, when
        given, also bounds `stop_token_ids`."""
        _check_count("max_tokens", self.max_tokens, 1)
        _check_real("temperature", self.temperature, lambda v: v >= 0, ">= 0 (0 = greedy)")
        _check_count("top_k", self.top_k, 0, " (0 = off)")
        _check_real("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        _check_real("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        low, high = REPETITION_PENALTY_RANGE
        _check_real(
            "repetition_penalty",
            self.repetition_penalty,
            lambda v: low <= v <= high,
            f"in [{low:g}, {high:g}] (1 = off)",
        )
        _check_count("repetition_window", self.repetition_window, 0)
        for field in ("presence_penalty", "frequency_penalty"):  # the OpenAI API's range
            _check_real(field, getattr(self, field), lambda v: -2 <= v <= 2, "in [-2, 2]")
        if self.seed is not None:
            _check_int("seed", self.seed, lambda v: 0 <= v <= MAX_SEED, f"in 0..{MAX_SEED}")
        _check_stop_strings(self.stop)
        _check_stop_token_ids(self.stop_token_ids, vocab_size)
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias, vocab_size)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(
                f"ignore_eos must be true or false, got {self.ignore_eos!r}", field="ignore_eos"
            )
        if self.logprobs is not None:
            _check_int(
                "logprobs", self.logprobs, lambda v: 0 <= v <= MAX_LOGPROBS, f"in 0..{MAX_LOGPROBS}"
            )
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequest(
                f"structured must be a StructuredOutput, got {_shown(self.structured)}",
                field="structured",
            )


_NUMBER_FIELDS = (
    "max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
    "repetition_window", "presence_penalty", "frequency_penalty", "seed", "logprobs",
)


def _plain_number(field: str, value: Any) -> Any:
    """`value` as a built-in int or float when it is a number of another type; anything else
    as it is (the checks refuse it by type). A number that cannot be read raises
    `InvalidRequest` naming `field`; one past float's range reads as infinity."""
    try:
        if type(value) in (int, float, bool) or not isinstance(value, Real):
            return value
        # The built-in types' own conversions, which a subclass's overrides cannot change.
        if isinstance(value, int):
            return int.__index__(value)
        if isinstance(value, float):
            return float.__float__(value)
        if isinstance(value, Integral):
            return operator.index(value)
        return float(value)
    except OverflowError:
        return math.inf
    except Exception as error:  # a hostile type: its conversion, or even isinstance, raised
        raise InvalidRequest(f"{field} must be a number; a {type(value).__name__} could not be "
                             f"read as one ({type(error).__name__})", field=field) from None


def _plain_text(field: str, value: Any) -> Any:
    """`value` as a built-in str when it is a str subclass; anything else as it is."""
    try:
        return str.__str__(value) if type(value) is not str and isinstance(value, str) else value
    except Exception as error:
        raise InvalidRequest(f"{field} must be text; a {type(value).__name__} could not be read "
                             f"as text ({type(error).__name__})", field=field) from None


def _shown(value: object) -> str:
    """A short repr for an error message: a bad value can be huge (repr of an int past
    4,300 digits even raises)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__, or a container holding a huge int
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _check_int(field: str, value: Any, allowed: Callable[[int], bool], bounds: str) -> None:
    if not _is_int(value):
        raise InvalidRequest(f"{field} must be an integer, got {_shown(value)}", field=field)
    if not allowed(value):
        raise InvalidRequest(f"{field} must be {bounds}, got {_shown(value)}", field=field)


def _check_count(field: str, value: Any, minimum: int, note: str = "") -> None:
    _check_int(field, value, lambda v: minimum <= v <= MAX_COUNT, f"in {minimum}..{MAX_COUNT}{note}")


def _check_real(field: str, value: Any, allowed: Callable[[float], bool], bounds: str) -> None:
    if not isinstance(value, Real) or isinstance(value, bool):
        raise InvalidRequest(f"{field} must be a number, got {_shown(value)}", field=field)
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = math.inf
    if not math.isfinite(number):
        raise InvalidRequest(f"{field} must be a finite number, got {_shown(value)}", field=field)
    if not allowed(number):
        raise InvalidRequest(f"{field} must be {bounds}, got {_shown(value)}", field=field)


def _check_stop_strings(stop: object) -> None:
    if not isinstance(stop, tuple) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest(f"stop must be a list of strings, got {_shown(stop)}", field="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", field="stop"
        )
    for text in stop:
        if not text:
            raise InvalidRequest("stop strings must not be empty", field="stop")
        if len(text) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, "
                f"got one of {len(text)}",
                field="stop",
            )


def _check_stop_token_ids(ids: object, vocab_size: int | None) -> None:
    if not isinstance(ids, tuple) or not all(_is_int(i) for i in ids):
        raise InvalidRequest(
            f"stop_token_ids must be a list of integers, got {_shown(ids)}", field="stop_token_ids"
        )
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed",
            field="stop_token_ids",
        )
    limit = MAX_COUNT + 1 if vocab_size is None else vocab_size
    upper = f" and < {limit}" if vocab_size is None else f" and < the vocabulary size {limit}"
    for token in ids:
        if not 0 <= token < limit:
            raise InvalidRequest(
                f"stop_token_ids must be >= 0{upper}, got {_shown(token)}", field="stop_token_ids"
            )


def _plain_logit_bias(bias: Mapping[Any, Any]) -> Any:
    """A copy of `bias` with built-in numbers (see `_plain_number`), or `bias` as it is where
    it holds too many tokens to read (the check refuses it)."""
    try:
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            return bias
        items = list(bias.items())
    except Exception as error:  # a hostile Mapping
        raise InvalidRequest(f"logit_bias could not be read ({type(error).__name__})",
                             field="logit_bias") from None
    return {_plain_number("logit_bias", token): _plain_number("logit_bias", value)
            for token, value in items}


def _check_logit_bias(bias: object, vocab_size: int | None) -> None:
    if not isinstance(bias, Mapping):
        raise InvalidRequest(f"logit_bias must map token ids to biases, got {_shown(bias)}",
                             field="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequest(f"logit_bias has {len(bias)} tokens; at most "
                             f"{MAX_LOGIT_BIAS_TOKENS} are allowed", field="logit_bias")
    limit = MAX_COUNT + 1 if vocab_size is None else vocab_size
    upper = f"< {limit}" if vocab_size is None else f"< the vocabulary size {limit}"
    low, high = LOGIT_BIAS_RANGE
    for token, value in bias.items():
        _check_int("logit_bias", token, lambda v: 0 <= v < limit, f">= 0 and {upper} (a token id)")
        _check_real("logit_bias", value, lambda v: low <= v <= high,
                    f"in [{low:g}, {high:g}] (token {token})")


_PATH_FIELD = re.compile(r"(?:at|in) `\$\.(\w+)")  # a dict key: "at `key` in `$.x`"
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")
_MISSING_FIELD = re.compile(r"missing required field `([^`]*)`")


def field_of(error: msgspec.ValidationError) -> str | None:
    """The top-level field a msgspec error points at (`... - at `$.top_k``), or names as
    unknown or missing."""
    found = next((match for pattern in (_PATH_FIELD, _UNKNOWN_FIELD, _MISSING_FIELD)
                  if (match := pattern.search(str(error)))), None)
    return found.group(1) if found else None


__all__ = ["SamplingParams", "StructuredOutput"]
