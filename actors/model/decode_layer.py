"""A decoding step's transformer block as one compiled call.

In a step of single tokens (every sequence decoding, no more rows than the direct product
takes) the weight products are small, and each numpy operation and kernel call made from
Python between them costs microseconds; a block makes a few dozen (measured, SmolLM2-135M one
stream: a token 11.9 ms with the numpy block, 10.5 ms with this one).
`DecodeLayers` runs such a block in one compiled call instead, with the pieces
`Transformer._layer` uses, in its order: the same norm (`rms_norm_rows`), the same products
(`product_in_call`: the kernels `QuantizedMatrix.apply` runs, shared with the kernel threads
in the same way), RoPE (`rotate_pairs`), KV writes, attention (`attend_decode`) and the gate
(`gate_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
from actors.model.weights import LayerWeights

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


@njit(nogil=True, cache=True)
def decode_layer(x, norms, post_norms, qk_norm, qkv_bias, datas, partss, rowss, featuress,
                 call, first, chunks, rope, keys, values, slot_blocks, slot_offsets, table,
                 bias, seq_rows, normed, qkv, qk, q, attn, projected, gate_up, gated, eps,
                 query_scale, activation):  # pragma: no cover - compiled
    """One block over the step's T single-token rows, updating the residual x (T, d_model).

    Matrices 0-3 (qkv, attn_out, gate_up, down) are run_rows' (data, parts, rows, features)
    in datas, partss, rowss, featuress; product i is call first + i in chunks[i] chunks (0:
    this thread alone). The rest is what Transformer._layer reads (module doc); qk (T, q and
    k heads, head_dim) and q (T, heads, head_dim) are scratch. Returns the reads spent
    waiting for the kernel threads."""
    n_rows, n_qk, head_dim = qk.shape
    n_heads = q.shape[1]
    qk_width = n_qk * head_dim
    kv_heads = n_qk - n_heads
    _norm_rows(x, norms, ATTN_NORM, eps, normed)
    reads = product_in_call(call, first, chunks[0], datas[0], partss[0], rowss[0],
                            featuress[0], normed, qkv)
    if qkv_bias.size:
        for t in range(n_rows):
            qkv[t] += qkv_bias
    for t in range(n_rows):
        for h in range(n_qk):
            qk[t, h] = qkv[t, h * head_dim : (h + 1) * head_dim]
    if qk_norm.shape[0]:
        rms_norm_rows(qk, qk_norm, eps, qk)
    rotate_pairs(qk, rope)
    for t in range(n_rows):
        block, offset = slot_blocks[t], slot_offsets[t]
        for h in range(n_heads):
            for i in range(head_dim):
                q[t, h, i] = qk[t, h, i] * query_scale
        for h in range(kv_heads):
            keys[block, offset, h] = qk[t, n_heads + h]
            values[block, offset, h] = qkv[t, qk_width + h * head_dim :
                                           qk_width + (h + 1) * head_dim]
    attend_decode(q, keys, values, table, bias, seq_rows, attn)
    reads += product_in_call(call, first + 1, chunks[1], datas[1], partss[1], rowss[1],
                             featuress[1], attn, projected)
    if post_norms & HAS_POST_ATTN:
        _norm_rows(projected, norms, POST_ATTN_NORM, eps, projected)
    x += projected
    _norm_rows(x, norms, FFN_NORM, eps, normed)
    reads += product_in_call(call, first + 2, chunks[2], datas[2], partss[2], rowss[2],
                             featuress[2], normed, gate_up)
    gate_rows(gate_up, activation, gated)
    reads += product_in_call(call, first + 3, chunks[3], datas[3], partss[3], rowss[3],
                             featuress[3], gated, projected)
    if post_norms & HAS_POST_FFN:
        _norm_rows(projected, norms, POST_FFN_NORM, eps, projected)
    x += projected
    return reads


@dataclass(frozen=True)
class _Layer:
    """One block's arrays as decode_layer takes them."""

    norms: np.ndarray  # (4, d_model) float32: the rows named above
    post_norms: int
    qk_norm: np.ndarray  # (q and k heads, head_dim), or (0, head_dim)
    qkv_bias: np.ndarray  # (q_dim + 2 * kv_dim,), or (0,)
    matrices: tuple[QuantizedMatrix, ...]  # qkv, attn_out, gate_up, down
    products: tuple[tuple[int, int], ...]  # each matrix's output features and weights
    kernel_arrays: tuple[tuple[np.ndarray, ...], ...]  # datas, partss, rowss, featuress


