"""One request's logic: admission, the token loop, stops, budget and streaming text.

A session is an async generator running in the caller's task, so cancelling the caller (or
closing / dropping the iterator) cancels the session. It is pull-based: it asks the scheduler
for the next token only after the caller took the last chunk, so a slow consumer parks only its
own sequence. Its `finally` is synchronous (non-blocking sends into an inbox sized so they never
block), so it runs the same whether the request ends, is cancelled, or is garbage-collected.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import msgspec

from actors.channels import LoopReceiver, LoopSender, loop_channel
from actors.errors import ComputeError, EngineClosed, EngineOverloaded, InvalidRequest
from actors.logs import get_logger
from actors.messages import (
    Advance,
    Chunk,
    CloseSequence,
    ConstraintFailed,
    OpenSequence,
    SequenceFailed,
    Timings,
    TokenReady,
    Usage,
)
from actors.params import SamplingParams
from actors.reasoning import ChatReasoning, ReasoningGate, ReasoningText
from actors.sampling import SequenceSampling
from actors.scheduler import Admission
from actors.structured import Constraint

_seq_ids = itertools.count(1)


def answer_budget(params: SamplingParams, context_length: int, prompt_tokens: int) -> int:
    """How many tokens the answer may hold: `max_tokens`, or what the context has left."""
    return min(params.max_tokens, context_length - prompt_tokens)


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


class StopText:
    """Holds back generated text that could still turn into a stop string, so text is never
    emitted and then taken back."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string was found). After a
        stop string, the text from it on is dropped."""
        if not self._stops:  # most requests: nothing to find or hold back
            return text, False
        held = self._held + text
        hits = [index for index in (held.find(stop) for stop in self._stops) if index >= 0]
        if hits:
            self._held = ""
            return held[: min(hits)], True
        keep = self._longest_stop_prefix_suffix(held)
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep], False

    def flush(self) -> str:
        """The held text, once no more tokens will come."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


class Answer:
    """The tokens a request generated and the text they release: UTF-8-safe (the tokenizer's
    incremental decoder), stop strings held back, and the reason it ends. With `reasoning`,
    the tokens of the reasoning release reasoning text instead (stop strings look at the
    content alone)."""

    def __init__(self, tokenizer: Any, params: SamplingParams, budget: int,
                 reasoning: ReasoningText | None = None) -> None:
        self.token_ids: list[int] = []
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= tokenizer.stop_ids
        self._stop_ids = frozenset(stop_ids)
        self._decoder = tokenizer.incremental_decoder()
        self._stop_text = StopText(params.stop)
        self._budget = budget
        self.reasoning = reasoning
        # Out of budget: the caller's max_tokens, or else the context ran out.
        self._budget_reason = "length" if budget == params.max_tokens else "context"
        # Whether a stop string ended the answer (cutting its text short).
        self.stopped_by_text = False

    def is_stop_token(self, token: int) -> bool:
        """A token that ends the answer without being part of it."""
        return token in self._stop_ids

    def add(self, token: int) -> tuple[str, str, str | None]:
        """Text and reasoning text `token` releases, and the finish reason if the answer ends
        with it."""
        if self.is_stop_token(token):
            return (*self._rest(), "stop")
        self.token_ids.append(token)
        thought = None if self.reasoning is None else self.reasoning.take(token)
        text = ""
        if thought is None:
            text, hit = self._stop_text.push(self._content(token))
            if hit:
                self.stopped_by_text = True
                return text, "", "stop"
        if len(self.token_ids) >= self._budget:
            rest, rest_thought = self._rest()
            return (text + rest, (thought or "") + rest_thought,
                    "stop" if self.stopped_by_text else self._budget_reason)
        return text, thought or "", None

    @property
    def reasoning_tokens(self) -> int:
        return 0 if self.reasoning is None else self.reasoning.tokens

    def close(self) -> tuple[str, str]:
        """The text and reasoning text still held back, when the answer ends before its budget
        (a complete structured-output constraint)."""
        return self._rest()

    def _content(self, token: int) -> str:
        text = self._decoder.push(token)
        return text if self.reasoning is None else self.reasoning.content(text)

    def _rest(self) -> tuple[str, str]:
        thought = "" if self.reasoning is None else self.reasoning.flush()
        text, hit = self._stop_text.push(self._decoder.flush())
        self.stopped_by_text |= hit
        return (text, thought) if hit else (text + self._stop_text.flush(), thought)


