"""`bounded_numbers`: where a JSON schema's integers and numbers get bounds in length, and
where they are left as the schema says (served end to end in tests/test_server_structured.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from actors.serve.schemas import FRACTION_STEP, LARGEST, bounded_numbers

INTEGER = {"minimum": -LARGEST, "maximum": LARGEST}
NUMBER = {**INTEGER, "multipleOf": FRACTION_STEP}


@pytest.mark.parametrize(("schema", "expected"), [
    ({"type": "integer"}, {"type": "integer", **INTEGER}),
    ({"type": "number"}, {"type": "number", **NUMBER}),
    ({"type": ["number", "null"]}, {"type": ["number", "null"], **NUMBER}),
    ({"type": "integer", "minimum": 0}, {"type": "integer", "minimum": 0, "maximum": LARGEST}),
    ({"type": "number", "exclusiveMaximum": 1},
     {"type": "number", "exclusiveMaximum": 1, "minimum": -LARGEST,
      "multipleOf": FRACTION_STEP}),
    # Draft 4's boolean exclusive bounds are no bounds of their own.
    ({"type": "integer", "exclusiveMinimum": True},
     {"type": "integer", "exclusiveMinimum": True, **INTEGER}),
    ({"type": "number", "multipleOf": 0.5}, {"type": "number", "multipleOf": 0.5, **INTEGER}),
    # A bound past the default's is kept, and the other side is not added against it.
    ({"type": "integer", "minimum": 10**20}, {"type": "integer", "minimum": 10**20}),
    ({"type": "integer", "maximum": -(10**20)}, {"type": "integer", "maximum": -(10**20)}),
    # Values the schema fixes, other types, and no type at all, are left as they are.
    ({"type": "integer", "enum": [10**20]}, {"type": "integer", "enum": [10**20]}),
    ({"type": "number", "const": 1.5}, {"type": "number", "const": 1.5}),
    ({"type": "string"}, {"type": "string"}),
    ({}, {}),
    ({"type": [{"odd": 1}], "properties": "not a map"},
     {"type": [{"odd": 1}], "properties": "not a map"}),
])
def test_one_schema(schema: dict[str, Any], expected: dict[str, Any]) -> None:
    assert bounded_numbers(schema) == expected


def test_every_subschema_is_bounded_and_the_callers_schema_is_left_as_it_was() -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"},
                       "list": {"type": "array", "items": {"type": "number"}},
                       "pair": {"type": "array", "prefixItems": [{"type": "integer"}],
                                "items": [{"type": "integer"}]},  # draft 4's item list
                       "ref": {"$ref": "#/$defs/either"}},
        "additionalProperties": {"type": "integer"},
        "patternProperties": {"^x": {"type": "integer"}},
        "$defs": {"either": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "definitions": {"all": {"allOf": [{"type": "integer"}]}},
        "then": {"type": "integer"},
        "not": {"type": "integer"},
        "if": {"type": "integer"},
        "default": {"type": "integer"},
    }
    sent = copy.deepcopy(schema)
    bounded = bounded_numbers(schema)
    assert schema == sent
    properties = bounded["properties"]
    for subschema in (properties["n"], properties["list"]["items"],
                      properties["pair"]["prefixItems"][0], properties["pair"]["items"][0],
                      bounded["additionalProperties"], bounded["patternProperties"]["^x"],
                      bounded["$defs"]["either"]["anyOf"][0],
                      bounded["definitions"]["all"]["allOf"][0], bounded["then"]):
        assert subschema["maximum"] == LARGEST, subschema
    # A bound inside `not` or `if` would change what they refuse or test; `default` is a value.
    assert (bounded["not"], bounded["if"], bounded["default"]) == ({"type": "integer"},) * 3
    assert bounded["$defs"]["either"]["anyOf"][1] == {"type": "string"}


def test_a_schema_nested_past_the_compilers_limit_is_walked_without_recursion() -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    bounded = bounded_numbers(schema)
    assert bounded["items"]["items"]["type"] == "array"
