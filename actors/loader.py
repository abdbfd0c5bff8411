"""The loader actor: GGUF file -> opened model (spec, tokenizer) and the backend to run it.

It is the first task of the engine's task group. Its blocking work (opening the file, choosing
the backend, building the tokenizer's encoder) runs in a thread of its own, which is joined,
and awaited even when the engine is cancelled (it cannot be interrupted, and no thread may
outlive the engine). Then it hands over, one message each: `BuildBackend` to the compute actor
(the backend factory, which the compute actor calls inside its own thread: it loads the weights
its own way, and a CUDA backend must create its context and upload weights in the thread that
will use them) and `ModelLoaded` (tokenizer, chat template, notices) to the engine; or
`LoadFailed`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from actors.compute.actor import run_in_own_thread
from actors.compute.backends import choose_backend
from actors.compute.contract import BuildBackend, KVRequest
from actors.logs import get_logger
from actors.model.loaded import Model, open_model
from actors.model.text.chat import ChatTemplate


class ModelLoaded(msgspec.Struct, frozen=True, kw_only=True):
    """The loader -> the engine: what the engine's door needs of the model."""

    tokenizer: Any
    chat_template: Any  # Callable[[str | None], ChatTemplate] | None
    model_name: str
    backend: str
    notices: tuple[str, ...]
    arch: str = ""
    quant_mix: dict[str, int] = {}


class LoadFailed(msgspec.Struct, frozen=True, kw_only=True):
    """The loader -> the engine: the load raised `error`; the engine raises it from `open`."""

    error: Exception


class Loaded(NamedTuple):
    """What a load returns: the message for the engine and the one for the compute actor."""

    model: ModelLoaded
    build: BuildBackend


class LoaderActor:
    """Runs `load` (blocking) in a thread of its own, then hands its result over."""

    def __init__(
        self,
        load: Callable[[], Loaded],
        compute_inbox: MemoryObjectSendStream[BuildBackend],
        engine_inbox: MemoryObjectSendStream[ModelLoaded | LoadFailed],
    ) -> None:
        self._load = load
        self._compute_inbox = compute_inbox
        self._engine_inbox = engine_inbox

    async def run(self) -> None:
        """The actor task: load, hand over, end. Closing the compute inbox without a
        BuildBackend tells the compute actor there is nothing to build."""
        with self._compute_inbox, self._engine_inbox:
            # Cancelled before it began: no need to load at all.
            await anyio.lowlevel.checkpoint_if_cancelled()
            try:
                loaded = await run_in_own_thread("q4k-loader", self._load)
            except Exception as exc:
                self._tell_engine(LoadFailed(error=exc))
                return
            try:
                # Cancelled while loading: the engine is gone, so nobody would use the model.
                await anyio.lowlevel.checkpoint_if_cancelled()
                # Both inboxes have room: each gets this one message and nothing else.
                self._compute_inbox.send_nowait(loaded.build)
            except BaseException:
                if loaded.build.release is not None:
                    loaded.build.release()
                raise
            self._tell_engine(loaded.model)

    def _tell_engine(self, message: ModelLoaded | LoadFailed) -> None:
        try:
            self._engine_inbox.send_nowait(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the engine stopped waiting (cancelled); the compute actor ends on its own


def load_gguf(
    source: str | Path | Model | None,
    backend: str,
    *,
    kv: KVRequest,
) -> Loaded:
    """Open the model (or take an already loaded one) and choose its backend, whose factory
    the compute actor then builds in its own thread (the factory loads the weights its way and
    sizes its KV pool from `kv`). Blocking: the loader actor runs it in its thread."""
    factory, notices = choose_backend(backend)
    model = source if isinstance(source, Model) else open_model(source)
    # The engine opened the file, so the engine closes it, once the backend is done with it.
    release = model.gguf.close if model is not source else None
    try:
        log = get_logger("actors.loader")
        for notice in notices:
            log.info("notice", message=notice)
        # Built here, in the loader's thread: on the first request it would stall the event
        # loop (about 1 s for gemma3's 262k-token vocabulary).
        model.tokenizer.prepare_encoder()
    except BaseException:
        if release is not None:
            release()
        raise
    return Loaded(
        model=ModelLoaded(
            tokenizer=model.tokenizer,
            chat_template=partial(ChatTemplate.from_model_metadata, model.gguf),
            model_name=str(model.path),
            backend=factory.name,
            arch=model.spec.arch,
            quant_mix=model.quant_mix,
            notices=notices,
        ),
        build=BuildBackend(make_backend=partial(factory.build, model, kv), release=release),
    )
