"""`q4k serve --replicas 2` on a local Ray instance (2 CPUs) with the tiny llama model, driven
with the official `openai` client: answers equal one engine's, a shared prompt prefix sticks
to the replica that holds it, unrelated prompts spread over both replicas, and a replica
killed mid-stream ends that stream with an error while the other serves what comes next.

One Ray instance serves every test of the module, started as `ray start --head --block` in a
process group of its own and stopped by signalling that group; `q4k serve` joins it through
RAY_ADDRESS. The test process never joins it: whatever Ray sets up in a driver's process, or
fails to take down, stays out of the tests that run after this module."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import msgspec
import numpy as np
import openai
import pytest

pytest.importorskip("ray", reason="needs the `ray` extra: pip install 'q4k-actors[ray]'")

from actors.compute.contract import KVRequest  # noqa: E402
from actors.compute.cpu import build_cpu_backend  # noqa: E402
from actors.compute.faults import Fault, FaultyBackend  # noqa: E402
from actors.engine import Engine  # noqa: E402
from actors.errors import ComputeError  # noqa: E402
from actors.model.loaded import load_model  # noqa: E402
from actors.params import SamplingParams  # noqa: E402
from actors.errors import InvalidRequest  # noqa: E402
from actors.serve.guard import API_KEY_ENV, RequestLimits  # noqa: E402
from actors.serve.ray import (  # noqa: E402
    REPLICA_HEADER,
    ROUTING_MESSAGES,
    ROUTING_TEXT_CHARS,
    ForwardedRequest,
    PrefixAffinityRouter,
    PromptKeys,
    ReplicaSettings,
    check_engine,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
MODEL = "llama-q4k-tiny"
BANNER = re.compile(r"on http://127\.0\.0\.1:(\d+)/v1 ")
START_TIMEOUT_S = 180
GREEDY = {"temperature": 0, "max_tokens": 16}
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
# The tiny model has no chat template of its own: the replicas (and their front, which keys
# chats by the rendered prompt) are given this one.
TEMPLATE = ROOT / "examples" / "chat_templates" / "chatml_tools.jinja"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# For the instance and `q4k serve`: the replicas import this checkout's `actors`, as the test
# process does; the instance listens on this machine only, so it runs without Ray's token.
RAY_ENVIRONMENT = {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
HEAD_ADDRESS = re.compile(r"ray start --address='([^']+)'")
ENGINE_REPLICA = "SERVE_REPLICA::q4k#EngineReplica#"


class Endpoint(msgspec.Struct):
    url: str
    client: openai.OpenAI
    # Each EngineReplica's id (as REPLICA_HEADER names it) and process, as they started.
    replica_pids: dict[str, int]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stop_group(process: subprocess.Popen) -> None:
    """SIGKILL to the process's group (it leads one of its own), as `ray stop --force` does:
    on SIGTERM `ray start --block` took over 30 s, and nothing of the instance is kept."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def _first_match(pattern: re.Pattern[str], lines: Iterator[str], what: str) -> re.Match[str]:
    """The first of `lines` that `pattern` finds, within START_TIMEOUT_S in all; fails with what
    came before if the lines end or the time runs out first."""
    found: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in lines:
            found.put(line)
        found.put("")  # they ended

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    seen = []
    while True:
        try:
            line = found.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = ""
        if not line:
            pytest.fail(f"{what} within {START_TIMEOUT_S} s:\n" + "".join(seen))
        seen.append(line)
        if match := pattern.search(line):
            return match


