"""A decoding step's transformer blocks as one compiled call.

In a step of single tokens (every sequence decoding, no more rows than the direct product
takes) the weight products are small, and each numpy operation and kernel call made from
Python between them costs microseconds; a block makes a few dozen (measured, SmolLM2-135M one
stream: a token 11.9 ms with the numpy block, 10.5 ms with a compiled call a block), and a
call a block still costs its Python and its dispatch, and lets the kernel threads wait
between blocks. `DecodeLayers` runs every block of such a step in one compiled call, with the
pieces `Transformer._layer` uses, in its order: the same norm (`rms_norm_rows`), the same
products (`product_in_call`: the kernels `QuantizedMatrix.apply` runs, shared with the kernel
threads in the same way), RoPE (`rotate_pairs`), KV writes, attention (`attend_decode`) and
the gate (`gate_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from actors.model.arch import ModelSpec
from actors.model.attention import attend_decode
from actors.model.elementwise import ACTIVATION_CODES, gate_rows, rms_norm_rows
from actors.model.quantized import QuantizedMatrix, run_kernel_calls
from actors.model.quantized_kernels import product_in_call
from actors.model.rope import rotate_pairs
from actors.model.step import StepPlan
from actors.model.weights import LayerWeights, Matrix

if TYPE_CHECKING:
    from actors.model.forward import AttentionGroup, KVPool, StepBuffers

# The norms table's rows (DecodeLayers): ones where a model has no such norm.
ATTN_NORM, FFN_NORM, POST_ATTN_NORM, POST_FFN_NORM = range(4)
# post_norms bits: which of the post norms the model has.
HAS_POST_ATTN, HAS_POST_FFN = 1, 2


@njit(inline="always")
def _norm_rows(x, norms, row, eps, out):
    """out = rms_norm(x) by norms[row], for x and out (T, width) C-order."""
    rms_norm_rows(x.reshape((1, x.shape[0], x.shape[1])), norms[row : row + 1], eps,
                   out.reshape((1, out.shape[0], out.shape[1])))


@njit(inline="always")
def _product(call, number, chunks, data, tables, entry, x, out):
    """Product `entry` of the step (layer * 4 + matrix) through the kernels: call number
    `number + entry` in chunks[entry] chunks (see product_in_call). tables holds every
    matrix's run_rows arrays end to end: parts, rows, features, and each entry's starts."""
    parts, rows, features, starts = tables
    return product_in_call(call, number + entry, chunks[entry], data,
                           parts[starts[entry, 0] : starts[entry + 1, 0]],
                           rows[starts[entry, 1] : starts[entry + 1, 1]],
                           features[starts[entry, 2] : starts[entry + 1, 2]], x, out)


@njit(nogil=True, cache=True)
def decode_blocks(x, norms, post_norms, qk_norms, qkv_biases, sliding, data, tables, call,
                  first, chunks, ropes, keys, values, slot_blocks, slot_offsets, spans,
                  seq_rows, normed, qkv, qk, q, attn, projected, gate_up, gated, eps,
                  query_scale, activation):  # pragma: no cover - compiled
    """Every block of a step of T single-token rows, updating the residual x (T, d_model).

    Per layer l: norms[l] (the rows named above), post_norms[l] (bits), qk_norms[l] (q and k
    heads, head_dim; no rows where the model has none), qkv_biases[l] (none: no items),
    sliding[l] (whether it attends within the window: ropes[1] and spans[1], else ropes[0]
    and spans[0]; a span is (block table, bias of each sequence's one query)). Its matrices
    0-3 (qkv, attn_out, gate_up, down) are the products l * 4 + i of `tables` over `data`
    (_product), call first + l * 4 + i of the published calls. keys, values: the pool (layers
    first). The rest is what Transformer._layer reads (module doc); qk (T, q and k heads,
    head_dim) and q (T, heads, head_dim) are scratch. Returns the reads spent waiting for the
    kernel threads."""
    n_rows, n_qk, head_dim = qk.shape
    n_heads = q.shape[1]
    qk_width = n_qk * head_dim
    kv_heads = n_qk - n_heads
    reads = 0
    for layer in range(norms.shape[0]):
        layer_norms, entry = norms[layer], 4 * layer
        window = 1 if sliding[layer] else 0
        table, bias = spans[window]
        layer_keys, layer_values = keys[layer], values[layer]
        _norm_rows(x, layer_norms, ATTN_NORM, eps, normed)
        reads += _product(call, first, chunks, data, tables, entry, normed, qkv)
        if qkv_biases.shape[1]:
            for t in range(n_rows):
                qkv[t] += qkv_biases[layer]
        for t in range(n_rows):
            for h in range(n_qk):
                qk[t, h] = qkv[t, h * head_dim : (h + 1) * head_dim]
        if qk_norms.shape[1]:
            rms_norm_rows(qk, qk_norms[layer], eps, qk)
        rotate_pairs(qk, ropes[window])
        for t in range(n_rows):
            block, offset = slot_blocks[t], slot_offsets[t]
            for h in range(n_heads):
                for i in range(head_dim):
                    q[t, h, i] = qk[t, h, i] * query_scale
            for h in range(kv_heads):
                layer_keys[block, offset, h] = qk[t, n_heads + h]
                layer_values[block, offset, h] = qkv[t, qk_width + h * head_dim :
                                                     qk_width + (h + 1) * head_dim]
        attend_decode(q, layer_keys, layer_values, table, bias, seq_rows, attn)
        reads += _product(call, first, chunks, data, tables, entry + 1, attn, projected)
        if post_norms[layer] & HAS_POST_ATTN:
            _norm_rows(projected, layer_norms, POST_ATTN_NORM, eps, projected)
        x += projected
        _norm_rows(x, layer_norms, FFN_NORM, eps, normed)
        reads += _product(call, first, chunks, data, tables, entry + 2, normed, gate_up)
        gate_rows(gate_up, activation, gated)
        reads += _product(call, first, chunks, data, tables, entry + 3, gated, projected)
        if post_norms[layer] & HAS_POST_FFN:
            _norm_rows(projected, layer_norms, POST_FFN_NORM, eps, projected)
        x += projected
    return reads


def _step_matrices(layers: Sequence[LayerWeights]) -> list[Matrix]:
    """Every layer's matrices in the order a step multiplies them: qkv, attn_out, gate_up,
    down, layer after layer."""
    return [matrix for layer in layers
            for matrix in (layer.qkv, layer.attn_out, layer.gate_up, layer.down)]


class DecodeLayers:
    """The compiled blocks (decode_blocks) for a model whose layers' matrices are all
    quantized and lie in one buffer (a model's mapped file: the kernels run them), and the
    steps they serve. Every layer's arrays are stacked, layers first."""

    def __init__(self, spec: ModelSpec, layers: Sequence[LayerWeights],
                 qk_norms: Sequence[np.ndarray | None]) -> None:
        self.activation = ACTIVATION_CODES[spec.activation]
        self.eps = np.float32(spec.rms_eps)
        self.query_scale = np.float32(spec.query_scale)
        ones = np.ones(spec.d_model, dtype=np.float32)
        self.norms = np.stack([
            np.stack([layer.attn_norm, layer.ffn_norm,
                      ones if layer.post_attn_norm is None else layer.post_attn_norm,
                      ones if layer.post_ffn_norm is None else layer.post_ffn_norm])
            for layer in layers]).astype(np.float32)
        self.post_norms = np.array(
            [(HAS_POST_ATTN if layer.post_attn_norm is not None else 0)
             | (HAS_POST_FFN if layer.post_ffn_norm is not None else 0) for layer in layers],
            dtype=np.int64)
        self.qk_norms = np.ascontiguousarray(
            np.stack(qk_norms) if all(norm is not None for norm in qk_norms)
            else np.zeros((len(layers), 0, spec.head_dim)), dtype=np.float32)
        # A layer without biases adds zeros where another layer has some.
        width = spec.q_dim + 2 * spec.kv_dim
        biased = any(layer.qkv_bias is not None for layer in layers)
        self.qkv_biases = np.ascontiguousarray(
            [np.zeros(width) if layer.qkv_bias is None else layer.qkv_bias for layer in layers]
            if biased else np.zeros((len(layers), 0)), dtype=np.float32)
        self.sliding = np.array([spec.is_sliding(index) for index in range(len(layers))])
        self.matrices: tuple[QuantizedMatrix, ...] = tuple(  # type: ignore[arg-type]
            _step_matrices(layers))
        # Each product's output features and weights, in the step's order.
        self.features = np.array([matrix.out_features for matrix in self.matrices])
        self.weights = self.features * np.array([matrix.in_features for matrix in self.matrices])
        self.data = self.matrices[0].buffer
        arrays = [matrix.kernel_arrays[1:] for matrix in self.matrices]
        starts = np.zeros((len(arrays) + 1, 3), dtype=np.int64)
        starts[1:] = np.cumsum([[len(array) for array in entry] for entry in arrays], axis=0)
        self.tables = (*(np.ascontiguousarray(np.concatenate(column)) for column in zip(*arrays)),
                       starts)

    @classmethod
    def of(cls, spec: ModelSpec, layers: Sequence[LayerWeights],
           qk_norms: Sequence[np.ndarray | None]) -> DecodeLayers | None:
        """The compiled blocks for these layers; None where a matrix is not quantized, the
        matrices do not all lie in one buffer (weights built in memory, not read from one
        file: one buffer is what lets a single call reach every layer's blocks), or only some
        layers norm their queries and keys."""
        matrices = _step_matrices(layers)
        if not all(isinstance(matrix, QuantizedMatrix) for matrix in matrices):
            return None
        buffers = {(matrix.buffer.ctypes.data, matrix.buffer.size)  # type: ignore[union-attr]
                   for matrix in matrices}
        if len(buffers) != 1:
            return None
        if len({norm is None for norm in qk_norms}) != 1:
            return None
        return cls(spec, layers, qk_norms)

    def serves(self, plan: StepPlan, groups: Sequence[AttentionGroup]) -> bool:
        """Whether the step is single tokens only, few enough for the direct product."""
        return (len(groups) == 1 and groups[0].single_queries
                and groups[0].rows.shape[0] == plan.n_tokens
                and all(plan.n_tokens <= matrix.direct_rows_limit for matrix in self.matrices))

    def run(self, x: np.ndarray, ropes: tuple[np.ndarray, np.ndarray],
            spans: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
            plan: StepPlan, group: AttentionGroup, kv: KVPool, buffers: StepBuffers,
            scratch: tuple[np.ndarray, np.ndarray]) -> None:
        """Every block over the step's rows (what Transformer._layer does), x in place. ropes
        and spans: the global layers' and the sliding layers' rotations and keys (a span:
        the block table, and the bias of each sequence's one query)."""

        def run(call: np.ndarray, first: int, chunks: np.ndarray) -> int:
            return decode_blocks(
                x, self.norms, self.post_norms, self.qk_norms, self.qkv_biases, self.sliding,
                self.data, self.tables, call, first, chunks, ropes, kv.k, kv.v,
                plan.slot_blocks, plan.slot_offsets, spans, group.rows[:, 0], buffers.normed,
                buffers.qkv, scratch[0], scratch[1], buffers.attn, buffers.projected,
                buffers.gate_up, buffers.gated, self.eps, self.query_scale, self.activation)

        run_kernel_calls(self.features, plan.n_tokens * self.weights, run)
