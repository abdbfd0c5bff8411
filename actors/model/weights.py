"""Loading a model's weights: dequantized exactly to float32 and laid out for `x @ W`.

Every matrix is stored (in_features, out_features), C-contiguous, because OpenBLAS runs
`x @ W` on that layout as fast as or faster than the GGUF row layout at every batch size we
step (measured on the 2-core target). q/k/v and gate/up are fused into one matrix each so a
layer pays three big matmuls instead of six. Each q and k head's features (and their bias and
norm weights) are stored in RoPE `pair_order`, so the forward rotates them with one complex
multiply. The token embedding is stored once, as
(d_model, vocab): it is the output projection when the output is tied, and the lookup reads
its columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from actors.errors import ModelFormatError
from actors.model.arch import ModelSpec
from actors.model.gguf.quants import dequantize
from actors.model.rope import pair_order
from actors.model.tensors import ModelTensors

# Rows dequantized at a time: bounds the temporary of the 262144-row embedding to ~40 MB.
DEQUANT_CHUNK_ROWS = 16384


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block. Optional parts are None where the architecture lacks them."""

    attn_norm: np.ndarray  # (d_model,)
    qkv: np.ndarray  # (d_model, q_dim + 2 * kv_dim), q and k heads in RoPE pair order
    qkv_bias: np.ndarray | None  # (q_dim + 2 * kv_dim,) qwen2, same order
    q_norm: np.ndarray | None  # (head_dim,) gemma3, RoPE pair order
    k_norm: np.ndarray | None  # (head_dim,) gemma3, RoPE pair order
    attn_out: np.ndarray  # (q_dim, d_model)
    post_attn_norm: np.ndarray | None  # (d_model,) gemma3
    ffn_norm: np.ndarray  # (d_model,)
    gate_up: np.ndarray  # (d_model, 2 * ffn_dim)
    down: np.ndarray  # (ffn_dim, d_model)
    post_ffn_norm: np.ndarray | None  # (d_model,) gemma3


@dataclass(frozen=True)
class ModelWeights:
    """All weights of a model, float32."""

    token_embd: np.ndarray  # (d_model, vocab): column t is token t's embedding
    output: np.ndarray  # (d_model, vocab); the same array as token_embd when tied
    output_norm: np.ndarray  # (d_model,)
    layers: tuple[LayerWeights, ...]
    # (rope_dim // 2,) divides the global layers' RoPE frequencies (Llama 3's factors times
    # any linear scaling: actors.model.tensors)
    rope_freq_factors: np.ndarray | None

    @property
    def tied_output(self) -> bool:
        return self.output is self.token_embd

    @property
    def n_bytes(self) -> int:
        """Bytes of float32 held, counting the tied embedding once."""
        arrays = [self.token_embd, self.output_norm]
        if not self.tied_output:
            arrays.append(self.output)
        if self.rope_freq_factors is not None:
            arrays.append(self.rope_freq_factors)
        for layer in self.layers:
            arrays.extend(a for a in vars(layer).values() if a is not None)
        return sum(a.nbytes for a in arrays)


class _Reader:
    """Reads named tensors of a model into float32, checking their shapes against the spec."""

    def __init__(self, tensors: ModelTensors) -> None:
        self.tensors = tensors

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        shape = self.tensors.tensor(name).shape
        if shape != expected:
            raise ModelFormatError(
                f"{self.tensors.path}: tensor {name!r} has shape {shape}, expected {expected} "
                "from the model's metadata"
            )

    def vector(self, name: str, length: int) -> np.ndarray:
        self._check_shape(name, (length,))
        info = self.tensors.tensor(name)
        return np.ascontiguousarray(dequantize(self.tensors.raw(name), info.type_name, info.shape))

    def optional_vector(self, name: str, length: int) -> np.ndarray | None:
        return self.vector(name, length) if self.has(name) else None

    def transposed_into(
        self, name: str, out: np.ndarray, row_order: np.ndarray | None = None
    ) -> None:
        """Write the (rows, cols) tensor `name`, its rows taken in `row_order` if given,
        transposed into `out` of shape (cols, rows), a chunk of rows at a time so no
        full-size temporary exists."""
        cols, rows = out.shape
        self._check_shape(name, (rows, cols))
        info = self.tensors.tensor(name)
        raw = self.tensors.raw(name)
        if row_order is not None:
            raw = raw[row_order]
        for first in range(0, rows, DEQUANT_CHUNK_ROWS):
            last = min(first + DEQUANT_CHUNK_ROWS, rows)
            out[:, first:last] = dequantize(raw[first:last], info.type_name, (last - first, cols)).T

    def matrix(self, name: str, rows: int, cols: int) -> np.ndarray:
        """The (rows, cols) GGUF matrix as a contiguous (cols, rows) array for `x @ W`."""
        out = np.empty((cols, rows), dtype=np.float32)
        self.transposed_into(name, out)
        return out

    def fused(
        self, parts: list[tuple[str, int]], cols: int,
        row_orders: tuple[np.ndarray, ...] | None = None,
    ) -> np.ndarray:
        """Several (rows_i, cols) matrices side by side as one (cols, sum rows_i) array, the
        rows of part i taken in `row_orders[i]` if given."""
        out = np.empty((cols, sum(rows for _, rows in parts)), dtype=np.float32)
        orders = row_orders if row_orders is not None else (None,) * len(parts)
        first = 0
        for (name, rows), order in zip(parts, orders):
            self.transposed_into(name, out[:, first : first + rows], order)
            first += rows
        return out


