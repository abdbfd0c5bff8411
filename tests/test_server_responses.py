"""`POST /v1/responses` driven with the official `openai` client: `responses.create` whole and
streamed, `responses.parse` and the `responses.stream` helper, with instructions, JSON-schema
output and function tools, and every refusal naming its field.

What a real model cannot be made to do on demand runs in-process over the counting fake
backend: the exact conversation a chat template receives from input items, a failure midway
through a stream, refusals that must start no work. The rest runs `q4k serve` on the tiny
llama with a ChatML template that renders tools (as tests/test_server_structured.py does):
its weights are random, so its free text is nonsense, but an enforced answer (a schema, a
required call) is valid and ends, and greedy decoding makes each answer the same whole and
streamed."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from actors.engine import Engine
from actors.model.text.chat import ChatTemplate
from actors.serve.app import ServerOptions
from actors.serve.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from test_server import Server, _start, _stop
from test_server_structured import ASK, PARAMETERS, PERSON, TEMPLATES
from tests.test_engine_fake import CountingBackend, FakeTokenizer, open_fake
from tests.test_server_fake import MODEL, failing_after, metric, serving, until_ready
from tests.test_server_tool_formats import ScriptedEngine, served, split_every

# The events of one message answer, in OpenAI's order (the deltas collapsed to one).
MESSAGE_EVENTS = [
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added", "response.output_text.delta", "response.output_text.done",
    "response.content_part.done", "response.output_item.done",
]
PERSON_FORMAT = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
# The Responses API's flat function tools; strict, so that the client parses their arguments.
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city",
     "parameters": PARAMETERS["get_weather"], "strict": True},
    {"type": "function", "name": "add", "description": "Add two numbers",
     "parameters": PARAMETERS["add"], "strict": True},
]
# The same tools as /v1/chat/completions takes them.
CHAT_TOOLS = [{"type": "function", "function": {key: value for key, value in tool.items()
                                                if key != "type"}} for tool in TOOLS]
GREEDY = {"temperature": 0, "max_output_tokens": 96}


def collapsed(types: list[str]) -> list[str]:
    """Event types with each run of one type written once."""
    return [kind for index, kind in enumerate(types) if index == 0 or types[index - 1] != kind]


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(the `event:` name, the data) of each server-sent event."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


# --- in-process, over the fake backend --------------------------------------------------------

# Writes each message's role, content, calls and call id, and the tools' names.
TRANSCRIPT_TEMPLATE = (
    "{% for t in tools or [] %}<tool {{ t.function.name }}>{% endfor %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}>{% endfor %}"
    "{% if m.tool_call_id %}<result of {{ m.tool_call_id }}>{% endif %}{% endfor %}"
)


def transcript_template(source: str | None) -> ChatTemplate:
    return ChatTemplate(source or TRANSCRIPT_TEMPLATE, bos_token="", eos_token="")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def serving_ready(open_engine: Callable[[], AbstractAsyncContextManager[Engine]],
                        options: ServerOptions = ServerOptions(),
                        ) -> AsyncIterator[tuple[httpx.AsyncClient, openai.AsyncOpenAI]]:
    """The app over the engine `open_engine` opens, once it is ready: a raw client and the
    openai one (closed on the way out: left open, it would close its connections on a later
    test's event loop, which fails that test)."""
    async with serving(open_engine, options) as http:
        await until_ready(http)
        async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key="unused",
                                      max_retries=0) as client:
            yield http, client


@pytest.mark.anyio
async def test_input_items_reach_the_template_as_the_chat_they_are() -> None:
    backend = CountingBackend(context_length=1024)
    async with serving_ready(lambda: open_fake(backend, chat_template=transcript_template)) as (
            _, client):
        answer = await client.responses.create(
            model=MODEL, instructions="Be brief.", max_output_tokens=1,
            tools=[{"type": "function", "name": "get_weather", "parameters": {}}],
            input=[
                {"role": "developer", "content": "Use Celsius."},
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "Weather "},
                             {"type": "input_text", "text": "in Paris?"}]},
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                 "arguments": '{"city": "Paris"}'},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather",
                 "arguments": '{"city": "Lyon"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
                {"type": "function_call_output", "call_id": "call_2",
                 "output": [{"type": "input_text", "text": "20 C"}]},
                {"role": "user", "content": "And now?"},
            ])
    expected = (
        "<tool get_weather>[system]Be brief.[system]Use Celsius.[user]Weather in Paris?"
        '[assistant]Looking.<tool_call call_1 get_weather {"city": "Paris"}>'
        '<tool_call call_2 get_weather {"city": "Lyon"}>'
        "[tool]18 C<result of call_1>[tool]20 C<result of call_2>[user]And now?"
    )
    (prompt, *_) = backend.steps[0]
    assert prompt.tokens == tuple(FakeTokenizer().encode(expected))
    assert answer.usage.input_tokens == len(expected)
    assert answer.instructions == "Be brief." and answer.store is False


