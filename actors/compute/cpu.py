"""The CPU compute backend: the numpy forward over a float32 paged KV pool (the reference
every other backend is tested against)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from actors.compute.contract import (
    Candidates,
    ComputeInfo,
    KVRequest,
    RowInputs,
    StepItem,
    apply_penalties,
    apply_token_masks,
    plan_step,
    top_candidates,
)
from actors.errors import InvalidRequest
from actors.model.loaded import Model, OpenedModel, load_float32
from actors.progress import progress_callback

# KV cache budget when the caller does not size it in blocks.
DEFAULT_KV_BYTES = 1 << 30
# The K/V arrays are float32 on the host.
KV_DTYPE = np.float32


class CpuBackend:
    """Owns a float32 model and its KV pool; runs `Model.step` and the candidates on them."""

    def __init__(
        self, model: Model, num_blocks: int, block_size: int, notices: Sequence[str] = ()
    ) -> None:
        self._model = model
        self._kv = model.new_kv_pool(num_blocks, block_size)
        self._last_rows = np.zeros((0, model.spec.vocab_size), dtype=np.float32)
        self.info = ComputeInfo.of_model(
            model.spec,
            on_gpu=False,
            num_blocks=num_blocks,
            block_size=block_size,
            kv_dtype=np.dtype(KV_DTYPE).name,
            notices=tuple(notices),
        )

    def run(self, items: Sequence[StepItem], rows: Sequence[RowInputs]) -> Candidates:
        # Forget the last step's rows first: a failed step leaves nothing to fetch.
        self._last_rows = self._last_rows[:0]
        plan = plan_step(items, self._model.spec, self._kv.num_blocks, self._kv.block_size)
        if len(rows) != len(plan.logit_rows):
            raise InvalidRequest(
                f"{len(rows)} row inputs for {len(plan.logit_rows)} items that want logits",
                field="rows",
            )
        logits = self._model.run_plan(plan, self._kv)
        apply_token_masks(logits, rows)
        apply_penalties(logits, rows)
        self._last_rows = logits
        return top_candidates(logits, rows)

    def fetch_rows(self, indices: Sequence[int]) -> np.ndarray:
        index = np.asarray(indices, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= len(self._last_rows)):
            raise InvalidRequest(
                f"rows {list(indices)} are not all rows of the last step "
                f"({len(self._last_rows)} rows)", field="rows",
            )
        return self._last_rows[index]

    def close(self) -> None:
        # The pool can be gigabytes; drop it now rather than when the engine is collected.
        self._kv = None
        self._last_rows = None


def build_cpu_backend(model: OpenedModel, kv: KVRequest, notices: Sequence[str]) -> CpuBackend:
    """The CPU backend for `model`: float32 weights dequantized from the file (or those of an
    already loaded `Model`), a float32 KV pool within DEFAULT_KV_BYTES unless `kv` sizes it."""
    if isinstance(model, Model):  # already loaded (e.g. shared by `Engine.open(model)`)
        loaded = model
    else:
        with progress_callback("loading the model weights") as report:
            loaded = load_float32(model, report)
    spec = loaded.spec
    block_bytes = kv.block_size * spec.kv_bytes_per_token(np.dtype(KV_DTYPE).itemsize)
    num_blocks = kv.blocks_within(DEFAULT_KV_BYTES, block_bytes, spec.context_length)
    return CpuBackend(loaded, num_blocks, kv.block_size, notices)
