"""The forward pass of llama, qwen2 and gemma3 in numpy, stepping many sequences at once.

One step (a `StepPlan`, see actors.model.step) advances any mix of sequences (whole
prompts, prefill chunks, single decode tokens). All tokens of all items go through the big
matmuls together as one (T, d_model) matrix; only attention is per sequence, over keys
gathered from the sequence's own blocks of a shared `KVPool`. Single-token (decode) items
are attended together in one padded batch so 64 streams cost a few array ops per layer, not
64.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from actors.errors import InvalidRequest
from actors.model.arch import ModelSpec
from actors.model.attention import attend, attend_decode, key_span
from actors.model.decode_layer import DecodeLayers
from actors.model.elementwise import ACTIVATION_CODES, gate_rows, rms_norm
from actors.model.rope import apply_rope, inverse_frequencies, rotation
from actors.model.step import StepPlan
from actors.model.weights import ModelWeights

# Queries of one sequence attended at a time (see attention_groups).
QUERY_CHUNK = 128


class KVPool:
    """Keys and values of every layer for `num_blocks` blocks of `block_size` positions.

    Arrays are (n_layers, num_blocks, block_size, n_kv_heads, head_dim) float32, zeroed pages
    of their own anonymous mapping: only pages written become resident, so an oversized pool
    costs address space, not memory. (numpy would ask the kernel for transparent huge pages
    for arrays this big: then a sequence's first position would make 2 MB of every layer's
    keys and values resident, 72 MB for gemma-3-270m.)
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
        self.k = _zeroed_mapping(shape)
        self.v = _zeroed_mapping(shape)
        self.bytes_per_block = block_size * spec.kv_bytes_per_token()