@pytest.mark.anyio
async def test_a_string_input_is_one_user_message() -> None:
    backend = CountingBackend()
    async with serving_ready(lambda: open_fake(backend, chat_template=transcript_template)) as (
            _, client):
        await client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    (prompt, *_) = backend.steps[0]
    assert prompt.tokens == tuple(FakeTokenizer().encode("[user]Hi"))


@pytest.mark.anyio
async def test_an_answer_cut_by_max_output_tokens_is_incomplete_whole_and_streamed() -> None:
    # The fake model never ends an answer on its own: max_output_tokens always cuts it.
    async with serving_ready(lambda: open_fake(CountingBackend(),
                                               chat_template=transcript_template)) as (
            http, client):
        whole = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=5,
                                              temperature=0)
        events = [event async for event in await client.responses.create(
            model=MODEL, input="Hi", max_output_tokens=5, temperature=0, stream=True)]
        finished = await metric(http, 'q4k_requests_total{outcome="length"}')
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    (message,) = whole.output
    assert message.status == "incomplete" and whole.usage.output_tokens == 5
    types = [event.type for event in events]
    assert collapsed(types) == [*MESSAGE_EVENTS, "response.incomplete"]
    assert types.count("response.output_text.delta") == 5
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == whole.output_text == "".join(
        event.delta for event in events if event.type == "response.output_text.delta")
    assert final.output[0].status == "incomplete" and final.usage.output_tokens == 5
    assert {events[0].response.id, final.id} == {final.id}
    assert finished == 2


@pytest.mark.anyio
async def test_a_failure_mid_stream_ends_with_error_and_response_failed() -> None:
    backend = CountingBackend(fail_when=failing_after(3))
    async with serving_ready(lambda: open_fake(backend, chat_template=transcript_template)) as (
            http, _):
        response = await http.post("/v1/responses", json={
            "model": MODEL, "input": "Hi", "max_output_tokens": 50, "temperature": 0,
            "stream": True})
        failed = await metric(http, 'q4k_requests_total{outcome="failed"}')
    assert response.status_code == 200
    events = sse_events(response.text)
    assert all(name == data["type"] for name, data in events)
    (*_, (_, error), (_, last)) = events
    assert (error["type"], error["code"]) == ("error", "compute_error")
    assert (last["type"], last["response"]["status"]) == ("response.failed", "failed")
    assert last["response"]["error"]["message"] == error["message"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert failed == 1


@pytest.mark.anyio
async def test_store_is_accepted_and_nothing_is_kept() -> None:
    async with serving_ready(lambda: open_fake(CountingBackend(),
                                               chat_template=transcript_template)) as (
            http, client):
        answer = await client.responses.create(model=MODEL, input="Hi", store=True,
                                               max_output_tokens=1)
        kept = await http.get(f"/v1/responses/{answer.id}")
    assert answer.store is False  # what the server did, whatever was asked
    assert kept.status_code == 404


WEATHER_CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Paris"}'}


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"conversation": "conv_1"}, "conversation", "stateless"),
    ({"background": True}, "background", "stream: true"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "stateless"),
    ({"truncation": "auto"}, "truncation", "never drops input"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning effort"),
    ({"include": ["message.output_text.logprobs"]}, "include", "/v1/chat/completions"),
    ({"top_logprobs": 3}, "top_logprobs", "/v1/chat/completions"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "stateless"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]", "function_call_output"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input[0].content", "text only"),
    ({"input": [{"role": "tool", "content": "18 C"}]}, "input[0].role",
     "function_call_output"),
    ({"input": [{"role": "user", "content": "Hi"}, {**WEATHER_CALL, "arguments": "[1]"}]},
     "input[1].arguments", "JSON object"),
    ({"input": [WEATHER_CALL, {"type": "function_call_output", "output": "18 C"}]},
     "input[1].call_id", "call_id"),
    ({"input": []}, "input", "no items"),
    ({"input": 5}, "input", "Expected `str | array`"),
    ({"tools": [{"type": "web_search"}]}, "tools", "function tools only"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools", "tools[0].name"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", '"name"'),
    ({"tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", "'g'"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice", "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format", "schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "'xml'"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"max_output_tokens": 9}, "max_output_tokens", "max_output_tokens is 9"),
    # The fake tokenizer: a token a character; "[user]" and 245 of them leave 5 of 256.
    ({"max_output_tokens": 8, "input": "x" * 245}, "max_output_tokens",
     "8 in max_output_tokens"),
    ({"input": "x" * 300}, "input", "shorter than the context"),
])
@pytest.mark.anyio
async def test_refusals_are_400_naming_the_field(fields: dict[str, Any], param: str,
                                                 words: str) -> None:
    backend = CountingBackend()  # a 256-token context
    options = ServerOptions(max_tokens_limit=8)
    async with serving_ready(lambda: open_fake(backend, chat_template=transcript_template),
                             options) as (_, client):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.create(**{"model": MODEL, "input": "Hi", **fields},
                                              stream=stream)
            error = caught.value.response.json()["error"]
            assert (error["param"], error["type"]) == (param, "invalid_request_error")
            assert words in error["message"]
            assert "Traceback" not in caught.value.response.text
    assert backend.steps == []


