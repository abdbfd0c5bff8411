"""Structured output and function tools through `q4k serve`, driven with the official `openai`
client: `response_format` (json_schema, json_object), vLLM's `guided_*` fields, and `tools` with
every `tool_choice`, whole and streamed (the stream accumulated by the client's own helper);
integers and numbers a schema leaves unbounded, bounded in length.

The tiny llama's weights are random, so its free answers are nonsense; an enforced answer is
still valid, which is what these tests check: every answer parses and validates against its
schema (`jsonschema`), every call names a declared function with valid arguments. Greedy
decoding makes each answer the same whole and streamed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from actors.serve.schemas import LARGEST

from test_cli_logs import CALL_TIMEOUT_S
from test_server import Server, _start, _stop

TEMPLATES = Path(__file__).parent.parent / "examples" / "chat_templates"
GREEDY = {"temperature": 0, "max_tokens": 96}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                   "b": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
# Strict, so that the client's stream helper accepts (and parses) them.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_PARAMETERS, "strict": True}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                      "parameters": ADD_PARAMETERS, "strict": True}},
]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "add": ADD_PARAMETERS}
ASK = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}]


@pytest.fixture(scope="module")
def server(tiny_model_paths: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny llama with a ChatML template that renders tools."""
    running = _start(tiny_model_paths["llama-q4k-tiny"],
                     tmp_path_factory.mktemp("tools") / "serve.log",
                     "--template", str(TEMPLATES / "chatml_tools.jinja"))
    yield running
    _stop(running)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, server: Server, **fields: Any) -> Any:
    return client.chat.completions.create(model=server.model, **{"messages": ASK, **GREEDY,
                                                                 **fields})


def _streamed_text(client: openai.OpenAI, server: Server, **fields: Any) -> tuple[str, str]:
    """(the streamed answer's text, its finish reason)."""
    text, finish = "", ""
    for chunk in _chat(client, server, stream=True, **fields):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def _refusal(call: Any) -> dict[str, Any]:
    """The OpenAI error object of a request the server refuses with 400."""
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value.response.json()["error"]


# --- response_format ------------------------------------------------------------------------


def test_json_schema_answers_validate_whole_and_streamed(server: Server,
                                                         client: openai.OpenAI) -> None:
    whole = _chat(client, server, response_format=PERSON_FORMAT)
    (choice,) = whole.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    streamed, finish = _streamed_text(client, server, response_format=PERSON_FORMAT)
    assert (streamed, finish) == (choice.message.content, "stop")


def test_json_object_answers_parse_whole_and_streamed(server: Server,
                                                      client: openai.OpenAI) -> None:
    json_object = {"type": "json_object"}
    (choice,) = _chat(client, server, response_format=json_object).choices
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)
    assert _streamed_text(client, server, response_format=json_object) == \
        (choice.message.content, "stop")


def test_a_json_schema_completion(server: Server, client: openai.OpenAI) -> None:
    answer = client.completions.create(model=server.model, prompt="A person:", temperature=0,
                                       max_tokens=96, extra_body={"response_format": PERSON_FORMAT})
    jsonschema.validate(json.loads(answer.choices[0].text), PERSON)


# --- vLLM's guided fields -------------------------------------------------------------------


def test_guided_regex_and_choice_answers_match(server: Server, client: openai.OpenAI) -> None:
    pattern = r"[a-z]{2,6}-[0-9]{2}"
    (choice,) = _chat(client, server, extra_body={"guided_regex": pattern}).choices
    assert re.fullmatch(pattern, choice.message.content) and choice.finish_reason == "stop"
    labels = ["positive", "negative", "neutral"]
    (choice,) = _chat(client, server, extra_body={"guided_choice": labels}).choices
    assert choice.message.content in labels
    completion = client.completions.create(model=server.model, prompt="Sentiment:", max_tokens=8,
                                           temperature=0, extra_body={"guided_choice": labels})
    assert completion.choices[0].text in labels
    streamed, _ = _streamed_text(client, server, extra_body={"guided_json": json.dumps(PERSON)})
    jsonschema.validate(json.loads(streamed), PERSON)


