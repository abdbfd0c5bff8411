"""The loader actor: GGUF file -> model (spec, tokenizer, weights) and the backend to run it.

It is the first task of the engine's task group. Its blocking load runs in a thread of its own,
which is joined, and awaited even when the engine is cancelled (a load cannot be interrupted,
and no thread may outlive the engine). Then it hands over what it loaded, one message each:
`BuildBackend` to the compute actor (a factory the compute actor calls inside its own thread:
a CUDA backend must create its context and upload weights in the thread that will use them)
and `ModelLoaded` (tokenizer, chat template, notices) to the engine; or `LoadFailed`.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from actors.compute.protocol import BuildBackend, ComputeBackend, run_in_own_thread
from actors.errors import InvalidRequest
from actors.logs import get_logger
from actors.model.chat import ChatTemplate
from actors.model.loaded import Model, load_model
from actors.progress import progress_callback

BACKENDS = ("auto", "cpu", "cuda")
# KV cache budget when the caller does not size it in blocks.
DEFAULT_KV_BYTES = 1 << 30
# The K/V arrays are float32 on the host.
KV_DTYPE_BYTES = 4


class ModelLoaded(msgspec.Struct, frozen=True, kw_only=True):
    """The loader -> the engine: what the engine's door needs of the model."""

    tokenizer: Any
    chat_template: Any  # Callable[[str | None], ChatTemplate] | None
    model_name: str
    backend: str
    notices: tuple[str, ...]


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
    kv_blocks: int | None,
    block_size: int,
    max_sequences: int,
) -> Loaded:
    """Open the model (or take an already loaded one), choose its backend and size its KV pool
    (`kv_blocks` None: from DEFAULT_KV_BYTES). Blocking: the loader actor runs it in its
    thread."""
    if backend not in BACKENDS:
        raise InvalidRequest(
            f"backend {backend!r} is not one of {', '.join(BACKENDS)}", field="backend"
        )
    if isinstance(source, Model):
        model = source
    else:
        with progress_callback("loading the model weights") as report:
            model = load_model(source, progress=report)
    # The engine opened the file, so the engine closes it, once the backend is done with it.
    release = model.gguf.close if model is not source else None
    try:
        chosen, make_backend, notices = _choose_backend(model, backend)
        num_blocks = kv_blocks or kv_blocks_for_budget(model, block_size, max_sequences)
    except BaseException:
        if release is not None:
            release()
        raise
    log = get_logger("actors.loader")
    log.info(
        "model_loaded",
        arch=model.spec.arch,
        quant_mix=model.quant_mix,
        load_ms=round(model.load_ms, 3),
        backend=chosen,
        path=str(model.path),
    )
    for notice in notices:
        log.info("notice", message=notice)
    # Built here, in the loader's thread: on the first request it would stall the event
    # loop (about 1 s for gemma3's 262k-token vocabulary).
    model.tokenizer.prepare_encoder()
    return Loaded(
        model=ModelLoaded(
            tokenizer=model.tokenizer,
            chat_template=partial(ChatTemplate.from_model_metadata, model.gguf),
            model_name=str(model.path),
            backend=chosen,
            notices=notices,
        ),
        build=BuildBackend(
            make_backend=partial(make_backend, num_blocks, block_size), release=release
        ),
    )


def kv_blocks_for_budget(model: Model, block_size: int, max_sequences: int) -> int:
    """As many blocks as DEFAULT_KV_BYTES holds, but no more than max_sequences full contexts."""
    block_bytes = model.spec.kv_bytes_per_token(KV_DTYPE_BYTES) * block_size
    useful = max_sequences * -(-model.spec.context_length // block_size)
    return max(1, min(DEFAULT_KV_BYTES // block_bytes, useful))


def _choose_backend(
    model: Model, requested: str
) -> tuple[str, Callable[[int, int], ComputeBackend], tuple[str, ...]]:
    """The backend to run on, its factory, and the notices that explain the choice."""
    from actors.compute.cpu import CpuBackend

    if requested in ("auto", "cuda"):
        if importlib.util.find_spec("actors.compute.cuda") is not None:
            cuda = importlib.import_module("actors.compute.cuda")
            reason = cuda.unavailable_reason()
            if reason is None:
                return "cuda", lambda blocks, size: cuda.make_backend(model, blocks, size), ()
        else:
            reason = "this build has no CUDA backend"
        notice = f"backend {requested}: CUDA not used ({reason}); running on the CPU"
        return "cpu", lambda blocks, size: CpuBackend(model, blocks, size, (notice,)), (notice,)
    return "cpu", lambda blocks, size: CpuBackend(model, blocks, size), ()