@pytest.mark.anyio
async def test_an_unknown_model_is_404_and_a_template_refusal_names_input() -> None:
    refusing = "{{ raise_exception('no greeting') }}"
    async with serving_ready(lambda: open_fake(
            CountingBackend(), chat_template=lambda _: transcript_template(refusing))) as (
            http, _):
        unknown = await http.post("/v1/responses", json={"model": "gpt-5", "input": "Hi"})
        refused = await http.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == ("input", "template_error")
    assert "no greeting" in error["message"]


@pytest.mark.anyio
async def test_without_a_template_responses_says_which_flag_to_pass() -> None:
    async with serving_ready(lambda: open_fake(CountingBackend()),
                             ServerOptions(chat_available=False)) as (http, _):
        response = await http.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "template_error" and "/v1/responses" in error["message"]
    assert "--template FILE" in error["message"]


class ControlTagEngine(ScriptedEngine):
    """Answers with Hermes's tags as control tokens whose decoded text is empty (as a
    tokenizer that leaves control tokens out of its text decodes Qwen's), the rest of the
    answer three characters a token."""

    TAGS = {TOOL_CALL_OPEN: 900, TOOL_CALL_CLOSE: 901}

    def tokenize(self, text: str, add_bos: bool | None = None,
                 parse_special: bool = False) -> list[int]:
        if parse_special and text in self.TAGS:
            return [self.TAGS[text]]
        return self._engine.tokenize(text, add_bos=add_bos, parse_special=parse_special)

    def detokenize(self, token_ids: list[int]) -> str:
        if set(token_ids) <= set(self.TAGS.values()):
            return ""
        return self._engine.detokenize(token_ids)

    def tokens(self) -> list[tuple[str, int]]:
        tokens: list[tuple[str, int]] = []
        for part in re.split(f"({TOOL_CALL_OPEN}|{TOOL_CALL_CLOSE})", self.answer):
            if part in self.TAGS:
                tokens.append(("", self.TAGS[part]))
            else:
                tokens += [(text, len(tokens)) for text in split_every(part, 3)]
        return tokens


WEATHER_ARGUMENTS = {"city": "Paris", "unit": "celsius"}
SUM_ARGUMENTS = {"a": 12, "b": 30}
TWO_CALLS = (
    "Checking both.\n"
    f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': WEATHER_ARGUMENTS})}\n"
    f"</tool_call>\n<tool_call>\n{json.dumps({'name': 'add', 'arguments': SUM_ARGUMENTS})}\n"
    "</tool_call>")


