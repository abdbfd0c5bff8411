"""The compute actor: one thread that builds a backend and runs every step in it.

A backend (see actors.compute.contract) is built and used inside ONE thread for the engine's
lifetime, because a CUDA context is bound to the thread that made it. The actor's first
message, `BuildBackend` from the loader, says how to build it; the actor reports its
`ComputeInfo` (or `StartFailed`). Then it receives `RunStep` from the scheduler and answers
`StepDone` (the step's candidates) or `StepFailed`, and `FetchRows` with `RowsFetched`; the
sampler actor chooses the tokens. Once the backend raises `BackendLostError` every message is
answered `BackendLost`. Work in flight is never abandoned; `Shutdown` (or closing the inbox)
ends it. Its inbox and outbox are the light channels of actors.channels: the thread blocks on
the one and posts to the loop on the other, with no portal task per message.

`run_in_own_thread` is how every actor with a thread of its own runs it (the loader's and the
sampler's too).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream

from actors.channels import LoopSender, ThreadReceiver
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


class ComputeActor:
    """Builds the backend and then runs every step in one dedicated thread of its own, which
    exits (and is joined) before the actor task returns."""

    def __init__(
        self,
        builds: MemoryObjectReceiveStream[BuildBackend],
        inbox: ThreadReceiver[RunStep | FetchRows | Shutdown],
        outbox: LoopSender[ComputeAnswer],
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
            with self._builds, anyio.CancelScope(shield=True):
                # Shielded so a BuildBackend handed over is never lost (its `release` must
                # run): the loader always ends by sending one or closing this stream.
                try:
                    build = await self._builds.receive()
                except anyio.EndOfStream:
                    return  # the load failed; the loader told the engine
            await run_in_own_thread("q4k-compute", partial(self._serve, build),
                                    abandon=self._hung, stop=self._inbox.close)

    def _serve(self, build: BuildBackend) -> None:
        try:
            try:
                backend = build.make_backend()
            except Exception as exc:  # reported to the engine, which raises it from `open`
                self._outbox.send_from_thread(StartFailed(error=exc))
                return
            try:
                if not self._outbox.send_from_thread(backend.info):
                    return
                lost: BackendLost | None = None
                while True:
                    message = self._inbox.receive()
                    if message is None or isinstance(message, Shutdown):
                        return
                    answer = lost or _answer(backend, message)
                    if isinstance(answer, BackendLost):
                        lost = answer
                    if not self._outbox.send_from_thread(answer):
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
            started = time.perf_counter()
            candidates = backend.run(message.items, message.rows)
            return StepDone(step_id=message.step_id, candidates=candidates,
                            busy_s=time.perf_counter() - started)
        logits = np.ascontiguousarray(backend.fetch_rows(message.rows), dtype=np.float32)
        return RowsFetched(step_id=message.step_id, logits=logits)
    except BackendLostError as exc:
        return BackendLost(error=f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        return StepFailed(step_id=message.step_id, error=f"{type(exc).__name__}: {exc}")


# --- an actor's own thread ---------------------------------------------------------------------


async def run_in_own_thread(
    name: str,
    work: Callable[[], T],
    abandon: anyio.Event | None = None,
    stop: Callable[[], None] | None = None,
) -> T | None:
    """Run `work()` in a new thread called `name`; return what it returns or raise what it
    raises. A cancelled caller still waits for the thread (blocking work cannot be
    interrupted, and no thread is left behind), which is joined before this returns (or
    raises the cancellation): `stop`, when given, is called then to make `work` end sooner
    (it closes the thread's inbox); without it, `work` must end by itself. Only when
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
    try:
        # Without `stop` there is nothing to do on cancel but wait: shielded throughout.
        with anyio.CancelScope(shield=stop is None):
            await _first_set(finished, abandon)
    except anyio.get_cancelled_exc_class():
        stop()
        with anyio.CancelScope(shield=True):
            await _first_set(finished, abandon)
        if finished.is_set():
            thread.join()
        raise
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
