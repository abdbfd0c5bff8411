"""JSON schemas as the server hands them to the constraint compiler: numbers bounded in length.

An integer or number a schema leaves unbounded lets a model write digits until `max_tokens`
cuts the answer (small models do: the tiny llama writes 70 digits), and the client's parse
fails. llama.cpp's json-schema-to-grammar caps them (an integral part of at most 16 digits, a
fraction of at most 16); llguidance has no such option, so the bounds are written into the
schema, where it gives none: `minimum` / `maximum` of +-(10**16 - 1), and for a number a
`multipleOf` of 1e-10, which holds its fraction to 10 digits (the smallest step llguidance
takes) and leaves out exponents. A schema's own bounds are kept; a value it fixes (`const`,
`enum`) is left as it is; values of no declared type (`{}`, `{"type": "json_object"}`'s
members) are not bounded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from actors.structured import MAX_SCHEMA_NESTING

MAX_INTEGER_DIGITS = 16
LARGEST = 10**MAX_INTEGER_DIGITS - 1
FRACTION_STEP = 1e-10
NUMERIC_TYPES = ("integer", "number")
# Where a schema holds subschemas: maps of them, or one or a list of them (`items` is either).
# `not` and `if` are left as they are: a bound inside them would widen what they refuse or
# change what they test.
SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions",
                         "dependentSchemas"))
SCHEMAS = frozenset(("items", "additionalItems", "additionalProperties", "contains",
                     "propertyNames", "unevaluatedItems", "unevaluatedProperties", "then",
                     "else", "anyOf", "oneOf", "allOf", "prefixItems"))


def bounded_numbers(schema: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` with each integer and number it declares bounded in length where it gives no
    bounds. Schema objects are copied on the way (the caller's are left as they were: a
    tool's parameters are also written into the prompt); values are shared. Past
    MAX_SCHEMA_NESTING levels nothing is changed, as the compiler refuses such a schema."""
    root = dict(schema)
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        _bound(node)
        if depth < MAX_SCHEMA_NESTING:
            stack += [(child, depth + 1) for child in _copied_subschemas(node)]
    return root


def _copied_subschemas(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Replaces each subschema of `node` (a schema object) with a copy; the copies."""
    copies: list[dict[str, Any]] = []

    def copied(value: Any) -> Any:
        if isinstance(value, dict):
            copies.append(dict(value))
            return copies[-1]
        return value

    for key, value in node.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            node[key] = {name: copied(member) for name, member in value.items()}
        elif key in SCHEMAS:
            node[key] = [copied(member) for member in value] if isinstance(
                value, list) else copied(value)
    return copies


def _bound(node: dict[str, Any]) -> None:
    """Bounds in place the integer or number `node` declares, where it gives no bounds."""
    declared = node.get("type")
    types = [declared] if isinstance(declared, str) else declared
    if not isinstance(types, list) or not any(kind in NUMERIC_TYPES for kind in types
                                              if isinstance(kind, str)):
        return
    if "const" in node or "enum" in node:
        return
    low = _bound_of(node, "minimum", "exclusiveMinimum")
    high = _bound_of(node, "maximum", "exclusiveMaximum")
    if low is None and (high is None or high >= -LARGEST):
        node["minimum"] = -LARGEST
    if high is None and (low is None or low <= LARGEST):
        node["maximum"] = LARGEST
    if "number" in types and "multipleOf" not in node:
        node["multipleOf"] = FRACTION_STEP


def _bound_of(node: dict[str, Any], *keys: str) -> float | None:
    """The first of `keys` that holds a number (draft 4's boolean exclusive bounds are not)."""
    for key in keys:
        value = node.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value
    return None