def _replica_pids(address: str) -> dict[str, int]:
    """Each EngineReplica's id and process, asked of Ray by a driver of its own."""
    script = (
        "import json, os, sys, ray\n"
        "ray.init(address=sys.argv[1], log_to_driver=False)\n"
        "names = [actor['name'] for actor in ray.util.list_named_actors(all_namespaces=True)\n"
        "         if actor['name'].startswith(sys.argv[2])]\n"
        "pids = [ray.get_actor(name, namespace='serve').__ray_call__.remote(lambda _: os.getpid())\n"
        "        for name in names]\n"
        "print(json.dumps(dict(zip([n[len(sys.argv[2]):] for n in names], ray.get(pids)))))\n"
    )
    asked = subprocess.run([sys.executable, "-c", script, address, ENGINE_REPLICA],
                           env={**os.environ, **RAY_ENVIRONMENT}, capture_output=True, text=True,
                           timeout=START_TIMEOUT_S, check=True)
    return msgspec.json.decode(asked.stdout.splitlines()[-1], type=dict[str, int])


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray instance of 2 CPUs, in a process group of its own: its GCS address."""
    head = subprocess.Popen(
        [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
         "--port", "0", "--ray-client-server-port", str(_free_port()), "--num-cpus", "2",
         "--include-dashboard", "false", "--disable-usage-stats"],
        env={**os.environ, **RAY_ENVIRONMENT}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        # _first_match's reader drains the pipe to its end, so the head never blocks on it.
        yield _first_match(HEAD_ADDRESS, head.stdout, "ray start printed no address")[1]
    finally:
        _stop_group(head)


@pytest.fixture(scope="module")
def endpoint(ray_address: str, tiny_model_paths: dict[str, Path]) -> Iterator[Endpoint]:
    process = subprocess.Popen(
        [sys.executable, "-m", "actors.cli", "serve", "--model",
         str(tiny_model_paths[MODEL]), "--backend", "cpu", "--replicas", "2",
         "--template", str(TEMPLATE), "--port", str(_free_port())],
        env={**os.environ, **RAY_ENVIRONMENT, "RAY_ADDRESS": ray_address},
        stderr=subprocess.PIPE, text=True,
    )
    try:
        # The endpoint line comes once the replicas are up (Ray's own lines come first).
        banner = _first_match(BANNER, process.stderr, "q4k serve --replicas printed no endpoint")
        url = f"http://127.0.0.1:{banner[1]}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60,
                               max_retries=0)
        yield Endpoint(url=url, client=client, replica_pids=_replica_pids(ray_address))
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        finally:
            process.kill()


@pytest.fixture(scope="module")
def single_engine_answers(tiny_model_paths: dict[str, Path]) -> dict[str, str]:
    """Completions of PROMPTS, and the answer to QUESTION under "chat", from one engine."""
    async def answers() -> dict[str, str]:
        params = SamplingParams(temperature=0, max_tokens=GREEDY["max_tokens"])
        async with Engine.open(tiny_model_paths[MODEL], backend="cpu") as engine:
            found = {prompt: (await engine.complete(prompt, params)).text for prompt in PROMPTS}
            chat = engine.chat(QUESTION, params, TEMPLATE.read_text())
            found["chat"] = "".join([chunk.text async for chunk in chat])
            return found

    return anyio.run(answers)


def test_an_engine_whose_backend_is_lost_fails_the_health_check(
        tiny_model_paths: dict[str, Path]) -> None:
    """What `EngineReplica.check_health` asks: healthy while the engine serves, ComputeError
    once a backend that stopped answering for two step deadlines is lost."""
    model = load_model(tiny_model_paths[MODEL])
    prompt = model.tokenizer.encode("Once upon a time")
    hang = Fault(kind="hang", prompt_prefix=tuple(prompt[:2]), times=1, hang_s=2.0)
    kv = KVRequest(blocks=64, block_size=16, max_sequences=4)

    async def drill() -> None:
        async with Engine.open_backend(
            lambda: FaultyBackend(build_cpu_backend(model, kv, ()), [hang]), model.tokenizer,
            step_timeout_s=0.2,
        ) as engine:
            await check_engine(engine)
            with anyio.fail_after(30), pytest.raises(ComputeError):
                await engine.complete(prompt, SamplingParams(max_tokens=2))
            with pytest.raises(ComputeError, match="lost"):
                await check_engine(engine)

    anyio.run(drill)


def test_the_router_sends_a_prefix_to_its_holder_until_the_holder_is_busy() -> None:
    # Ray Serve builds its routers itself; this one is built by hand (from Ray's private ids)
    # to drive its choices directly.
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    from ray.serve.request_router import ReplicaID

    deployment = DeploymentID(name="EngineReplica", app_name="q4k")
    replicas = [SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=deployment))
                for name in "abc"]
    a = replicas[0]

    def pending(*blocks: bytes, replica: str | None = None) -> SimpleNamespace:
        request = ForwardedRequest(method="POST", path="/v1/completions", query_string=b"",
                                   headers=[], body=b"", client=None, prefix=blocks,
                                   replica=replica)
        return SimpleNamespace(args=[request])

    async def choices() -> list[list[list[SimpleNamespace]]]:
        router = PrefixAffinityRouter(deployment, DeploymentHandleSource.UNKNOWN,
                                      use_replica_queue_len_cache=True)
        router.initialize_state(busy_at=2)
        router.on_request_routed(pending(b"1", b"2", b"3"), a.replica_id, None)
        found = [await router.choose_replicas(replicas, pending(b"1", b"2", b"3", b"4")),
                 await router.choose_replicas(replicas, pending(b"1", b"9", b"9", b"9")),
                 await router.choose_replicas(replicas, pending(b"1", b"2", replica="b"))]
        router.on_new_queue_len_info(a.replica_id, 2)
        found.append(await router.choose_replicas(replicas, pending(b"1", b"2", b"3")))
        return found

    shared, barely_shared, pinned, busy = anyio.run(choices)
    assert shared == [[a]]
    # One block of four in common is too little to prefer its holder: two at random.
    assert len(barely_shared) == 1 and len(barely_shared[0]) == 2
    assert pinned == [[replicas[1]]]
    assert len(busy) == 1 and len(busy[0]) == 2


class Recorder:
    """Stands in for a method and records what each call was given."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(args)
        return self.method(*args, **kwargs)


