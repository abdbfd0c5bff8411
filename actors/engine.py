"""The Engine: starts the actors in one task group and is the public door to them.

    async with Engine.open("model.gguf") as engine:
        async for chunk in engine.generate("Once upon a time", SamplingParams(max_tokens=64)):
            print(chunk.text, end="")

Actors, all tasks of one task group, each with a bounded inbox of frozen msgspec messages:
the loader (loads the model in a thread of its own and hands the backend factory to the compute
actor), the compute actor (one thread owning the backend and its KV arrays; answers logits
rows), the sampler (one thread choosing tokens from those rows) and the scheduler (admission,
batching, KV block accounting). Each request is a session running in the caller's task.
Everything a request can get wrong is checked here, before any work starts.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import anyio
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream

from actors.compute.protocol import (
    BuildBackend,
    ComputeActor,
    ComputeBackend,
    ComputeInfo,
    RunStep,
    Shutdown,
    StartFailed,
    StepDone,
    StepFailed,
)
from actors.errors import (
    ContextLengthExceeded,
    EngineClosed,
    EngineOverloaded,
    InvalidRequest,
    TemplateError,
)
from actors.kv_blocks import BlockPool
from actors.loader import Loaded, LoaderActor, LoadFailed, ModelLoaded, load_gguf
from actors.logs import get_logger, logging_to
from actors.messages import Chunk, Completion, EngineStats
from actors.model.loaded import Model
from actors.params import SamplingParams
from actors.sampler import SampleStep, SamplerActor, SamplingFailed, StepSampled
from actors.scheduler import Admission, Scheduler
from actors.session import Session, new_request_id

# Messages a live session can have in the scheduler's inbox at once: open, advance, close.
_INBOX_SLOTS_PER_REQUEST = 3
# The roles chat templates know; any other is most likely a typo the template would render.
CHAT_ROLES = ("system", "user", "assistant", "tool")


class Engine:
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
        log_level: str | None = None,
        log_file: str | os.PathLike[str] | TextIO | None = None,
    ) -> AsyncIterator[Engine]:
        """Load a GGUF model (None = the default model; or pass a loaded `Model` to share it)
        and serve it until the block ends.

        `backend`: "auto" | "cpu" | "cuda" (an unusable GPU is a notice and a CPU fallback).
        `kv_blocks`: KV pool size in blocks of `block_size` positions (None: from a 1 GiB
        budget). `log_level` / `log_file`: where the engine's JSON-line logs go (None: leave the
        logging configuration as it is)."""
        _check_count("block_size", block_size, 1)
        if kv_blocks is not None:
            _check_count("kv_blocks", kv_blocks, 1)
        logging = (
            logging_to(log_level or "info", log_file)
            if log_level is not None or log_file is not None
            else nullcontext()
        )
        load = partial(
            load_gguf,
            path,
            backend,
            kv_blocks=kv_blocks,
            block_size=block_size,
            max_sequences=max_sequences,
        )
        with logging:
            async with cls._serve(
                load,
                max_sequences=max_sequences,
                max_queued=max_queued,
                prefill_chunk=prefill_chunk,
            ) as engine:
                yield engine

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
        async with cls._serve(
            lambda: loaded,
            max_sequences=max_sequences,
            max_queued=max_queued,
            prefill_chunk=prefill_chunk,
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
    ) -> AsyncIterator[Engine]:
        """Start the actors in one task group: the loader runs `load` and hands the backend
        factory to the compute actor; once that reports ready, the scheduler starts."""
        _check_count("max_sequences", max_sequences, 1)
        _check_count("max_queued", max_queued, 0)
        _check_count("prefill_chunk", prefill_chunk, 1)
        limit = max_sequences + max_queued
        inbox_send, inbox_receive = anyio.create_memory_object_stream[Any](
            _INBOX_SLOTS_PER_REQUEST * limit
        )
        build_send, build_receive = anyio.create_memory_object_stream[BuildBackend](1)
        loaded_send, loaded_receive = anyio.create_memory_object_stream[
            ModelLoaded | LoadFailed
        ](1)
        compute_send, compute_receive = anyio.create_memory_object_stream[RunStep | Shutdown](1)
        answer_send, answer_receive = anyio.create_memory_object_stream[
            ComputeInfo | StartFailed | StepDone | StepFailed
        ](1)
        rows_send, rows_receive = anyio.create_memory_object_stream[SampleStep](1)
        choices_send, choices_receive = anyio.create_memory_object_stream[
            StepSampled | SamplingFailed
        ](1)
        # The scheduler's streams; closed here instead when it never starts.
        scheduler_streams = (inbox_receive, compute_send, answer_receive, rows_send, choices_receive)
        # Errors of the caller's block are re-raised after the task group, so callers see the
        # exception itself rather than an ExceptionGroup around it.
        failure: Exception | None = None
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(LoaderActor(load, build_send, loaded_send).run)
            tasks.start_soon(ComputeActor(build_receive, compute_receive, answer_send).run)
            tasks.start_soon(SamplerActor(rows_receive, choices_send).run)
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
                    pool=BlockPool(info.num_blocks, info.block_size),
                    admission=admission,
                    max_sequences=max_sequences,
                    prefill_chunk=prefill_chunk,
                    inbox=inbox_receive,
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
                    "engine_started", backend=model.backend, model=model.model_name, arch=info.arch
                )
                try:
                    yield engine
                except Exception as exc:
                    failure = exc
                finally:
                    engine.close()
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Stop taking requests; running ones end with EngineClosed. Idempotent. The actors
        finish the step in flight and exit when the `open` block ends."""
        if not self._closed:
            self._closed = True
            # The scheduler ends when its inbox does, then tells the compute actor to stop.
            self._inbox.close()

    # --- requests -------------------------------------------------------------------------

    def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> AsyncIterator[Chunk]:
        """Stream the completion of `prompt` (text, or token ids) chunk by chunk.

        Raises at once: InvalidRequest (bad params or prompt), ContextLengthExceeded,
        EngineOverloaded (running and queued limits reached), EngineClosed. Close the iterator
        (or `break` and drop it) to cancel; `contextlib.aclosing` cancels deterministically."""
        return self._start_session(self._prompt_ids(prompt), params)

    def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        template: str | None = None,
    ) -> AsyncIterator[Chunk]:
        """Stream the assistant's answer to `messages`, rendered with the model's chat template
        (or `template`, a Jinja source run in a sandbox). Roles: `CHAT_ROLES`; others raise
        InvalidRequest."""
        self._check_open()
        self._check_roles(messages)
        text = self._render_chat(messages, template)
        ids = self._tokenizer.encode(text, parse_special=True)
        bos = self._tokenizer.bos_id
        # Templates that write the BOS themselves would otherwise get a second one.
        if bos is not None and ids[:2] == [bos, bos]:
            ids = ids[1:]
        return self._start_session(self._checked_ids(ids), params)

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

    def stats(self) -> EngineStats:
        self._check_open()
        pool = self._scheduler.pool
        return EngineStats(
            running=self._scheduler.running,
            waiting=self._scheduler.waiting,
            kv_blocks_used=pool.used,
            kv_blocks_free=pool.empty,
            kv_blocks_cached=pool.cached,
            steps=self._scheduler.steps,
            tokens=self._scheduler.tokens,
            last_step_s=self._scheduler.last_step_s,
        )

    # --- checks at the door ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("this engine is closed; open a new one")

    def _start_session(self, prompt_ids: list[int], params: SamplingParams | None) -> AsyncIterator[Chunk]:
        params = SamplingParams() if params is None else params
        request_id = new_request_id()
        log = self._log.bind(request_id=request_id)
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(
                f"params must be a SamplingParams, not {type(params).__name__}", field="params"
            )
        try:
            params.validate(self._tokenizer.vocab_size)
        except InvalidRequest as exc:
            log.warning("request_rejected", reason="invalid_request", error=str(exc))
            raise
        try:
            self._admission.check()
        except EngineOverloaded as exc:
            log.warning("request_rejected", reason="overloaded", error=str(exc))
            raise
        session = Session(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            context_length=self.context_length,
            tokenizer=self._tokenizer,
            scheduler_inbox=self._inbox,
            admission=self._admission,
        )
        return session.stream()

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
        ids = np.asarray(token_ids) if isinstance(token_ids, (list, tuple)) else None
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
        if len(ids) >= self.context_length:
            self._reject(
                ContextLengthExceeded(
                    f"the prompt is {len(ids)} tokens; it must be shorter than the context "
                    f"({self.context_length} tokens) to leave room for an answer",
                    field="prompt",
                )
            )
        return ids

    def _reject(self, error: InvalidRequest) -> None:
        reason = "context_length" if isinstance(error, ContextLengthExceeded) else "invalid_request"
        self._log.warning("request_rejected", request_id=new_request_id(), reason=reason, error=str(error))
        raise error

    def _check_roles(self, messages: list[dict[str, Any]]) -> None:
        """Refuse an unknown role; other malformed messages are the template's to report."""
        for index, message in enumerate(messages if isinstance(messages, list) else ()):
            role = message.get("role") if isinstance(message, dict) else None
            if isinstance(role, str) and role not in CHAT_ROLES:
                self._reject(
                    InvalidRequest(
                        f"messages[{index}] has the role {role!r}; the roles are "
                        f"{', '.join(CHAT_ROLES)}",
                        field="messages",
                    )
                )

    def _render_chat(self, messages: list[dict[str, Any]], template: str | None) -> str:
        if self._chat_template is None:
            raise TemplateError("this engine was opened without a chat template source")
        if template is not None:
            return self._chat_template(template).render(messages)
        if self._default_template is None:
            self._default_template = self._chat_template(None)
        return self._default_template.render(messages)


