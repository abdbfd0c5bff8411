"""A fault drill: requests run at once on a model whose backend injects a fault, and what
each got. The fault-injection benchmark and tests check the outcome against the contract
(the hit requests replay or fail with ComputeError, the others keep their solo tokens)."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import msgspec

from actors.compute.contract import KVRequest
from actors.compute.cpu import build_cpu_backend
from actors.compute.faults import Fault, FaultyBackend
from actors.engine import Engine
from actors.errors import ComputeError
from actors.model.loaded import Model
from actors.params import SamplingParams


class DrillResult(msgspec.Struct, frozen=True, kw_only=True):
    """Per prompt the tokens it got (None: ComputeError); the KV blocks still held once
    all were done; how many steps each kind of fault hit."""

    tokens: tuple[tuple[int, ...] | None, ...]
    blocks_held: int
    injected: dict[str, int]


async def run_with_fault(
    model: Model,
    prompts: Sequence[Sequence[int]],
    fault: Fault,
    params: SamplingParams,
    *,
    step_timeout_s: float,
) -> DrillResult:
    """Every prompt at once through a CPU backend of `model` with `fault` injected."""
    kv = KVRequest(blocks=512, block_size=16, max_sequences=len(prompts))
    backend = FaultyBackend(build_cpu_backend(model, kv, ()), [fault])
    tokens: list[tuple[int, ...] | None] = [None] * len(prompts)

    async def one(index: int) -> None:
        try:
            tokens[index] = (await engine.complete(list(prompts[index]), params)).token_ids
        except ComputeError:
            tokens[index] = None

    async with Engine.open_backend(lambda: backend, model.tokenizer,
                                   step_timeout_s=step_timeout_s) as engine:
        async with anyio.create_task_group() as tasks:
            for index in range(len(prompts)):
                tasks.start_soon(one, index)
        await anyio.sleep(0.05)  # the sessions' closes reach the scheduler
        held = engine.stats().kv_blocks_used
    return DrillResult(tokens=tuple(tokens), blocks_held=held, injected=dict(backend.injected))