@pytest.fixture
def prompt_keys(tiny_model_paths: dict[str, Path],
                monkeypatch: pytest.MonkeyPatch) -> tuple[PromptKeys, Recorder, Recorder]:
    """The front's keys over the tiny model (context 2,048) and the template, and what its
    tokenizer is asked to encode and its template to render."""
    keys = PromptKeys(ReplicaSettings(model=str(tiny_model_paths[MODEL]),
                                      chat_template=TEMPLATE.read_text()))
    encode = Recorder(keys._tokenizer.encode)
    render = Recorder(keys._template.render)
    monkeypatch.setattr(keys._tokenizer, "encode", encode)
    monkeypatch.setattr(keys._template, "render", render)
    return keys, encode, render


def _key(keys: PromptKeys, path: str, **fields: object) -> tuple[bytes, ...]:
    return keys.of(path, msgspec.json.encode({"model": MODEL, **fields}))


def test_the_front_keys_a_long_prompt_by_its_beginning_only(
        prompt_keys: tuple[PromptKeys, Recorder, Recorder]) -> None:
    keys, encode, _ = prompt_keys
    story = "Once upon a time a fox met a crow. " * 900  # 31,500 characters, fits by its size
    whole = _key(keys, "/v1/completions", prompt=story)
    assert [len(text) for text, *_ in encode.calls] == [ROUTING_TEXT_CHARS]
    # Another prompt with the same beginning gets the same key; a shorter one its first blocks.
    assert _key(keys, "/v1/completions", prompt=story[:ROUTING_TEXT_CHARS + 7]) == whole
    beginning = _key(keys, "/v1/completions", prompt=story[:4000])
    assert len(beginning) > 10 and whole[:len(beginning) - 1] == beginning[:-1]


def test_the_front_leaves_a_prompt_that_cannot_fit_unkeyed_and_untokenized(
        prompt_keys: tuple[PromptKeys, Recorder, Recorder]) -> None:
    """As the replica's door refuses them, from their size alone: 8 MB of text, a million ids,
    more messages than the context has tokens."""
    keys, encode, render = prompt_keys
    assert _key(keys, "/v1/completions", prompt="x" * (8 << 20)) == ()
    assert _key(keys, "/v1/completions", prompt=[7] * 1_000_000) == ()
    assert _key(keys, "/v1/chat/completions", messages=QUESTION * 3000) == ()
    assert encode.calls == [] and render.calls == []
    assert len(_key(keys, "/v1/completions", prompt=list(range(3, 2003)))) == 1999 // 16


def test_the_front_renders_a_chats_first_messages_and_text_only(
        prompt_keys: tuple[PromptKeys, Recorder, Recorder]) -> None:
    keys, _, render = prompt_keys
    turns = [{"role": role, "content": f"Turn {index}"}
             for index, role in zip(range(1500), ["user", "assistant"] * 750)]
    many = _key(keys, "/v1/chat/completions", messages=turns)
    long_one = [{"role": "system", "content": [{"type": "text", "text": "r" * (1 << 20)}]},
                *QUESTION]
    assert many and _key(keys, "/v1/chat/completions", messages=long_one)
    (many_rendered, *_), (long_rendered, *_) = render.calls
    assert len(many_rendered) == ROUTING_MESSAGES
    assert [message["content"] for message in long_rendered] == ["r" * ROUTING_TEXT_CHARS]
    # Chats that share their first messages share the key.
    assert _key(keys, "/v1/chat/completions", messages=turns[:ROUTING_MESSAGES + 1]) == many