def _zeroed_mapping(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array of `shape` in a fresh anonymous mapping (zeros, resident once written).

    A mapping the kernel refuses is a MemoryError, as numpy's own allocation would be."""
    size = math.prod(shape) * 4
    try:
        mapping = mmap.mmap(-1, size)
    except OSError as exc:
        raise MemoryError(f"cannot map {size:,} bytes: {exc.strerror}") from None
    return np.frombuffer(mapping, dtype=np.float32).reshape(shape)


@dataclass(frozen=True)
class KeySpan:
    """Where a group's keys come from: `table` (B, blocks) pool blocks to gather, `bias`
    (B, n, blocks * block_size) 0 where a query may attend to the key, -inf elsewhere."""

    table: np.ndarray
    bias: np.ndarray


@dataclass(frozen=True)
class AttentionGroup:
    """Queries attended together: `rows` (B, n) index the step's token rows; `keys` serves
    global layers, `local_keys` sliding-window layers (only the blocks inside the window)."""

    rows: np.ndarray
    keys: KeySpan
    local_keys: KeySpan

    @property
    def single_queries(self) -> bool:
        """Whether each sequence has one query here (the decoding sequences' group): these
        are attended straight from the pool's blocks (`attend_decode`), not gathered."""
        return self.rows.shape[1] == 1


def _key_span(
    tables: np.ndarray, query_pos: np.ndarray, block_size: int, window: int
) -> KeySpan:
    """The keys B sequences' queries at `query_pos` (B, n) may see, from their block `tables`
    (B, >= blocks needed). With a window, blocks wholly before it are left out."""
    return KeySpan(*key_span(np.ascontiguousarray(tables), np.ascontiguousarray(query_pos),
                             block_size, window))


def _attention_group(
    rows: np.ndarray, tables: np.ndarray, query_pos: np.ndarray, block_size: int, window: int
) -> AttentionGroup:
    keys = _key_span(tables, query_pos, block_size, 0)
    local_keys = _key_span(tables, query_pos, block_size, window) if window else keys
    return AttentionGroup(rows, keys, local_keys)


def attention_groups(plan: StepPlan, window: int) -> tuple[AttentionGroup, ...]:
    """The CPU's attention batches for a step: single-token (decode) items all together in
    one padded group; longer items in query chunks of QUERY_CHUNK, each attending to the keys
    up to its own last position (that skips most of the causal mask's upper triangle and
    bounds the score arrays)."""
    block_size = plan.block_size
    groups = []
    decode = np.flatnonzero(plan.lengths == 1)
    if decode.size:
        groups.append(_attention_group(plan.first_rows[decode][:, None],
                                       plan.block_tables[decode],
                                       plan.starts[decode][:, None], block_size, window))
    for i in np.flatnonzero(plan.lengths > 1):
        for first in range(0, plan.lengths[i], QUERY_CHUNK):
            rows = plan.first_rows[i] + np.arange(first, min(first + QUERY_CHUNK,
                                                             plan.lengths[i]))
            groups.append(_attention_group(rows[None], plan.block_tables[i : i + 1],
                                           plan.positions[rows][None], block_size, window))
    return tuple(groups)


@dataclass(frozen=True)
class StepBuffers:
    """The per-layer arrays of one step, allocated once and reused by every layer: fresh
    multi-MB arrays per layer are mapped and unmapped by malloc each time, and their page
    faults cost a 512-token prefill more than 100 ms."""

    normed: np.ndarray  # (T, d_model) a norm's output, the input of a matmul
    qkv: np.ndarray  # (T, q_dim + 2 * kv_dim)
    attn: np.ndarray  # (T, q_dim)
    projected: np.ndarray  # (T, d_model) attention or FFN output before the residual add
    gate_up: np.ndarray  # (T, 2 * ffn_dim)
    gated: np.ndarray  # (T, ffn_dim)
    gathered: tuple[np.ndarray, ...]  # attention group g's gathered keys and values

    @classmethod
    def for_step(
        cls, spec: ModelSpec, plan: StepPlan, groups: Sequence[AttentionGroup]
    ) -> StepBuffers:
        n = plan.n_tokens
        block_elements = plan.block_size * spec.kv_dim

        def empty(*shape: int) -> np.ndarray:
            return np.empty(shape, dtype=np.float32)

        return cls(
            normed=empty(n, spec.d_model),
            qkv=empty(n, spec.q_dim + 2 * spec.kv_dim),
            attn=empty(n, spec.q_dim),
            projected=empty(n, spec.d_model),
            gate_up=empty(n, 2 * spec.ffn_dim),
            gated=empty(n, spec.ffn_dim),
            gathered=tuple(empty(0 if group.single_queries
                                 else 2 * group.keys.table.size * block_elements)
                           for group in groups),
        )


class Transformer:
    """The math of one architecture: token ids + KV in, hidden states and logits out.

    Each weight product runs over all T rows of a step at once (`Matrix.apply`: OpenBLAS or
    the quantized kernels, threaded over the cores); the numpy work between them is vectorized
    over rows, heads and attention groups.
    """

    def __init__(self, spec: ModelSpec, weights: ModelWeights) -> None:
        self.spec = spec
        self.weights = weights
        self.inv_freq = inverse_frequencies(spec.rope_base, spec.rope_dim,
                                            weights.rope_freq_factors)
        self.inv_freq_local = (
            inverse_frequencies(spec.rope_base_local, spec.rope_dim)
            if spec.sliding_window else self.inv_freq
        )
        self.embed_scale = np.float32(spec.embedding_scale)
        self.query_scale = np.float32(spec.query_scale)
        self.activation = ACTIVATION_CODES[spec.activation]
        # q and k sit side by side in the fused qkv output: one per-head weight table lets a
        # single norm call (and a single RoPE call) cover both.
        self.qk_norms = tuple(
            np.concatenate([np.tile(layer.q_norm, (spec.n_heads, 1)),
                            np.tile(layer.k_norm, (spec.n_kv_heads, 1))])
            if layer.q_norm is not None and layer.k_norm is not None else None
            for layer in weights.layers
        )
        self.decode_layers = DecodeLayers.of(spec, weights.layers, self.qk_norms)

    def hidden_states(self, plan: StepPlan, kv: KVPool) -> np.ndarray:
        """Run every layer over the step's tokens, writing their K/V into `kv`; return the
        residual stream after the last layer, (T, d_model), before the output norm."""
        x = self.weights.token_embd.lookup(plan.token_ids)
        x *= self.embed_scale
        rope_global = rotation(plan.positions, self.inv_freq)
        rope_local = (
            rotation(plan.positions, self.inv_freq_local) if self.spec.sliding_window
            else rope_global
        )
        groups = attention_groups(plan, self.spec.sliding_window)
        buffers = StepBuffers.for_step(self.spec, plan, groups)
        if self.decode_layers is not None and self.decode_layers.serves(plan, groups):
            self._decode_layers(x, self.decode_layers, rope_local, rope_global, plan, groups[0],
                                kv, buffers)
            return x
        for index in range(self.spec.n_layers):
            sliding = self.spec.is_sliding(index)
            self._layer(x, index, rope_local if sliding else rope_global, sliding, plan,
                        groups, kv, buffers)
        return x

    def _decode_layers(self, x: np.ndarray, layers: DecodeLayers, rope_local: np.ndarray,
                       rope_global: np.ndarray, plan: StepPlan, group: AttentionGroup,
                       kv: KVPool, buffers: StepBuffers) -> None:
        """Every layer of a step of single tokens, in one compiled call."""
        spec = self.spec
        qk = np.empty((plan.n_tokens, spec.n_heads + spec.n_kv_heads, spec.head_dim),
                      dtype=np.float32)
        q = np.empty((plan.n_tokens, spec.n_heads, spec.head_dim), dtype=np.float32)
        rope = np.ascontiguousarray(rope_global[:, 0])
        ropes = (rope, rope if rope_local is rope_global
                 else np.ascontiguousarray(rope_local[:, 0]))
        spans = ((group.keys.table, group.keys.bias[:, 0]),
                 (group.local_keys.table, group.local_keys.bias[:, 0]))
        layers.run(x, ropes, spans, plan, group, kv, buffers, (qk, q))

    def logits(self, hidden: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Output norm and projection of hidden rows (n, d_model) -> (n, vocab) float32, into
        `out` where given (C order, that shape)."""
        normed = rms_norm(hidden, self.weights.output_norm, self.spec.rms_eps)
        if out is None:
            out = np.empty((len(hidden), self.spec.vocab_size), dtype=np.float32)
        return self.weights.output.apply(normed, out)

    def _layer(
        self,
        x: np.ndarray,
        index: int,
        rope: np.ndarray,
        sliding: bool,
        plan: StepPlan,
        groups: Sequence[AttentionGroup],
        kv: KVPool,
        buffers: StepBuffers,
    ) -> None:
        """One transformer block, updating the residual stream x (T, d_model) in place."""
        spec, layer, eps = self.spec, self.weights.layers[index], self.spec.rms_eps
        n_tokens, q_dim, kv_dim = plan.n_tokens, spec.q_dim, spec.kv_dim
        n_qk_heads = spec.n_heads + spec.n_kv_heads

        qkv = layer.qkv.apply(rms_norm(x, layer.attn_norm, eps, out=buffers.normed),
                              buffers.qkv)
        if layer.qkv_bias is not None:
            qkv += layer.qkv_bias
        qk = qkv[:, : q_dim + kv_dim].reshape(n_tokens, n_qk_heads, spec.head_dim)
        v = qkv[:, q_dim + kv_dim :].reshape(n_tokens, spec.n_kv_heads, spec.head_dim)
        qk_norm = self.qk_norms[index]
        if qk_norm is not None:
            rms_norm(qk, qk_norm, eps, out=qk)
        apply_rope(qk, rope)
        q, k = qk[:, : spec.n_heads], qk[:, spec.n_heads :]
        q *= self.query_scale

        keys, values = kv.k[index], kv.v[index]
        keys[plan.slot_blocks, plan.slot_offsets] = k
        values[plan.slot_blocks, plan.slot_offsets] = v
        attn = buffers.attn
        for group, buffer in zip(groups, buffers.gathered):
            span = group.local_keys if sliding else group.keys
            if group.single_queries:
                # q's rows as one C-order block: the kernel's loops over head_dim vectorize.
                attend_decode(np.ascontiguousarray(q), keys, values, span.table,
                              span.bias[:, 0], group.rows[:, 0], attn)
                continue
            gathered = buffer[: 2 * span.table.size * kv.block_size * kv_dim].reshape(
                2, *span.table.shape, kv.block_size, spec.n_kv_heads, spec.head_dim
            )
            # mode="clip" lets take write straight into `out` (block ids are validated).
            np.take(keys, span.table, axis=0, out=gathered[0], mode="clip")
            np.take(values, span.table, axis=0, out=gathered[1], mode="clip")
            shape = (len(span.table), -1, spec.n_kv_heads, spec.head_dim)
            attn[group.rows.ravel()] = attend(
                q[group.rows], gathered[0].reshape(shape), gathered[1].reshape(shape), span.bias
            ).reshape(-1, q_dim)

        attn_out = layer.attn_out.apply(attn, buffers.projected)
        if layer.post_attn_norm is not None:
            rms_norm(attn_out, layer.post_attn_norm, eps, out=attn_out)
        x += attn_out

        gate_up = layer.gate_up.apply(rms_norm(x, layer.ffn_norm, eps, out=buffers.normed),
                                      buffers.gate_up)
        gated = buffers.gated
        gate_rows(gate_up, self.activation, gated)
        ffn_out = layer.down.apply(gated, buffers.projected)
        if layer.post_ffn_norm is not None:
            rms_norm(ffn_out, layer.post_ffn_norm, eps, out=ffn_out)
        x += ffn_out
