"""The smaller points of the OpenAI protocol, with the official `openai` client and raw HTTP:
how a stream ends (an empty delta carrying the finish reason, then the usage chunk), fields
outside the ranges OpenAI takes them in (400s naming the field), `system_fingerprint`.

In-process over the counting fake backend, or over a fake engine that answers a set text
through a real chat template (tests/test_server_tool_formats.py's `served`)."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

from actors.serve.app import ServerOptions
from actors.serve.fingerprint import ENGINE_VERSION
from tests.test_engine_fake import CountingBackend, open_fake
from tests.test_server_fake import MODEL, serving, until_ready
from tests.test_server_tool_formats import ADD, served

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sse_chunks(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON chunks of a stream, checked to end with `[DONE]`."""
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


def assert_ends_as_openai_does(chunks: list[dict[str, Any]], final_choice: dict[str, Any],
                               usage: bool) -> None:
    """Every chunk but the last one or two carries no finish reason; then one choice with
    nothing but the finish reason; then, with include_usage, `choices: []` and the usage."""
    if usage:
        *chunks, last = chunks
        assert last["choices"] == [] and last["usage"]["total_tokens"] > 0
        assert all(chunk["usage"] is None for chunk in chunks)
    *answer, final = chunks
    assert answer and all(chunk["choices"][0]["finish_reason"] is None for chunk in answer)
    assert final["choices"] == [final_choice]


@pytest.mark.parametrize("usage", [False, True])
async def test_a_chat_stream_ends_with_an_empty_delta_and_the_finish_reason(usage: bool) -> None:
    async with served("generic", "Hello there, friend.") as (client, _):
        async with httpx.AsyncClient(base_url=str(client.base_url)) as http:
            response = await http.post("/chat/completions", json={
                "model": MODEL, "messages": HI, "stream": True,
                "stream_options": {"include_usage": usage}})
        chunks = sse_chunks(response)
        assert_ends_as_openai_does(chunks, {"index": 0, "delta": {}, "logprobs": None,
                                            "finish_reason": "stop"}, usage)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert len({chunk["system_fingerprint"] for chunk in chunks}) == 1
        # The client's own stream helper rebuilds the whole answer from these chunks.
        async with client.chat.completions.stream(model=MODEL, messages=HI) as stream:
            final = await stream.get_final_completion()
    assert final.choices[0].message.content == "Hello there, friend."
    assert final.choices[0].finish_reason == "stop"


async def test_a_stream_of_calls_ends_with_an_empty_delta_and_tool_calls() -> None:
    call = json.dumps({"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    async with served("generic", call) as (client, _):
        async with httpx.AsyncClient(base_url=str(client.base_url)) as http:
            response = await http.post("/chat/completions", json={
                "model": MODEL, "messages": HI, "tools": [ADD], "stream": True})
        async with client.chat.completions.stream(model=MODEL, messages=HI,
                                                  tools=[ADD]) as stream:
            final = await stream.get_final_completion()
    assert_ends_as_openai_does(sse_chunks(response), {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}, False)
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"a": 1, "b": 2}


@pytest.mark.parametrize("usage", [False, True])
async def test_a_completion_stream_ends_with_empty_text_and_the_finish_reason(
        usage: bool) -> None:
    async with serving(lambda: open_fake(CountingBackend())) as http:
        await until_ready(http)
        response = await http.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 5, "logprobs": 2, "stream": True,
            "stream_options": {"include_usage": usage}, "temperature": 0})
        async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key="unused",
                                      max_retries=0) as client:
            streamed = [chunk async for chunk in await client.completions.create(
                model=MODEL, prompt="Hi", max_tokens=5, stream=True, temperature=0)]
            whole = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=5,
                                                    temperature=0)
    chunks = sse_chunks(response)
    assert_ends_as_openai_does(chunks, {"index": 0, "text": "", "logprobs": None,
                                        "finish_reason": "length"}, usage)
    # Each token's logprobs come with its text, none with the finish.
    scored = [chunk for chunk in chunks if chunk["choices"] and chunk["choices"][0]["logprobs"]]
    assert sum(len(chunk["choices"][0]["logprobs"]["tokens"]) for chunk in scored) == 5
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole.choices[0].text
    assert [chunk.choices[0].finish_reason for chunk in streamed][-2:] == [None, "length"]


