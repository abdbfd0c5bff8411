"""The smaller points of the OpenAI protocol, with the official `openai` client and raw HTTP:
how a stream ends (an empty delta carrying the finish reason, then the usage chunk), fields
outside the ranges OpenAI takes them in (400s naming the field), `system_fingerprint`, CORS
(`q4k serve --cors-origin`) beside the API key and the Host / Origin guard.

In-process over the counting fake backend, or over a fake engine that answers a set text
through a real chat template (tests/test_server_tool_formats.py's `served`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from actors.cli import build_parser
from actors.serve.app import ServerOptions
from actors.serve.fingerprint import ENGINE_VERSION, model_digest, system_fingerprint
from actors.serve.guard import RequestLimits
from test_server import _start, _stop
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


APP = "http://localhost:5173"  # a web app's dev server, calling the API from a browser
KEY = "sk-test"
PREFLIGHT = {"origin": APP, "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type, x-stainless-os"}


def cors_headers(response: httpx.Response) -> dict[str, str]:
    return {name: value for name, value in response.headers.items()
            if name.startswith("access-control-")}


async def test_a_preflight_from_an_allowed_origin_is_answered_without_the_key() -> None:
    limits = RequestLimits(api_key=KEY, cors_origins=(APP, "https://app.example.com"))
    async with serving(lambda: open_fake(CountingBackend()), limits=limits) as http:
        await until_ready(http)
        preflight = await http.options("/v1/chat/completions", headers=PREFLIGHT)
        async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key=KEY,
                                      max_retries=0, default_headers={"Origin": APP}) as client:
            answer = await client.completions.with_raw_response.create(
                model=MODEL, prompt="Hi", max_tokens=2)
        keyless = await http.post("/v1/completions", headers={"origin": APP},
                                  json={"model": MODEL, "prompt": "Hi"})
        # An allowed origin is served whatever its host (the Origin guard lets it through).
        elsewhere = await http.get("/v1/models", headers={
            "origin": "https://app.example.com", "authorization": f"Bearer {KEY}"})
    assert preflight.status_code == 204 and preflight.content == b""
    assert cors_headers(preflight) == {
        "access-control-allow-origin": APP,
        "access-control-allow-methods": "GET, POST, OPTIONS",
        "access-control-allow-headers": PREFLIGHT["access-control-request-headers"],
        "access-control-max-age": "600",
        "access-control-expose-headers": "Retry-After",
    }
    assert answer.status_code == 200 and answer.parse().choices[0].text is not None
    assert answer.headers["access-control-allow-origin"] == APP
    assert answer.headers["vary"] == "Origin"
    # A refusal carries the headers too, so that the page can read why.
    assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "invalid_api_key"
    assert keyless.headers["access-control-allow-origin"] == APP
    assert elsewhere.status_code == 200
    assert elsewhere.headers["access-control-allow-origin"] == "https://app.example.com"


async def test_origins_not_allowed_get_no_cors_headers() -> None:
    async with serving(lambda: open_fake(CountingBackend()),
                       limits=RequestLimits(api_key=KEY)) as http:
        await until_ready(http)
        # Nothing is allowed by default, not even a page on this machine.
        by_default = await http.options("/v1/chat/completions", headers=PREFLIGHT)
        same_machine = await http.get("/v1/models", headers={
            "origin": APP, "authorization": f"Bearer {KEY}"})
    limits = RequestLimits(api_key=KEY, cors_origins=("https://app.example.com",))
    async with serving(lambda: open_fake(CountingBackend()), limits=limits) as http:
        await until_ready(http)
        other_origin = await http.options("/v1/chat/completions", headers=PREFLIGHT)
        foreign = await http.options("/v1/chat/completions", headers={
            **PREFLIGHT, "origin": "https://evil.example"})
    for refused in (by_default, other_origin):
        assert refused.status_code == 403 and cors_headers(refused) == {}
        assert refused.json()["error"]["code"] == "cors_origin_not_allowed"
        assert "--cors-origin" in refused.json()["error"]["message"]
    assert same_machine.status_code == 200 and cors_headers(same_machine) == {}
    # A page of a host the server does not answer to is refused by the Origin guard.
    assert foreign.status_code == 403 and cors_headers(foreign) == {}
    assert foreign.json()["error"]["code"] == "origin_not_allowed"


async def test_any_origin_with_a_star() -> None:
    async with serving(lambda: open_fake(CountingBackend()),
                       limits=RequestLimits(cors_origins=("*",))) as http:
        await until_ready(http)
        preflight = await http.options("/v1/models", headers={
            "origin": "https://any.example", "access-control-request-method": "GET"})
        answer = await http.get("/v1/models", headers={"origin": "https://any.example"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "https://any.example"
    assert "access-control-allow-headers" not in preflight.headers  # none were asked for
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == "https://any.example"


def test_cors_origins_are_read_as_browsers_send_them(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--cors-origin", "HTTP://LocalHost:5173/",
                                      "--cors-origin", "*"])
    assert args.cors_origin == [APP, "*"]
    for bad in ("localhost:5173", "http://localhost:5173/app", "http://"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--cors-origin", bad])
        assert "--cors-origin: must be an origin" in capsys.readouterr().err


CHATML_TOOLS = Path(__file__).parent.parent / "examples" / "chat_templates" / "chatml_tools.jinja"


def test_q4k_serve_takes_cors_origins_and_names_its_model_file(
        tiny_model_paths: dict[str, Path], tmp_path: Path) -> None:
    model = tiny_model_paths["llama-q4k-tiny"]
    server = _start(model, tmp_path / "serve.log", "--template", str(CHATML_TOOLS),
                    "--api-key", KEY, "--cors-origin", APP)
    try:
        with httpx.Client(base_url=server.url) as http:
            preflight = http.options("/v1/chat/completions", headers=PREFLIGHT)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                               default_headers={"Origin": APP})
        chat = client.chat.completions.with_raw_response.create(
            model=server.model, messages=HI, max_tokens=2)
        chunks = list(client.chat.completions.create(model=server.model, messages=HI,
                                                     max_tokens=2, stream=True))
        completion = client.completions.create(model=server.model, prompt="Hi", max_tokens=2)
    finally:
        _stop(server)
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == APP
    assert chat.headers["access-control-allow-origin"] == APP
    # The model file's digest, the CPU backend, this engine: one string for every reply.
    expected = system_fingerprint(model_digest(model), on_gpu=False)
    assert {chat.parse().system_fingerprint, completion.system_fingerprint,
            *(chunk.system_fingerprint for chunk in chunks)} == {expected}