class Session:
    """Everything one request needs; `stream()` is the async iterator the caller gets."""

    def __init__(
        self,
        *,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        context_length: int,
        tokenizer: Any,
        scheduler_inbox: LoopSender[OpenSequence | Advance | CloseSequence],
        admission: Admission,
        constraint: Constraint | ReasoningGate | None = None,
        admitted: bool = False,
        reasoning: ChatReasoning | None = None,
    ) -> None:
        """`admitted`: the caller already took this request's admission slot (it had work to
        do first, such as compiling `constraint`), and the session gives it back.
        `constraint`: a `Constraint`, or a `ReasoningGate` around one; `reasoning`: where the
        answer's reasoning is (None: it has none)."""
        self.request_id = request_id
        self._constraint = constraint
        self._reasoning = reasoning
        self._prompt_ids = tuple(prompt_ids)
        self._params = params
        self._budget = answer_budget(params, context_length, len(prompt_ids))
        self._tokenizer = tokenizer
        self._inbox = scheduler_inbox
        self._admission = admission
        self._admitted = admitted
        self._log = get_logger("actors.session", request_id=request_id)

    async def stream(self) -> AsyncIterator[Chunk]:
        if not self._admitted:
            try:
                self._admission.enter()
            except EngineOverloaded as exc:
                self._log.warning("request_rejected", reason="overloaded", error=str(exc))
                raise
        # From here on the slot is taken: everything, even building the request's state, runs
        # inside the try whose finally gives it back (an error there once locked the engine).
        seq_id = next(_seq_ids)
        started = time.perf_counter()
        opened = False
        answer: Answer | None = None
        first_token_at: float | None = None
        ended = False
        try:
            # A light channel (one message at a time): it is waited on every token.
            reply_receive: LoopReceiver[TokenReady | SequenceFailed | ConstraintFailed]
            reply_send, reply_receive = loop_channel(1)
            sampler = SequenceSampling(self._params, self._prompt_ids, self._tokenizer.vocab_size,
                                       self._constraint)
            answer = Answer(self._tokenizer, self._params, self._budget,
                            None if self._reasoning is None else
                            self._reasoning.text(self._tokenizer))
            with reply_receive:
                self._send(
                    OpenSequence(
                        seq_id=seq_id, request_id=self.request_id, sampler=sampler, reply=reply_send
                    )
                )
                opened = True
                # Tokens a constraint forces before the model's first choice are computed
                # with the prompt, and lead the first token's chunks.
                leading = self._constraint.leading if self._constraint is not None else ()
                self._send(Advance(seq_id=seq_id, tokens=self._prompt_ids + leading))
                self._log.info(
                    "request_admitted",
                    prompt_tokens=len(self._prompt_ids),
                    max_tokens=self._params.max_tokens,
                )
                while True:
                    message = await self._receive(reply_receive)
                    now = time.perf_counter()
                    # The cache may also have held a constraint's forced start, which is part
                    # of the answer, not of the prompt.
                    cached_tokens = min(message.cached_tokens, len(self._prompt_ids))
                    if first_token_at is None:
                        first_token_at = now
                        self._log.info(
                            "prefill_finished",
                            prompt_tokens=len(self._prompt_ids),
                            cached_tokens=cached_tokens,
                            ms=_ms(now - started),
                        )
                    chunks, finish = _chunks(answer, message, leading, self._params.logprobs)
                    leading = ()
                    if finish == "stop" and self._constraint_cut(answer, message):
                        for chunk in chunks:
                            yield chunk
                        raise self._cut_error(answer)
                    for chunk in chunks[:-1]:
                        yield chunk
                    chunk = chunks[-1]
                    if finish is None:
                        yield chunk
                        self._send(Advance(seq_id=seq_id, tokens=(message.token, *message.forced)))
                        continue
                    ended = True
                    usage = Usage(
                        prompt_tokens=len(self._prompt_ids),
                        completion_tokens=len(answer.token_ids),
                        cached_tokens=cached_tokens,
                        reasoning_tokens=answer.reasoning_tokens,
                    )
                    timings = _timings(started, first_token_at, now, len(answer.token_ids))
                    self._log_finished(finish, usage, timings)
                    yield msgspec.structs.replace(
                        chunk, finish_reason=finish, usage=usage, timings=timings
                    )
                    return
        except Exception as exc:
            ended = True
            known = isinstance(exc, ComputeError | EngineClosed | InvalidRequest)
            self._log.error("request_failed", error=str(exc) if known else repr(exc))
            raise
        finally:
            self._release(seq_id, opened)
            if not ended:
                self._log_cancelled(started, first_token_at, answer)

    def _constraint_cut(self, answer: Answer, message: TokenReady) -> bool:
        """Whether a stop string or stop token ended a constrained answer short of its
        constraint's end: its text then does not match the constraint."""
        return self._params.structured is not None and (
            answer.stopped_by_text or not message.constraint_done)

    def _cut_error(self, answer: Answer) -> InvalidRequest:
        field = "stop" if answer.stopped_by_text else "stop_token_ids"
        return InvalidRequest(
            f"{field} ended the answer before its structured output constraint "
            f"({self._constraint_kind}) was complete, so the text does not match it; leave "
            f"{field} out of constrained requests", field=field)

    @property
    def _constraint_kind(self) -> str:
        """The kind of the request's structured output (`StructuredOutput.kind`)."""
        structured = self._params.structured
        return structured.kind if structured is not None else "none"

    def _release(self, seq_id: int, opened: bool) -> None:
        """Give the admission slot back: through the scheduler once it knows the sequence (it
        frees the slot when it has handled the close, so a request counts against the limits
        until its blocks are really released), or here if it never heard of it."""
        if not opened:
            self._admission.leave()
            return
        try:
            self._inbox.send_nowait(CloseSequence(seq_id=seq_id))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the scheduler is gone, and its bookkeeping with it

    def _log_cancelled(
        self, started: float, first_token_at: float | None, answer: Answer | None
    ) -> None:
        # ttft_ms only when a token came, so `q4k logs` can show it for cancelled requests.
        first_token = {} if first_token_at is None else {"ttft_ms": _ms(first_token_at - started)}
        self._log.info(
            "request_cancelled",
            completion_tokens=0 if answer is None else len(answer.token_ids),
            total_ms=_ms(time.perf_counter() - started),
            **first_token,
        )

    def _log_finished(self, finish: str, usage: Usage, timings: Timings) -> None:
        self._log.info(
            "request_finished",
            finish_reason=finish,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            ttft_ms=timings.ttft_ms,
            decode_tokens_per_s=timings.decode_tokens_per_s,
            total_ms=timings.total_ms,
        )

    def _send(self, message: OpenSequence | Advance) -> None:
        # Never blocks: the inbox has room for three messages (open, advance, close) per
        # admission slot, and a slot is only freed once the scheduler handled the close.
        try:
            self._inbox.send_nowait(message)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise EngineClosed("the engine closed while this request was running") from None

    async def _receive(
        self, reply: LoopReceiver[TokenReady | SequenceFailed | ConstraintFailed]
    ) -> TokenReady:
        try:
            message = await reply.receive()
        except anyio.EndOfStream:
            raise EngineClosed("the engine closed while this request was running") from None
        if isinstance(message, SequenceFailed):
            raise ComputeError(f"a step failed twice for this request: {message.error}")
        if isinstance(message, ConstraintFailed):
            raise InvalidRequest(message.error, field=f"structured.{self._constraint_kind}")
        return message