async def _started(
    loaded: MemoryObjectReceiveStream[ModelLoaded | LoadFailed],
    answers: MemoryObjectReceiveStream[ComputeInfo | StartFailed | StepDone | StepFailed],
) -> tuple[ModelLoaded, ComputeInfo]:
    """Wait for the loader's result, then for the compute actor's report; raise what failed."""
    with loaded:
        model = await loaded.receive()
    if isinstance(model, LoadFailed):
        raise model.error
    info = await answers.receive()
    if isinstance(info, StartFailed):
        raise info.error
    return model, info


async def collect(chunks: AsyncIterator[Chunk]) -> Completion:
    """Gather a stream of chunks into one Completion."""
    text: list[str] = []
    token_ids: list[int] = []
    async with aclosing(chunks):
        async for chunk in chunks:
            text.append(chunk.text)
            if chunk.token_id is not None:
                token_ids.append(chunk.token_id)
            if chunk.finish_reason is not None:
                return Completion(
                    text="".join(text),
                    token_ids=tuple(token_ids),
                    finish_reason=chunk.finish_reason,
                    usage=chunk.usage,
                    timings=chunk.timings,
                )
    raise EngineClosed("the stream ended without a finish reason")


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRequest(f"{name} must be an int >= {minimum}, got {value!r}", field=name)
