"""examples/structured.py: the schema a dataclass gives, an extraction into the dataclass on
gemma-3-270m, and a tool call answered and fed back on SmolLM2 (the real models: slow)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import anyio
import jsonschema
import pytest

from actors import Engine

EXAMPLE = Path(__file__).parent.parent / "examples" / "structured.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("structured_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the dataclass's annotations resolve in its module
    spec.loader.exec_module(module)
    return module


def test_a_dataclass_gives_its_schema(example: ModuleType) -> None:
    @dataclasses.dataclass
    class Reading:
        place: str
        celsius: float
        ok: bool
        tags: list[int]
        note: str | None = dataclasses.field(default=None, metadata={"schema": {"maxLength": 9}})

    schema = example.dataclass_schema(Reading)
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = {"place": "Oslo", "celsius": -2.5, "ok": True, "tags": [1], "note": None}
    jsonschema.validate(valid, schema)
    for invalid in ({**valid, "celsius": "cold"}, {**valid, "extra": 1}, {**valid, "tags": ["a"]},
                    {**valid, "note": "far too long"}, {k: v for k, v in valid.items()
                                                         if k != "ok"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(invalid, schema)
    with pytest.raises(TypeError, match="no JSON schema"):
        example.type_schema(dict[str, int])


def test_extraction_into_the_dataclass(example: ModuleType, gemma3_model_path: Path) -> None:
    async def extract() -> object:
        async with Engine.open(gemma3_model_path, backend="cpu") as engine:
            return await example.extract(
                engine, example.Person,
                "Tom Berg is 52 and works as a baker in Oslo; he speaks Norwegian.", example.SHOT)

    person = anyio.run(extract)
    assert isinstance(person, example.Person)
    jsonschema.validate(dataclasses.asdict(person), example.dataclass_schema(example.Person))


def test_a_tool_call_answered_and_fed_back(example: ModuleType, smollm2_model_path: Path) -> None:
    template = (example.TEMPLATES / "chatml_tools.jinja").read_text()

    async def ask() -> tuple:
        async with Engine.open(smollm2_model_path, backend="cpu") as engine:
            return await example.answer_with_tool(engine, template, "Weather in Paris?")

    call, result, answer = anyio.run(ask)
    assert call.name == "get_weather"
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, example.WEATHER_TOOL["function"]["parameters"])
    assert result == example.get_weather(**arguments)
    assert answer.strip()
