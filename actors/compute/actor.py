"""The compute actor: one thread that builds a backend and runs every step in it.

A backend (see actors.compute.contract) is built and used inside ONE thread for the engine's
lifetime, because a CUDA context is bound to the thread that made it. The actor's first
message, `BuildBackend` from the loader, says how to build it; the actor reports its
`ComputeInfo` (or `StartFailed`). Then it receives `RunStep` from the scheduler and answers
`StepDone` (the step's candidates) or `StepFailed`, and `FetchRows` with `RowsFetched`; the
sampler actor chooses the tokens. Once the backend raises `BackendLostError` every message is
answered `BackendLost`. Work in flight is never abandoned; `Shutdown` (or closing the inbox)
ends it.

`run_in_own_thread`, `LoopPortal`, `receive_from_loop` and `send_to_loop` are the bridge
every actor with a thread of its own uses (the loader's and the sampler's too).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np
from anyio.from_thread import BlockingPortal
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.compute.contract import (
    BackendLost,
    BackendLostError,
    BuildBackend,
    ComputeBackend,
    ComputeInfo,
    FetchRows,
    RowsFetched,
    RunStep,
    Shutdown,
    StartFailed,
    StepDone,
    StepFailed,
)

T = TypeVar("T")


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
        inbox: MemoryObjectReceiveStream[RunStep | FetchRows | Shutdown],
        outbox: MemoryObjectSendStream[ComputeAnswer],
        hung: anyio.Event | None = None,
    ) -> None:
        self._builds = builds
        self._inbox = inbox
        self._outbox = outbox
        # Set by the scheduler when the backend stopped answering: the actor then stops
        # waiting for its thread, which a blocking call holds (it cannot be interrupted).
        self._hung = hung

    async def run(self) -> None:
        """The actor task: wait for the backend to build, then hold the thread until shutdown."""
        with self._inbox, self._outbox:
            async with LoopPortal() as portal:
                with self._builds, anyio.CancelScope(shield=True):
                    # Shielded so a BuildBackend handed over is never lost (its `release` must
                    # run): the loader always ends by sending one or closing this stream.
                    try:
                        build = await self._builds.receive()
                    except anyio.EndOfStream:
                        return  # the load failed; the loader told the engine
                await run_in_own_thread("q4k-compute", partial(self._serve, portal, build),
                                        abandon=self._hung)

    def _serve(self, portal: LoopPortal, build: BuildBackend) -> None:
        try:
            try:
                backend = build.make_backend()
            except Exception as exc:  # reported to the engine, which raises it from `open`
                send_to_loop(portal, self._outbox, StartFailed(error=exc))
                return
            try:
                if not send_to_loop(portal, self._outbox, backend.info):
                    return
                lost: BackendLost | None = None
                while True:
                    message = receive_from_loop(portal, self._inbox)
                    if message is None or isinstance(message, Shutdown):
                        return
                    answer = lost or _answer(backend, message)
                    if isinstance(answer, BackendLost):
                        lost = answer
                    if not send_to_loop(portal, self._outbox, answer):
                        return
            finally:
                backend.close()
        finally:
            if build.release is not None:
                build.release()


# What the compute actor answers the scheduler.
ComputeAnswer = ComputeInfo | StartFailed | StepDone | RowsFetched | StepFailed | BackendLost


def _answer(
    backend: ComputeBackend, message: RunStep | FetchRows
) -> StepDone | RowsFetched | StepFailed | BackendLost:
    """Run one message on the backend; a failure is an answer, not a crash (the contract)."""
    try:
        if isinstance(message, RunStep):
            return StepDone(step_id=message.step_id,
                            candidates=backend.run(message.items, message.rows))
        logits = np.ascontiguousarray(backend.fetch_rows(message.rows), dtype=np.float32)
        return RowsFetched(step_id=message.step_id, logits=logits)
    except BackendLostError as exc:
        return BackendLost(error=f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        return StepFailed(step_id=message.step_id, error=f"{type(exc).__name__}: {exc}")


# --- the bridge between an actor's own thread and the event loop ------------------------------


async def run_in_own_thread(
    name: str, work: Callable[[], T], abandon: anyio.Event | None = None
) -> T | None:
    """Run `work()` in a new thread called `name`; return what it returns or raise what it
    raises. The wait is shielded: a cancelled caller still waits for the thread (blocking work
    cannot be interrupted, and no thread is left behind), which is joined before this returns.
    `work` must end by itself: its streams close, or its portal calls are cancelled. Only when
    `abandon` is set first (the work is known to hang) does this return None at once, leaving
    the (daemon) thread behind."""
    outcome: list[tuple[bool, Any]] = []
    finished = anyio.Event()
    token = anyio.lowlevel.current_token()

    def target() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as exc:  # handed to the event loop, raised there
            outcome.append((False, exc))
        finally:
            try:
                anyio.from_thread.run_sync(finished.set, token=token)
            except RuntimeError:
                pass  # abandoned, and the event loop is gone: nobody waits for this thread

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    with anyio.CancelScope(shield=True):
        await _first_set(finished, abandon)
    if not finished.is_set():
        return None
    thread.join()
    ((returned, value),) = outcome
    if not returned:
        raise value
    return value


async def _first_set(event: anyio.Event, other: anyio.Event | None) -> None:
    """Wait until `event` (or `other`, when given) is set."""
    if other is None:
        await event.wait()
        return
    async with anyio.create_task_group() as waiting:

        async def wait_for(one: anyio.Event) -> None:
            await one.wait()
            waiting.cancel_scope.cancel()

        waiting.start_soon(wait_for, event)
        waiting.start_soon(wait_for, other)


def receive_from_loop(portal: BlockingPortal, stream: MemoryObjectReceiveStream[T]) -> T | None:
    """The next message (in a worker thread); None when the loop side is gone."""
    try:
        return portal.call(stream.receive)
    except _LOOP_GONE:
        return None


class LoopPortal(BlockingPortal):
    """A portal that also names its event loop, for the plain callbacks `send_to_loop` runs
    there."""

    def __init__(self) -> None:
        super().__init__()
        self.token = anyio.lowlevel.current_token()


def send_to_loop(portal: LoopPortal, stream: MemoryObjectSendStream[T], message: T) -> bool:
    """Send from a worker thread; False when the loop side is gone. The loop side usually
    waits for the message already: a plain callback then hands it over, without the task a
    portal call starts for each send."""
    try:
        try:
            anyio.from_thread.run_sync(stream.send_nowait, message, token=portal.token)
        except anyio.WouldBlock:
            portal.call(stream.send, message)
    except _LOOP_GONE:
        return False
    return True
