"""The scheduler actor: continuous batching over the KV block pool.

It owns every sequence's bookkeeping (its tokens; actors.kv_manager keeps its KV's block
table) and turns the advances sessions ask for into one `RunStep` at a time: decode items
first, then prefill chunks under a token budget, each row with its sequence's penalty inputs.
The compute actor answers the step's token candidates, the sampler actor the tokens chosen
from them (asking, through the scheduler, for the few whole rows the candidates cannot
decide; a step of greedy rows only is chosen here, its candidates decide it at once). It
then hands each sequence its token (a constrained sequence's once a constraint worker has fed
it to the constraint: actors.sampling.constraints; the sequence sits out the steps until
then, so its mask's cost is its own) and briefly gathers the next advances, so N decoding
sequences ride in ~N-item steps instead of fragmenting into many small ones; a sequence
whose caller is slow simply misses steps.

It keeps the replay rules of the compute contract (actors.compute.contract): a forward resumes
exactly at what a sequence's KV holds; a failed step (or a row whose token could not be
chosen, for its own sequence) leaves the sequence holding nothing, to be replayed from scratch,
and failing MAX_STEP_FAILURES times in a row fails that sequence alone. A lost backend fails
every sequence and takes no more steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio

from actors.channels import LoopReceiver, LoopSender, ThreadSender
from actors.compute.contract import (
    MAX_STEP_FAILURES,
    BackendLost,
    FetchRows,
    RowsFetched,
    RunStep,
    Shutdown,
    StepDone,
    StepFailed,
    StepItem,
)
from actors.errors import EngineOverloaded
from actors.kv_manager import BlockTable, KVBlockManager
from actors.logs import enabled_for, get_logger
from actors.messages import (
    Advance,
    CloseSequence,
    ConstraintFailed,
    OpenSequence,
    SequenceFailed,
    TokenReady,
)
from actors.sampling import (
    AdvanceConstraint,
    ConstraintAdvanced,
    ReleaseConstraint,
    RowFailed,
    RowsWanted,
    SampleRows,
    SampleStep,
    SamplingFailed,
    StepSampled,
    TokenChoice,
    sample,
)

# How long the scheduler keeps waiting for sequences that just got a token to ask for the next
# one, measured from the last one that did; past it, the stragglers miss this step. Generous
# next to the microseconds a consumer needs, small next to a forward pass: the larger of a
# floor and a fraction of the last step's time (a loaded machine slows consumers too).
GATHER_IDLE_MIN_S = 0.002
GATHER_IDLE_STEP_FRACTION = 0.02
_LOGGER = "actors.scheduler"


class Admission:
    """Counts live requests against the engine's limits (running + queued). Sessions enter on
    their first step; the scheduler lets them leave when it handles their CloseSequence."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.live = 0

    def check(self, count: int = 1) -> None:
        """Raise EngineOverloaded if `count` more sequences (a request's answers) cannot be
        taken now."""
        if self.live + count > self.limit:
            asked = f"; this request asks for {count}" if count > 1 else ""
            raise EngineOverloaded(
                f"{self.live} requests are already running or queued (the limit is "
                f"max_sequences + max_queued = {self.limit}{asked}); retry later or raise the "
                "limits"
            )

    def enter(self, count: int = 1) -> None:
        self.check(count)
        self.live += count

    def leave(self) -> None:
        self.live -= 1


# What a sequence's session may be sent.
Reply = TokenReady | SequenceFailed | ConstraintFailed
# What the scheduler's inbox receives: the sessions' messages, and the constraint workers'.
Inbound = OpenSequence | Advance | CloseSequence | ConstraintAdvanced


@dataclass(eq=False)
class _Sequence:
    seq_id: int
    request_id: str
    sampler: Any
    reply: LoopSender[Reply]
    order: int
    tokens: list[int] = field(default_factory=list)
    kv: BlockTable = field(default_factory=BlockTable)
    pending: bool = False
    cached_tokens: int = 0
    admitted: bool = False
    failures: int = 0
    # A constrained sequence's chosen token, while a constraint worker feeds it to the
    # constraint: its reply waits for that, and the sequence sits out the steps meanwhile.
    held: TokenChoice | None = None