@pytest.mark.parametrize(("fields", "param"), [
    ({"extra_body": {"guided_regex": "a+", "guided_choice": ["x"]}}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_json": {}}},
     "guided_json"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    # Refused by the constraint's compiler in the engine, named as the client spelled it.
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_conflicting_or_bad_constraints_are_400_naming_the_param(
        server: Server, client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    for stream in (False, True):
        error = _refusal(lambda: _chat(client, server, stream=stream, **fields))
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert param in error["message"]


# --- tools ----------------------------------------------------------------------------------


def _checked_call(call: Any) -> dict[str, Any]:
    """A call's arguments, after checking the call has OpenAI's shape and valid arguments."""
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.function.name])
    return arguments


def test_a_required_call_whole_and_streamed(server: Server, client: openai.OpenAI) -> None:
    (choice,) = _chat(client, server, tools=TOOLS, tool_choice="required").choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    arguments = _checked_call(call)

    with client.chat.completions.stream(model=server.model, messages=ASK, tools=TOOLS,
                                        tool_choice="required", **GREEDY) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    (streamed,) = final.choices
    assert streamed.finish_reason == "tool_calls"
    (streamed_call,) = streamed.message.tool_calls
    assert streamed_call.function.name == call.function.name
    assert streamed_call.function.parsed_arguments == arguments
    assert _checked_call(streamed_call) == arguments
    assert events.count("tool_calls.function.arguments.done") == 1
    assert "content.delta" not in events and streamed.message.content is None


def test_a_named_function_is_the_one_called(server: Server, client: openai.OpenAI) -> None:
    for name in PARAMETERS:
        choice = {"type": "function", "function": {"name": name}}
        (answer,) = _chat(client, server, tools=TOOLS, tool_choice=choice).choices
        (call,) = answer.message.tool_calls
        assert call.function.name == name
        _checked_call(call)


def test_a_call_and_its_result_fed_back(server: Server, client: openai.OpenAI) -> None:
    (first,) = _chat(client, server, tools=TOOLS, tool_choice="required").choices
    (call,) = first.message.tool_calls
    conversation = [*ASK, first.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    (answer,) = _chat(client, server, messages=conversation, tools=TOOLS,
                      tool_choice={"type": "function", "function": {"name": "add"}}).choices
    _checked_call(answer.message.tool_calls[0])
    (text,) = _chat(client, server, messages=conversation, tools=TOOLS, max_tokens=8).choices
    assert text.message.content or text.message.tool_calls


def test_tool_choice_none_answers_in_text(server: Server, client: openai.OpenAI) -> None:
    (choice,) = _chat(client, server, tools=TOOLS, tool_choice="none", max_tokens=12).choices
    assert choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length") and choice.message.content


def test_a_template_without_tools_calls_through_the_generic_format(
        tiny_model_paths: dict[str, Path], tmp_path: Path) -> None:
    """Gemma 3's template renders no tools: they are described in a system message and the
    call comes back in the generic format (tests/test_server_tool_formats.py has the rest)."""
    running = _start(tiny_model_paths["llama-q4k-tiny"], tmp_path / "serve.log",
                     "--template", str(TEMPLATES / "gemma3.jinja"))
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        (choice,) = _chat(client, running, tools=TOOLS, tool_choice="required",
                          parallel_tool_calls=False).choices
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        _checked_call(call)
        with httpx.Client(base_url=running.url, timeout=CALL_TIMEOUT_S) as http:
            plain = http.post("/v1/chat/completions", json={
                "model": running.model, "messages": ASK, "tools": TOOLS, "tool_choice": "none",
                "max_tokens": 4})
            assert plain.status_code == 200
    finally:
        _stop(running)


def test_smollm2_with_the_chatml_tools_template_calls_the_right_function(
        smollm2_model_path: Path, tmp_path: Path) -> None:
    """A real model given the template: asked about the weather, it calls get_weather (once
    or more: parallel calls are OpenAI's default, and it repeats its call)."""
    running = _start(smollm2_model_path, tmp_path / "serve.log",
                     "--template", str(TEMPLATES / "chatml_tools.jinja"))
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        (choice,) = _chat(client, running, tools=TOOLS, tool_choice="required").choices
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            _checked_call(call)
        (once,) = _chat(client, running, tools=TOOLS, tool_choice="required",
                        parallel_tool_calls=False).choices
        (call,) = once.message.tool_calls
        assert call.function.name == "get_weather"
    finally:
        _stop(running)


# --- numbers a schema leaves unbounded ------------------------------------------------------

# A negative frequency penalty rewards each digit the answer repeats: pushed so, the tiny llama
# writes digits for as long as the grammar lets it.
DIGITS_PUSHED = {"temperature": 0, "max_tokens": 200, "frequency_penalty": -2}
# (the integral part, the fraction) of each JSON number in a text.
NUMBER = re.compile(r"-?([0-9]+)(?:\.([0-9]+))?")


class Reading(pydantic.BaseModel):
    """Unbounded: pydantic writes a bare {"type": "integer"} and {"type": "number"}."""

    count: int
    ratio: float


# As the openai client's parse() sends it (strict: no other properties, whose names a pushed
# model would write without end).
READING = {**Reading.model_json_schema(), "additionalProperties": False}


def assert_bounded_in_length(text: str) -> None:
    numbers = NUMBER.findall(text)
    assert numbers
    for integral, fraction in numbers:
        assert len(integral) <= 16 and len(fraction) <= 10, text


def test_the_pushed_model_writes_every_digit_a_schema_allows(server: Server,
                                                            client: openai.OpenAI) -> None:
    """The push works, and a schema's own bounds are its own: with 21 digits allowed, the
    answer takes more than the 16 allowed by default."""
    wide = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                   "maximum": 10**20}},
            "required": ["n"], "additionalProperties": False}
    (choice,) = _chat(client, server, response_format={
        "type": "json_schema", "json_schema": {"name": "wide", "schema": wide}},
        **DIGITS_PUSHED).choices
    assert 16 < len(str(json.loads(choice.message.content)["n"])) <= 21