@pytest.mark.anyio
async def test_parallel_calls_stream_their_arguments_as_written() -> None:
    """Two calls whose tags are control tokens: read as calls (the tags put back from their
    token ids), each call's arguments streamed in several deltas, whole and streamed alike;
    with parallel_tool_calls false, the first call only."""
    async with served("hermes", TWO_CALLS, ControlTagEngine) as (client, _):
        ask = {"model": MODEL, "input": "Weather in Paris, and 12 + 30?", "tools": TOOLS}
        whole = await client.responses.create(**ask)
        events = [event async for event in await client.responses.create(**ask, stream=True)]
        async with client.responses.stream(**ask) as stream:
            helped = await stream.get_final_response()
        single = await client.responses.create(**ask, parallel_tool_calls=False)
    assert [item.type for item in whole.output] == ["message", "function_call", "function_call"]
    assert whole.output[0].content[0].text == "Checking both."
    calls = [(item.name, json.loads(item.arguments)) for item in whole.output[1:]]
    assert calls == [("get_weather", WEATHER_ARGUMENTS), ("add", SUM_ARGUMENTS)]
    assert [data["sequence_number"] for data in (event.model_dump() for event in events)] == \
        list(range(len(events)))
    final = events[-1].response
    assert final.status == "completed"
    for item in final.output[1:]:
        deltas = [event.delta for event in events
                  if event.type == "response.function_call_arguments.delta"
                  and event.item_id == item.id]
        (done,) = [event for event in events
                   if event.type == "response.function_call_arguments.done"
                   and event.item_id == item.id]
        assert len(deltas) > 1  # streamed as the model writes them, not in one piece
        assert "".join(deltas) == done.arguments == item.arguments
    assert [(item.name, json.loads(item.arguments)) for item in final.output[1:]] == calls
    assert [(item.name, item.parsed_arguments) for item in helped.output[1:]] == calls
    assert [item.type for item in single.output].count("function_call") == 1
    assert single.output[1].name == "get_weather"


# --- `q4k serve` on the tiny llama, with a template that renders tools ----------------------


@pytest.fixture(scope="module")
def server(tiny_model_paths: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = _start(tiny_model_paths["llama-q4k-tiny"],
                     tmp_path_factory.mktemp("responses") / "serve.log",
                     "--template", str(TEMPLATES / "chatml_tools.jinja"))
    yield running
    _stop(running)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


class Add(pydantic.BaseModel):
    a: int = pydantic.Field(ge=-99, le=99)
    b: int = pydantic.Field(ge=-99, le=99)


def _create(client: openai.OpenAI, server: Server, **fields: Any) -> Any:
    return client.responses.create(model=server.model, **{"input": ASK, **GREEDY, **fields})


def _chat_prompt_tokens(client: openai.OpenAI, server: Server, messages: list[Any],
                        **fields: Any) -> int:
    """The prompt tokens of the same conversation sent to /v1/chat/completions."""
    answer = client.chat.completions.create(model=server.model, messages=messages, max_tokens=1,
                                            **fields)
    return answer.usage.prompt_tokens


def _checked_call(item: Any) -> dict[str, Any]:
    """A function_call item's arguments, after checking its shape and the arguments."""
    assert (item.type, item.status) == ("function_call", "completed")
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, PARAMETERS[item.name])
    return arguments


def test_text_with_instructions_is_the_chat_with_a_system_message(
        server: Server, client: openai.OpenAI) -> None:
    instructions = "Answer in one word."
    answer = _create(client, server, instructions=instructions, max_output_tokens=6)
    (message,) = answer.output
    assert message.type == "message" and message.role == "assistant"
    assert answer.output_text == message.content[0].text != ""
    assert answer.usage.output_tokens <= 6
    assert answer.usage.total_tokens == answer.usage.input_tokens + answer.usage.output_tokens
    assert (answer.status == "incomplete") == (answer.incomplete_details is not None)
    system = [{"role": "system", "content": instructions}]
    assert answer.usage.input_tokens == _chat_prompt_tokens(client, server, system + ASK)
    plain = _create(client, server, max_output_tokens=1)
    assert plain.usage.input_tokens == _chat_prompt_tokens(client, server, ASK)
    assert plain.usage.input_tokens < answer.usage.input_tokens


