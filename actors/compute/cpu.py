"""The CPU compute backend: numpy forward over the paged KV pool (the reference backend)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from actors.compute.protocol import ComputeInfo, ForwardItem
from actors.model.forward import StepItem
from actors.model.loaded import Model


class CpuBackend:
    """Owns the model's KV pool and runs `Model.step` on it."""

    def __init__(
        self, model: Model, num_blocks: int, block_size: int, notices: Sequence[str] = ()
    ) -> None:
        self._model = model
        self._kv = model.new_kv_pool(num_blocks, block_size)
        self.info = ComputeInfo(
            arch=model.spec.arch,
            on_gpu=False,
            context_length=model.spec.context_length,
            vocab_size=model.spec.vocab_size,
            num_blocks=num_blocks,
            block_size=block_size,
            notices=tuple(notices),
        )

    def forward(self, items: Sequence[ForwardItem]) -> np.ndarray:
        return self._model.step(
            [
                StepItem(
                    tokens=item.tokens,
                    start=item.start,
                    blocks=item.blocks,
                    want_logits=item.want_logits,
                )
                for item in items
            ],
            self._kv,
        )

    def close(self) -> None:
        # The pool can be gigabytes; drop it now rather than when the engine is collected.
        self._kv = None