def test_unbounded_numbers_in_a_schema_stay_bounded_and_parse(server: Server,
                                                              client: openai.OpenAI) -> None:
    parsed = client.chat.completions.parse(model=server.model, messages=ASK,
                                           response_format=Reading, **DIGITS_PUSHED)
    (choice,) = parsed.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Reading)
    assert abs(choice.message.parsed.count) <= LARGEST
    assert_bounded_in_length(choice.message.content)
    streamed, finish = _streamed_text(client, server, response_format={
        "type": "json_schema", "json_schema": {"name": "reading", "schema": READING}},
        **DIGITS_PUSHED)
    assert finish == "stop"
    assert_bounded_in_length(streamed)
    Reading.model_validate_json(streamed)
    completion = client.completions.create(
        model=server.model, prompt="A reading:",
        extra_body={"guided_json": READING}, **DIGITS_PUSHED)
    assert completion.choices[0].finish_reason == "stop"
    Reading.model_validate_json(completion.choices[0].text)


def test_an_enforced_call_with_an_unbounded_integer_stays_bounded(
        server: Server, client: openai.OpenAI) -> None:
    tools = [openai.pydantic_function_tool(Reading, name="record")]
    (choice,) = _chat(client, server, tools=tools, tool_choice="required",
                      **DIGITS_PUSHED).choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert_bounded_in_length(call.function.arguments)
    Reading.model_validate_json(call.function.arguments)
