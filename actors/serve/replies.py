"""Engine chunks written as OpenAI response objects: whole, or as server-sent events.

The two endpoints differ only in shape (a completion's `text` against a chat `message` /
`delta`, their logprobs layouts, and a chat's tool calls); `CompletionsShape` and `ChatShape`
hold those differences and `Reply` does the rest once for both.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, contextmanager
from typing import Any

import msgspec

from actors.errors import EngineClosed, Q4KError
from actors.messages import Chunk, Usage
from actors.serve.metrics import outcome_of
from actors.serve.tools import CallArguments, CallStart, ToolCallReader

# The engine's finish reasons as the OpenAI API names them: running out of context is `length`.
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}
DONE_EVENT = b"data: [DONE]\n\n"

TokenText = Callable[[int], str]
CountOutcome = Callable[[str, Usage | None], None]


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """An OpenAI error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def answer_text(chunk: Chunk, calls: ToolCallReader | None) -> str:
    """A chunk's text as `calls` (the reader of the answer's tool calls) takes it: with the
    call marker its token stands for, where decoding leaves the marker out."""
    return chunk.text if calls is None else calls.format.text_of(chunk.text, chunk.token_id)


@contextmanager
def counting_failures(count: CountOutcome) -> Iterator[None]:
    """Count a project error under its outcome, anything else (a cancelled task, a closed
    generator: the client left) as cancelled; then let it go on."""
    try:
        yield
    except Q4KError as error:
        count(outcome_of(error), None)
        raise
    except BaseException:
        count("cancelled", None)
        raise


class CompletionsShape:
    """`/v1/completions`: choices carry `text`; logprobs are the legacy parallel lists."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def text(self, chunk: Chunk) -> str:
        return chunk.text

    def choice(self, text: str, logprobs: dict[str, Any] | None,
               finish: str | None, reasoning: str = "") -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def reasoning_pieces(self, reasoning: str) -> list[dict[str, Any]]:
        return []  # a completion keeps no reasoning apart

    def pieces(self, text: str, final: bool) -> list[dict[str, Any]]:
        return [{"text": text}] if text else []

    def empty_piece(self) -> dict[str, Any]:
        return {"text": ""}

    def streamed_choice(self, piece: dict[str, Any], logprobs: dict[str, Any] | None,
                        first: bool) -> dict[str, Any]:
        return {"index": 0, **piece, "logprobs": logprobs, "finish_reason": None}

    def final_choice(self, finish: str) -> dict[str, Any]:
        """The stream's last choice: no text, the finish reason."""
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}

    def logprobs(self, chunks: list[Chunk], token_text: TokenText, offset: int) -> dict[str, Any]:
        tokens = [token_text(chunk.token_id) for chunk in chunks]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [chunk.logprob for chunk in chunks],
            "top_logprobs": [
                {token_text(token): logprob for token, logprob in chunk.top_logprobs or ()}
                for chunk in chunks
            ],
            "text_offset": offsets,
        }


