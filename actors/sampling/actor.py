"""The sampler actor: one dedicated thread that chooses and records each step's tokens, and
the messages it exchanges with the scheduler."""

from __future__ import annotations

from typing import Any

import msgspec

from actors.channels import LoopSender, ThreadReceiver
from actors.compute.actor import run_in_own_thread
from actors.compute.contract import Candidates
from actors.sampling.from_candidates import PendingChoice, start_choice
from actors.sampling.state import RowFailed, TokenChoice
from actors.sampling.whole_row import finish_choice


class SampleStep(msgspec.Struct, frozen=True, kw_only=True):
    """One step's candidates and, row by row, the sampling state of the sequence each row
    belongs to."""

    step_id: int
    candidates: Candidates
    samplers: tuple[Any, ...]  # SequenceSampling


class RowsWanted(msgspec.Struct, frozen=True, kw_only=True):
    """The candidates could not decide these rows: the scheduler fetches their whole rows
    from the backend and answers `SampleRows` with them."""

    step_id: int
    pending: PendingChoice


class SampleRows(msgspec.Struct, frozen=True, kw_only=True):
    """The rows a `RowsWanted` asked for (float32 (rows, vocab), penalized, in its order)."""

    step_id: int
    pending: PendingChoice
    logits: Any  # np.ndarray
    samplers: tuple[Any, ...]  # SequenceSampling, as in the step's SampleStep


class StepSampled(msgspec.Struct, frozen=True, kw_only=True):
    """One choice per row of the step, in row order; each TokenChoice is recorded in its
    sequence, a RowFailed fails only its own sequence's step."""

    step_id: int
    choices: tuple[TokenChoice | RowFailed, ...]


class SamplingFailed(msgspec.Struct, frozen=True, kw_only=True):
    """The sampler raised; nothing was recorded and the whole step counts as failed."""

    step_id: int
    error: str


class SamplerActor:
    """Chooses and records each step's tokens in one dedicated thread of its own.

    Off the event loop because deciding a batch of rows takes milliseconds, which the
    sessions' streaming would otherwise wait behind. A dedicated thread rather than a pooled
    worker per step: it is joined when the engine closes (no pooled thread outlives the
    engine), and no other user of the default thread limiter can make a step wait for a slot.
    """

    def __init__(
        self,
        inbox: ThreadReceiver[SampleStep | SampleRows],
        outbox: LoopSender[StepSampled | RowsWanted | SamplingFailed],
    ) -> None:
        self._inbox = inbox
        self._outbox = outbox

    async def run(self) -> None:
        """The actor task: until the inbox closes (or the engine is cancelled)."""
        with self._inbox, self._outbox:
            await run_in_own_thread("q4k-sampler", self._serve, stop=self._inbox.close)

    def _serve(self) -> None:
        while (message := self._inbox.receive()) is not None:
            if not self._outbox.send_from_thread(sample(message)):
                return


def sample(message: SampleStep | SampleRows) -> StepSampled | RowsWanted | SamplingFailed:
    """Choose what can be chosen (recording the step's tokens once all are chosen), or ask
    for the rows still needed; any failure is an answer, never a crash."""
    try:
        if isinstance(message, SampleStep):
            pending = start_choice(message.candidates, message.samplers)
            if pending.needed_rows:
                return RowsWanted(step_id=message.step_id, pending=pending)
            choices = list(pending.choices)
        else:
            choices = finish_choice(message.pending, message.logits, message.samplers)
        for sampler, choice in zip(message.samplers, choices):
            if isinstance(choice, TokenChoice):
                sampler.record(choice.token)
    except Exception as exc:
        return SamplingFailed(step_id=message.step_id, error=f"{type(exc).__name__}: {exc}")
    return StepSampled(step_id=message.step_id, choices=tuple(choices))

