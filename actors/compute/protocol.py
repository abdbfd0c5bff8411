"""The message protocol every compute actor speaks, and the one-thread actor that speaks it.

A backend (CPU now, CUDA later) is a plain synchronous object built and used inside ONE thread
for the engine's lifetime, because a CUDA context is bound to the thread that made it.
The actor's first message, `BuildBackend` from the loader, says how to build it; the actor
reports its `ComputeInfo` (or `StartFailed`). Then it receives `RunStep` from the scheduler,
runs the forward in the thread and answers `StepDone` (the logits rows) or `StepFailed`; the
sampler actor chooses the tokens. Work in flight is never abandoned; `Shutdown` (or closing the
inbox) ends it.

`run_in_own_thread`, `receive_from_loop` and `send_to_loop` are the bridge every actor with a
thread of its own uses (the loader's and the sampler's too).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import msgspec
import numpy as np
from anyio.from_thread import BlockingPortal
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

T = TypeVar("T")


class ComputeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend reports once it is ready."""

    arch: str
    on_gpu: bool
    context_length: int
    vocab_size: int
    num_blocks: int
    block_size: int
    notices: tuple[str, ...] = ()


class ForwardItem(msgspec.Struct, frozen=True, kw_only=True):
    """Advance one sequence: its KV holds positions [0, start); `tokens` go at start...;
    `blocks` cover positions 0 .. start + len(tokens) - 1."""

    seq_id: int
    tokens: tuple[int, ...]
    start: int
    blocks: tuple[int, ...]
    want_logits: bool = True


class BuildBackend(msgspec.Struct, frozen=True, kw_only=True):
    """The compute actor's first message (from the loader): how to build its backend."""

    make_backend: Any  # Callable[[], ComputeBackend], called in the compute thread
    # Called in the compute thread after the backend is closed (or failed to build): the model
    # file the engine opened, whose mapped weights only the backend knows it has stopped reading.
    release: Any = None  # Callable[[], None] | None


class RunStep(msgspec.Struct, frozen=True, kw_only=True):
    """One batched forward."""

    step_id: int
    items: tuple[ForwardItem, ...]


class StepDone(msgspec.Struct, frozen=True, kw_only=True):
    """The step ran: `logits` is float32 (rows, vocab), one row per item that wanted logits,
    in item order."""

    step_id: int
    logits: Any  # np.ndarray


class StepFailed(msgspec.Struct, frozen=True, kw_only=True):
    """The step raised: the KV of every sequence in it is unknown now."""

    step_id: int
    error: str


class StartFailed(msgspec.Struct, frozen=True, kw_only=True):
    """The backend could not be built; the engine does not start."""

    error: Exception


class Shutdown(msgspec.Struct, frozen=True):
    """Leave the worker thread once the step in flight (if any) is answered."""


class ComputeBackend(Protocol):
    """The synchronous side of a compute actor, living in its worker thread."""

    info: ComputeInfo

    def forward(self, items: Sequence[ForwardItem]) -> np.ndarray:
        """Logits (one float32 row per item with want_logits, in item order)."""
        ...

    def close(self) -> None:
        """Release what the backend holds (device memory, KV arrays)."""
        ...


# What a worker thread sees when the loop side goes away: the stream ended, or the host task
# was cancelled while the thread waited on the loop.
_LOOP_GONE = (
    anyio.EndOfStream,
    anyio.ClosedResourceError,
    anyio.BrokenResourceError,
    asyncio.CancelledError,
    concurrent.futures.CancelledError,
)


class ComputeActor:
    """Builds the backend and then runs every step in one dedicated thread of its own, which
    exits (and is joined) before the actor task returns."""

    def __init__(
        self,
        builds: MemoryObjectReceiveStream[BuildBackend],
        inbox: MemoryObjectReceiveStream[RunStep | Shutdown],
        outbox: MemoryObjectSendStream[ComputeInfo | StartFailed | StepDone | StepFailed],
    ) -> None:
        self._builds = builds
        self._inbox = inbox
        self._outbox = outbox

    async def run(self) -> None:
        """The actor task: wait for the backend to build, then hold the thread until shutdown."""
        with self._inbox, self._outbox:
            async with BlockingPortal() as portal:
                with self._builds, anyio.CancelScope(shield=True):
                    # Shielded so a BuildBackend handed over is never lost (its `release` must
                    # run): the loader always ends by sending one or closing this stream.
                    try:
                        build = await self._builds.receive()
                    except anyio.EndOfStream:
                        return  # the load failed; the loader told the engine
                await run_in_own_thread("q4k-compute", partial(self._serve, portal, build))

    def _serve(self, portal: BlockingPortal, build: BuildBackend) -> None:
        try:
            try:
                backend = build.make_backend()
            except Exception as exc:  # reported to the engine, which raises it from `open`
                send_to_loop(portal, self._outbox, StartFailed(error=exc))
                return
            try:
                if not send_to_loop(portal, self._outbox, backend.info):
                    return
                while True:
                    message = receive_from_loop(portal, self._inbox)
                    if message is None or isinstance(message, Shutdown):
                        return
                    if not send_to_loop(portal, self._outbox, _run_step(backend, message)):
                        return
            finally:
                backend.close()
        finally:
            if build.release is not None:
                build.release()


def _run_step(backend: ComputeBackend, step: RunStep) -> StepDone | StepFailed:
    try:
        logits = np.ascontiguousarray(backend.forward(step.items), dtype=np.float32)
    except Exception as exc:  # the compute contract: a failed step is an answer, not a crash
        return StepFailed(step_id=step.step_id, error=f"{type(exc).__name__}: {exc}")
    return StepDone(step_id=step.step_id, logits=logits)


# --- the bridge between an actor's own thread and the event loop ------------------------------


async def run_in_own_thread(name: str, work: Callable[[], T]) -> T:
    """Run `work()` in a new thread called `name`; return what it returns or raise what it
    raises. The wait is shielded: a cancelled caller still waits for the thread (blocking work
    cannot be interrupted, and no thread is left behind), which is joined before this returns.
    `work` must end by itself: its streams close, or its portal calls are cancelled."""
    outcome: list[tuple[bool, Any]] = []
    finished = anyio.Event()
    token = anyio.lowlevel.current_token()

    def target() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as exc:  # handed to the event loop, raised there
            outcome.append((False, exc))
        finally:
            anyio.from_thread.run_sync(finished.set, token=token)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    with anyio.CancelScope(shield=True):
        await finished.wait()
    thread.join()
    ((returned, value),) = outcome
    if not returned:
        raise value
    return value


def receive_from_loop(portal: BlockingPortal, stream: MemoryObjectReceiveStream[T]) -> T | None:
    """The next message (in a worker thread); None when the loop side is gone."""
    try:
        return portal.call(stream.receive)
    except _LOOP_GONE:
        return None


def send_to_loop(portal: BlockingPortal, stream: MemoryObjectSendStream[T], message: T) -> bool:
    """Send from a worker thread; False when the loop side is gone."""
    try:
        portal.call(stream.send, message)
    except _LOOP_GONE:
        return False
    return True