# (the fields sent, the param the 400 names, words of its message)
CHAT_OUT_OF_RANGE = [
    ({"temperature": 2.5}, "temperature", "[0, 2]"),
    ({"temperature": -0.5}, "temperature", "[0, 2]"),
    ({"top_p": 1.5}, "top_p", "[0, 1]"),
    ({"top_p": -0.1}, "top_p", "[0, 1]"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    ({"n": 0}, "n", "at least 1"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_completion_tokens": -3}, "max_completion_tokens", "at least 1"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0..20"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "0..20"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"hello": 1}}, "logit_bias", "not a token id"),
    ({"seed": 1.5}, "seed", "int"),
]
COMPLETION_OUT_OF_RANGE = [
    ({"temperature": 3}, "temperature", "[0, 2]"),
    ({"top_p": 2}, "top_p", "[0, 1]"),
    ({"presence_penalty": -3}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    ({"n": -1}, "n", "at least 1"),
    ({"max_tokens": -1}, "max_tokens", "at least 1"),
    ({"logprobs": 21}, "logprobs", "0..20"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias", "[-100, 100]"),
    ({"seed": "seven"}, "seed", "int"),
]
RESPONSES_OUT_OF_RANGE = [
    ({"temperature": 2.01}, "temperature", "[0, 2]"),
    ({"top_p": 1.01}, "top_p", "[0, 1]"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
]


async def test_fields_out_of_openais_ranges_are_400s_naming_them() -> None:
    backend = CountingBackend()
    async with served("generic", "Fine.") as (client, _):
        for fields, param, words in CHAT_OUT_OF_RANGE:
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as caught:
                    await client.chat.completions.create(model=MODEL, messages=HI,
                                                         stream=stream, **fields)
                assert_names(caught.value, param, words)
        for fields, param, words in RESPONSES_OUT_OF_RANGE:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.create(model=MODEL, input="Hi", **fields)
            assert_names(caught.value, param, words)
        # The ends of each range are served.
        edges = await client.chat.completions.create(
            model=MODEL, messages=HI, temperature=2, top_p=1, presence_penalty=-2,
            frequency_penalty=2, n=1, max_tokens=1, logprobs=True, top_logprobs=20)
        assert edges.choices[0].finish_reason in ("stop", "length")
    async with serving(lambda: open_fake(backend)) as http:
        await until_ready(http)
        async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key="unused",
                                      max_retries=0) as completions_client:
            for fields, param, words in COMPLETION_OUT_OF_RANGE:
                with pytest.raises(openai.BadRequestError) as caught:
                    await completions_client.completions.create(model=MODEL, prompt="Hi",
                                                                **fields)
                assert_names(caught.value, param, words)
    assert backend.steps == []  # refused before any work


def assert_names(error: openai.BadRequestError, param: str, words: str) -> None:
    body = error.response.json()["error"]
    assert (body["param"], body["type"]) == (param, "invalid_request_error"), body
    assert words in body["message"], body
    assert "Traceback" not in error.response.text


FINGERPRINT = re.compile(rf"fp_q4k-{re.escape(ENGINE_VERSION)}-cpu-[0-9a-f]{{10}}")


async def test_every_reply_and_chunk_carries_one_system_fingerprint() -> None:
    fingerprints = []
    for digest in ("ab" * 32, "ab" * 32, "cd" * 32):
        async with serving(lambda: open_fake(CountingBackend()),
                           ServerOptions(model_digest=digest)) as http:
            await until_ready(http)
            async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key="unused",
                                          max_retries=0) as client:
                whole = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
                chunks = [chunk async for chunk in await client.completions.create(
                    model=MODEL, prompt="Hi", max_tokens=3, stream=True,
                    stream_options={"include_usage": True})]
        seen = {whole.system_fingerprint, *(chunk.system_fingerprint for chunk in chunks)}
        (fingerprint,) = seen
        assert FINGERPRINT.fullmatch(fingerprint)
        fingerprints.append(fingerprint)
    # The same engine, backend and model file: the same string; another file: another.
    assert fingerprints[0] == fingerprints[1] != fingerprints[2]
    assert fingerprints[0].endswith("-abababab" + "ab")
