"""The server's edge, in process over the fake engine: a large body is read into a
request in a worker thread, with the garbage collector paused, while the loop answers others,
a small one on the loop; requests naming a host the server does not answer to (DNS rebinding)
or from a page of another origin are 403, and one with too many header fields is 431, each an
OpenAI error object naming the problem."""

from __future__ import annotations

import gc
import json
import threading

import anyio
import httpx
import pytest

import actors.serve.app as app_module
from actors.serve.app import CONVERT_ON_LOOP_BYTES
from actors.serve.guard import MAX_HEADER_FIELDS, RequestLimits
from actors.serve.protocol import completion_generation
from tests.test_engine_fake import CountingBackend, open_fake
from tests.test_server_fake import MODEL, serving, until_ready

pytestmark = pytest.mark.anyio
PROMPT = [5, 6, 7, 8]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def completion(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **fields}


def assert_refused(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"
    return error["message"]


async def test_a_large_body_is_read_in_a_worker_thread_while_the_loop_answers() -> None:
    """The conversion of a body past CONVERT_ON_LOOP_BYTES is held in its thread until
    /health has been answered: had it run on the loop, /health could not be."""
    readers: list[threading.Thread] = []
    reading = threading.Event()
    may_finish = threading.Event()

    def held_reading(body: bytes, **options: object):
        readers.append(threading.current_thread())
        if len(body) > CONVERT_ON_LOOP_BYTES:
            reading.set()
            assert may_finish.wait(60)
        return completion_generation(body, **options)

    # A long `user` field (read, then ignored) makes the body large, not the prompt.
    large = completion(user="u" * (2 * CONVERT_ON_LOOP_BYTES))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app_module, "completion_generation", held_reading)
        async with serving(lambda: open_fake(CountingBackend())) as client:
            await until_ready(client)
            answers: list[httpx.Response] = []
            async with anyio.create_task_group() as tasks:

                async def post_large() -> None:
                    answers.append(await client.post("/v1/completions", json=large))

                tasks.start_soon(post_large)
                await anyio.to_thread.run_sync(reading.wait, 60)
                health = await client.get("/health")
                may_finish.set()
            small = await client.post("/v1/completions", json=completion())
    assert health.status_code == 200
    assert answers[0].status_code == 200 and small.status_code == 200, answers[0].text
    large_reader, small_reader = readers
    assert large_reader is not threading.main_thread()
    assert small_reader is threading.main_thread()


async def test_a_large_body_is_read_with_the_collector_paused_until_it_is_read() -> None:
    """Paused for a large body's reading only, whether it is served or refused."""
    collecting: list[bool] = []

    def recording(body: bytes, **options: object):
        collecting.append(gc.isenabled())
        return completion_generation(body, **options)

    large = completion(user="u" * (2 * CONVERT_ON_LOOP_BYTES))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app_module, "completion_generation", recording)
        async with serving(lambda: open_fake(CountingBackend())) as client:
            await until_ready(client)
            served = await client.post("/v1/completions", json=large)
            refused = await client.post("/v1/completions", json={**large, "max_tokens": -1})
            small = await client.post("/v1/completions", json=completion())
    assert [served.status_code, refused.status_code, small.status_code] == [200, 400, 200]
    assert collecting == [False, False, True] and gc.isenabled()


def test_a_serving_process_keeps_the_objects_alive_at_start_out_of_collections() -> None:
    """What exists once the engine is open is frozen (a full collection no longer walks it);
    what is made after is collected as before."""
    made_before = [[]]
    try:
        app_module.freeze_long_lived_objects()
        made_after = [[]]
        gc.collect()
        walked = {id(tracked) for tracked in gc.get_objects(generation=2)}
        assert id(made_before) not in walked and id(made_after) in walked
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example",
                                  "127.0.0.1.nip.io", "2130706433", "[::1", "a b"])
async def test_a_host_the_server_does_not_answer_to_is_403(host: str) -> None:
    async with serving(lambda: open_fake(CountingBackend())) as client:
        await until_ready(client)
        for response in (await client.post("/v1/completions", json=completion(),
                                           headers={"host": host}),
                         await client.get("/v1/models", headers={"host": host}),
                         await client.get("/health", headers={"host": host})):
            message = assert_refused(response, 403, "host_not_allowed")
            assert "--allowed-host" in message and "DNS rebinding" in message


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:9", "[::1]:8000", "10.1.2.3",
                                  "localhost", "LOCALHOST.", "api.localhost:1"])
async def test_ip_addresses_and_loopback_names_are_served(host: str) -> None:
    async with serving(lambda: open_fake(CountingBackend())) as client:
        await until_ready(client)
        answer = await client.post("/v1/completions", json=completion(), headers={"host": host})
    assert answer.status_code == 200, answer.text


async def test_allowed_hosts_name_a_host_its_domain_or_any() -> None:
    limits = RequestLimits(allowed_hosts=("models.lan", ".example.org"))
    async with serving(lambda: open_fake(CountingBackend()), limits=limits) as client:
        await until_ready(client)
        statuses = {host: (await client.get("/v1/models", headers={"host": host})).status_code
                    for host in ("models.lan:8000", "example.org", "api.example.org",
                                 "other.lan", "example.org.evil.example")}
    assert statuses == {"models.lan:8000": 200, "example.org": 200, "api.example.org": 200,
                        "other.lan": 403, "example.org.evil.example": 403}
    async with serving(lambda: open_fake(CountingBackend()),
                       limits=RequestLimits(allowed_hosts=("*",))) as client:
        await until_ready(client)
        assert (await client.get("/v1/models", headers={"host": "any.name"})).status_code == 200


@pytest.mark.parametrize("origin", ["http://evil.example", "https://evil.example:8000", "null",
                                    "file://"])
async def test_a_page_of_another_origin_is_403(origin: str) -> None:
    async with serving(lambda: open_fake(CountingBackend())) as client:
        await until_ready(client)
        refused = await client.post("/v1/completions", json=completion(),
                                    headers={"origin": origin})
        own_page = await client.post("/v1/completions", json=completion(),
                                     headers={"origin": "http://localhost:3000"})
    assert "--allowed-host" in assert_refused(refused, 403, "origin_not_allowed")
    assert own_page.status_code == 200


async def test_too_many_header_fields_is_431_before_anything_else() -> None:
    """Before the host and the API key are looked at."""
    fields = [(f"x-field-{index}", "v") for index in range(MAX_HEADER_FIELDS)]
    limits = RequestLimits(api_key="sk-edge")
    async with serving(lambda: open_fake(CountingBackend()), limits=limits) as client:
        await until_ready(client)
        refused = await client.post("/v1/completions", content=json.dumps(completion()),
                                    headers=[*fields, ("host", "evil.example")])
        under = await client.post("/v1/completions", json=completion(),
                                  headers=[*fields[:80], ("authorization", "Bearer sk-edge")])
    message = assert_refused(refused, 431, "request_header_fields_too_large")
    assert f"at most {MAX_HEADER_FIELDS}" in message
    assert under.status_code == 200, under.text
