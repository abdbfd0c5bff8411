"""The compute contract: everything a backend (CPU, CUDA, a test's fake) must know, in one file.

A backend is a plain synchronous object that a factory builds inside the compute actor's ONE
thread (a CUDA context is bound to the thread that made it) and that the actor then drives,
step after step, from that thread. Write a backend against this file alone:

- `BackendFactory`: `unavailable_reason()` says why it cannot run here (None: it can);
  `build(model, kv)` loads the opened model's weights its own way (the CPU as float32 arrays,
  a GPU as the file's quantized blocks), sizes its KV pool from `kv` and returns the backend.
- `ComputeBackend.run(items, rows)`: advance every `StepItem` (its KV holds positions
  [0, start); write the K/V of `tokens` at start...; its `blocks` cover every position up to
  its last token), then for each item that wants logits, in item order, mask its logits row
  by `rows[i].allowed` (structured output: forbidden tokens to -inf), penalize it by `rows[i]`
  and answer its `Candidates` (see actors.model.candidates: the most likely
  tokens and the row's log-partition). Keep the penalized rows of the last step:
  `fetch_rows(indices)` hands over whole rows the sampler could not decide from candidates.
  `plan_step` validates the items and lays them out as arrays, for any backend to use.
- A bad step raises (any exception): the step failed. A backend that can no longer run at all
  (a sticky device error, a lost device) raises `BackendLostError`.
- `close()` releases what the backend holds (device memory, KV arrays).

The replay rules, which the scheduler keeps:

- A forward resumes only at exactly what a sequence's KV holds; anything else resets that
  sequence and replays the whole span.
- A failed step leaves the KV of every sequence in it unknown: each is marked as holding
  nothing and replays on its next step, or fails with `ComputeError` if its steps failed
  `MAX_STEP_FAILURES` times in a row. A row whose logits are not finite fails its own
  sequence's step only. The engine keeps serving the others.
- `BackendLost` is final: what is in flight fails with `ComputeError`, new requests are
  refused with a clear error, and nothing is ever replayed onto a dead device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import numpy as np

from actors.model.candidates import (
    Candidates,
    RowInputs,
    apply_penalties,
    apply_token_masks,
    top_candidates,
)
from actors.model.step import StepItem, StepPlan, plan_step

if TYPE_CHECKING:
    from actors.model.arch import ModelSpec
    from actors.model.loaded import OpenedModel

# A sequence whose steps fail this many times in a row is failed with ComputeError.
MAX_STEP_FAILURES = 2


class BackendLostError(Exception):
    """Raised by a backend that can no longer run any step (e.g. a sticky CUDA error)."""


class ComputeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend reports once it is ready."""

    arch: str
    on_gpu: bool
    context_length: int
    vocab_size: int
    num_blocks: int
    block_size: int
    kv_dtype: str = "float32"
    notices: tuple[str, ...] = ()

    @classmethod
    def of_model(cls, spec: ModelSpec, **backend: Any) -> ComputeInfo:
        """The info of a backend serving `spec`: the model's fields from the spec, the
        backend's own (on_gpu, the KV pool, notices) as keywords."""
        return cls(arch=spec.arch, context_length=spec.context_length,
                   vocab_size=spec.vocab_size, **backend)


class KVRequest(msgspec.Struct, frozen=True, kw_only=True):
    """How the engine asks a backend to size its KV pool: `blocks` of `block_size` positions,
    or None to let the backend choose from its memory, but no more than `max_sequences` full
    contexts are useful."""

    blocks: int | None
    block_size: int
    max_sequences: int

    def blocks_within(self, budget_bytes: int, block_bytes: int, context_length: int) -> int:
        """`blocks` if given, else as many as `budget_bytes` holds (at least 1), capped at
        what `max_sequences` full contexts use."""
        if self.blocks is not None:
            return self.blocks
        useful = self.max_sequences * -(-context_length // self.block_size)
        return max(1, min(budget_bytes // block_bytes, useful))


class ComputeBackend(Protocol):
    """The synchronous side of a compute actor, living in its one thread."""

    info: ComputeInfo

    def run(self, items: Sequence[StepItem], rows: Sequence[RowInputs]) -> Candidates:
        """Advance the items; the candidates of each row that wants logits, in item order."""
        ...

    def fetch_rows(self, indices: Sequence[int]) -> np.ndarray:
        """Whole penalized logits rows of the last step (float32, (len(indices), vocab))."""
        ...

    def close(self) -> None:
        """Release what the backend holds (device memory, KV arrays)."""
        ...


class BackendFactory(Protocol):
    """One kind of backend, as the registry (actors.compute.backends) lists it."""

    name: str

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run on this machine, or None when it can. Cheap, and
        never raises."""
        ...

    def build(self, model: OpenedModel, kv: KVRequest) -> ComputeBackend:
        """Load `model`'s weights, size the KV pool from `kv` and return the ready backend;
        called in the compute actor's thread."""
        ...


# --- messages -------------------------------------------------------------------------------


class BuildBackend(msgspec.Struct, frozen=True, kw_only=True):
    """The compute actor's first message (from the loader): how to build its backend."""

    make_backend: Any  # Callable[[], ComputeBackend], called in the compute thread
    # Called in the compute thread after the backend is closed (or failed to build): the model
    # file the engine opened, whose mapped weights only the backend knows it has stopped reading.
    release: Any = None  # Callable[[], None] | None


class RunStep(msgspec.Struct, frozen=True, kw_only=True):
    """One batched forward; `rows` has one entry per item that wants logits, in item order."""

    step_id: int
    items: tuple[StepItem, ...]
    rows: tuple[RowInputs, ...]


class StepDone(msgspec.Struct, frozen=True, kw_only=True):
    """The step ran: one candidates row per item that wanted logits, in item order;
    `busy_s`: the backend's own time for it in the compute thread (host work and device)."""

    step_id: int
    candidates: Candidates
    busy_s: float = 0.0


class FetchRows(msgspec.Struct, frozen=True, kw_only=True):
    """Whole rows of the step just run, for the sampler's rows its candidates cannot decide."""

    step_id: int
    rows: tuple[int, ...]


class RowsFetched(msgspec.Struct, frozen=True, kw_only=True):
    """float32 (len(rows), vocab), penalized, in the order asked."""

    step_id: int
    logits: Any  # np.ndarray


class StepFailed(msgspec.Struct, frozen=True, kw_only=True):
    """The step raised: the KV of every sequence in it is unknown now."""

    step_id: int
    error: str


class BackendLost(msgspec.Struct, frozen=True, kw_only=True):
    """The backend can no longer run anything; every later message gets this answer too."""

    error: str


class StartFailed(msgspec.Struct, frozen=True, kw_only=True):
    """The backend could not be built; the engine does not start."""

    error: Exception


class Shutdown(msgspec.Struct, frozen=True):
    """Leave the worker thread once the step in flight (if any) is answered."""


__all__ = [
    "MAX_STEP_FAILURES",
    "BackendFactory",
    "BackendLost",
    "BackendLostError",
    "BuildBackend",
    "Candidates",
    "ComputeBackend",
    "ComputeInfo",
    "FetchRows",
    "KVRequest",
    "RowInputs",
    "RowsFetched",
    "RunStep",
    "Shutdown",
    "StartFailed",
    "StepDone",
    "StepFailed",
    "StepItem",
    "StepPlan",
    "apply_penalties",
    "apply_token_masks",
    "plan_step",
    "top_candidates",
]
