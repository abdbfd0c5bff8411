"""The forward pass of llama, qwen2 and gemma3 in numpy, stepping many sequences at once.

One step advances any mix of sequences (whole prompts, prefill chunks, single decode tokens).
All tokens of all items go through the big matmuls together as one (T, d_model) matrix; only
attention is per sequence, over keys gathered from the sequence's own blocks of a shared
`KVPool`. Single-token (decode) items are attended together in one padded batch so 64
streams cost a few array ops per layer, not 64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from actors.errors import ContextLengthExceeded, InvalidRequest
from actors.model.arch import ModelSpec
from actors.model.attention import attend
from actors.model.rope import apply_rope, inverse_frequencies, rotation
from actors.model.weights import LayerWeights, ModelWeights


@dataclass(frozen=True)
class StepItem:
    """One sequence's part of a step.

    The sequence's KV holds positions [0, start); `tokens` go at positions start, start+1...
    `blocks` is its block table: block i of the pool holds positions
    [i * block_size, (i + 1) * block_size) and must cover every position up to the last token.
    `want_logits=False` (a non-final prefill chunk) skips the output projection.
    """

    tokens: tuple[int, ...]
    start: int
    blocks: tuple[int, ...]
    want_logits: bool = True


class KVPool:
    """Keys and values of every layer for `num_blocks` blocks of `block_size` positions.

    Arrays are (n_layers, num_blocks, block_size, n_kv_heads, head_dim) float32, allocated
    zeroed (pages are only touched when written, so an oversized pool costs address space,
    not memory).
    """

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int = 16) -> None:
        for field, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequest(f"{field} must be a positive integer, got {value!r}",
                                     field=field)
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (spec.n_layers, num_blocks, block_size, spec.n_kv_heads, spec.head_dim)
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)
        self.bytes_per_block = block_size * spec.kv_bytes_per_token()


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together: `rows` (B, n) index the step's token rows, `table`
    (B, blocks) the pool blocks their keys are gathered from, `visible` / `visible_local`
    (B, n, S) the causal masks for global and sliding-window layers."""

    rows: np.ndarray
    table: np.ndarray
    visible: np.ndarray
    visible_local: np.ndarray


