"""The Engine: starts the actors in one task group and is the public door to them.

    async with Engine.open("model.gguf") as engine:
        async for chunk in engine.generate("Once upon a time", SamplingParams(max_tokens=64)):
            print(chunk.text, end="")

Actors, all tasks of one task group, each with a bounded inbox of frozen msgspec messages:
the loader (opens the model in a thread of its own and hands the backend factory to the
compute actor), the compute actor (one thread owning the backend, its weights and KV cache;
answers each step's token candidates), the sampler (one thread choosing tokens from the
candidates) and the scheduler (admission, batching, KV block accounting). Each request is a
session running in the caller's task.
Everything a request can get wrong is checked here, before any work starts.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import ExitStack, aclosing, asynccontextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from actors.channels import (
    LoopReceiver,
    ThreadSender,
    loop_channel,
    require_asyncio,
    thread_channel,
)
from actors.compute.actor import ComputeActor, ComputeAnswer
from actors.compute.contract import (
    BuildBackend,
    ComputeBackend,
    ComputeInfo,
    FetchRows,
    KVRequest,
    RunStep,
    Shutdown,
    StartFailed,
)
from actors.errors import (
    ComputeError,
    EngineClosed,
    InvalidRequest,
    TemplateError,
)
from actors.engine_door import EngineDoor
from actors.kv_manager import KVBlockManager
from actors.loader import Loaded, LoaderActor, LoadFailed, ModelLoaded, load_gguf
from actors.logs import get_logger, logging_to
from actors.messages import Chunk, Completion, EngineStats
from actors.model.arch import MAX_CONTEXT
from actors.model.loaded import Model, check_model_path
from actors.model.text.chat import ChatTemplate, check_messages, check_template_kwargs
from actors.params import SamplingParams
from actors.sampling import (
    AdvanceConstraint,
    ConstraintWorkers,
    ReleaseConstraint,
    RowsWanted,
    SampleRows,
    SampleStep,
    SamplerActor,
    SamplingFailed,
    StepSampled,
)
from actors.scheduler import Admission, Inbound, Scheduler
from actors.structured import CompileThreads, GrammarCompiler

# A step running this long is failed, and a backend silent for twice as long is lost:
# generous next to any real step (a 512-token CPU prefill of gemma-3 takes about a second).
DEFAULT_STEP_TIMEOUT_S = 300.0
# Messages a live request can have in the scheduler's inbox at once: its session's open,
# advance and close, and its constraint worker's answer.
_INBOX_SLOTS_PER_REQUEST = 4
# Text prompts longer than this are tokenized in a worker thread (below it: ~5 ms of work).
_TOKENIZE_INLINE_CHARS = 16_384
# Token-id prompts and chat message lists longer than this are checked in a worker thread
# (below it: ~1 ms of work on the loop).
_CHECK_INLINE_ITEMS = 16_384
# Sanity bounds on the options, far above any real use, so a typo cannot size an allocation:
# KV positions past the largest context a model file may claim (arch.MAX_CONTEXT), counts of
# requests whose inboxes and tables would be sized by them.
_MAX_KV_POSITIONS = MAX_CONTEXT
_MAX_BLOCK_SIZE = 4096
_MAX_REQUESTS = 1 << 20


class Engine(EngineDoor):
    """An open engine; get one from `Engine.open(...)` (or `Engine.open_backend(...)`)."""

    def __init__(
        self,
        *,
        info: ComputeInfo,
        tokenizer: Any,
        chat_template: Callable[[str | None], Any] | None,
        scheduler: Scheduler,
        scheduler_inbox: Any,
        admission: Admission,
        notices: tuple[str, ...],
    ) -> None:
        self.info = info
        # The KV pool caps how long one sequence can get, so nothing waits for blocks forever.
        self.context_length = min(info.context_length, info.num_blocks * info.block_size)
        self.notices = notices
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._default_template: Any = None
        self._scheduler = scheduler
        self._inbox = scheduler_inbox
        self._admission = admission
        self._grammars = GrammarCompiler(tokenizer)
        self._compiles = CompileThreads()
        self._closed = False
        self._log = get_logger("actors.engine")

    # --- lifecycle ------------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        path: str | Path | Model | None = None,
        backend: str = "auto",
        *,
        max_sequences: int = 64,
        max_queued: int = 256,
        kv_blocks: int | None = None,
        block_size: int = 16,
        prefill_chunk: int = 512,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        log_level: str | None = None,
        log_file: str | os.PathLike[str] | TextIO | None = None,
    ) -> AsyncIterator[Engine]:
        """Load a GGUF model (a path; a packaged model's name, e.g. "smollm2-135m-instruct";
        None = the default model, gemma-3-270m; or a loaded `Model` to share it) and serve it
        until the block ends.

        `backend`: "auto" (the best that runs here; passing over a GPU is a notice) or a name
        of `actors.compute.backends.BACKENDS` ("cpu", "cuda"), which raises
        `BackendUnavailable` where it cannot run. `kv_blocks`: KV pool size in blocks of
        `block_size` positions (None: the backend sizes it from its memory; on the CPU the
        model's context or 1024 positions a sequence, within half the available memory).
        `step_timeout_s`: a step still running after this long is failed (its sequences
        replay), and a backend silent for twice as long is lost.
        `log_level` / `log_file`: where the engine's JSON-line logs go (None: leave the
        logging configuration as it is)."""
        _check_model_path(path)
        _check_count("block_size", block_size, 1, _MAX_BLOCK_SIZE)
        if kv_blocks is not None:
            _check_count("kv_blocks", kv_blocks, 1, _MAX_KV_POSITIONS // block_size)
        _check_limits(max_sequences, max_queued, prefill_chunk, step_timeout_s)
        if log_level is not None and not isinstance(log_level, str):
            raise InvalidRequest(
                f"log_level must be a level name, not {type(log_level).__name__}", field="log_level"
            )
        if log_file is not None and not isinstance(log_file, str | os.PathLike) and not hasattr(
            log_file, "write"
        ):
            raise InvalidRequest(
                f"log_file must be a path or a text stream, not {type(log_file).__name__}",
                field="log_file",
            )
        logging = (
            logging_to(log_level or "info", log_file)
            if log_level is not None or log_file is not None
            else nullcontext()
        )
        load = partial(
            load_gguf,
            path,
            backend,
            kv=KVRequest(blocks=kv_blocks, block_size=block_size, max_sequences=max_sequences),
        )
        started = False
        with ExitStack() as stack:
            try:
                stack.enter_context(logging)
            except (OSError, ValueError) as exc:  # no such folder, a NUL in the name...
                raise InvalidRequest(
                    f"log_file {str(log_file)!r:.80} cannot be opened for writing: {exc}",
                    field="log_file",
                ) from None
            try:
                async with cls._serve(
                    load,
                    max_sequences=max_sequences,
                    max_queued=max_queued,
                    prefill_chunk=prefill_chunk,
                    step_timeout_s=step_timeout_s,
                ) as engine:
                    # llguidance's tokenizer for structured output is built now, not on the
                    # first constrained request: building it holds the GIL (1.3 s for
                    # gemma-3's 262k vocabulary), which the event loop would wait through.
                    await engine._compiles.run(engine._grammars.grammar_tokenizer)
                    started = True
                    yield engine
            except MemoryError as exc:
                if started:  # the caller's own block ran out of memory
                    raise
                # Sizes under the sanity bounds can still exceed this machine.
                raise InvalidRequest(
                    f"the model and its KV pool do not fit in memory ({exc}); lower kv_blocks "
                    f"(now {kv_blocks}, None = sized from the model and this machine's memory) or "
                    f"use a smaller model",
                    field="kv_blocks" if kv_blocks is not None else "path",
                ) from None

    @classmethod
    @asynccontextmanager
    async def open_backend(
        cls,
        make_backend: Callable[[], ComputeBackend],
        tokenizer: Any,
        *,
        chat_template: Callable[[str | None], Any] | None = None,
        model_name: str = "",
        backend: str = "cpu",
        max_sequences: int = 64,
        max_queued: int = 256,
        prefill_chunk: int = 512,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        notices: Sequence[str] = (),
    ) -> AsyncIterator[Engine]:
        """Serve with a given compute backend factory (called in the compute thread) and
        tokenizer: what `open` does once loaded, and how tests drive a fake backend."""
        loaded = Loaded(
            model=ModelLoaded(
                tokenizer=tokenizer,
                chat_template=chat_template,
                model_name=model_name,
                backend=backend,
                notices=tuple(notices),
            ),
            build=BuildBackend(make_backend=make_backend),
        )

        def load() -> Loaded:
            # In the loader's thread, as `open` does: not on the first request's event loop.
            prepare = getattr(tokenizer, "prepare_encoder", None)  # test doubles have none
            if prepare is not None:
                prepare()
            return loaded

        async with cls._serve(
            load,
            max_sequences=max_sequences,
            max_queued=max_queued,
            prefill_chunk=prefill_chunk,
            step_timeout_s=step_timeout_s,
        ) as engine:
            yield engine

    @classmethod
    @asynccontextmanager
    async def _serve(
        cls,
        load: Callable[[], Loaded],
        *,
        max_sequences: int,
        max_queued: int,
        prefill_chunk: int,
        step_timeout_s: float,
    ) -> AsyncIterator[Engine]:
        """Start the actors in one task group: the loader runs `load` and hands the backend
        factory to the compute actor; once that reports ready, the scheduler starts."""
        _check_limits(max_sequences, max_queued, prefill_chunk, step_timeout_s)
        require_asyncio()
        limit = max_sequences + max_queued
        inbox_receive: LoopReceiver[Inbound]
        inbox_send, inbox_receive = loop_channel(_INBOX_SLOTS_PER_REQUEST * limit)
        # Two jobs at most per live request: its token just chosen, and its release.
        constraint_send: ThreadSender[AdvanceConstraint | ReleaseConstraint]
        constraint_send, constraint_receive = thread_channel(2 * limit)
        build_send, build_receive = anyio.create_memory_object_stream[BuildBackend](1)
        loaded_send, loaded_receive = anyio.create_memory_object_stream[
            ModelLoaded | LoadFailed
        ](1)
        # The per-step channels to and from the actor threads (actors.channels).
        compute_send: ThreadSender[RunStep | FetchRows | Shutdown]
        compute_send, compute_receive = thread_channel()
        answer_receive: LoopReceiver[ComputeAnswer]
        answer_send, answer_receive = loop_channel()
        rows_send: ThreadSender[SampleStep | SampleRows]
        rows_send, rows_receive = thread_channel()
        choices_receive: LoopReceiver[StepSampled | RowsWanted | SamplingFailed]
        choices_send, choices_receive = loop_channel()
        # The scheduler's streams; closed here instead when it never starts.
        scheduler_streams = (inbox_receive, constraint_send, compute_send, answer_receive,
                             rows_send, choices_receive)
        # Errors of the caller's block are re-raised after the task group, so callers see the
        # exception itself rather than an ExceptionGroup around it.
        failure: Exception | None = None
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(LoaderActor(load, build_send, loaded_send).run)
            compute_hung = anyio.Event()
            tasks.start_soon(
                ComputeActor(build_receive, compute_receive, answer_send, compute_hung).run
            )
            tasks.start_soon(SamplerActor(rows_receive, choices_send).run)
            tasks.start_soon(ConstraintWorkers(constraint_receive, inbox_send).run)
            started = time.perf_counter()
            try:
                model, info = await _started(loaded_receive, answer_receive)
            except BaseException as exc:
                inbox_send.close()
                for stream in scheduler_streams:
                    stream.close()
                if not isinstance(exc, Exception):
                    raise  # cancelled: the loader still finishes its load first
                failure = exc
            else:
                admission = Admission(limit)
                scheduler = Scheduler(
                    kv=KVBlockManager(info.num_blocks, info.block_size),
                    admission=admission,
                    max_sequences=max_sequences,
                    prefill_chunk=prefill_chunk,
                    step_timeout_s=step_timeout_s,
                    compute_hung=compute_hung,
                    inbox=inbox_receive,
                    constraint_inbox=constraint_send,
                    compute_inbox=compute_send,
                    compute_outbox=answer_receive,
                    sampler_inbox=rows_send,
                    sampler_outbox=choices_receive,
                )
                tasks.start_soon(scheduler.run)
                engine = cls(
                    info=info,
                    tokenizer=model.tokenizer,
                    chat_template=model.chat_template,
                    scheduler=scheduler,
                    scheduler_inbox=inbox_send,
                    admission=admission,
                    notices=tuple(dict.fromkeys((*model.notices, *info.notices))),
                )
                engine._log.info(
                    "model_loaded",
                    arch=info.arch,
                    quant_mix=model.quant_mix,
                    load_ms=round((time.perf_counter() - started) * 1e3, 3),
                    backend=model.backend,
                    path=model.model_name,
                    kv_blocks=info.num_blocks,
                    kv_dtype=info.kv_dtype,
                )
                engine._log.info(
                    "engine_started", backend=model.backend, model=model.model_name, arch=info.arch
                )
                try:
                    yield engine
                except Exception as exc:
                    failure = exc
                finally:
                    engine.close()
                    # A compile cannot be interrupted: it ends on its own (bounded by the
                    # parser limits), and no thread of the engine's outlives it.
                    with anyio.CancelScope(shield=True):
                        await engine._compiles.wait_idle()
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Stop taking requests; running ones end with EngineClosed, those compiling their
        constraint too, at once. Idempotent. The actors finish the step in flight and exit
        when the `open` block ends."""
        if not self._closed:
            self._closed = True
            self._compiles.close()
            # The scheduler ends when its inbox does, then tells the compute actor to stop.
            self._inbox.close()

    # --- requests -------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        strict_max_tokens: bool = False,
        n: int = 1,
    ) -> AsyncIterator[Chunk]:
        """Stream the completion of `prompt` (text, or token ids) chunk by chunk.

        Raises at once: InvalidRequest (bad params or prompt), ContextLengthExceeded,
        EngineOverloaded (running and queued limits reached), EngineClosed. A text longer than
        16 Ki characters is measured and tokenized in a worker thread, so a prompt too long for
        the context raises ContextLengthExceeded from the first iteration instead; so are the
        ids of a list longer than 16 Ki ids checked (its length against the context at once).
        Close the iterator (or `break` and drop it) to cancel; `contextlib.aclosing` cancels
        deterministically. `strict_max_tokens`: a prompt and `params.max_tokens` that together
        pass the context raise ContextLengthExceeded (OpenAI's rule) instead of the answer
        ending at the context (finish reason "context"). `params.structured` compiles in a
        worker thread on the first iteration, before any step: a schema, regex or grammar
        that does not compile raises InvalidRequest (field `structured.<kind>`) from there.

        `n`: that many answers to the prompt (1..min(128, max_sequences), else InvalidRequest
        naming `n`), their chunks interleaved as they come, each with its `index` and each
        answer ending with its own last chunk (finish reason, usage). The prompt is prefilled
        once: the other answers start once answer 0's first token came, reusing its blocks
        from the prefix cache. Answer i samples with its own seed stream
        (`SamplingParams.for_answer`), each constrained by its own matcher; closing the
        iterator cancels them all."""
        self._check_open()
        params = self._checked_params(params, n)
        if isinstance(prompt, str) and len(prompt) > _TOKENIZE_INLINE_CHARS:
            return self._stream_when_ready(partial(self._encode_in_worker, prompt), params,
                                           strict_max_tokens, n)
        if isinstance(prompt, (list, tuple)) and len(prompt) > _CHECK_INLINE_ITEMS:
            # The length alone refuses a prompt past the context; the ids' check is linear.
            self._checked_ids_fit(len(prompt))
            return self._stream_when_ready(partial(self._ids_in_worker, prompt), params,
                                           strict_max_tokens, n)
        ids = self._prompt_ids(prompt)
        # A constraint compiles in a worker thread first; several answers start one by one.
        if params.structured is not None or n > 1:
            return self._stream_when_ready(partial(_as_awaitable, ids), params, strict_max_tokens,
                                           n)
        return self._start_session(ids, params, strict_max_tokens)

    def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        template: str | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        strict_max_tokens: bool = False,
        reasoning_budget: int | None = None,
        n: int = 1,
    ) -> AsyncIterator[Chunk]:
        """Stream the assistant's answer to `messages`, rendered with the model's chat template
        (or `template`, a Jinja source run in a sandbox). Roles:
        `actors.model.text.chat.CHAT_ROLES`; others raise InvalidRequest. `tools`: OpenAI-style
        function tools, rendered by the template (its `tools` variable; one that has none
        raises InvalidRequest); an assistant message may carry `tool_calls`, a `tool` message
        answers one. `chat_template_kwargs`: more variables for the template, as transformers'
        apply_chat_template takes them (e.g. `{"enable_thinking": False}` for Qwen3); names
        and JSON values, see `actors.model.text.chat.check_template_kwargs`.

        Bad messages, params or a template that is not a string raise at once (the messages
        of a chat longer than 16 Ki messages are checked in a worker thread, so their errors
        come from the first iteration; one with more messages than the context has tokens is
        refused at once); the template renders in a worker thread within a time and size
        bound, so its errors (TemplateError, ContextLengthExceeded; a template's own refusal,
        its `raise_exception`, is a TemplateError with its message) come from the first
        iteration. `strict_max_tokens` and `n`: as for `generate`.

        A thinking model's reasoning (between the template's reasoning markers, e.g.
        `<think>`...`</think>`; how they are found: `actors.reasoning`) comes in the chunks'
        `reasoning`, never in their `text`; `params.structured` holds from the reasoning's
        end on. `reasoning_budget`: at most this many reasoning tokens, then the end marker
        is forced (a template without markers refuses it, from the first iteration)."""
        self._check_open()
        if template is not None and not isinstance(template, str):
            self._reject(
                InvalidRequest(
                    f"template must be a Jinja source string or None (the model's own), not "
                    f"{type(template).__name__}",
                    field="template",
                )
            )
        long_chat = isinstance(messages, list) and len(messages) > _CHECK_INLINE_ITEMS
        if long_chat:  # its messages are checked in the worker thread, its length here
            self._check_message_count(len(messages))
        else:
            self._check_chat(check_messages, messages)
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)
        ):
            self._reject(InvalidRequest("tools must be a list of dicts (function tools)",
                                        field="tools"))
        self._check_chat(check_template_kwargs, chat_template_kwargs)
        if reasoning_budget is not None:
            self._check_chat(partial(_check_count, "reasoning_budget", minimum=0,
                                     maximum=MAX_CONTEXT), reasoning_budget)
        params = self._checked_params(params, n)
        return self._stream_when_ready(
            partial(self._chat_prompt_ids, messages, template, tools, chat_template_kwargs,
                    check=long_chat),
            params, strict_max_tokens, n,
            partial(self._chat_reasoning, template, reasoning_budget),
        )

    async def complete(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> Completion:
        """The whole completion of `prompt` at once."""
        return await collect(self.generate(prompt, params))

    def tokenize(
        self, text: str, *, add_bos: bool | None = None, parse_special: bool = False
    ) -> list[int]:
        self._check_open()
        if not isinstance(text, str):
            raise InvalidRequest(f"text must be a str, not {type(text).__name__}", field="text")
        return self._tokenizer.encode(text, add_bos=add_bos, parse_special=parse_special)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        self._check_open()
        return self._tokenizer.decode(self._checked_token_range(token_ids, "token_ids"))

    def chat_template(self, template: str | None = None) -> ChatTemplate:
        """The compiled template `chat(..., template)` renders with (the model's own when
        None). Compiling blocks: async code calls it in a worker thread."""
        if self._chat_template is None:
            raise TemplateError("this engine was opened without a chat template source")
        if template is not None:
            return self._chat_template(template)
        if self._default_template is None:
            self._default_template = self._chat_template(None)
        return self._default_template

    def stats(self) -> EngineStats:
        self._check_open()
        pool = self._scheduler.kv.pool
        return EngineStats(
            running=self._scheduler.running,
            waiting=self._scheduler.waiting,
            kv_blocks_used=pool.used,
            kv_blocks_free=pool.empty,
            kv_blocks_cached=pool.cached,
            steps=self._scheduler.steps,
            tokens=self._scheduler.tokens,
            bytes_from_compute=self._scheduler.bytes_from_compute,
            last_step_s=self._scheduler.last_step_s,
            compute_busy_s=self._scheduler.compute_busy_s,
        )


async def _as_awaitable(ids: list[int]) -> list[int]:
    return ids


async def _started(
    loaded: MemoryObjectReceiveStream[ModelLoaded | LoadFailed],
    answers: LoopReceiver[ComputeAnswer],
) -> tuple[ModelLoaded, ComputeInfo]:
    """Wait for the loader's result, then for the compute actor's report; raise what failed."""
    with loaded:
        model = await loaded.receive()
    if isinstance(model, LoadFailed):
        raise model.error
    info = await answers.receive()
    if isinstance(info, StartFailed):
        raise info.error
    if not isinstance(info, ComputeInfo):
        raise ComputeError(f"the compute actor answered {type(info).__name__} before it started")
    return model, info


async def collect(chunks: AsyncIterator[Chunk]) -> Completion:
    """Gather a stream of chunks into one Completion."""
    text: list[str] = []
    reasoning: list[str] = []
    token_ids: list[int] = []
    async with aclosing(chunks):
        async for chunk in chunks:
            text.append(chunk.text)
            reasoning.append(chunk.reasoning)
            if chunk.token_id is not None:
                token_ids.append(chunk.token_id)
            if chunk.finish_reason is not None:
                return Completion(
                    text="".join(text),
                    token_ids=tuple(token_ids),
                    finish_reason=chunk.finish_reason,
                    usage=chunk.usage,
                    timings=chunk.timings,
                    reasoning="".join(reasoning),
                )
    raise EngineClosed("the stream ended without a finish reason")


def _check_model_path(path: object) -> None:
    """A model source Engine.open can take: None, a str or os.PathLike path, a loaded Model."""
    if not isinstance(path, Model):
        check_model_path(path, accepted="a model file path (str or os.PathLike of str), a "
                                         "loaded Model or None")


def _check_count(name: str, value: int, minimum: int, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        huge = isinstance(value, int) and value.bit_length() > 64  # its repr may even raise
        shown = "a huge int" if huge else f"{value!r:.40}"
        raise InvalidRequest(
            f"{name} must be an int in {minimum}..{maximum:,}, got {shown}", field=name
        )


def _check_limits(
    max_sequences: int, max_queued: int, prefill_chunk: int, step_timeout_s: float
) -> None:
    _check_count("max_sequences", max_sequences, 1, _MAX_REQUESTS)
    _check_count("max_queued", max_queued, 0, _MAX_REQUESTS)
    _check_count("prefill_chunk", prefill_chunk, 1, _MAX_KV_POSITIONS)
    if (
        isinstance(step_timeout_s, bool)
        or not isinstance(step_timeout_s, (int, float))
        # An int past the largest float compares below infinity but cannot become a deadline.
        or not 0 < step_timeout_s <= sys.float_info.max
    ):
        raise InvalidRequest(
            f"step_timeout_s must be a positive, finite number of seconds, got "
            f"{step_timeout_s!r:.60}",
            field="step_timeout_s",
        )