class DecodeLayers:
    """The compiled block (decode_layer) for a model whose layers' matrices are all quantized
    (the kernels run them), and the steps it serves."""

    def __init__(self, spec: ModelSpec, layers: Sequence[LayerWeights],
                 qk_norms: Sequence[np.ndarray | None]) -> None:
        self.activation = ACTIVATION_CODES[spec.activation]
        self.eps = np.float32(spec.rms_eps)
        self.query_scale = np.float32(spec.query_scale)
        self._layers = tuple(self._layer(spec, layer, qk_norm)
                             for layer, qk_norm in zip(layers, qk_norms))

    @classmethod
    def of(cls, spec: ModelSpec, layers: Sequence[LayerWeights],
           qk_norms: Sequence[np.ndarray | None]) -> DecodeLayers | None:
        """The compiled block for these layers; None where a matrix is not quantized."""
        if not all(isinstance(matrix, QuantizedMatrix)
                   for layer in layers
                   for matrix in (layer.qkv, layer.attn_out, layer.gate_up, layer.down)):
            return None
        return cls(spec, layers, qk_norms)

    @staticmethod
    def _layer(spec: ModelSpec, layer: LayerWeights, qk_norm: np.ndarray | None) -> _Layer:
        ones = np.ones(spec.d_model, dtype=np.float32)
        norms = np.stack([layer.attn_norm, layer.ffn_norm,
                          ones if layer.post_attn_norm is None else layer.post_attn_norm,
                          ones if layer.post_ffn_norm is None else layer.post_ffn_norm]
                         ).astype(np.float32)
        post_norms = ((HAS_POST_ATTN if layer.post_attn_norm is not None else 0)
                      | (HAS_POST_FFN if layer.post_ffn_norm is not None else 0))
        matrices = (layer.qkv, layer.attn_out, layer.gate_up, layer.down)
        arrays = [matrix.kernel_arrays for matrix in matrices]  # type: ignore[union-attr]
        return _Layer(
            norms=np.ascontiguousarray(norms),
            post_norms=post_norms,
            qk_norm=np.ascontiguousarray(
                np.zeros((0, spec.head_dim)) if qk_norm is None else qk_norm, dtype=np.float32),
            qkv_bias=np.ascontiguousarray(
                np.zeros(0) if layer.qkv_bias is None else layer.qkv_bias, dtype=np.float32),
            matrices=matrices,  # type: ignore[arg-type]
            products=tuple((matrix.out_features, matrix.out_features * matrix.in_features)
                           for matrix in matrices),
            kernel_arrays=tuple(tuple(column) for column in zip(*arrays)),
        )

    def serves(self, plan: StepPlan, groups: Sequence[AttentionGroup]) -> bool:
        """Whether the step is single tokens only, few enough for the direct product."""
        return (len(groups) == 1 and groups[0].single_queries
                and groups[0].rows.shape[0] == plan.n_tokens
                and all(plan.n_tokens <= matrix.direct_rows_limit
                        for layer in self._layers for matrix in layer.matrices))

    def run(self, x: np.ndarray, index: int, rope: np.ndarray,
            span: tuple[np.ndarray, np.ndarray], plan: StepPlan, group: AttentionGroup,
            kv: KVPool, buffers: StepBuffers, scratch: tuple[np.ndarray, np.ndarray]) -> None:
        """Block `index` over the step's rows (what Transformer._layer does), x in place;
        `span` the layer's keys (block table, and bias of each sequence's one query)."""
        layer, n_rows = self._layers[index], plan.n_tokens
        datas, partss, rowss, featuress = layer.kernel_arrays
        table, bias = span
        calls = [(features, n_rows * weights) for features, weights in layer.products]

        def run(call: np.ndarray, first: int, chunks: np.ndarray) -> int:
            return decode_layer(
                x, layer.norms, layer.post_norms, layer.qk_norm, layer.qkv_bias, datas, partss,
                rowss, featuress, call, first, chunks, rope, kv.k[index], kv.v[index],
                plan.slot_blocks, plan.slot_offsets, table, bias, group.rows[:, 0],
                buffers.normed, buffers.qkv, scratch[0], scratch[1], buffers.attn,
                buffers.projected, buffers.gate_up, buffers.gated, self.eps, self.query_scale,
                self.activation)

        run_kernel_calls(calls, run)
