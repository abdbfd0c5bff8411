"""The server app in-process (uvicorn on 127.0.0.1) over the counting fake backend: what a real
model cannot be made to do on demand, fast: a model still loading, failing steps, exactly
which steps carried a request whose client disconnected, and the server's own limits (the
context, --max-tokens-limit, chat without a template); what a chat template gets from a
request (chat_template_kwargs) and its refusals."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial

import anyio
import httpx
import pytest
import uvicorn

from actors.compute.contract import StepItem
from actors.engine import Engine
from actors.model.text.chat import ChatTemplate
from actors.serve.app import ServerOptions, build_app
from actors.serve.guard import RequestLimits
from tests.test_engine_fake import CountingBackend, FakeTokenizer, open_fake

pytestmark = pytest.mark.anyio
MODEL = "fake"
PROMPT = "hello there"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def serving(open_engine: Callable[[], AbstractAsyncContextManager[Engine]],
                  options: ServerOptions = ServerOptions(),
                  limits: RequestLimits | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """The app on a free loopback port, and a client for it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    config = uvicorn.Config(build_app(open_engine, MODEL, options=options, limits=limits),
                            log_config=None, lifespan="on")
    server = uvicorn.Server(config)
    url = "http://127.0.0.1:%d" % listener.getsockname()[1]
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(server.serve, [listener])
        try:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                yield client
        finally:
            server.should_exit = True


async def until_ready(client: httpx.AsyncClient) -> None:
    while (await client.get("/health")).status_code != 200:
        await anyio.sleep(0.01)


def failing_after(steps: int) -> Callable[[Sequence[StepItem]], bool]:
    """A backend failure that starts after `steps` good steps and never stops."""
    seen = []

    def fail(items: Sequence[StepItem]) -> bool:
        seen.append(items)
        return len(seen) > steps

    return fail


async def metric(client: httpx.AsyncClient, sample: str) -> float:
    text = (await client.get("/metrics")).text
    return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines()
                      if line.startswith(sample + " ")))


async def test_health_is_503_until_the_engine_has_opened() -> None:
    may_open = anyio.Event()

    @asynccontextmanager
    async def slow_open() -> AsyncIterator[Engine]:
        await may_open.wait()
        async with open_fake(CountingBackend()) as engine:
            yield engine

    async with serving(slow_open) as client:
        loading = await client.get("/health")
        refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT})
        may_open.set()
        await until_ready(client)
        assert (await client.get("/health")).json() == {"status": "ok"}
    assert loading.status_code == 503 and loading.headers["Retry-After"] == "1"
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "model_not_ready"


async def test_a_failing_computation_is_500_whole_or_streamed() -> None:
    # Every step fails from the start: the request fails before any token, so even a stream
    # answers with the status code.
    async with serving(lambda: open_fake(CountingBackend(fail_when=failing_after(0)))) as client:
        await until_ready(client)
        whole = await client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT})
        streamed = await client.post("/v1/completions",
                                     json={"model": MODEL, "prompt": PROMPT, "stream": True})
        failed = await metric(client, 'q4k_requests_total{outcome="failed"}')
    for response in (whole, streamed):
        assert response.status_code == 500
        assert response.json()["error"]["code"] == "compute_error"
        assert "Traceback" not in response.text
    assert failed == 2


async def test_a_failure_mid_stream_is_an_error_event() -> None:
    async with serving(lambda: open_fake(CountingBackend(fail_when=failing_after(3)))) as client:
        await until_ready(client)
        # Greedy: sampled at the default temperature, the fake's rows let any token win, an
        # end-of-text one (an early "stop") or one with no text (no event of its own) included.
        response = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": 50,
            "temperature": 0})
        failed = await metric(client, 'q4k_requests_total{outcome="failed"}')
    events = [line[len("data: "):] for line in response.text.splitlines() if line]
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2]] == [None] * 3
    assert json.loads(events[-2])["error"]["code"] == "compute_error"
    assert failed == 1


async def assert_dropped_within_a_step(client: httpx.AsyncClient, backend: CountingBackend,
                                       steps_at_close: int) -> None:
    """Once the cancelled request has left the batch: the steps run since its client left are
    the one in flight at the close and at most one the scheduler built before the disconnect
    reached it, never the ~200 its answer had left; and it counts as cancelled."""
    while await metric(client, "q4k_requests_running"):
        await anyio.sleep(0.01)
    assert len(backend.steps) - steps_at_close <= 2
    assert await metric(client, 'q4k_requests_total{outcome="cancelled"}') == 1


async def test_a_disconnect_drops_the_sequence_after_the_step_in_flight() -> None:
    backend = CountingBackend(step_seconds=0.02)
    async with serving(lambda: open_fake(backend)) as client:
        await until_ready(client)
        body = {"model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": 200,
                "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: {")
            steps_before_close = len(backend.steps)
        # Leaving the block closed the connection mid-answer.
        await assert_dropped_within_a_step(client, backend, steps_before_close)


