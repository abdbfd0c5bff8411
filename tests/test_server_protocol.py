"""OpenAI request bodies read into engine requests: defaults, aliases, and every refusal naming
the field as the client spelled it."""

from __future__ import annotations

import json

import msgspec
import pytest

from actors.errors import ContextLengthExceeded, InvalidRequest
from actors.model.text.chat import MAX_TEMPLATE_KWARGS_CHARS
from actors.params import MAX_CONSTRAINT_CHARS
from actors.serve.protocol import (
    AS_SENT,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    JSON_PIECE_BYTES,
    MAX_ARGUMENTS_JSON_BYTES,
    MAX_TOOL_CHOICE_JSON_BYTES,
    chat_generation,
    completion_generation,
    read_json,
)
from actors.serve.tools import MAX_TOOLS_JSON_BYTES

CONTEXT = 8192


def body(**fields: object) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def chat(**fields: object) -> bytes:
    return body(messages=[{"role": "user", "content": "hi"}], **fields)


def test_completion_defaults_and_fields() -> None:
    generation = completion_generation(body(prompt="hi", stop="\n", seed=3, top_k=5,
                                            stream=True, stream_options={"include_usage": True},
                                            some_future_field=1))
    params = generation.params
    assert params.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS
    assert (params.stop, params.seed, params.top_k, params.temperature) == (("\n",), 3, 5, 1.0)
    assert generation.stream and generation.include_usage
    assert generation.prompt == "hi" and generation.messages is None


@pytest.mark.parametrize(("prompt", "expected"), [
    ([1, 2, 3], [1, 2, 3]), (["one"], "one"), ([[4, 5]], [4, 5]), ([[["deep"]]], "deep"), ([], []),
])
def test_prompts_of_one(prompt: object, expected: object) -> None:
    assert completion_generation(body(prompt=prompt)).prompt == expected


def test_chat_runs_to_the_end_of_the_context_unless_limited() -> None:
    unlimited = chat_generation(chat(), CONTEXT)
    assert unlimited.params.max_tokens == CONTEXT
    assert unlimited.max_tokens_field is None  # so the engine stops at the context's end
    limited = chat_generation(chat(max_tokens=9, max_completion_tokens=7), CONTEXT)
    assert limited.params.max_tokens == 7
    assert limited.max_tokens_field == "max_completion_tokens"


def test_the_max_tokens_limit_caps_defaults_and_refuses_more() -> None:
    assert chat_generation(chat(), CONTEXT, max_tokens_limit=100).params.max_tokens == 100
    assert completion_generation(body(prompt="hi"), max_tokens_limit=4).params.max_tokens == 4
    assert chat_generation(chat(max_tokens=100), CONTEXT, 100).params.max_tokens == 100
    for request, field in ((chat(max_completion_tokens=101), "max_completion_tokens"),
                           (chat(max_tokens=101), "max_tokens")):
        with pytest.raises(InvalidRequest) as caught:
            chat_generation(request, CONTEXT, max_tokens_limit=100)
        assert caught.value.field == field
        assert f"{field} is 101" in str(caught.value) and "(100;" in str(caught.value)


def test_chat_messages_as_templates_take_them() -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                     {"type": "text", "text": "there"}], "name": "ann"},
        {"role": "assistant", "content": None},
    ]
    generation = chat_generation(body(messages=messages), CONTEXT)
    assert generation.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": ""},
    ]


def test_chat_template_kwargs_are_vllms_field() -> None:
    kwargs = {"enable_thinking": False, "persona": {"name": "Ada", "tags": ["terse"]}}
    assert chat_generation(chat(chat_template_kwargs=kwargs), CONTEXT).chat_template_kwargs \
        == kwargs
    assert chat_generation(chat(), CONTEXT).chat_template_kwargs == {}
    assert chat_generation(chat(chat_template_kwargs=None), CONTEXT).chat_template_kwargs == {}


def test_n_and_logit_bias_reach_the_engines_request() -> None:
    generation = chat_generation(chat(n=3, logit_bias={"5": 100, "0012": -100.0}), CONTEXT)
    assert generation.n == 3
    assert generation.params.logit_bias == {5: 100.0, 12: -100.0}
    plain = completion_generation(body(prompt="hi"))
    assert (plain.n, plain.params.logit_bias) == (1, None)


def test_chat_logprobs() -> None:
    assert chat_generation(chat(logprobs=True), CONTEXT).params.logprobs == 0
    assert chat_generation(chat(logprobs=True, top_logprobs=4), CONTEXT).params.logprobs == 4
    assert chat_generation(chat(), CONTEXT).params.logprobs is None


@pytest.mark.parametrize(("fields", "field"), [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"n": 0}, "n"),
    ({"logit_bias": {"12345678901": -100}}, "logit_bias"),
    ({"temperature": -1}, "temperature"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"chat_template_kwargs": True}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"": 1}}, "chat_template_kwargs"),
])
def test_chat_refusals_name_the_field(fields: dict[str, object], field: str) -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(InvalidRequest) as caught:
        chat_generation(body(**request), CONTEXT)
    assert caught.value.field == field
    assert field in str(caught.value)


@pytest.mark.parametrize(("fields", "field"), [
    ({"echo": True}, "echo"),
    ({"suffix": "!"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"prompt": [1, "two"]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [[[[]]]] * 1000}, "prompt"),
    ({"prompt": [[1], [2]]}, "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": "many"}, "max_tokens"),
])
def test_completion_refusals_name_the_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        completion_generation(body(**{"prompt": "hi", **fields}))
    assert caught.value.field == field


