"""How long the text is that a chat template operation would build, known before it is built.

The sandbox calls these before a C call that cannot be interrupted once it starts (`str()` of a
container, `%`-formatting, `str.format`, joins): each returns an upper estimate, and stops
counting once the estimate passes `limit` (so it costs at most about `limit` steps, in Python,
where the GIL is released to other threads).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from jinja2.utils import Namespace

# A `%` conversion: %(name)flags width .precision length type (`*` takes a number from the
# values).
_PERCENT_SPEC = re.compile(
    r"%(?:\((?P<name>[^)]*)\))?[-#0 +]*(?P<width>\*|\d+)?(?:\.(?P<precision>\*|\d*))?[hlL]?"
    r"(?P<type>.)",
    re.DOTALL,
)
# The numbers in a `str.format` spec (width, precision; the spec's fields are already filled).
_SPEC_NUMBER = re.compile(r"\d+")
# Digits longer than this are past any limit: no need to convert them to an int.
_MAX_DIGITS = 12
# Containers whose text is their items' (not any iterable: iterating a loop consumes it).
_CONTAINERS = (list, tuple, set, frozenset, type({}.keys()), type({}.values()), type({}.items()))
# An object with no size of its own (a macro, a loop, a cycler): its repr is short.
_OPAQUE_CHARS = 100


def repr_size(text: str) -> int:
    """At most len(repr(text)): printable text escapes only quotes and backslashes (2 chars
    each); the longest escape of anything else is `\\U0001xxxx` (10 chars)."""
    return 2 + len(text) * (2 if text.isprintable() else 10)


def text_size(value: Any, limit: int) -> int:
    """At most len(str(value)), or any number past `limit` once the count passes it."""
    if isinstance(value, str):
        return len(value)
    total = 0
    pending: list[Any] = [value]
    while pending and total <= limit:
        item = pending.pop()
        if isinstance(item, str):
            total += repr_size(item) + 2  # inside a container: its repr and a separator
        elif isinstance(item, bytes):
            total += 4 * len(item) + 5
        elif isinstance(item, bool) or item is None:
            total += 7
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 4
        elif isinstance(item, float | complex):
            total += 64
        elif isinstance(item, Namespace):  # its repr shows its attributes
            total += 14
            pending.append(object.__getattribute__(item, "_Namespace__attrs"))
        elif isinstance(item, dict):
            total += 2 + 2 * len(item)
            pending.extend(item.items())
        elif isinstance(item, _CONTAINERS):
            total += 2 + len(item)
            pending.extend(item)
        else:
            total += _OPAQUE_CHARS
    return total


def percent_format_size(text: str, values: Any, limit: int) -> int:
    """At most len(text % values): the text, each conversion's width and precision (`*` ones
    from the values) and each value's own text."""
    positional = list(values) if isinstance(values, tuple) else [values]
    total = len(text)
    for spec in _PERCENT_SPEC.finditer(text):
        if spec["type"] == "%":
            continue
        for number in (spec["width"], spec["precision"]):
            if number == "*":
                total += _int_size(positional.pop(0) if positional else 0, limit)
            elif number:
                total += _digits_size(number, limit)
        if spec["name"] is not None and isinstance(values, Mapping):
            value = values.get(spec["name"], "")
        else:
            value = positional.pop(0) if positional else ""
        total += _converted_size(value, spec["type"], limit)
        if total > limit:
            break
    return total


def format_field_size(value: Any, spec: str, limit: int) -> int:
    """At most len(format(value, spec)): the spec's numbers (width, precision) and the value's
    text, doubled for the grouping separators and signs a number may gain."""
    numbers = sum(_digits_size(number, limit) for number in _SPEC_NUMBER.findall(spec))
    return numbers + 2 * text_size(value, limit) + 8


def _converted_size(value: Any, conversion: str, limit: int) -> int:
    if conversion in "ra" and isinstance(value, str):
        return repr_size(value)
    return 2 * text_size(value, limit) + 8  # a number's sign, exponent, grouping


def _int_size(value: Any, limit: int) -> int:
    return abs(value) if isinstance(value, int) else limit + 1


def _digits_size(digits: str, limit: int) -> int:
    return limit + 1 if len(digits) > _MAX_DIGITS else int(digits)
