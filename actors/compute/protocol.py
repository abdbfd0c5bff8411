"""The message protocol every compute actor speaks, and the one-thread actor that speaks it.

A backend (CPU now, CUDA later) is a plain synchronous object built and used inside ONE thread
for the engine's lifetime, because a CUDA context is bound to the thread that made it.
The actor task bridges that thread to the event loop: it receives `RunStep` from the scheduler,
runs the forward and the batched token choice in the thread, and answers `StepDone` or
`StepFailed`. Work in flight is never abandoned; `Shutdown` (or closing the inbox) ends it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio
import msgspec
import numpy as np
from anyio.from_thread import BlockingPortal
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.sampler import TokenChoice, choose_tokens


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


class RunStep(msgspec.Struct, frozen=True, kw_only=True):
    """One batched forward. `samplers[i]` is the SequenceSampling of the i-th item that wants
    logits; the chosen token is recorded in it before the answer goes back."""

    step_id: int
    items: tuple[ForwardItem, ...]
    samplers: tuple[Any, ...]


class StepDone(msgspec.Struct, frozen=True, kw_only=True):
    """The step ran: one choice per item that wanted logits, in item order."""

    step_id: int
    choices: tuple[TokenChoice, ...]
    ms: float


class StepFailed(msgspec.Struct, frozen=True, kw_only=True):
    """The step raised: the KV of every sequence in it is unknown now."""

    step_id: int
    error: str


class StartFailed(msgspec.Struct, frozen=True, kw_only=True):
    """The backend could not be built; the engine does not start."""

    error: BaseException


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
    """Runs `make_backend()` and then every step in one dedicated thread of its own, which
    exits (and is joined) before the actor task returns."""

    def __init__(
        self,
        make_backend: Callable[[], ComputeBackend],
        inbox: MemoryObjectReceiveStream[RunStep | Shutdown],
        outbox: MemoryObjectSendStream[ComputeInfo | StartFailed | StepDone | StepFailed],
    ) -> None:
        self._make_backend = make_backend
        self._inbox = inbox
        self._outbox = outbox

    async def run(self) -> None:
        """The actor task: hold the worker thread until shutdown."""
        with self._inbox, self._outbox:
            async with BlockingPortal() as portal:
                finished = anyio.Event()
                thread = threading.Thread(
                    target=self._thread_main, args=(portal, finished), name="q4k-compute", daemon=True
                )
                thread.start()
                # Never abandon the thread (a step may be running): even when cancelled, wait
                # for it; the scheduler closing our inbox is what ends it.
                with anyio.CancelScope(shield=True):
                    await finished.wait()
            thread.join()

    def _thread_main(self, portal: BlockingPortal, finished: anyio.Event) -> None:
        try:
            self._serve(portal)
        finally:
            portal.call(finished.set)

    def _serve(self, portal: BlockingPortal) -> None:
        try:
            backend = self._make_backend()
        except Exception as exc:  # reported to the engine, which raises it from `open`
            self._send(portal, StartFailed(error=exc))
            return
        try:
            if not self._send(portal, backend.info):
                return
            while True:
                try:
                    message = portal.call(self._inbox.receive)
                except _LOOP_GONE:
                    return
                if isinstance(message, Shutdown):
                    return
                if not self._send(portal, _run_step(backend, message)):
                    return
        finally:
            backend.close()

    def _send(self, portal: BlockingPortal, message: object) -> bool:
        """Send to the loop; False when the loop side is gone."""
        try:
            portal.call(self._outbox.send, message)
        except _LOOP_GONE:
            return False
        return True


def _run_step(backend: ComputeBackend, step: RunStep) -> StepDone | StepFailed:
    started = time.perf_counter()
    try:
        logits = backend.forward(step.items)
        choices = choose_tokens(logits, step.samplers) if step.samplers else []
    except Exception as exc:  # the compute contract: a failed step is an answer, not a crash
        return StepFailed(step_id=step.step_id, error=f"{type(exc).__name__}: {exc}")
    for sampler, choice in zip(step.samplers, choices):
        sampler.record(choice.token)
    return StepDone(
        step_id=step.step_id,
        choices=tuple(choices),
        ms=(time.perf_counter() - started) * 1000.0,
    )
