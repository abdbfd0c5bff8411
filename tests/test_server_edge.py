"""The server's edge, in process over the fake engine (issue 34): a large body is read into a
request in a worker thread while the loop answers others, a small one on the loop."""

from __future__ import annotations

import threading

import anyio
import httpx
import pytest

import actors.serve.app as app_module
from actors.serve.app import CONVERT_ON_LOOP_BYTES
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
