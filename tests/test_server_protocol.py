"""OpenAI request bodies read into engine requests: defaults, aliases, and every refusal naming
the field as the client spelled it."""

from __future__ import annotations

import json

import pytest

from actors.errors import InvalidRequest
from actors.serve.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    chat_generation,
    completion_generation,
)

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
    ([1, 2, 3], [1, 2, 3]), (["one"], "one"), ([[4, 5]], [4, 5]),
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
    ({"n": 2}, "n"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
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
