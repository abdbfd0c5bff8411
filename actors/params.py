"""SamplingParams: how one request chooses its tokens, validated at the door.

Every bad value raises `InvalidRequest` whose `.field` names the parameter, both when the
params are built in Python (`SamplingParams(top_p=2)`) and when they arrive as a dict or
decoded JSON (`SamplingParams.from_dict(...)`), so no bad value ever reaches a running step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from numbers import Integral, Real
from typing import Any

import msgspec

from actors.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # the session holds back text that could start a stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-request sampling settings; see `actors.sampler` for the order they apply in.

    temperature 0 (or below 1e-5) means greedy; top_k 0, top_p 1 and min_p 0 switch those
    filters off; repetition_penalty 1 and presence/frequency 0 switch the penalties off.
    `stop` also accepts a list or a single string (normalized to a tuple).
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

    def __post_init__(self) -> None:
        # Lists are the natural spelling in Python; keep the frozen struct hashable.
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

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
                f"invalid sampling parameters: {error}", field=field_of(error)
            ) from None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidRequest(field=...)` for the first bad value; `vocab_size`, when
        given, also bounds `stop_token_ids`."""
        _check_int("max_tokens", self.max_tokens, lambda v: v >= 1, ">= 1")
        _check_real("temperature", self.temperature, lambda v: v >= 0, ">= 0 (0 = greedy)")
        _check_int("top_k", self.top_k, lambda v: v >= 0, ">= 0 (0 = off)")
        _check_real("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        _check_real("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        _check_real("repetition_penalty", self.repetition_penalty, lambda v: v > 0, "> 0")
        _check_int("repetition_window", self.repetition_window, lambda v: v >= 0, ">= 0")
        for field in ("presence_penalty", "frequency_penalty"):  # the OpenAI API's range
            _check_real(field, getattr(self, field), lambda v: -2 <= v <= 2, "in [-2, 2]")
        if self.seed is not None:
            _check_int("seed", self.seed, lambda v: v >= 0, ">= 0")
        _check_stop_strings(self.stop)
        _check_stop_token_ids(self.stop_token_ids, vocab_size)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(
                f"ignore_eos must be true or false, got {self.ignore_eos!r}", field="ignore_eos"
            )
        if self.logprobs is not None:
            _check_int(
                "logprobs", self.logprobs, lambda v: 0 <= v <= MAX_LOGPROBS, f"in 0..{MAX_LOGPROBS}"
            )


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _check_int(field: str, value: Any, allowed: Callable[[int], bool], bounds: str) -> None:
    if not _is_int(value):
        raise InvalidRequest(f"{field} must be an integer, got {value!r}", field=field)
    if not allowed(value):
        raise InvalidRequest(f"{field} must be {bounds}, got {value}", field=field)


def _check_real(field: str, value: Any, allowed: Callable[[float], bool], bounds: str) -> None:
    if not isinstance(value, Real) or isinstance(value, bool):
        raise InvalidRequest(f"{field} must be a number, got {value!r}", field=field)
    if not math.isfinite(value):
        raise InvalidRequest(f"{field} must be a finite number, got {value}", field=field)
    if not allowed(value):
        raise InvalidRequest(f"{field} must be {bounds}, got {value}", field=field)


def _check_stop_strings(stop: object) -> None:
    if not isinstance(stop, tuple) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest(f"stop must be a list of strings, got {stop!r}", field="stop")
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
            f"stop_token_ids must be a list of integers, got {ids!r}", field="stop_token_ids"
        )
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed",
            field="stop_token_ids",
        )
    upper = "" if vocab_size is None else f" and < the vocabulary size {vocab_size}"
    for token in ids:
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise InvalidRequest(
                f"stop_token_ids must be >= 0{upper}, got {token}", field="stop_token_ids"
            )


_PATH_FIELD = re.compile(r"at `\$\.(\w+)")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")


def field_of(error: msgspec.ValidationError) -> str | None:
    """The top-level field a msgspec error points at (`... - at `$.top_k``)."""
    found = _PATH_FIELD.search(str(error)) or _UNKNOWN_FIELD.search(str(error))
    return found.group(1) if found else None


__all__ = ["SamplingParams"]