def test_replicas_take_the_api_key_from_their_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = ReplicaSettings(model="m.gguf")
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert settings.request_limits().api_key is None
    monkeypatch.setenv(API_KEY_ENV, "sk-node")
    assert settings.request_limits().api_key == "sk-node"
    given = ReplicaSettings(model="m.gguf", limits=RequestLimits(api_key="sk-given"))
    assert given.request_limits().api_key == "sk-given"
    monkeypatch.setenv(API_KEY_ENV, " ")
    with pytest.raises(InvalidRequest, match=f"{API_KEY_ENV} is set but empty"):
        settings.request_limits()


def _complete(client: openai.OpenAI, prompt: str | list[int], **options: object):
    """The completion and the replica that answered it."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, **options)
    return raw.parse(), raw.headers[REPLICA_HEADER]


def test_answers_equal_a_single_engines(endpoint: Endpoint,
                                        single_engine_answers: dict[str, str]) -> None:
    expected_answers = dict(single_engine_answers)
    chat = endpoint.client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
    assert chat.choices[0].message.content == expected_answers.pop("chat")
    for prompt, expected in expected_answers.items():
        whole, _ = _complete(endpoint.client, prompt, **GREEDY)
        assert whole.choices[0].text == expected
        stream = endpoint.client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                                    **GREEDY)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected


def test_requests_sharing_a_prefix_go_where_it_is_cached(endpoint: Endpoint) -> None:
    vocab = np.random.default_rng(7)
    prefix = vocab.integers(3, 1000, 200).tolist()
    answers = [_complete(endpoint.client, prefix + vocab.integers(3, 1000, 8).tolist(),
                         temperature=0, max_tokens=2) for _ in range(20)]
    cached = [reply.usage.prompt_tokens_details.cached_tokens for reply, _ in answers]
    assert sum(tokens > 0 for tokens in cached) >= 18, cached
    # Every request after the first went to the replica that served the first.
    assert {replica for _, replica in answers} == {answers[0][1]}, answers


def test_chats_sharing_a_system_prompt_go_where_it_is_cached(endpoint: Endpoint) -> None:
    """The front keys a chat by its prompt as the template renders it."""
    system = {"role": "system", "content": " ".join(f"Rule {i}: be brief." for i in range(40))}
    replicas, cached = set(), []
    for question in range(6):
        raw = endpoint.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[system, {"role": "user", "content": f"Question {question}?"}],
            temperature=0, max_tokens=2)
        replicas.add(raw.headers[REPLICA_HEADER])
        cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
    assert len(replicas) == 1 and all(tokens > 0 for tokens in cached[1:]), (replicas, cached)


def test_unrelated_prompts_spread_over_both_replicas(endpoint: Endpoint) -> None:
    vocab = np.random.default_rng(11)
    prompts = [vocab.integers(3, 1000, 40).tolist() for _ in range(16)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(
            lambda prompt: _complete(endpoint.client, prompt, temperature=0, max_tokens=4),
            prompts))
    assert len({replica for _, replica in answers}) == 2


def _metrics(url: str, replica: str) -> dict[str, float]:
    """One replica's /metrics samples, `name{labels}` -> value."""
    text = httpx.get(f"{url}/metrics", headers={REPLICA_HEADER: replica}).text
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}


def test_a_client_that_leaves_cancels_its_request_on_the_replica(endpoint: Endpoint) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "stream": True, "temperature": 0,
            "max_tokens": 1500, "ignore_eos": True}
    with httpx.stream("POST", f"{endpoint.url}/v1/completions", json=body) as response:
        replica = response.headers[REPLICA_HEADER]
        next(response.iter_lines())
    # The replica's engine drops the request: nothing left running there, one cancelled.
    deadline = time.monotonic() + 20
    while (samples := _metrics(endpoint.url, replica))["q4k_requests_running"] > 0:
        assert time.monotonic() < deadline, samples
        time.sleep(0.1)
    assert samples['q4k_requests_total{outcome="cancelled"}'] == 1


def test_a_replica_killed_mid_stream_ends_its_stream_with_an_error(endpoint: Endpoint) -> None:
    raw = endpoint.client.completions.with_raw_response.create(
        model=MODEL, prompt="Once upon a time", stream=True, temperature=0, max_tokens=1500,
        extra_body={"ignore_eos": True})
    killed = raw.headers[REPLICA_HEADER]
    chunks = iter(raw.parse())
    next(chunks)
    os.kill(endpoint.replica_pids[killed], signal.SIGKILL)
    with pytest.raises(openai.APIError, match="replica"):
        for _ in chunks:
            pass
    later = [_complete(endpoint.client, prompt, **GREEDY)[1] for prompt in PROMPTS]
    assert killed not in later