class ChatShape:
    """`/v1/chat/completions`: a `message` (whole) or `delta` (streamed); per-token logprobs.
    With `tool_calls` (a reader of the answer's calls), calls become `tool_calls`: whole, or
    streamed as OpenAI's tool-call deltas (the call's id, type and name, then its arguments
    in pieces as the model writes them). A thinking model's reasoning is `reasoning_content`
    (the field vLLM and llama.cpp write), beside the content."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, tool_calls: ToolCallReader | None = None) -> None:
        self._tool_calls = tool_calls
        self._calls_streamed = 0

    def text(self, chunk: Chunk) -> str:
        return answer_text(chunk, self._tool_calls)

    def choice(self, text: str, logprobs: dict[str, Any] | None,
               finish: str | None, reasoning: str = "") -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self._tool_calls is not None:
            content, calls = self._tool_calls.parse(text)
            if calls:
                message = {"role": "assistant", "content": content,
                           "tool_calls": [call.as_openai() for call in calls]}
                finish = "tool_calls" if finish == "stop" else finish
        if reasoning:
            message["reasoning_content"] = reasoning
        return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def reasoning_pieces(self, reasoning: str) -> list[dict[str, Any]]:
        return [{"reasoning_content": reasoning}] if reasoning else []

    def pieces(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The deltas `text` (following what came before) settles: text that may still become
        a call waits until it is decided."""
        if self._tool_calls is None:
            return [{"content": text}] if text else []
        reader = self._tool_calls
        settled = reader.feed_pieces(text) + (reader.end_pieces() if final else [])
        pieces: list[dict[str, Any]] = []
        for piece in settled:
            if isinstance(piece, str):
                pieces.append({"content": piece})
            elif isinstance(piece, CallStart):
                head = {"index": self._calls_streamed, "id": piece.id, "type": "function",
                        "function": {"name": piece.name, "arguments": ""}}
                self._calls_streamed += 1
                pieces.append({"content": None, "tool_calls": [head]})
            elif isinstance(piece, CallArguments):
                pieces.append({"tool_calls": [{"index": self._calls_streamed - 1,
                                               "function": {"arguments": piece.text}}]})
        return pieces

    def empty_piece(self) -> dict[str, Any]:
        # While text may still become a call, there is no content yet, not even empty.
        return {"content": "" if self._tool_calls is None else None}

    def streamed_choice(self, piece: dict[str, Any], logprobs: dict[str, Any] | None,
                        first: bool) -> dict[str, Any]:
        delta = {"role": "assistant", **piece} if first else piece
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}

    def final_choice(self, finish: str) -> dict[str, Any]:
        """The stream's last choice, as OpenAI sends it: an empty delta and the finish reason
        (`tool_calls` for an answer that made calls)."""
        if finish == "stop" and self._calls_streamed:
            finish = "tool_calls"
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}

    def logprobs(self, chunks: list[Chunk], token_text: TokenText, offset: int) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {
                    **entry(chunk.token_id, chunk.logprob),
                    "top_logprobs": [entry(t, lp) for t, lp in chunk.top_logprobs or ()],
                }
                for chunk in chunks
            ]
        }


Shape = CompletionsShape | ChatShape


