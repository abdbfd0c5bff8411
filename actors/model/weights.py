"""Loading a model's weights, as the CPU forward reads them: each matrix either dequantized
exactly to float32 (`load_weights`, the reference path) or kept as the file's quantized blocks
(`load_quantized_weights`, actors.model.quantized). Both give `Matrix` objects with the same
two operations, so the forward is one code path.

float32 matrices are stored (in_features, out_features), C-contiguous, because OpenBLAS runs
`x @ W` on that layout as fast as or faster than the GGUF row layout at every batch size we
step (measured on the 2-core target). q/k/v and gate/up are fused into one matrix each so a
layer pays three big products instead of six. Each q and k head's features (and their bias and
norm weights) are in RoPE `pair_order`, so the forward rotates them with one complex multiply.
The token embedding is held once: it is the output projection when the output is tied, and
`lookup` reads its rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from actors.errors import ModelFormatError
from actors.model.arch import ModelSpec
from actors.model.gguf.quants import dequantize
from actors.model.quantized import QuantizedMatrix, kernel_supports, part_of_blocks
from actors.model.rope import pair_order
from actors.model.tensors import ModelTensors

# Rows dequantized at a time: bounds the temporary of the 262144-row embedding to ~40 MB.
DEQUANT_CHUNK_ROWS = 16384


class Matrix(Protocol):
    """A weight matrix W (out_features, in_features), however it is stored."""

    in_features: int
    out_features: int

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        ...

    def apply(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = x @ W.T: x (n, in_features) float32 into out (n, out_features), C order."""
        ...

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """W[ids], float32 (len(ids), in_features): rows of the token embedding."""
        ...