async def test_a_disconnect_cancels_a_whole_answer_too() -> None:
    backend = CountingBackend(step_seconds=0.02)
    async with serving(lambda: open_fake(backend)) as client:
        await until_ready(client)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
        async with anyio.create_task_group() as tasks:
            async with httpx.AsyncClient(base_url=str(client.base_url)) as leaving:
                tasks.start_soon(partial(leaving.post, "/v1/completions", json=body))
                while len(backend.steps) < 3:  # it is decoding
                    await anyio.sleep(0.01)
                tasks.cancel_scope.cancel()  # the client gives up: its connection closes
        await assert_dropped_within_a_step(client, backend, len(backend.steps))


async def test_models_retrieve_by_id() -> None:
    async with serving(lambda: open_fake(CountingBackend())) as client:
        found = await client.get(f"/v1/models/{MODEL}")
        missing = await client.get("/v1/models/gpt-4o")
    assert found.status_code == 200
    assert (found.json()["id"], found.json()["object"]) == (MODEL, "model")
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert "'gpt-4o'" in error["message"]


async def test_chat_without_a_template_tells_the_client_which_flag_to_pass() -> None:
    options = ServerOptions(chat_available=False)
    async with serving(lambda: open_fake(CountingBackend()), options) as client:
        await until_ready(client)
        response = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        refused = await metric(client, 'q4k_requests_total{outcome="invalid"}')
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "template_error"
    assert "--template FILE" in error["message"] and "/v1/completions" in error["message"]
    assert "ChatTemplate" not in error["message"]  # no advice for Python callers
    assert refused == 1


async def test_max_tokens_past_the_context_is_refused_naming_both_numbers() -> None:
    backend = CountingBackend()  # a 256-token context; the fake tokenizer: a token a character
    async with serving(lambda: open_fake(backend)) as client:
        await until_ready(client)
        refused = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 100000})
        steps_after_refusal = len(backend.steps)
        # Without max_tokens the default (16) is cut to what is left of the context.
        near_the_end = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": [3] * 250, "ignore_eos": True})
    assert refused.status_code == 400 and steps_after_refusal == 0
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
    assert f"{len(PROMPT)} in the prompt and 100000 in max_tokens" in error["message"]
    assert "context is 256 tokens" in error["message"]
    assert near_the_end.status_code == 200
    assert near_the_end.json()["usage"]["completion_tokens"] == 256 - 250


async def test_max_tokens_limit_refuses_more_and_caps_the_default() -> None:
    options = ServerOptions(max_tokens_limit=8)
    async with serving(lambda: open_fake(CountingBackend()), options) as client:
        await until_ready(client)
        refused = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 9})
        defaulted = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "ignore_eos": True})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "max_tokens"
    assert "max_tokens is 9" in error["message"] and "(8;" in error["message"]
    assert "--max-tokens-limit" in error["message"]
    assert defaulted.status_code == 200
    assert defaulted.json()["usage"]["completion_tokens"] == 8


# Writes its `greeting` variable before the messages, and refuses a chat without one.
GREETING_TEMPLATE = (
    "{% if greeting is not defined %}{{ raise_exception('pass a greeting') }}{% endif %}"
    "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
)
HI = [{"role": "user", "content": "hi"}]


def greeting_template(source: str | None) -> ChatTemplate:
    return ChatTemplate(source or GREETING_TEMPLATE, bos_token="", eos_token="")


async def test_chat_template_kwargs_reach_the_template() -> None:
    backend = CountingBackend()
    async with serving(lambda: open_fake(backend, chat_template=greeting_template)) as client:
        await until_ready(client)
        answered = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": HI, "max_tokens": 1,
            "chat_template_kwargs": {"greeting": "Hello, "}})
    assert answered.status_code == 200, answered.text
    (prompt, *_) = backend.steps[0]
    assert prompt.tokens == tuple(FakeTokenizer().encode("Hello, hi"))


async def test_a_template_refusal_is_400_with_its_message() -> None:
    backend = CountingBackend()
    async with serving(lambda: open_fake(backend, chat_template=greeting_template)) as client:
        await until_ready(client)
        whole = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": HI})
        streamed = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": HI, "stream": True})
    for response in (whole, streamed):
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "template_error"
        assert error["message"] == "chat template refused the conversation: pass a greeting"
    assert backend.steps == []


@pytest.mark.parametrize(("kwargs", "message"), [
    ("greeting", "must be an object mapping names to JSON values, not str"),
    (["greeting", "Hello"], "must be an object mapping names to JSON values, not list"),
    ({"messages": []}, "may not set 'messages'"),
    ({"add_generation_prompt": False}, "may not set 'add_generation_prompt'"),
    ({"greeting-text": "Hello"}, "the key 'greeting-text'"),
])
async def test_bad_chat_template_kwargs_are_400_naming_the_field(kwargs: object,
                                                                 message: str) -> None:
    backend = CountingBackend()
    async with serving(lambda: open_fake(backend, chat_template=greeting_template)) as client:
        await until_ready(client)
        response = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": HI, "chat_template_kwargs": kwargs})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and message in error["message"]
    assert backend.steps == []
