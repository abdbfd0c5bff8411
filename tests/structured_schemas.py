"""JSON schemas of varied shape for the structured-output tests: nested objects, arrays with
min/max items, enums, bounded numbers, optional fields, anyOf, consts, patterns. Every string
and array is bounded, so a greedy answer always completes within the tests' token budget."""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "maxLength": 12}
_WORD = {"type": "string", "pattern": "^[a-z]{1,8}$"}


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[dict[str, Any]] = [
    _object({"name": _NAME}),
    _object({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _object({"ok": {"type": "boolean"}}),
    # multipleOf bounds the digits: a greedy small model may otherwise write 1.000... forever.
    _object({"score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01}}),
    _object({"color": {"enum": ["red", "green", "blue"]}}),
    _object({"name": _NAME, "age": {"type": "integer", "minimum": 18, "maximum": 99}}),
    _object({"tags": {"type": "array", "items": _WORD, "minItems": 1, "maxItems": 3}}),
    _object({"point": _object({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                               "y": {"type": "integer", "minimum": -9, "maximum": 9}})}),
    _object({"id": {"type": "integer", "minimum": 1000, "maximum": 9999},
             "nick": _NAME}, required=["id"]),
    _object({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                 {"type": "string", "maxLength": 5}]}}),
    _object({"kind": {"const": "event"}, "day": {"type": "integer", "minimum": 1,
                                                 "maximum": 31}}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 2, "maxItems": 4},
    {"type": "array", "items": _object({"k": _WORD}), "minItems": 1, "maxItems": 2},
    _object({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    _object({"user": _object({"name": _NAME, "admin": {"type": "boolean"}}),
             "level": {"enum": [1, 2, 3]}}),
    _object({"a": {"type": "null"}, "b": {"type": "boolean"}}),
    _object({"temperature": {"type": "number", "minimum": -50, "maximum": 60},
             "unit": {"enum": ["C", "F"]}}),
    _object({"items": {"type": "array", "maxItems": 2,
                       "items": _object({"sku": _WORD,
                                         "qty": {"type": "integer", "minimum": 1,
                                                 "maximum": 5}})}}),
    _object({"answer": {"enum": ["yes", "no"]}, "why": _NAME}, required=["answer"]),
    _object({"matrix": {"type": "array", "minItems": 1, "maxItems": 2,
                        "items": {"type": "array", "minItems": 1, "maxItems": 2,
                                  "items": {"type": "integer", "minimum": 0,
                                            "maximum": 9}}}}),
    _object({"title": _NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 999},
             "author": _object({"first": _NAME, "last": _NAME})}),
    _object({"shape": {"anyOf": [_object({"circle": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}}),
                                 _object({"square": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}})]}}),
    _object({"email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}}),
    _object({"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 3,
                       "maxItems": 3}}),
    _object({"ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 10}}),
    _object({"status": {"enum": ["active", "inactive", "banned"]},
             "since": {"type": "integer", "minimum": 1990, "maximum": 2030}}),
    _object({"meta": _object({"version": {"type": "integer", "minimum": 1, "maximum": 3},
                              "draft": {"type": "boolean"}}),
             "body": _NAME}),
    _object({"opt_a": _NAME, "opt_b": {"type": "integer", "minimum": 0, "maximum": 9}},
            required=[]),
    {"enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    _object({"list": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 0,
                      "maxItems": 3},
             "count": {"type": "integer", "minimum": 0, "maximum": 3}}),
    _object({"either": {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
             "code": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
]