@dataclass(frozen=True)
class StepPlan:
    """A validated step laid out as flat arrays over its T tokens."""

    token_ids: np.ndarray  # (T,)
    positions: np.ndarray  # (T,)
    slot_blocks: np.ndarray  # (T,) pool block each token's K/V is written to
    slot_offsets: np.ndarray  # (T,) position within that block
    groups: tuple[AttentionGroup, ...]
    logit_rows: np.ndarray  # rows of the last token of each item that wants logits

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def _check_item(item: object, index: int, spec: ModelSpec, kv: KVPool) -> tuple[int, int]:
    """Validate one item's shape (not its token values); return (start, end)."""
    if not isinstance(item, StepItem):
        raise InvalidRequest(f"items[{index}] is a {type(item).__name__}, not a StepItem",
                             field="items")
    start, n = item.start, len(item.tokens)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise InvalidRequest(f"items[{index}].start must be an integer >= 0, got {start!r}",
                             field="start")
    if n == 0:
        raise InvalidRequest(f"items[{index}] has no tokens to advance", field="tokens")
    end = start + n
    if end > spec.context_length:
        raise ContextLengthExceeded(
            f"items[{index}] reaches position {end}, past the model's context length "
            f"{spec.context_length}",
            field="tokens",
        )
    needed = -(-end // kv.block_size)
    if len(item.blocks) < needed:
        raise InvalidRequest(
            f"items[{index}] covers positions up to {end - 1} and needs {needed} blocks of "
            f"{kv.block_size}, but its block table has {len(item.blocks)}",
            field="blocks",
        )
    return start, end


def _int_array(values: Sequence[int], what: str, field: str, low: int, high: int) -> np.ndarray:
    """`values` as int64, each in [low, high), or InvalidRequest naming `what`."""
    try:
        array = np.asarray(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise InvalidRequest(f"{what} must all be integers", field=field) from None
    if array.ndim != 1 or any(
        isinstance(v, (bool, float, np.floating, np.bool_)) for v in values
    ):
        raise InvalidRequest(f"{what} must all be integers", field=field)
    if array.size and (array.min() < low or array.max() >= high):
        bad = int(array[(array < low) | (array >= high)][0])
        raise InvalidRequest(f"{what} contain {bad}, outside [{low}, {high})", field=field)
    return array


def _visibility(
    query_pos: np.ndarray, n_keys: int, window: int
) -> tuple[np.ndarray, np.ndarray]:
    """Causal masks (..., n_keys) for queries at `query_pos` (...): all earlier keys, and
    only the last `window` of them (window 0 = no sliding window)."""
    distance = query_pos[..., None] - np.arange(n_keys)
    visible = distance >= 0
    local = visible & (distance < window) if window else visible
    return visible, local


def plan_step(items: Sequence[StepItem], spec: ModelSpec, kv: KVPool) -> StepPlan:
    """Validate `items` against the model and pool and lay the step out for `Transformer`.

    Raises `InvalidRequest` (naming the field) for a malformed item, a token id outside the
    vocabulary, a block table too short or naming blocks outside the pool, or two items
    writing the same slot; `ContextLengthExceeded` past the context length.
    """
    if kv.spec.n_layers != spec.n_layers or kv.k.shape[3:] != (spec.n_kv_heads, spec.head_dim):
        raise InvalidRequest("the KV pool was made for a different model", field="kv")
    if len(items) == 0:
        raise InvalidRequest("a step needs at least one item", field="items")
    spans = [_check_item(item, i, spec, kv) for i, item in enumerate(items)]
    lengths = np.array([end - start for start, end in spans], dtype=np.int64)
    starts = np.array([start for start, _ in spans], dtype=np.int64)
    first_rows = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    n_tokens = int(lengths.sum())
    token_ids = _int_array(
        [t for item in items for t in item.tokens], "token ids", "tokens", 0, spec.vocab_size
    )
    blocks_needed = -(-(starts + lengths) // kv.block_size)
    table = np.zeros((len(items), int(blocks_needed.max())), dtype=np.int64)
    for i, item in enumerate(items):
        table[i, : blocks_needed[i]] = _int_array(
            item.blocks[: blocks_needed[i]], f"items[{i}].blocks", "blocks", 0, kv.num_blocks
        )

    item_of_row = np.repeat(np.arange(len(items)), lengths)
    positions = np.arange(n_tokens) - first_rows[item_of_row] + starts[item_of_row]
    slot_blocks = table[item_of_row, positions // kv.block_size]
    slot_offsets = positions % kv.block_size
    slots = slot_blocks * kv.block_size + slot_offsets
    if np.unique(slots).size != n_tokens:
        raise InvalidRequest("two items of one step write the same KV slot", field="blocks")

    window = spec.sliding_window
    groups = []
    decode = np.flatnonzero(lengths == 1)
    if decode.size:
        n_blocks = int(blocks_needed[decode].max())
        visible, local = _visibility(starts[decode][:, None], n_blocks * kv.block_size, window)
        groups.append(AttentionGroup(first_rows[decode][:, None], table[decode, :n_blocks],
                                     visible, local))
    for i in np.flatnonzero(lengths > 1):
        rows = first_rows[i] + np.arange(lengths[i])
        visible, local = _visibility(positions[rows][None], blocks_needed[i] * kv.block_size,
                                     window)
        groups.append(AttentionGroup(rows[None], table[i : i + 1, : blocks_needed[i]],
                                     visible, local))

    want = np.array([item.want_logits for item in items], dtype=bool)
    return StepPlan(
        token_ids=token_ids,
        positions=positions,
        slot_blocks=slot_blocks,
        slot_offsets=slot_offsets,
        groups=tuple(groups),
        logit_rows=(first_rows + lengths - 1)[want],
    )


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (Gemma's +1 is in the GGUF)."""
    mean_square = np.einsum("...i,...i->...", x, x)[..., None] / np.float32(x.shape[-1])
    return x * (1.0 / np.sqrt(mean_square + np.float32(eps))) * weight


def silu(x: np.ndarray) -> np.ndarray:
    # sigmoid via tanh: no overflow warnings for large |x|.
    return x * (np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * x)))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    inner = np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))


class Transformer:
    """The math of one architecture: token ids + KV in, hidden states and logits out."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights) -> None:
        self.spec = spec
        self.weights = weights
        is_gemma3 = spec.arch == "gemma3"
        self.inv_freq = inverse_frequencies(spec.rope_base, spec.rope_dim,
                                            weights.rope_freq_factors)
        self.inv_freq_local = (
            inverse_frequencies(spec.rope_base_local, spec.rope_dim)
            if spec.sliding_window else self.inv_freq
        )
        # Gemma scales the embedding by sqrt(d_model); its query_pre_attn_scalar is head_dim
        # for every release llama.cpp runs, so all three scale queries by 1/sqrt(head_dim).
        self.embed_scale = np.float32(math.sqrt(spec.d_model)) if is_gemma3 else np.float32(1)
        self.query_scale = np.float32(1.0 / math.sqrt(spec.head_dim))
        self.activation: Callable[[np.ndarray], np.ndarray] = gelu_tanh if is_gemma3 else silu

    def hidden_states(self, plan: StepPlan, kv: KVPool) -> np.ndarray:
        """Run every layer over the step's tokens, writing their K/V into `kv`; return the
        residual stream after the last layer, (T, d_model), before the output norm."""
        x = np.ascontiguousarray(self.weights.token_embd[:, plan.token_ids].T)
        x *= self.embed_scale
        rope_global = rotation(plan.positions, self.inv_freq)
        rope_local = (
            rotation(plan.positions, self.inv_freq_local) if self.spec.sliding_window
            else rope_global
        )
        for index, layer in enumerate(self.weights.layers):
            sliding = self.spec.is_sliding(index)
            x = self._layer(x, layer, index, sliding, rope_local if sliding else rope_global,
                            plan, kv)
        return x

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Output norm and projection of hidden rows (n, d_model) -> (n, vocab) float32."""
        normed = rms_norm(hidden, self.weights.output_norm, self.spec.rms_eps)
        return normed @ self.weights.output

    def _layer(
        self,
        x: np.ndarray,
        layer: LayerWeights,
        index: int,
        sliding: bool,
        rope: tuple[np.ndarray, np.ndarray],
        plan: StepPlan,
        kv: KVPool,
    ) -> np.ndarray:
        spec = self.spec
        n_tokens = plan.n_tokens
        q_dim, kv_dim, head_dim = spec.q_dim, spec.kv_dim, spec.head_dim

        qkv = rms_norm(x, layer.attn_norm, spec.rms_eps) @ layer.qkv
        if layer.qkv_bias is not None:
            qkv += layer.qkv_bias
        q = qkv[:, :q_dim].reshape(n_tokens, spec.n_heads, head_dim)
        k = qkv[:, q_dim : q_dim + kv_dim].reshape(n_tokens, spec.n_kv_heads, head_dim)
        v = qkv[:, q_dim + kv_dim :].reshape(n_tokens, spec.n_kv_heads, head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, spec.rms_eps)
        if layer.k_norm is not None:
            k = rms_norm(k, layer.k_norm, spec.rms_eps)
        apply_rope(q, *rope, spec.rope_neox)
        apply_rope(k, *rope, spec.rope_neox)
        q *= self.query_scale

        keys, values = kv.k[index], kv.v[index]
        keys[plan.slot_blocks, plan.slot_offsets] = k
        values[plan.slot_blocks, plan.slot_offsets] = v
        attn = np.empty((n_tokens, q_dim), dtype=np.float32)
        for group in plan.groups:
            batch = group.table.shape[0]
            gathered_k = keys[group.table].reshape(batch, -1, spec.n_kv_heads, head_dim)
            gathered_v = values[group.table].reshape(batch, -1, spec.n_kv_heads, head_dim)
            mask = group.visible_local if sliding else group.visible
            attn[group.rows.ravel()] = attend(q[group.rows], gathered_k, gathered_v,
                                              mask).reshape(-1, q_dim)

        attn_out = attn @ layer.attn_out
        if layer.post_attn_norm is not None:
            attn_out = rms_norm(attn_out, layer.post_attn_norm, spec.rms_eps)
        x = x + attn_out

        gate_up = rms_norm(x, layer.ffn_norm, spec.rms_eps) @ layer.gate_up
        ffn_out = (self.activation(gate_up[:, : spec.ffn_dim]) * gate_up[:, spec.ffn_dim :]) \
            @ layer.down
        if layer.post_ffn_norm is not None:
            ffn_out = rms_norm(ffn_out, layer.post_ffn_norm, spec.rms_eps)
        return x + ffn_out
