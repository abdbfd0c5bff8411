"""A loaded model: spec, weights, tokenizer and the synchronous forward, without any actor."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from actors.errors import ContextLengthExceeded, InvalidRequest
from actors.model.arch import ModelSpec, spec_from_gguf
from actors.model.forward import KVPool, Transformer
from actors.model.gguf.inventory import type_mix
from actors.model.gguf.reader import GGUFFile, open_gguf
from actors.model.packaged import resolve_model
from actors.model.step import StepItem, StepPlan, plan_step
from actors.model.tensors import ModelTensors
from actors.model.weights import ModelWeights, load_quantized_weights, load_weights

if TYPE_CHECKING:
    from actors.model.text.tokenizer import Tokenizer

# Model.logits prefills in chunks of this many tokens: bounds the (heads, n, n) attention
# scores of a long sequence while keeping the matmuls large.
LOGITS_CHUNK_TOKENS = 512
LOGITS_BLOCK_SIZE = 16


class OpenedModel:
    """A GGUF file opened and understood, weights not loaded: its `spec` (every architecture
    quirk included), tokenizer and chat template. Each backend loads the weights its own way
    from `tensors` (the CPU as the file's blocks read in place, or float32 for reference; a GPU
    as the file's blocks in device memory)."""

    def __init__(self, gguf: GGUFFile, spec: ModelSpec, load_ms: float) -> None:
        self.gguf = gguf
        self.spec = spec
        self.load_ms = load_ms
        self.tensors = ModelTensors(gguf, spec)

    @property
    def path(self) -> Path:
        return Path(self.gguf.path)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        from actors.model.text.tokenizer import tokenizer_of_file

        return tokenizer_of_file(self.gguf)

    @property
    def chat_template(self) -> str | None:
        template = self.gguf.metadata.get("tokenizer.chat_template")
        return template if isinstance(template, str) else None

    @property
    def quant_mix(self) -> dict[str, int]:
        """Tensor type name -> number of tensors of that type in the file."""
        return {name: share.count for name, share in type_mix(self.gguf).items()}


class Model(OpenedModel):
    """A model ready to run on the CPU: `.logits(ids)` for teacher-forced scoring,
    `.step(items, kv)` for batched stepping over a block KV cache."""

    def __init__(self, gguf: GGUFFile, spec: ModelSpec, weights: ModelWeights,
                 load_ms: float) -> None:
        super().__init__(gguf, spec, load_ms)
        self.weights = weights
        self._transformer = Transformer(spec, weights)

    def new_kv_pool(self, num_blocks: int, block_size: int = 16) -> KVPool:
        return KVPool(self.spec, num_blocks, block_size)

    def step(self, items: Sequence[StepItem], kv: KVPool) -> np.ndarray:
        """Advance every item by its tokens, writing their K/V into `kv`.

        Returns (number of items with want_logits, vocab) float32: the logits after each such
        item's last token, in item order. Raises `InvalidRequest` / `ContextLengthExceeded`
        for a bad item before anything is written.
        """
        if kv.spec != self.spec:
            raise InvalidRequest("the KV pool was made for a different model", field="kv")
        return self.run_plan(plan_step(items, self.spec, kv.num_blocks, kv.block_size), kv)

    def run_plan(self, plan: StepPlan, kv: KVPool, out: np.ndarray | None = None) -> np.ndarray:
        """`step` for a plan already validated against this model and `kv`; the logits go
        into `out` where given ((len(plan.logit_rows), vocab) float32, C order)."""
        hidden = self._transformer.hidden_states(plan, kv)
        return self._transformer.logits(hidden[plan.logit_rows], out)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits (n, vocab) float32: row i predicts the token after
        token_ids[i]. Runs on a private KV pool; the engine's caches are untouched."""
        n = len(token_ids)
        if n == 0:
            raise InvalidRequest("token_ids is empty", field="token_ids")
        if n > self.spec.context_length:
            raise ContextLengthExceeded(
                f"{n} tokens exceed the model's context length {self.spec.context_length}",
                field="token_ids",
            )
        kv = self.new_kv_pool(-(-n // LOGITS_BLOCK_SIZE), LOGITS_BLOCK_SIZE)
        blocks = tuple(range(kv.num_blocks))
        out = np.empty((n, self.spec.vocab_size), dtype=np.float32)
        for start in range(0, n, LOGITS_CHUNK_TOKENS):
            chunk = tuple(token_ids[start : start + LOGITS_CHUNK_TOKENS])
            plan = plan_step([StepItem(chunk, start, blocks)], self.spec, kv.num_blocks,
                             kv.block_size)
            hidden = self._transformer.hidden_states(plan, kv)
            out[start : start + len(chunk)] = self._transformer.logits(hidden)
        return out


def open_model(path: str | Path | None = None) -> OpenedModel:
    """Open a GGUF file (a path, a packaged model's name such as "smollm2-135m-instruct", or
    None = the default gemma-3-270m) and read its spec, without loading any weights. Raises
    `ModelFormatError` for a broken file or a packaged model not installed, and
    `UnsupportedModelError` for an architecture we do not run."""
    started = time.perf_counter()
    gguf = open_gguf(resolve_model(path))
    try:
        return OpenedModel(gguf, spec_from_gguf(gguf), load_ms=(time.perf_counter() - started) * 1e3)
    except BaseException:
        gguf.close()
        raise


# How `load_model` may hold the weights: the file's blocks, or dequantized to float32.
WEIGHT_KINDS = {"quantized": load_quantized_weights, "float32": load_weights}


def _load(opened: OpenedModel, weights: str,
          progress: Callable[[int, int], None] | None) -> Model:
    started = time.perf_counter()
    loaded = WEIGHT_KINDS[weights](opened.tensors, opened.spec, progress)
    load_ms = opened.load_ms + (time.perf_counter() - started) * 1e3
    return Model(opened.gguf, opened.spec, loaded, load_ms=load_ms)


def load_quantized(
    opened: OpenedModel, progress: Callable[[int, int], None] | None = None
) -> Model:
    """An opened model for the CPU path with its weight matrices as the file's quantized
    blocks, read in place from the mapped file (resident memory about the file's size);
    `progress(done, total)` is called as layers load. Raises `UnsupportedModelError` for a
    tensor type we do not run and `ModelFormatError` for a missing or misshapen tensor."""
    return _load(opened, "quantized", progress)


def load_float32(
    opened: OpenedModel, progress: Callable[[int, int], None] | None = None
) -> Model:
    """An opened model for the CPU path with every weight dequantized to float32 (the
    reference the quantized path is checked against; several times the file's memory).
    `progress` and errors as `load_quantized`."""
    return _load(opened, "float32", progress)


def check_model_path(
    path: object, accepted: str = "a model file path (str or os.PathLike of str) or None"
) -> None:
    """`InvalidRequest` (field `path`) unless `path` is None, a str or an os.PathLike of str;
    `accepted` says what the caller takes."""
    if path is None or isinstance(path, str):
        return
    try:
        if isinstance(path, os.PathLike) and isinstance(os.fspath(path), str):
            return
    except Exception:  # a PathLike whose __fspath__ raises is no path either
        pass
    raise InvalidRequest(f"path must be {accepted}, not {type(path).__name__}", field="path")


def load_model(
    path: str | Path | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
    weights: str = "quantized",
) -> Model:
    """Open a GGUF file (a path, a packaged model's name, or None = the default gemma-3-270m;
    see `open_model`) and load its weights: as the file's
    quantized blocks, or with `weights="float32"` dequantized (`load_quantized`,
    `load_float32`).

    `progress(done, total)` is called as layers load. Raises `ModelFormatError` for a broken
    file, `UnsupportedModelError` for an architecture or tensor type we do not run, and
    `InvalidRequest` for a `path` of another type or an unknown `weights`.
    """
    check_model_path(path)
    if weights not in WEIGHT_KINDS:
        raise InvalidRequest(f"weights must be one of {', '.join(map(repr, WEIGHT_KINDS))}, "
                             f"not {weights!r}", field="weights")
    opened = open_model(path)
    try:
        return _load(opened, weights, progress)
    except BaseException:
        opened.gguf.close()
        raise