def test_a_json_schema_answer_parses(server: Server, client: openai.OpenAI) -> None:
    answer = _create(client, server, text={"format": PERSON_FORMAT})
    assert answer.status == "completed" and answer.incomplete_details is None
    jsonschema.validate(json.loads(answer.output_text), PERSON)
    assert answer.text.format.type == "json_schema"
    parsed = client.responses.parse(model=server.model, input=ASK, text_format=Person, **GREEDY)
    assert isinstance(parsed.output_parsed, Person)


def test_streamed_events_come_in_order_and_end_as_the_whole_answer(
        server: Server, client: openai.OpenAI) -> None:
    whole = _create(client, server, text={"format": PERSON_FORMAT})
    events = list(_create(client, server, text={"format": PERSON_FORMAT}, stream=True))
    types = [event.type for event in events]
    assert collapsed(types) == [*MESSAGE_EVENTS, "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    item_ids = {event.item_id for event in events if hasattr(event, "item_id")}
    assert item_ids == {events[2].item.id}
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    done = next(event for event in events if event.type == "response.output_text.done")
    final = events[-1].response
    assert deltas == done.text == final.output_text == whole.output_text
    assert final.status == "completed" and final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_the_stream_helper_parses_a_json_schema_answer(server: Server,
                                                       client: openai.OpenAI) -> None:
    with client.responses.stream(model=server.model, input=ASK, text_format=Person,
                                 **GREEDY) as stream:
        done = [event for event in stream if event.type == "response.output_text.done"]
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Person)
    assert done[0].parsed == final.output_parsed


def test_a_function_call_round_trip(server: Server, client: openai.OpenAI) -> None:
    first = _create(client, server, tools=TOOLS, tool_choice="required")
    assert first.status == "completed"
    (call,) = first.output
    _checked_call(call)
    conversation = [*ASK, *(item.model_dump(exclude_none=True) for item in first.output),
                    {"type": "function_call_output", "call_id": call.call_id,
                     "output": "18 C, sunny"}]
    second = _create(client, server, input=conversation, tools=TOOLS,
                     tool_choice={"type": "function", "name": "add"})
    (added,) = second.output
    assert added.name == "add" and added.call_id != call.call_id
    _checked_call(added)
    # The call and its output are rendered as the chat path renders a call and a tool result.
    chat = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}]
    assert second.usage.input_tokens == _chat_prompt_tokens(
        client, server, chat, tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}})
    answer = _create(client, server, input=conversation, tools=TOOLS, max_output_tokens=8)
    assert answer.output and answer.usage.output_tokens <= 8


def test_tool_choice_none_answers_in_text(server: Server, client: openai.OpenAI) -> None:
    answer = _create(client, server, tools=TOOLS, tool_choice="none", max_output_tokens=6)
    assert [item.type for item in answer.output] == ["message"]
    assert answer.tool_choice == "none" and [tool.name for tool in answer.tools] == [
        "get_weather", "add"]


def test_the_stream_helper_reads_a_function_call(server: Server, client: openai.OpenAI) -> None:
    add_only = {"type": "function", "name": "add"}
    whole = _create(client, server, tools=TOOLS, tool_choice=add_only)
    with client.responses.stream(model=server.model, input=ASK, tools=TOOLS, tool_choice=add_only,
                                 **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert collapsed([event.type for event in events]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    (call,) = final.output
    assert call.parsed_arguments == _checked_call(call)  # strict tools: parsed by the client
    done = next(event for event in events
                if event.type == "response.function_call_arguments.done")
    assert call.arguments == done.arguments == whole.output[0].arguments
    # A pydantic model as the tool: its arguments come back as that model.
    as_model = openai.pydantic_function_tool(Add, name="add")
    with client.responses.stream(model=server.model, input=ASK, tools=[as_model],
                                 tool_choice=add_only, **GREEDY) as stream:
        (call,) = stream.get_final_response().output
    assert isinstance(call.parsed_arguments, Add)
    assert call.parsed_arguments.model_dump() == _checked_call(call)


def test_a_schema_the_engine_refuses_is_400_naming_text_format(
        server: Server, client: openai.OpenAI) -> None:
    broken = {"type": "json_schema", "name": "broken", "schema": {
        "type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            _create(client, server, text={"format": broken}, stream=stream)
        error = caught.value.response.json()["error"]
        assert error["param"] == "text.format" and "text.format" in error["message"]
