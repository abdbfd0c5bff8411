"""The loader: GGUF file -> model (spec, tokenizer, weights) and the compute backend to run it.

It runs once, in a thread of its own (joined before the engine starts, so no pooled worker
thread outlives the engine), before the other actors start. What it hands over is a factory
the compute actor calls inside its own thread (a CUDA backend must create its context and
upload weights in the thread that will use them).
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.from_thread
import anyio.lowlevel

from actors.compute.protocol import ComputeBackend
from actors.errors import InvalidRequest
from actors.logs import get_logger
from actors.model.chat import ChatTemplate
from actors.model.loaded import Model, load_model

BACKENDS = ("auto", "cpu", "cuda")
# KV cache budget when the caller does not size it in blocks.
DEFAULT_KV_BYTES = 1 << 30
# The K/V arrays are float32 on the host.
KV_DTYPE_BYTES = 4


@dataclass(frozen=True)
class LoadedModel:
    """What the engine needs from the loader."""

    model: Model
    # Whether the engine opened the model (and so closes its file).
    owned: bool
    path: str
    backend: str
    notices: tuple[str, ...]
    make_backend: Callable[[int, int], ComputeBackend]

    def chat_template(self, override: str | None = None) -> ChatTemplate:
        return ChatTemplate.from_model_metadata(self.model.gguf, override)


async def load_in_thread(source: str | Path | Model | None, backend: str) -> LoadedModel:
    """`load` in a dedicated thread; waits for it even when cancelled (loading cannot be
    interrupted, and the thread must not be left behind)."""
    outcome: list[LoadedModel | BaseException] = []
    finished = anyio.Event()
    token = anyio.lowlevel.current_token()

    def target() -> None:
        try:
            outcome.append(load(source, backend))
        except BaseException as exc:  # handed to the event loop, raised there
            outcome.append(exc)
        finally:
            anyio.from_thread.run_sync(finished.set, token=token)

    thread = threading.Thread(target=target, name="q4k-loader", daemon=True)
    thread.start()
    with anyio.CancelScope(shield=True):
        await finished.wait()
    thread.join()
    (result,) = outcome
    if isinstance(result, BaseException):
        raise result
    return result


def load(source: str | Path | Model | None, backend: str) -> LoadedModel:
    """Open the model (or take an already loaded one) and choose its backend (blocking: call
    it from a worker thread)."""
    if backend not in BACKENDS:
        raise InvalidRequest(
            f"backend {backend!r} is not one of {', '.join(BACKENDS)}", field="backend"
        )
    model = source if isinstance(source, Model) else load_model(source)
    chosen, make_backend, notices = _choose_backend(model, backend)
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
    return LoadedModel(
        model=model,
        owned=model is not source,
        path=str(model.path),
        backend=chosen,
        notices=notices,
        make_backend=make_backend,
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