class Scheduler:
    """Admits sequences, builds steps, sends them to the compute actor, routes the tokens."""

    def __init__(
        self,
        *,
        kv: KVBlockManager,
        admission: Admission,
        max_sequences: int,
        prefill_chunk: int,
        step_timeout_s: float,
        compute_hung: anyio.Event,
        inbox: LoopReceiver[Inbound],
        constraint_inbox: ThreadSender[AdvanceConstraint | ReleaseConstraint],
        compute_inbox: ThreadSender[RunStep | FetchRows | Shutdown],
        compute_outbox: LoopReceiver[Any],
        sampler_inbox: ThreadSender[SampleStep | SampleRows],
        sampler_outbox: LoopReceiver[StepSampled | RowsWanted | SamplingFailed],
    ) -> None:
        self.kv = kv
        self.admission = admission
        self._max_sequences = max_sequences
        self._prefill_chunk = prefill_chunk
        self._step_timeout_s = step_timeout_s
        self._compute_hung = compute_hung
        self._inbox = inbox
        self._constraint_inbox = constraint_inbox
        self._compute_inbox = compute_inbox
        self._compute_outbox = compute_outbox
        self._sampler_inbox = sampler_inbox
        self._sampler_outbox = sampler_outbox
        self._sequences: dict[int, _Sequence] = {}
        self._waiting: deque[_Sequence] = deque()
        # By seq_id, in admission order: a step checks membership once per item.
        self._running: dict[int, _Sequence] = {}
        # Sequences that got a token and have not asked for the next one (or closed) yet.
        self._outstanding: set[int] = set()
        self._orders = 0
        self._last_step_s = 0.0
        self.steps = 0
        self.tokens = 0
        self.bytes_from_compute = 0
        self.compute_busy_s = 0.0  # the backend's own time in the steps (StepDone.busy_s)
        # Why the backend can no longer run (BackendLost), once it cannot.
        self.lost: str | None = None
        self._log = get_logger(_LOGGER)

    @property
    def max_sequences(self) -> int:
        return self._max_sequences

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def run(self) -> None:
        """The actor task: until the inbox closes or the compute or sampler actor goes away."""
        try:
            with (self._inbox, self._constraint_inbox, self._compute_outbox, self._sampler_inbox,
                  self._sampler_outbox):
                while True:
                    self._drain()
                    await self._gather_outstanding()
                    step = self._build_step()
                    if step is None:
                        self._handle(await self._inbox.receive())
                        continue
                    self._apply(step, *await self._run_step(step))
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        finally:
            # Sessions still waiting learn that the engine is gone (they raise EngineClosed).
            for seq in self._sequences.values():
                seq.reply.close()
            try:
                self._compute_inbox.send_nowait(Shutdown())
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass  # closing the inbox below ends the compute thread just the same
            self._compute_inbox.close()

    # --- messages -------------------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            try:
                message = self._inbox.receive_nowait()
            except anyio.WouldBlock:
                return
            self._handle(message)

    def _handle(self, message: Inbound) -> None:
        if isinstance(message, ConstraintAdvanced):
            self._constraint_advanced(message)
            return
        if isinstance(message, OpenSequence):
            self._orders += 1
            seq = _Sequence(
                seq_id=message.seq_id,
                request_id=message.request_id,
                sampler=message.sampler,
                reply=message.reply,
                order=self._orders,
            )
            self._sequences[seq.seq_id] = seq
            self._waiting.append(seq)
            return
        self._outstanding.discard(message.seq_id)
        if isinstance(message, Advance):
            seq = self._sequences[message.seq_id]
            if self.lost is not None:
                self._reply(seq, SequenceFailed(error=f"the compute backend was lost: {self.lost}"))
                return
            seq.tokens.extend(message.tokens)
            seq.pending = True
            return
        self.admission.leave()
        seq = self._sequences.pop(message.seq_id)
        if self._running.pop(seq.seq_id, None) is None:
            self._waiting.remove(seq)
        self.kv.release(seq.kv)
        seq.reply.close()
        if seq.sampler.constraint is not None:
            self._constraint_inbox.send_nowait(
                ReleaseConstraint(constraint=seq.sampler.constraint))

    def _constraint_advanced(self, message: ConstraintAdvanced) -> None:
        """A constraint took its sequence's token: the held token goes out, with the tokens
        the constraint forces after it, or the constraint's failure does."""
        seq = self._sequences.get(message.seq_id)
        if seq is None or seq.held is None:
            return  # closed while its constraint advanced
        choice, seq.held = seq.held, None
        if message.error is not None:
            self._reply(seq, ConstraintFailed(error=message.error))
            return
        self._outstanding.add(seq.seq_id)
        self._reply(seq, _token_ready(seq, choice, message.forced, message.done))

    async def _gather_outstanding(self) -> None:
        """Let the sequences that just got a token ask for the next one before the step."""
        idle_limit = max(GATHER_IDLE_MIN_S, GATHER_IDLE_STEP_FRACTION * self._last_step_s)
        idle_since = time.monotonic()
        while self._outstanding and time.monotonic() - idle_since < idle_limit:
            await anyio.sleep(0)
            before = len(self._outstanding)
            self._drain()
            if len(self._outstanding) < before:
                idle_since = time.monotonic()
        self._outstanding.clear()

    # --- building a step ------------------------------------------------------------------

    def _build_step(self) -> RunStep | None:
        if self.lost is not None:
            return None
        self._admit()
        items: list[StepItem] = []
        in_step: set[int] = set()
        pending = [seq for seq in self._running.values() if seq.pending]
        # A sequence whose last step failed replays alone until it gets a token: a failure it
        # causes then takes down no sequence batched with it, and theirs cannot take it down.
        suspects = [seq for seq in pending if seq.failures]
        if suspects:
            pending = suspects[:1]
        decoding = [seq for seq in pending if len(seq.tokens) - seq.kv.held == 1]
        prefilling = [seq for seq in pending if len(seq.tokens) - seq.kv.held > 1]
        # Decoding alone, nothing waiting: the next step may well be this one again.
        steady = not prefilling and not self._waiting
        for seq in decoding:
            # An earlier reservation in this loop may have preempted it.
            if seq.seq_id in self._running and self._reserve(seq, len(seq.tokens), in_step):
                if steady:
                    self._reserve_next_position(seq)
                items.append(self._item(seq, len(seq.tokens), len(seq.tokens) + 1))
                in_step.add(seq.seq_id)
        budget = max(self._prefill_chunk - len(items), self.kv.block_size)
        for seq in prefilling:
            if budget <= 0:
                break
            end = min(len(seq.tokens), seq.kv.held + budget)
            if seq.seq_id not in self._running or not self._reserve(seq, end, in_step):
                continue
            items.append(self._item(seq, end))
            in_step.add(seq.seq_id)
            budget -= end - seq.kv.held
        if not items:
            return None
        self.steps += 1
        rows = tuple(
            self._sequences[item.seq_id].sampler.row_inputs()
            for item in items if item.want_logits
        )
        return RunStep(step_id=self.steps, items=tuple(items), rows=rows)

    def _item(self, seq: _Sequence, end: int, covered: int | None = None) -> StepItem:
        """The step's item of `seq` up to `end`, its table covering positions up to `covered`
        (default `end`) where it holds them."""
        return StepItem(
            seq_id=seq.seq_id,
            tokens=tuple(seq.tokens[seq.kv.held : end]),
            start=seq.kv.held,
            blocks=self.kv.step_blocks(seq.kv, end if covered is None else covered),
            want_logits=end == len(seq.tokens),
        )

    def _reserve_next_position(self, seq: _Sequence) -> None:
        """The block of a decoding sequence's next position too, a step early (in a step of
        decoding sequences alone, none waiting), where the pool has a free block for every
        running sequence besides (so it takes none another sequence needs, and preempts
        nothing): a backend may then run the next step ahead (actors.compute.cuda_ahead),
        which it does only inside the tables it was given."""
        if self.kv.pool.available > len(self._running):
            self.kv.reserve(seq.kv, len(seq.tokens) + 1)

    def _admit(self) -> None:
        """Move waiting sequences (first come, first served) into the running set while there
        is room, reusing the cached blocks of their longest known prefix."""
        # A sequence that waits for its caller (no advance pending) lets later ones go first.
        for seq in [seq for seq in self._waiting if seq.pending]:
            if len(self._running) >= self._max_sequences:
                return
            if not self.kv.admit(seq.kv, seq.tokens, self._prefill_chunk):
                return
            self._waiting.remove(seq)
            if not seq.admitted:
                seq.admitted = True
                seq.cached_tokens = seq.kv.held
            self._running[seq.seq_id] = seq

    def _reserve(self, seq: _Sequence, end: int, in_step: set[int]) -> bool:
        """Make `seq`'s block table cover positions [0, end), preempting the newest other
        sequence not in this step while blocks run short. False: `seq` waits this step."""
        while not self.kv.reserve(seq.kv, end):
            victims = [s for s in self._running.values()
                       if s is not seq and s.seq_id not in in_step]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda s: s.order))
        return True

    def _preempt(self, seq: _Sequence) -> None:
        """Free a sequence's blocks and queue it again at the front; it is recomputed (reusing
        whatever prefix is still cached) when readmitted."""
        del self._running[seq.seq_id]
        self.kv.release(seq.kv)
        self._waiting.appendleft(seq)
        self._log.info(
            "notice",
            request_id=seq.request_id,
            message="preempted: KV blocks ran out; it is recomputed when blocks free up",
        )

    # --- running it -----------------------------------------------------------------------

    async def _run_step(
        self, step: RunStep
    ) -> tuple[StepSampled | StepFailed | SamplingFailed | BackendLost, float, float]:
        """The forward, then the token choice for the items that wanted logits (fetching the
        whole rows the sampler asks for); the result, the step's wall time and the backend's
        own time in it (ms)."""
        started = time.perf_counter()
        result = await self._ask_compute(step)
        compute_ms = result.busy_s * 1000.0 if isinstance(result, StepDone) else 0.0
        if isinstance(result, StepDone):
            samplers = tuple(
                self._sequences[item.seq_id].sampler for item in step.items if item.want_logits
            )
            if samplers:
                message = SampleStep(step_id=step.step_id, candidates=result.candidates,
                                     samplers=samplers)
                # Greedy rows are decided from their candidates in microseconds (never a
                # whole row): sampled here, without the two thread hops to the sampler (a
                # constrained row's constraint then takes its token in a constraint worker).
                if all(sampler.decided_inline for sampler in samplers):
                    result = sample(message)
                else:
                    result = await self._ask_sampler(message)
            else:
                result = StepSampled(step_id=step.step_id, choices=())
            if isinstance(result, RowsWanted):
                rows = await self._ask_compute(
                    FetchRows(step_id=step.step_id, rows=result.pending.needed_rows)
                )
                if isinstance(rows, RowsFetched):
                    rows = await self._ask_sampler(
                        SampleRows(step_id=step.step_id, pending=result.pending,
                                   logits=rows.logits, samplers=samplers)
                    )
                result = rows
        self._last_step_s = time.perf_counter() - started
        return result, self._last_step_s * 1000.0, compute_ms

    async def _ask_compute(self, message: RunStep | FetchRows) -> Any:
        """The compute actor's answer; a step past its deadline is a failed step, and a
        backend that does not answer within a second deadline either is lost."""
        # The compute thread has taken every earlier message: it answered each before this.
        self._compute_inbox.send_nowait(message)
        try:
            return self._counted(await self._compute_outbox.receive(self._step_timeout_s))
        except TimeoutError:
            pass
        late = f"a step ran past its deadline of {self._step_timeout_s:g} s"
        self._log.error("step_timeout", step=message.step_id, timeout_s=self._step_timeout_s)
        # The backend still owes this answer; only then can it take the next step.
        try:
            await self._compute_outbox.receive(self._step_timeout_s)
            return StepFailed(step_id=message.step_id, error=late)
        except TimeoutError:
            pass
        self._compute_hung.set()
        return BackendLost(error=f"{late} and gave no answer within another one")

    def _counted(self, answer: Any) -> Any:
        if isinstance(answer, StepDone):
            self.bytes_from_compute += answer.candidates.nbytes
            self.compute_busy_s += answer.busy_s
        elif isinstance(answer, RowsFetched):
            self.bytes_from_compute += answer.logits.nbytes
        return answer

    async def _ask_sampler(
        self, message: SampleStep | SampleRows
    ) -> StepSampled | RowsWanted | SamplingFailed:
        self._sampler_inbox.send_nowait(message)  # it answered every earlier one
        return await self._sampler_outbox.receive()

    def _apply(
        self,
        step: RunStep,
        result: StepSampled | StepFailed | SamplingFailed | BackendLost,
        ms: float,
        compute_ms: float,
    ) -> None:
        n_tokens = sum(len(item.tokens) for item in step.items)
        self.tokens += n_tokens
        # Checked first: building an event costs more than a fast step's own bookkeeping.
        if enabled_for(_LOGGER, "debug"):
            decode_items = sum(1 for item in step.items if len(item.tokens) == 1)
            self._log.debug(
                "step",
                step=step.step_id,
                items=len(step.items),
                decode_items=decode_items,
                prefill_items=len(step.items) - decode_items,
                tokens=n_tokens,
                ms=round(ms, 3),
                compute_ms=round(compute_ms, 3),
            )
        sequences = [self._sequences[item.seq_id] for item in step.items]
        if isinstance(result, BackendLost):
            self._lose_backend(result.error)
            return
        if not isinstance(result, StepSampled):
            self._fail(sequences, result.error)
            return
        choices = iter(result.choices)
        for seq, item in zip(sequences, step.items):
            choice = next(choices) if item.want_logits else None
            if isinstance(choice, RowFailed):
                self._fail([seq], choice.error)
                continue
            self.kv.computed(seq.kv, seq.tokens, item.start, item.start + len(item.tokens))
            if choice is None:
                continue
            seq.failures = 0
            seq.pending = False
            if seq.sampler.constraint is not None:
                seq.held = choice
                self._constraint_inbox.send_nowait(
                    AdvanceConstraint(seq_id=seq.seq_id, token=choice.token, sampler=seq.sampler))
                continue
            self._outstanding.add(seq.seq_id)
            self._reply(seq, _token_ready(seq, choice))

    def _lose_backend(self, error: str) -> None:
        """The backend can no longer run: fail every sequence, take no more steps."""
        self.lost = error
        self._log.error("backend_lost", error=error)
        for seq in self._sequences.values():
            self.kv.release(seq.kv)
            # The others hold an unread token; their next advance is answered in `_handle`.
            if seq.pending:
                seq.pending = False
                self._reply(seq, SequenceFailed(error=f"the compute backend was lost: {error}"))

    def _fail(self, sequences: Iterable[_Sequence], error: str) -> None:
        """A failed step: every sequence in it holds nothing now; each replays from scratch on
        the next step, unless this was already its replay."""
        self._log.warning("notice", message=f"step failed: {error}")
        for seq in sequences:
            self.kv.release(seq.kv)
            seq.failures += 1
            if seq.failures >= MAX_STEP_FAILURES:
                seq.pending = False
                self._reply(seq, SequenceFailed(error=error))

    @staticmethod
    def _reply(seq: _Sequence, message: Reply) -> None:
        try:
            seq.reply.send_nowait(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the session is gone; its CloseSequence is on the way

    @property
    def last_step_s(self) -> float:
        return self._last_step_s


def _token_ready(seq: _Sequence, choice: TokenChoice, forced: tuple[int, ...] = (),
                 constraint_done: bool = False) -> TokenReady:
    return TokenReady(
        token=choice.token,
        logprob=choice.logprob,
        top_logprobs=choice.top_logprobs,
        cached_tokens=seq.cached_tokens,
        forced=forced,
        constraint_done=constraint_done,
    )