def usage_object(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def request_usage(usages: Sequence[Usage]) -> Usage:
    """A request's usage from its answers' (one each): the prompt counted once, as answer 0
    found it in the cache, and every answer's completion tokens."""
    return Usage(prompt_tokens=usages[0].prompt_tokens,
                 completion_tokens=sum(usage.completion_tokens for usage in usages),
                 cached_tokens=usages[0].cached_tokens,
                 reasoning_tokens=sum(usage.reasoning_tokens for usage in usages))


class Reply:
    """One request's response, its `choices` one per answer (`shapes`: each answer's, by
    index): `whole(chunks)`, or `first(chunks)` then `events(...)`. Each request's outcome is
    counted once: answer 0's finish reason, the error it raised, or `cancelled`."""

    def __init__(self, shapes: Sequence[Shape], *, model: str, fingerprint: str,
                 want_logprobs: bool, include_usage: bool, token_text: TokenText,
                 count: CountOutcome) -> None:
        self.shapes = shapes
        self.id = shapes[0].id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self._want_logprobs = want_logprobs
        self._include_usage = include_usage
        self._token_text = token_text
        self._count = count

    async def whole(self, chunks: AsyncIterator[Chunk]) -> dict[str, Any]:
        """The whole response object, once every answer is complete."""
        texts: list[list[str]] = [[] for _ in self.shapes]
        thoughts: list[list[str]] = [[] for _ in self.shapes]
        scored: list[list[Chunk]] = [[] for _ in self.shapes]
        lasts: list[Chunk | None] = [None for _ in self.shapes]
        with counting_failures(self._count):
            async with aclosing(chunks):
                async for chunk in chunks:
                    texts[chunk.index].append(self.shapes[chunk.index].text(chunk))
                    thoughts[chunk.index].append(chunk.reasoning)
                    scored[chunk.index] += self._scored(chunk)
                    lasts[chunk.index] = chunk
            if any(last is None or last.finish_reason is None for last in lasts):
                raise EngineClosed("the answer ended without a finish reason")
        usage = self._finished(lasts)
        choices = [{**shape.choice("".join(text), self._logprobs(answer_scored, 0),
                                   FINISH_REASONS[last.finish_reason], "".join(thought)),
                    "index": index}
                   for index, (shape, text, thought, answer_scored, last)
                   in enumerate(zip(self.shapes, texts, thoughts, scored, lasts))]
        return {**self._head(self.shapes[0].object), "choices": choices,
                "usage": usage_object(usage)}

    async def first(self, chunks: AsyncIterator[Chunk]) -> Chunk:
        """The first chunk, taken before a stream answers 200 (so that admission and compute
        errors still get their own status codes)."""
        with counting_failures(self._count):
            return await anext(chunks)

    async def events(self, first: Chunk, chunks: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
        """Server-sent events: one per chunk that carries text or logprobs, then for each
        answer one with no text and its finish reason (as OpenAI ends a choice), each event's
        choice carrying its answer's index; then the usage when asked for, then `[DONE]`.
        `first` was already taken from `chunks`."""
        offsets = [0 for _ in self.shapes]
        started = [False for _ in self.shapes]
        lasts: list[Chunk | None] = [None for _ in self.shapes]
        chunk = first
        with counting_failures(self._count):
            async with aclosing(chunks):
                while True:
                    index, shape = chunk.index, self.shapes[chunk.index]
                    final = chunk.finish_reason is not None
                    scored = self._scored(chunk)
                    pieces = [*shape.reasoning_pieces(chunk.reasoning),
                              *shape.pieces(shape.text(chunk), final=final)]
                    if pieces or scored or not started[index]:
                        logprobs = self._logprobs(scored, offsets[index])
                        for number, piece in enumerate(pieces or [shape.empty_piece()]):
                            yield self._chunk_event(index, shape.streamed_choice(
                                piece, logprobs if number == 0 else None, not started[index]))
                            started[index] = True
                    offsets[index] += len(chunk.text)
                    if final:
                        lasts[index] = chunk
                        if all(done is not None for done in lasts):
                            break
                        yield self._final_event(chunk)
                    chunk = await anext(chunks)
        usage = self._finished(lasts)
        yield self._final_event(chunk)
        if self._include_usage:
            yield sse_event({**self._head(self.shapes[0].chunk_object), "choices": [],
                               "usage": usage_object(usage)})
        yield DONE_EVENT

    def _finished(self, lasts: Sequence[Chunk]) -> Usage:
        """Count the finished request (answer 0's finish reason as OpenAI names it); its
        usage."""
        usage = request_usage([last.usage for last in lasts])
        self._count(FINISH_REASONS[lasts[0].finish_reason], usage)
        return usage

    def _final_event(self, last: Chunk) -> bytes:
        """An answer's last event: its finish reason as OpenAI names it."""
        shape = self.shapes[last.index]
        finish = FINISH_REASONS[last.finish_reason]
        return self._chunk_event(last.index, shape.final_choice(finish))

    def _chunk_event(self, index: int, choice: dict[str, Any]) -> bytes:
        return sse_event({**self._head(self.shapes[0].chunk_object),
                          "choices": [{**choice, "index": index}], **self._no_usage()})

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def _no_usage(self) -> dict[str, Any]:
        # With include_usage, OpenAI sends `usage: null` on every chunk but the last.
        return {"usage": None} if self._include_usage else {}

    def _scored(self, chunk: Chunk) -> list[Chunk]:
        """The chunk, if it has a token whose logprobs were asked for."""
        return [chunk] if self._want_logprobs and chunk.token_id is not None else []

    def _logprobs(self, scored: list[Chunk], offset: int) -> dict[str, Any] | None:
        if not self._want_logprobs:
            return None
        return self.shapes[0].logprobs(scored, self._token_text, offset)


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def error_event(payload: dict[str, Any]) -> bytes:
    """An error after the stream started: one event with OpenAI's error object, then done."""
    return sse_event(payload) + DONE_EVENT