class DenseMatrix:
    """W as float32, stored transposed: (in_features, out_features), C order."""

    def __init__(self, transposed: np.ndarray) -> None:
        self.transposed = transposed
        self.in_features, self.out_features = transposed.shape

    @property
    def nbytes(self) -> int:
        return self.transposed.nbytes

    def apply(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        return np.matmul(x, self.transposed, out=out)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        # take along axis 1 copies a 512-token prompt's columns 2.4x faster than fancy indexing.
        return np.ascontiguousarray(np.take(self.transposed, ids, axis=1).T)


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block. Optional parts are None where the architecture lacks them."""

    attn_norm: np.ndarray  # (d_model,)
    qkv: Matrix  # (q_dim + 2 * kv_dim, d_model), q and k heads in RoPE pair order
    qkv_bias: np.ndarray | None  # (q_dim + 2 * kv_dim,) qwen2, same order
    q_norm: np.ndarray | None  # (head_dim,) gemma3, RoPE pair order
    k_norm: np.ndarray | None  # (head_dim,) gemma3, RoPE pair order
    attn_out: Matrix  # (d_model, q_dim)
    post_attn_norm: np.ndarray | None  # (d_model,) gemma3
    ffn_norm: np.ndarray  # (d_model,)
    gate_up: Matrix  # (2 * ffn_dim, d_model)
    down: Matrix  # (d_model, ffn_dim)
    post_ffn_norm: np.ndarray | None  # (d_model,) gemma3


@dataclass(frozen=True)
class ModelWeights:
    """All weights of a model: the matrices float32 or quantized, the vectors float32."""

    token_embd: Matrix  # (vocab, d_model)
    output: Matrix  # (vocab, d_model); the same object as token_embd when tied
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
        """Bytes held, counting the tied embedding once."""
        held: list[Matrix | np.ndarray] = [self.token_embd, self.output_norm]
        if not self.tied_output:
            held.append(self.output)
        if self.rope_freq_factors is not None:
            held.append(self.rope_freq_factors)
        for layer in self.layers:
            held.extend(part for part in vars(layer).values() if part is not None)
        return sum(part.nbytes for part in held)


# One matrix's source: the (rows, cols) tensors stacked as its output features, each with its
# rows in the given order (None: as stored).
MatrixParts = list[tuple[str, int, np.ndarray | None]]


class _Reader:
    """Reads named tensors of a model, checking their shapes against the spec: vectors as
    float32, matrices through `matrix` (float32 here, quantized in the subclass)."""

    def __init__(self, tensors: ModelTensors) -> None:
        self.tensors = tensors

    def has(self, name: str) -> bool:
        return name in self.tensors

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        shape = self.tensors.tensor(name).shape
        if shape != expected:
            raise ModelFormatError(
                f"{self.tensors.path}: tensor {name!r} has shape {shape}, expected {expected} "
                "from the model's metadata"
            )

    def vector(self, name: str, length: int) -> np.ndarray:
        self.check_shape(name, (length,))
        info = self.tensors.tensor(name)
        return np.ascontiguousarray(dequantize(self.tensors.raw(name), info.type_name, info.shape))

    def optional_vector(self, name: str, length: int) -> np.ndarray | None:
        return self.vector(name, length) if self.has(name) else None

    def matrix(self, parts: MatrixParts, cols: int) -> Matrix:
        """The tensors of `parts` stacked as one matrix of `cols` input features."""
        return self.dense(parts, cols)

    def dense(self, parts: MatrixParts, cols: int) -> DenseMatrix:
        out = np.empty((cols, sum(rows for _, rows, _ in parts)), dtype=np.float32)
        first = 0
        for name, rows, order in parts:
            self._transposed_into(name, out[:, first : first + rows], order)
            first += rows
        return DenseMatrix(out)

    def _transposed_into(
        self, name: str, out: np.ndarray, row_order: np.ndarray | None = None
    ) -> None:
        """Write the (rows, cols) tensor `name`, its rows taken in `row_order` if given,
        transposed into `out` of shape (cols, rows), a chunk of rows at a time so no
        full-size temporary exists."""
        cols, rows = out.shape
        self.check_shape(name, (rows, cols))
        info = self.tensors.tensor(name)
        raw = self.tensors.raw(name)
        if row_order is not None:
            raw = raw[row_order]
        for first in range(0, rows, DEQUANT_CHUNK_ROWS):
            last = min(first + DEQUANT_CHUNK_ROWS, rows)
            out[:, first:last] = dequantize(raw[first:last], info.type_name, (last - first, cols)).T


class _QuantizedReader(_Reader):
    """Matrices as the file's blocks (`QuantizedMatrix`), where the kernels run their type
    and width; float32 otherwise."""

    def matrix(self, parts: MatrixParts, cols: int) -> Matrix:
        infos = [self.tensors.tensor(name) for name, _, _ in parts]
        if not all(kernel_supports(info.type_name, cols) for info in infos):
            return self.dense(parts, cols)
        quantized_parts = []
        first = 0
        for (name, rows, order), info in zip(parts, infos):
            self.check_shape(name, (rows, cols))
            quantized_parts.append(part_of_blocks(info.type_name, self.tensors.raw(name),
                                                  first, order))
            first += rows
        return QuantizedMatrix(quantized_parts, cols)


def _load_layer(read: _Reader, spec: ModelSpec, index: int) -> LayerWeights:
    prefix = f"blk.{index}."
    d, q_dim, kv_dim, ffn = spec.d_model, spec.q_dim, spec.kv_dim, spec.ffn_dim
    qkv_rows = [(prefix + "attn_q.weight", q_dim), (prefix + "attn_k.weight", kv_dim),
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
            for name, (_, rows), order in zip(bias_names, qkv_rows, qkv_orders)
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
        qkv=read.matrix([(name, rows, order) for (name, rows), order
                         in zip(qkv_rows, qkv_orders)], d),
        qkv_bias=qkv_bias,
        q_norm=None if q_norm is None else q_norm[head_order],
        k_norm=None if k_norm is None else k_norm[head_order],
        attn_out=read.matrix([(prefix + "attn_output.weight", d, None)], q_dim),
        post_attn_norm=post_attn_norm,
        ffn_norm=read.vector(prefix + "ffn_norm.weight", d),
        gate_up=read.matrix([(prefix + "ffn_gate.weight", ffn, None),
                             (prefix + "ffn_up.weight", ffn, None)], d),
        down=read.matrix([(prefix + "ffn_down.weight", d, None)], ffn),
        post_ffn_norm=post_ffn_norm,
    )


def _load(
    read: _Reader,
    spec: ModelSpec,
    progress: Callable[[int, int], None] | None,
) -> ModelWeights:
    """Read every weight of a model, one tensor at a time; `progress(done, total)` after each
    layer (the embedding counts as one step)."""
    total = spec.n_layers + 1
    token_embd = read.matrix([("token_embd.weight", spec.vocab_size, None)], spec.d_model)
    output = (
        token_embd if spec.tied_output
        else read.matrix([("output.weight", spec.vocab_size, None)], spec.d_model)
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


def load_weights(
    tensors: ModelTensors,
    spec: ModelSpec,
    progress: Callable[[int, int], None] | None = None,
) -> ModelWeights:
    """Dequantize every weight of a model's `tensors` to float32, one tensor at a time.

    `progress(done, total)` is called after each layer (the embedding counts as one step).
    Raises `ModelFormatError` for a missing tensor or one whose shape contradicts `spec`.
    """
    return _load(_Reader(tensors), spec, progress)


def load_quantized_weights(
    tensors: ModelTensors,
    spec: ModelSpec,
    progress: Callable[[int, int], None] | None = None,
) -> ModelWeights:
    """Every matrix of a model's `tensors` as its quantized blocks, read in place from the
    mapped file (float32 where the kernels do not run its type or width); vectors float32.
    `progress` and errors as `load_weights`."""
    return _load(_QuantizedReader(tensors), spec, progress)
