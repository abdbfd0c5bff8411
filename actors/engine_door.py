"""The engine's way in for a request: the checks at the door (params, prompt, messages,
room in the context and in the admission limits), each refusal logged as
`request_rejected`, then the session start (after the work a prompt needs off the event
loop: a template to render, a long text to tokenize, a constraint to compile).

`EngineDoor` is `Engine`'s base class: it reads what `Engine.__init__` sets (the tokenizer,
the context length, the scheduler and its inbox, the admission counter, the chat template
source, the grammar compiler and its compile threads, the log) and holds no state of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from functools import partial
from typing import Any, NoReturn

import anyio
import msgspec
import numpy as np

from actors.errors import (
    ComputeError,
    ContextLengthExceeded,
    EngineClosed,
    EngineOverloaded,
    InvalidRequest,
)
from actors.messages import Chunk
from actors.model.text.chat import check_messages
from actors.model.text.sandbox import RenderLimits
from actors.params import SamplingParams, StructuredOutput
from actors.reasoning import (
    ANSWER,
    KNOWN_MARKERS,
    ChatReasoning,
    ReasoningGate,
    opening_phase,
    reasoning_markers,
)
from actors.session import Session, answer_budget, new_request_id
from actors.structured import COMPILE_SECONDS, Constraint

# Seconds one chat template may render.
CHAT_RENDER_SECONDS = 2.0
# The most answers one request may ask for (`n`), within max_sequences: each is a sequence.
MAX_ANSWERS = 128


class EngineDoor:
    """Checks a request at the door and starts its session (see the module docstring)."""

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("this engine is closed; open a new one")

    def _checked_params(self, params: SamplingParams | None, n: int = 1) -> SamplingParams:
        """The request's params, valid, and its `n` answers' count, with room for them: else
        the error, at once."""
        if self._scheduler.lost is not None:
            error = ComputeError(
                f"the compute backend was lost ({self._scheduler.lost}); this engine cannot "
                "serve any more requests: close it and open a new one"
            )
            self._log.error("request_rejected", request_id=new_request_id(),
                            reason="backend_lost", error=str(error))
            raise error
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            self._reject(
                InvalidRequest(
                    f"params must be a SamplingParams, not {type(params).__name__}", field="params"
                )
            )
        try:
            params.validate(self._tokenizer.vocab_size)
        except InvalidRequest as exc:
            self._reject(exc)
        self._check_answers(n)
        self._check_room(take=False, count=n)
        return params

    def _check_answers(self, n: int) -> None:
        """InvalidRequest naming `n` unless it is 1..MAX_ANSWERS and no more answers than the
        engine runs sequences at once (more could not share the prompt's prefill)."""
        most = min(MAX_ANSWERS, self._scheduler.max_sequences)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
            self._reject(InvalidRequest(
                f"n must be an int in 1..{most} (at most {MAX_ANSWERS} answers a request, and "
                f"no more than this engine runs at once, max_sequences), got {n!r:.40}",
                field="n"))

    def _check_room(self, take: bool, count: int = 1) -> None:
        """EngineOverloaded (logged as the request's rejection) when the admission limits
        cannot take `count` more sequences; `take`: else count them from now (each leaves
        through its session)."""
        try:
            if take:
                self._admission.enter(count)
            else:
                self._admission.check(count)
        except EngineOverloaded as exc:
            self._log.warning(
                "request_rejected", request_id=new_request_id(), reason="overloaded", error=str(exc)
            )
            raise

    def _start_session(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        strict_max_tokens: bool,
        constraint: Constraint | ReasoningGate | None = None,
        admitted: bool = False,
        reasoning: ChatReasoning | None = None,
    ) -> AsyncIterator[Chunk]:
        if strict_max_tokens:
            self._check_max_tokens_fit(len(prompt_ids), params.max_tokens)
        session = Session(
            request_id=new_request_id(),
            prompt_ids=prompt_ids,
            params=params,
            context_length=self.context_length,
            tokenizer=self._tokenizer,
            scheduler_inbox=self._inbox,
            admission=self._admission,
            constraint=constraint,
            admitted=admitted,
            reasoning=reasoning,
        )
        return session.stream()

    async def _stream_when_ready(
        self,
        prompt_ids: Callable[[], Awaitable[list[int]]],
        params: SamplingParams,
        strict_max_tokens: bool,
        n: int = 1,
        chat_reasoning: Callable[[list[int]], Awaitable[ChatReasoning | None]] | None = None,
    ) -> AsyncIterator[Chunk]:
        """A session whose prompt needs work off the event loop first (a template to render,
        a long text to tokenize, a constraint to compile), or the `n` sessions of a request
        for several answers: that work runs on the first iteration, with the request's
        sequences already counted against the admission limits. `chat_reasoning`: a chat's
        reasoning, decided from its prompt's ids."""
        self._check_room(take=True, count=n)
        try:
            ids = self._checked_ids(await prompt_ids())
            if strict_max_tokens:
                self._check_max_tokens_fit(len(ids), params.max_tokens)
            reasoning = None if chat_reasoning is None else await chat_reasoning(ids)
            constraints: list[Constraint | ReasoningGate | None] = [None] * n
            if params.structured is not None:  # compiled once; each answer its own matcher
                budget = answer_budget(params, self.context_length, len(ids))
                first = await self._compiled(params.structured, budget)
                constraints = [first, *[await self._compiles.run(first.copy)
                                        for _ in range(n - 1)]]
            if reasoning is not None and (params.structured is not None
                                          or reasoning.budget is not None):
                # Each answer's constraint holds from its reasoning's end; the budget forces
                # that end.
                stops = self._tokenizer.stop_ids | set(params.stop_token_ids)
                constraints = [reasoning.gate(constraint, stops, self._tokenizer.vocab_size)
                               for constraint in constraints]
            self._check_open()
        except BaseException:
            for _ in range(n):
                self._admission.leave()
            raise
        # The sessions give the slots back from here on.
        start = partial(self._answer_session, ids, params, constraints, reasoning)
        async with aclosing(start(0) if n == 1 else self._answers(start, n)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _chat_reasoning(self, template: str | None, budget: int | None,
                              prompt_ids: list[int]) -> ChatReasoning | None:
        """A chat's reasoning (actors.reasoning): its template's markers, where its answer
        begins; None where it has none to keep apart. A `budget` needs markers."""
        source = template if template is not None else self.chat_template().source
        markers = reasoning_markers(source, partial(self._tokenizer.encode, add_bos=False,
                                                    parse_special=True))
        if markers is None:
            if budget is not None:
                self._reject(InvalidRequest(
                    "reasoning_budget needs a chat template with reasoning markers (one of "
                    f"{', '.join('/'.join(pair) for pair in KNOWN_MARKERS)}, each one token of "
                    "the vocabulary); this one has none", field="reasoning_budget"))
            return None
        phase = await anyio.to_thread.run_sync(opening_phase, markers, prompt_ids,
                                               self._tokenizer.decode, abandon_on_cancel=True)
        return None if phase == ANSWER else ChatReasoning(markers, phase, budget)

    def _answer_session(self, prompt_ids: list[int], params: SamplingParams,
                        constraints: list[Constraint | ReasoningGate | None],
                        reasoning: ChatReasoning | None, index: int) -> AsyncIterator[Chunk]:
        """Answer `index`'s session, its admission slot already taken, its own seed stream."""
        return self._start_session(prompt_ids, params.for_answer(index), False,
                                   constraints[index], admitted=True, reasoning=reasoning)

    async def _answers(self, start: Callable[[int], AsyncIterator[Chunk]],
                       n: int) -> AsyncIterator[Chunk]:
        """The chunks of `n` answers to one prompt as they come, each with its `index`; each
        answer's slot is taken, and one never started gives it back here.

        Answer 0 runs alone until its first token: its prompt is computed by then and the
        prompt's full blocks are in the prefix cache, where the others' admission finds them,
        so the prompt is prefilled once (each other answer computes only what its last,
        partial block holds). Every answer asks for its next token once its chunk was taken;
        the first error, or closing this stream, ends them all."""
        # An answer's session starts with its first `next_chunk` (a task cancelled before
        # it runs starts none): started, it gives its slot back itself.
        streams: dict[int, AsyncIterator[Chunk]] = {}

        async def next_chunk(index: int) -> Chunk:
            if index not in streams:
                streams[index] = start(index)
            return await anext(streams[index])

        waiting: dict[asyncio.Task[Chunk], int] = {}
        try:
            first = await next_chunk(0)
            waiting.update({asyncio.create_task(next_chunk(index)): index
                            for index in range(1, n)})
            yield first
            if first.finish_reason is None:
                waiting[asyncio.create_task(next_chunk(0))] = 0
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=waiting.__getitem__):
                    index = waiting.pop(task)
                    chunk = task.result()
                    yield msgspec.structs.replace(chunk, index=index)
                    if chunk.finish_reason is None:
                        waiting[asyncio.create_task(next_chunk(index))] = index
        finally:
            for task in waiting:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*waiting, return_exceptions=True)
                for stream in streams.values():
                    await stream.aclose()
            for _ in range(n - len(streams)):
                self._admission.leave()

    async def _compiled(self, structured: StructuredOutput, budget: int) -> Constraint:
        """The request's constraint, ready, compiled in a compile thread within
        `COMPILE_SECONDS` (the first constrained request also builds llguidance's tokenizer
        first: seconds for a large vocabulary, not counted against that bound)."""
        if not self._grammars.ready:
            await self._compiles.run(self._grammars.grammar_tokenizer)
        try:
            return await self._compiles.run(partial(self._grammars.constraint, structured, budget),
                                            timeout_s=COMPILE_SECONDS)
        except TimeoutError:
            self._reject(InvalidRequest(
                f"{structured.kind} did not compile within {COMPILE_SECONDS:g} s: simplify it",
                field=f"structured.{structured.kind}"))
        except InvalidRequest as exc:
            self._reject(exc)

    def _check_fits_by_size(self, text: str) -> None:
        """Refuse a text whose bytes alone prove it cannot fit the context (each token stands
        for at most the tokenizer's longest token text), without tokenizing it. Linear in the
        text: worker threads call it."""
        min_tokens = getattr(self._tokenizer, "min_tokens", None)  # test doubles have none
        if min_tokens is None:
            return
        at_least = min_tokens(text)
        if at_least >= self.context_length:
            self._reject(
                ContextLengthExceeded(
                    f"the prompt is at least {at_least:,} tokens ({len(text):,} characters); "
                    f"it must be shorter than the context ({self.context_length} tokens)",
                    field="prompt",
                )
            )

    async def _encode_in_worker(self, text: str, *, parse_special: bool = False) -> list[int]:
        # Abandoned on cancel: the thread only computes, and ends on its own.
        return await anyio.to_thread.run_sync(
            self._encode_if_it_can_fit, text, parse_special, abandon_on_cancel=True
        )

    def _encode_if_it_can_fit(self, text: str, parse_special: bool) -> list[int]:
        self._check_fits_by_size(text)
        return self._tokenizer.encode(text, parse_special=parse_special)

    async def _ids_in_worker(self, prompt: Sequence[int]) -> list[int]:
        return await anyio.to_thread.run_sync(
            self._checked_token_range, prompt, "prompt", abandon_on_cancel=True
        )

    def _check_message_count(self, count: int) -> None:
        """Refuse, from its length alone, a chat with more messages than the context has
        tokens: every chat template writes at least one token (a role marker) a message."""
        if count >= self.context_length:
            self._reject(
                ContextLengthExceeded(
                    f"the chat has {count:,} messages; the context holds {self.context_length} "
                    "tokens, and every message takes at least one",
                    field="messages",
                )
            )

    async def _chat_prompt_ids(
        self,
        messages: list[dict[str, Any]],
        template: str | None,
        tools: list[dict[str, Any]] | None,
        chat_template_kwargs: Mapping[str, Any] | None,
        *,
        check: bool = False,
    ) -> list[int]:
        """`check`: the messages are still to be checked (a long list, checked here in the
        worker thread rather than on the loop)."""
        text = await anyio.to_thread.run_sync(
            self._checked_render_chat if check else self._render_chat,
            messages,
            template,
            tools,
            chat_template_kwargs,
            abandon_on_cancel=True,
        )
        ids = await self._encode_in_worker(text, parse_special=True)
        bos = self._tokenizer.bos_id
        # Templates that write the BOS themselves would otherwise get a second one.
        if bos is not None and ids[:2] == [bos, bos]:
            ids = ids[1:]
        return ids

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        self._check_open()
        if isinstance(prompt, str):
            if not prompt:
                self._reject(InvalidRequest("the prompt is empty", field="prompt"))
            return self._checked_ids(self._tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            return self._checked_ids(self._checked_token_range(prompt, "prompt"))
        self._reject(
            InvalidRequest(
                f"prompt must be a str or a list of token ids, not {type(prompt).__name__}",
                field="prompt",
            )
        )

    def _checked_token_range(self, token_ids: Sequence[int], field: str) -> list[int]:
        vocab = self._tokenizer.vocab_size
        try:
            ids = np.asarray(token_ids) if isinstance(token_ids, (list, tuple)) else None
        except (ValueError, TypeError, OverflowError):  # ragged, or not numbers at all
            ids = None
        if ids is None or ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            self._reject(InvalidRequest(f"{field} must be a list of int token ids", field=field))
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            self._reject(
                InvalidRequest(
                    f"{field} has token ids outside [0, {vocab}): {bad[:5].tolist()}", field=field
                )
            )
        return ids.astype(np.int64).tolist()

    def _checked_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            self._reject(InvalidRequest("the prompt is empty", field="prompt"))
        self._checked_ids_fit(len(ids))
        return ids

    def _checked_ids_fit(self, count: int) -> None:
        if count >= self.context_length:
            self._reject(
                ContextLengthExceeded(
                    f"the prompt is {count} tokens; it must be shorter than the context "
                    f"({self.context_length} tokens) to leave room for an answer",
                    field="prompt",
                )
            )

    def _check_max_tokens_fit(self, prompt_tokens: int, max_tokens: int) -> None:
        """ContextLengthExceeded, naming both numbers, when the prompt and all the tokens asked
        for cannot fit the context together."""
        if prompt_tokens + max_tokens > self.context_length:
            self._reject(
                ContextLengthExceeded(
                    f"this model's context is {self.context_length} tokens, but the request "
                    f"needs {prompt_tokens + max_tokens}: {prompt_tokens} in the prompt and "
                    f"{max_tokens} in max_tokens; ask for at most "
                    f"{self.context_length - prompt_tokens} or shorten the prompt",
                    field="max_tokens",
                )
            )

    def _reject(self, error: InvalidRequest) -> NoReturn:
        reason = "context_length" if isinstance(error, ContextLengthExceeded) else "invalid_request"
        self._log.warning("request_rejected", request_id=new_request_id(), reason=reason, error=str(error))
        raise error

    def _check_chat(self, check: Callable[[Any], object], value: Any) -> None:
        """`check(value)`, a chat request's messages or template kwargs; its InvalidRequest
        logged as the request's rejection."""
        try:
            check(value)
        except InvalidRequest as exc:
            self._reject(exc)

    def _checked_render_chat(self, messages: list[dict[str, Any]], template: str | None,
                             tools: list[dict[str, Any]] | None,
                             chat_template_kwargs: Mapping[str, Any] | None) -> str:
        self._check_chat(check_messages, messages)
        return self._render_chat(messages, template, tools, chat_template_kwargs)

    def _render_chat(self, messages: list[dict[str, Any]], template: str | None,
                     tools: list[dict[str, Any]] | None,
                     chat_template_kwargs: Mapping[str, Any] | None) -> str:
        """Runs in a worker thread; bounded in time and in size (longer output could not fit
        the context anyway)."""
        chat_template = self.chat_template(template)
        max_token_bytes = getattr(self._tokenizer, "max_token_bytes", None)  # test doubles
        chars = RenderLimits().chars if max_token_bytes is None else self.context_length * max_token_bytes
        limits = RenderLimits(seconds=CHAT_RENDER_SECONDS, chars=chars)
        return chat_template.render(messages, limits=limits, tools=tools,
                                    chat_template_kwargs=chat_template_kwargs)