def _load_layer(read: _Reader, spec: ModelSpec, index: int) -> LayerWeights:
    prefix = f"blk.{index}."
    d, q_dim, kv_dim, ffn = spec.d_model, spec.q_dim, spec.kv_dim, spec.ffn_dim
    qkv_parts = [(prefix + "attn_q.weight", q_dim), (prefix + "attn_k.weight", kv_dim),
                 (prefix + "attn_v.weight", kv_dim)]
    bias_names = [prefix + "attn_q.bias", prefix + "attn_k.bias", prefix + "attn_v.bias"]
    head_order = pair_order(spec.head_dim, spec.rope_dim, spec.rope_neox)
    q_order, k_order = (
        (np.arange(heads)[:, None] * spec.head_dim + head_order).ravel()
        for heads in (spec.n_heads, spec.n_kv_heads)
    )
    qkv_orders = (q_order, k_order, np.arange(kv_dim))
    qkv_bias = None
    if spec.qkv_bias:
        qkv_bias = np.concatenate([
            read.vector(name, rows)[order]
            for name, (_, rows), order in zip(bias_names, qkv_parts, qkv_orders)
        ])
    q_norm, k_norm = (
        read.vector(prefix + name, spec.head_dim) if spec.qk_norm else None
        for name in ("attn_q_norm.weight", "attn_k_norm.weight")
    )
    post_attn_norm, post_ffn_norm = (
        read.vector(prefix + name, d) if spec.post_norms else None
        for name in ("post_attention_norm.weight", "post_ffw_norm.weight")
    )
    return LayerWeights(
        attn_norm=read.vector(prefix + "attn_norm.weight", d),
        qkv=read.fused(qkv_parts, d, qkv_orders),
        qkv_bias=qkv_bias,
        q_norm=None if q_norm is None else q_norm[head_order],
        k_norm=None if k_norm is None else k_norm[head_order],
        attn_out=read.matrix(prefix + "attn_output.weight", d, q_dim),
        post_attn_norm=post_attn_norm,
        ffn_norm=read.vector(prefix + "ffn_norm.weight", d),
        gate_up=read.fused([(prefix + "ffn_gate.weight", ffn), (prefix + "ffn_up.weight", ffn)], d),
        down=read.matrix(prefix + "ffn_down.weight", d, ffn),
        post_ffn_norm=post_ffn_norm,
    )


def load_weights(
    tensors: ModelTensors,
    spec: ModelSpec,
    progress: Callable[[int, int], None] | None = None,
) -> ModelWeights:
    """Dequantize every weight of a model's `tensors` to float32, one tensor at a time.

    `progress(done, total)` is called after each layer (the embedding counts as one step).
    Raises `ModelFormatError` for a missing tensor or one whose shape contradicts `spec`.
    """
    read = _Reader(tensors)
    total = spec.n_layers + 1
    token_embd = read.matrix("token_embd.weight", spec.vocab_size, spec.d_model)
    output = (
        token_embd if spec.tied_output
        else read.matrix("output.weight", spec.vocab_size, spec.d_model)
    )
    if progress is not None:
        progress(1, total)
    layers = []
    for index in range(spec.n_layers):
        layers.append(_load_layer(read, spec, index))
        if progress is not None:
            progress(index + 2, total)
    return ModelWeights(
        token_embd=token_embd,
        output=output,
        output_norm=read.vector("output_norm.weight", spec.d_model),
        layers=tuple(layers),
        rope_freq_factors=read.optional_vector("rope_freqs.weight", spec.rope_dim // 2),
    )