def _chunks(
    answer: Answer, message: TokenReady, leading: tuple[int, ...] = (),
    logprobs: int | None = None,
) -> tuple[list[Chunk], str | None]:
    """The chunks of a chosen token, of the tokens its constraint forced before it (`leading`,
    at the start of the answer) and after it, and the finish reason if the answer ends.
    `logprobs`: the request's; a forced token's logprob is 0.0, the only token its constraint
    allowed (a chosen token's logprob, too, is over the tokens its constraint allowed)."""
    chunks: list[Chunk] = []
    for index, token in enumerate((*leading, message.token, *message.forced)):
        text, reasoning, finish = answer.add(token)
        in_answer = not answer.is_stop_token(token)
        if index == len(leading):  # the model's choice
            logprob, top = message.logprob, message.top_logprobs
        elif logprobs is None:
            logprob, top = None, None
        else:  # forced: the only token its constraint allowed
            logprob, top = 0.0, ((token, 0.0),)[:logprobs]
        if not in_answer:
            logprob, top = None, None
        chunks.append(Chunk(
            text=text,
            reasoning=reasoning,
            token_id=token if in_answer else None,
            logprob=logprob,
            top_logprobs=top,
        ))
        if finish is not None:
            return chunks, finish
    if message.constraint_done:  # nothing may follow: it ends here, without another step
        last = chunks[-1]
        text, reasoning = answer.close()
        chunks[-1] = msgspec.structs.replace(last, text=last.text + text,
                                             reasoning=last.reasoning + reasoning)
        return chunks, "stop"
    return chunks, None


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _timings(started: float, first_token_at: float, finished: float, tokens: int) -> Timings:
    decode_s = finished - first_token_at
    rate = (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0
    return Timings(
        ttft_ms=_ms(first_token_at - started),
        total_ms=_ms(finished - started),
        decode_tokens_per_s=round(rate, 3),
    )
