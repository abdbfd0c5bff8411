"""Light one-consumer channels for the engine's per-step messages.

anyio's memory object streams suit messages that are rare next to a step; on the per-step
paths they cost more than the step itself once a backend is fast (every receive yields the
loop once before it waits, and the actor threads crossed to the loop through a portal that
starts a task per message and blocks twice: about 0.15 ms a round trip). These channels keep
their interface (the two ends, `send_nowait`, `receive`, `close`, the same exceptions) for the
messages of one consumer:

- `loop_channel`: received by one task on the event loop, sent from the loop or, with
  `send_from_thread`, from an actor's own thread. A receive with a message ready returns it
  without yielding; one that waits parks on a bare future.
- `thread_channel`: sent from the loop, received (blocking) by an actor's own thread.

Sends never block: each protocol here has at most `capacity` messages in flight (a session
asks for its next token only once it has the last; the scheduler sends one step and waits for
its answer), and a send beyond it raises `anyio.WouldBlock` as a memory stream's would.
Closing the sending end ends the stream for the receiver once it has taken what was sent
(`anyio.EndOfStream`); closing the receiving end makes later sends raise
`anyio.BrokenResourceError`. The engine runs on asyncio (anyio's asyncio backend): a waiting
receive is a future of the running loop.
"""

from __future__ import annotations

import asyncio
import queue
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Generic, Self, TypeVar

import anyio

from actors.errors import InvalidRequest

T = TypeVar("T")
S = TypeVar("S")  # a channel's shared state


def require_asyncio() -> None:
    """InvalidRequest unless an asyncio event loop runs this task: the channels park on its
    futures and wake it from threads (anyio's trio backend is not supported)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise InvalidRequest(
            "q4k-actors runs on asyncio: start it with anyio.run(main) (anyio's default "
            "backend) or asyncio.run(main), not on trio", field="event_loop") from None


class _LoopState(Generic[T]):
    __slots__ = ("buffer", "capacity", "loop", "receiver_open", "sender_open", "waiter")

    def __init__(self, capacity: int) -> None:
        self.buffer: deque[T] = deque()
        self.capacity = capacity
        self.loop = asyncio.get_running_loop()
        self.sender_open = True
        self.receiver_open = True
        self.waiter: asyncio.Future[bool] | None = None  # its result: whether it expired

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(False)


def _check_send(state: _LoopState[Any] | _ThreadState[Any], queued: int) -> None:
    """A memory stream's errors for a send: this end closed, the other end closed, full."""
    if not state.sender_open:
        raise anyio.ClosedResourceError
    if not state.receiver_open:
        raise anyio.BrokenResourceError
    if queued >= state.capacity:
        raise anyio.WouldBlock


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(True)


class _End(ABC, Generic[S]):
    """What every end of a channel has: the channel's shared state, and `close` on leaving a
    `with` block."""

    __slots__ = ("_state",)

    def __init__(self, state: S) -> None:
        self._state = state

    @abstractmethod
    def close(self) -> None:
        """Closes this end (each kind says what the other end then sees)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class LoopSender(_End[_LoopState[T]], Generic[T]):
    """The sending end of a `loop_channel`."""

    __slots__ = ()

    def send_nowait(self, item: T) -> None:
        """On the loop: hand `item` over (it never waits)."""
        state = self._state
        _check_send(state, len(state.buffer))
        state.buffer.append(item)
        state.wake()

    def send_from_thread(self, item: T) -> bool:
        """From another thread: queue `item` for the loop without waiting for it. False when
        the loop has closed; a receiver that is gone by the time it lands just drops it."""
        try:
            self._state.loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the event loop is closed
            return False
        return True

    def _deliver(self, item: T) -> None:
        try:
            self.send_nowait(item)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the loop side stopped listening; the thread learns it from its inbox

    def close(self) -> None:
        self._state.sender_open = False
        self._state.wake()


class LoopReceiver(_End[_LoopState[T]], Generic[T]):
    """The receiving end of a `loop_channel`, for one task at a time."""

    __slots__ = ()

    def receive_nowait(self) -> T:
        state = self._state
        if not state.receiver_open:
            raise anyio.ClosedResourceError
        if state.buffer:
            return state.buffer.popleft()
        if not state.sender_open:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def receive(self, timeout: float | None = None) -> T:
        """The next message, waiting for it if none is there (cancellable while it waits);
        `timeout`: raise TimeoutError once this many seconds passed without one (a timer on
        the loop, lighter than a cancel scope)."""
        state = self._state
        deadline = None if timeout is None else state.loop.time() + timeout
        while True:
            if state.buffer:  # the common case, before any other check
                return state.buffer.popleft()
            try:
                return self.receive_nowait()  # closed ends raise; an open empty one waits
            except anyio.WouldBlock:
                pass
            waiter = state.loop.create_future()
            timer = None if deadline is None else state.loop.call_at(deadline, _expire, waiter)
            state.waiter = waiter
            try:
                expired = await waiter
            finally:
                state.waiter = None
                if timer is not None:
                    timer.cancel()
            if expired:
                raise TimeoutError

    def close(self) -> None:
        self._state.receiver_open = False
        self._state.buffer.clear()


def loop_channel(capacity: int = 1) -> tuple[LoopSender[T], LoopReceiver[T]]:
    """A channel received on the running event loop (see the module docstring)."""
    state: _LoopState[T] = _LoopState(capacity)
    return LoopSender(state), LoopReceiver(state)


# What a thread's receive finds once the loop side closed the channel.
_CLOSED = object()


class _ThreadState(Generic[T]):
    __slots__ = ("capacity", "items", "receiver_open", "sender_open")

    def __init__(self, capacity: int) -> None:
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.capacity = capacity
        self.sender_open = True
        self.receiver_open = True


class ThreadSender(_End[_ThreadState[T]], Generic[T]):
    """The loop's end of a `thread_channel`."""

    __slots__ = ()

    def send_nowait(self, item: T) -> None:
        state = self._state
        _check_send(state, state.items.qsize())
        state.items.put(item)

    def close(self) -> None:
        if self._state.sender_open:
            self._state.sender_open = False
            self._state.items.put(_CLOSED)


class ThreadReceiver(_End[_ThreadState[T]], Generic[T]):
    """The thread's end of a `thread_channel`; `close` it (from the loop or the thread) once
    the thread stops receiving."""

    __slots__ = ()

    def receive(self) -> T | None:
        """In the thread: the next message, blocking until there is one; None once the
        loop side has closed the channel (or this end was closed)."""
        if not self._state.receiver_open:
            return None
        item = self._state.items.get()
        if item is _CLOSED:
            self._state.items.put(_CLOSED)  # every later receive ends too
            return None
        return item

    def close(self) -> None:
        if self._state.receiver_open:
            self._state.receiver_open = False
            self._state.items.put(_CLOSED)  # wakes the thread if it waits in `receive`


def thread_channel(capacity: int = 1) -> tuple[ThreadSender[T], ThreadReceiver[T]]:
    """A channel from the event loop to an actor's own thread (see the module docstring)."""
    state: _ThreadState[T] = _ThreadState(capacity)
    return ThreadSender(state), ThreadReceiver(state)
