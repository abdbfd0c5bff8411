"""The light channels of the per-step messages (actors.channels): the memory streams' contract
they stand in for (order, capacity, closing either end, cancellation), their timeout, and the
crossings to and from an actor's own thread; and an actor thread's stop on cancel."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from actors.channels import loop_channel, require_asyncio, thread_channel
from actors.compute.actor import run_in_own_thread
from actors.errors import InvalidRequest

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- loop_channel ---------------------------------------------------------------------------


async def test_messages_come_in_order_and_a_receive_waits_for_one() -> None:
    send, receive = loop_channel(3)
    send.send_nowait(1)
    send.send_nowait(2)
    assert [await receive.receive(), await receive.receive()] == [1, 2]
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_send_later, send, 3)
        assert await receive.receive() == 3


async def _send_later(send, item) -> None:
    await anyio.sleep(0.01)
    send.send_nowait(item)


async def test_a_send_past_the_capacity_would_block() -> None:
    send, receive = loop_channel(1)
    send.send_nowait("a")
    with pytest.raises(anyio.WouldBlock):
        send.send_nowait("b")
    assert receive.receive_nowait() == "a"
    with pytest.raises(anyio.WouldBlock):
        receive.receive_nowait()


async def test_closing_the_sender_ends_the_stream_once_drained() -> None:
    send, receive = loop_channel(2)
    send.send_nowait("last")
    send.close()
    with pytest.raises(anyio.ClosedResourceError):
        send.send_nowait("more")
    assert await receive.receive() == "last"
    with pytest.raises(anyio.EndOfStream):
        await receive.receive()


async def test_closing_the_sender_wakes_a_waiting_receiver() -> None:
    send, receive = loop_channel()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_close_later, send)
            with pytest.raises(anyio.EndOfStream):
                await receive.receive()


async def _close_later(end) -> None:
    await anyio.sleep(0.01)
    end.close()


async def test_closing_the_receiver_breaks_later_sends() -> None:
    send, receive = loop_channel()
    with receive:
        pass
    with pytest.raises(anyio.BrokenResourceError):
        send.send_nowait(1)
    with pytest.raises(anyio.ClosedResourceError):
        await receive.receive()


async def test_a_receive_past_its_timeout_raises_and_loses_nothing() -> None:
    send, receive = loop_channel()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await receive.receive(timeout=0.05)
    assert time.monotonic() - started >= 0.04
    send.send_nowait("late")
    assert await receive.receive(timeout=0.05) == "late"


async def test_a_cancelled_receive_leaves_the_message_for_the_next() -> None:
    send, receive = loop_channel()
    with anyio.move_on_after(0.01) as scope:
        await receive.receive()
    assert scope.cancelled_caught
    send.send_nowait("kept")
    assert await receive.receive() == "kept"


async def test_a_thread_sends_to_the_loop_without_waiting() -> None:
    send, receive = loop_channel(2)
    thread = threading.Thread(target=lambda: [send.send_from_thread(i) for i in (1, 2)])
    thread.start()
    with anyio.fail_after(5):
        assert [await receive.receive(), await receive.receive()] == [1, 2]
    thread.join()
    receive.close()
    assert send.send_from_thread(3)  # the loop runs: queued, then dropped where nobody listens
    await anyio.sleep(0.01)


def test_a_send_from_a_thread_after_the_loop_closed_says_so() -> None:
    async def make():
        return loop_channel()

    send, _ = anyio.run(make)
    assert send.send_from_thread(1) is False


# --- thread_channel -------------------------------------------------------------------------


def _receive_all(receive, got: list) -> None:
    while (item := receive.receive()) is not None:
        got.append(item)
    got.append(receive.receive())  # still None: the end is sticky


async def test_a_thread_receives_in_order_until_the_loop_closes() -> None:
    send, receive = thread_channel(2)
    got: list = []
    send.send_nowait("a")
    send.send_nowait("b")
    with pytest.raises(anyio.WouldBlock):
        send.send_nowait("c")
    thread = threading.Thread(target=_receive_all, args=(receive, got))
    thread.start()
    send.close()
    with pytest.raises(anyio.ClosedResourceError):
        send.send_nowait("d")
    await anyio.to_thread.run_sync(thread.join)
    assert got == ["a", "b", None]


async def test_closing_the_thread_end_wakes_it_and_breaks_later_sends() -> None:
    send, receive = thread_channel()
    got: list = []
    thread = threading.Thread(target=_receive_all, args=(receive, got))
    thread.start()
    await anyio.sleep(0.01)
    receive.close()
    await anyio.to_thread.run_sync(thread.join)
    assert got == [None]
    with pytest.raises(anyio.BrokenResourceError):
        send.send_nowait(1)


# --- an actor's own thread ------------------------------------------------------------------


async def test_a_cancelled_actor_stops_its_thread_and_waits_for_it() -> None:
    """The thread ends through `stop` (its inbox closes), and has ended when the
    cancellation reaches the caller."""
    send, receive = thread_channel()
    ended = threading.Event()

    def serve() -> None:
        while receive.receive() is not None:
            pass
        time.sleep(0.05)  # still finishing when the caller is cancelled
        ended.set()

    with anyio.fail_after(5):
        with anyio.move_on_after(0.05) as scope:
            await run_in_own_thread("q4k-test", serve, stop=receive.close)
    assert scope.cancelled_caught and ended.is_set()
    send.close()


def test_the_engine_asks_for_asyncio_by_name() -> None:
    """Outside an asyncio loop (trio, or none) the engine refuses at open with a clear error,
    not an obscure one from deep in a channel."""
    with pytest.raises(InvalidRequest, match="runs on asyncio") as error:
        require_asyncio()
    assert error.value.field == "event_loop"

    async def on_asyncio() -> None:
        require_asyncio()

    anyio.run(on_asyncio)