def test_a_body_that_is_not_a_json_object() -> None:
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        completion_generation(b"{")
    with pytest.raises(InvalidRequest, match="model") as caught:
        completion_generation(b'{"prompt": "hi"}')
    assert caught.value.field == "model"


def test_an_unknown_role_lists_every_role_the_server_takes() -> None:
    with pytest.raises(InvalidRequest) as caught:
        chat_generation(body(messages=[{"role": "wizard", "content": "hi"}]), CONTEXT)
    assert caught.value.field == "messages"
    message = str(caught.value)
    assert "'wizard'" in message
    for role in ("system", "user", "assistant", "tool", "developer"):
        assert role in message


# --- what a body builds, bounded before it is built ----------------------------------------


@pytest.mark.parametrize(("messages", "field"), [
    # The first item is malformed: the length is checked before any item is read.
    ([{"role": 5}] * CONTEXT, "messages"),
    ([{"role": "user", "content": [{"type": "image_url"}] * CONTEXT}], "messages[0].content"),
    ([{"role": "assistant", "tool_calls": [{"call": None}] * CONTEXT}], "messages[0].tool_calls"),
])
def test_a_chat_list_longer_than_the_context_is_refused_from_its_length(
        messages: list[object], field: str) -> None:
    with pytest.raises(ContextLengthExceeded) as caught:
        chat_generation(body(messages=messages), CONTEXT)
    assert caught.value.field == field
    assert f"{CONTEXT:,} items" in str(caught.value) and f"{CONTEXT:,} tokens" in str(caught.value)
    shorter = chat_generation(body(messages=[{"role": "user", "content": "hi"}] * (CONTEXT - 1)),
                              CONTEXT)
    assert len(shorter.messages) == CONTEXT - 1


def padded(size: int) -> str:
    return "x" * size


@pytest.mark.parametrize(("fields", "field", "limit"), [
    # Each holds something malformed that reading would report: the size is checked first.
    ({"guided_json": "{" + padded(AS_SENT * MAX_CONSTRAINT_CHARS)}, "guided_json",
     AS_SENT * MAX_CONSTRAINT_CHARS),
    ({"response_format": {"type": "bogus", "pad": padded(AS_SENT * MAX_CONSTRAINT_CHARS)}},
     "response_format", AS_SENT * MAX_CONSTRAINT_CHARS),
    ({"chat_template_kwargs": {"not a name": padded(AS_SENT * MAX_TEMPLATE_KWARGS_CHARS)}},
     "chat_template_kwargs", AS_SENT * MAX_TEMPLATE_KWARGS_CHARS),
    ({"tool_choice": {"type": "bogus", "pad": padded(MAX_TOOL_CHOICE_JSON_BYTES)}},
     "tool_choice", MAX_TOOL_CHOICE_JSON_BYTES),
    ({"tools": [{"type": "bogus", "pad": padded(AS_SENT * MAX_TOOLS_JSON_BYTES)}]}, "tools",
     AS_SENT * MAX_TOOLS_JSON_BYTES),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": "[" + padded(MAX_ARGUMENTS_JSON_BYTES)}}]}]},
     "messages[0].tool_calls", MAX_ARGUMENTS_JSON_BYTES),
])
def test_a_field_past_its_size_is_refused_before_it_is_read(fields: dict[str, object],
                                                            field: str, limit: int) -> None:
    with pytest.raises(InvalidRequest) as caught:
        chat_generation(body(**{"messages": [{"role": "user", "content": "hi"}], **fields}),
                        CONTEXT)
    assert caught.value.field == field
    assert f"bytes of JSON; this server reads at most {limit:,}" in str(caught.value)


def test_what_a_message_holds_beyond_its_fields_is_never_read() -> None:
    unread = {"name": {"nested": [[[[]]]] * 10_000}, "audio": None, "refusal": [1, {"x": 2}]}
    generation = chat_generation(body(messages=[
        {"role": "user", "content": [{"type": "text", "text": "a", "cache": [[]] * 10}], **unread},
        {"role": "tool", "content": "18 C", "tool_call_id": {"not": "a string"}},
    ]), CONTEXT)
    assert generation.messages == [{"role": "user", "content": "a"},
                                   {"role": "tool", "content": "18 C"}]


def test_large_json_is_read_a_piece_at_a_time_into_the_same_value(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No call that builds objects reads more than JSON_PIECE_BYTES of arrays or objects (a
    long string is one copy); the value is what one call would have read."""
    value = {"type": "object", "rows": [[[index, {"k": None}]] for index in range(40_000)],
             "text": "t" * (2 * JSON_PIECE_BYTES),
             "map": {f"k{index}": [index, 1.5] for index in range(30_000)}}
    data = json.dumps(value).encode()
    built: list[int] = []  # the size of each read into Python objects, but a string's
    decode = msgspec.json.decode

    def recording(data: bytes | msgspec.Raw, **options: object) -> object:
        if "type" not in options and not bytes(data).startswith(b'"'):
            built.append(len(data))
        return decode(data, **options)

    monkeypatch.setattr(msgspec.json, "decode", recording)
    assert read_json(data) == value
    assert built and max(built) <= JSON_PIECE_BYTES < len(data)
    monkeypatch.undo()
    schema_text = json.dumps({"type": "object", "properties": value["map"]})
    generation = completion_generation(body(prompt="hi", guided_json=schema_text))
    assert generation.params.structured.json_schema == json.loads(schema_text)
