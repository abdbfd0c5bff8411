"""The CUDA backend's device memory, planned on the host (pure Python, no pycuda): the
workspace buffers a step uses, and how many KV blocks the memory left beside the weights and
the workspace holds. The kernels' names and launch geometry are actors.compute.cuda_plan's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.compute import cuda_plan as plan
from actors.errors import ComputeError, InvalidRequest

if TYPE_CHECKING:  # annotations only: the GPU machine's tests import this without `gguf`
    from actors.model.arch import ModelSpec


def kv_block_bytes(spec: ModelSpec, block_size: int) -> int:
    """Device bytes of one KV block: K and V, every layer, float16."""
    return 2 * spec.n_layers * block_size * spec.kv_dim * plan.KV_BYTES_PER_VALUE


@dataclass(frozen=True)
class StepLimits:
    """The largest step the workspace is sized for."""

    max_tokens: int  # tokens of one step (decode items + prefill chunk)
    max_rows: int  # logits rows of one step (items wanting a token)
    max_splits: int  # flash-decoding splits per (sequence, head)
    max_candidates: int  # candidates per row


# Workspace buffers the kernels count in across blocks: zero when allocated, and every launch
# leaves them zero (the last block of each counted group resets its counter).
ZEROED_BUFFERS = ("attention_counters", "candidate_counters", "qkv_counters")


def workspace_buffers(spec: ModelSpec, limits: StepLimits) -> dict[str, int]:
    """Bytes of each float32 / int32 device buffer a step uses, by name (forward.py's
    StepBuffers plus the logits, attention partials and candidate outputs). The buffers named
    in ZEROED_BUFFERS must be zero-filled once when allocated."""
    t, rows, f32 = limits.max_tokens, limits.max_rows, 4
    partials = rows * spec.n_heads * limits.max_splits
    token_tiles = -(-t // plan.BATCH_QKV_TOKENS)
    return {
        "x": t * spec.d_model * f32,
        "normed": t * spec.d_model * f32,
        "qkv": t * (spec.q_dim + 2 * spec.kv_dim) * f32,
        "attn": t * spec.q_dim * f32,
        "projected": t * spec.d_model * f32,
        "gate_up": t * 2 * spec.ffn_dim * f32,
        "gated": t * spec.ffn_dim * f32,
        "logits": rows * spec.vocab_size * f32,
        # The logits rows of the decode step the CUDA backend runs ahead (actors.compute.
        # cuda_ahead): the last step's stay readable beside them.
        "logits_ahead": rows * spec.vocab_size * f32,
        "partial_acc": partials * spec.head_dim * f32,
        "partial_max": partials * f32,
        "partial_sum": partials * f32,
        # attention_decode: one counter per (sequence, block row of heads) <= n_heads.
        "attention_counters": rows * spec.n_heads * 4,
        # The fused QKV kernels: one counter per head of the qkv row (its blocks that have
        # stored), per token tile of the batched QKV (at most BATCH_QKV_TOKENS of a step's
        # tokens a tile, a prefill chunk's too; the matvecs' take every row in one).
        "qkv_counters": (spec.n_heads + 2 * spec.n_kv_heads) * token_tiles * 4,
        "final": rows * spec.d_model * f32,  # the logits rows' normed states, gathered
        "candidates": rows * plan.candidate_record_words(limits.max_candidates) * 4,
        "candidate_partials": rows * plan.MAX_SLICES * plan.SLICE_WORDS * 4,
        "candidate_counters": rows * 4,
    }


@dataclass(frozen=True)
class MemoryPlan:
    """How the device memory is spent."""

    weight_bytes: int
    workspace_bytes: int
    kv_block_bytes: int
    kv_blocks: int

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.kv_block_bytes


def plan_memory(free_bytes: int, fraction: float, weights: int, workspace: int,
                block_bytes: int) -> MemoryPlan:
    """KV blocks = (free memory * fraction - weights - workspace) // block bytes, where
    `free_bytes` is measured before anything is allocated. ComputeError if not even one block
    fits (the message says how much more is needed)."""
    if not 0 < fraction <= 1:
        raise InvalidRequest(f"the device memory fraction must be in (0, 1], got {fraction}",
                             field="gpu_memory_fraction")
    budget = int(free_bytes * fraction)
    blocks = (budget - weights - workspace) // block_bytes
    if blocks < 1:
        short = weights + workspace + block_bytes - budget
        raise ComputeError(
            f"the model needs {weights / 2**30:.2f} GiB of weights and {workspace / 2**30:.2f} "
            f"GiB of workspace, but {fraction:.0%} of the device's free memory is "
            f"{budget / 2**30:.2f} GiB: {short / 2**20:.0f} MiB short of one KV block; use a "
            "smaller model, a larger fraction or a smaller step"
        )
    return MemoryPlan(weights, workspace, block_bytes, int(blocks))


def kv_pool_blocks(free_bytes: int, fraction: float, weights: int, workspace: int,
                   block_bytes: int, requested: int | None, useful: int) -> int:
    """KV blocks for the scheduler: `requested` if memory holds it, else as many as the
    memory plan holds up to `useful` (what the engine's sequences can use). One more block
    than this is allocated: the padding rows' block, which the scheduler never hands out."""
    memory = plan_memory(free_bytes, fraction, weights, workspace + block_bytes, block_bytes)
    if requested is not None:
        if requested > memory.kv_blocks:
            raise ComputeError(
                f"{requested} KV blocks of {block_bytes / 2**20:.1f} MiB do not fit: "
                f"{fraction:.0%} of the device's free memory holds {memory.kv_blocks} besides "
                "the weights and workspace; ask for fewer blocks or a larger fraction"
            )
        return requested
    return min(memory.kv_blocks, useful)
