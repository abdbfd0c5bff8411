"""The messages sessions and the scheduler exchange, and the results callers receive."""

from __future__ import annotations

from typing import Any

import msgspec


# --- session -> scheduler -------------------------------------------------------------------


class OpenSequence(msgspec.Struct, frozen=True, kw_only=True):
    """A new sequence; the scheduler answers its advances on `reply` (capacity 1)."""

    seq_id: int
    request_id: str
    sampler: Any  # actors.sampling.SequenceSampling: token history and seeded generator
    reply: Any  # actors.channels.LoopSender[TokenReady | SequenceFailed]


class Advance(msgspec.Struct, frozen=True, kw_only=True):
    """Append `tokens` to the sequence and choose the token after them."""

    seq_id: int
    tokens: tuple[int, ...]


class CloseSequence(msgspec.Struct, frozen=True, kw_only=True):
    """The session is over: drop the sequence from every later step and free its blocks."""

    seq_id: int


# --- scheduler -> session -------------------------------------------------------------------


class TokenReady(msgspec.Struct, frozen=True, kw_only=True):
    """The chosen next token; `cached_tokens` is how much of the prompt came from the cache.
    Structured output: `forced`, the tokens the constraint forces after it (the session sends
    them back with the token, to be computed as one chunk), and `constraint_done` once the
    constraint is complete."""

    token: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] | None
    cached_tokens: int
    forced: tuple[int, ...] = ()
    constraint_done: bool = False


class SequenceFailed(msgspec.Struct, frozen=True, kw_only=True):
    """The forward failed again on replay; the session raises ComputeError."""

    error: str


class ConstraintFailed(msgspec.Struct, frozen=True, kw_only=True):
    """The sequence's structured-output constraint failed (it refused a token, or reached the
    parser's limits): the session raises InvalidRequest naming its constraint."""

    error: str


# --- results for the caller -----------------------------------------------------------------


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """`reasoning_tokens`: of the completion's tokens, those of its reasoning (markers
    included)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int = 0


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    ttft_ms: float
    total_ms: float
    decode_tokens_per_s: float


class Chunk(msgspec.Struct, frozen=True, kw_only=True):
    """One generated token and the text it completes (may be empty while text is held back,
    e.g. half a UTF-8 character or the start of a possible stop string). The last chunk has
    `finish_reason`, `usage` and `timings` set; its `token_id` is None when it only flushes.
    A chat answer's reasoning (actors.reasoning) comes as `reasoning`, never in `text`; its
    markers in neither. `index`: which answer it belongs to, where a request asks for several
    (`n`); each answer ends with its own last chunk, its usage that answer's."""

    text: str
    token_id: int | None
    reasoning: str = ""
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    index: int = 0


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """A whole generation: what `Engine.complete` returns; `reasoning`, a chat answer's
    reasoning (kept out of `text`)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    timings: Timings
    reasoning: str = ""


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the engine's load."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    steps: int
    tokens: int
    # What crossed from the compute actor to the host for token choice: candidates, and the
    # whole rows the sampler asked for.
    bytes_from_compute: int = 0
    last_step_s: float = 0.0  # wall time of the latest forward step
    # The backend's own time in all steps so far (the compute thread's run calls): the rest
    # of the steps' wall time is the actors' (scheduling, sampling, the hops between them).
    compute_busy_s: float = 0.0
