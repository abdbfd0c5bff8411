"""Architectures: the hyperparameters of a model, read from GGUF metadata alone."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from actors.errors import ModelFormatError, UnsupportedModelError
from actors.model.gguf.reader import GGUFFile

SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")

# Gemma 3 alternates five sliding-window layers with one global layer; local layers use their
# own RoPE base (llama.cpp: `rope_freq_base_train_swa`, 10000 for every Gemma 3 release).
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0

# Sanity bounds on header claims, far above any real model, so a corrupt value is refused
# before it sizes an allocation.
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 17
MAX_HEADS = 1024
MAX_CONTEXT = 1 << 24


@dataclass(frozen=True)
class ModelSpec:
    """Everything the forward pass needs to know about a model's shape."""

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    context_length: int
    vocab_size: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    # NORM: rotate adjacent pairs (llama); NEOX: rotate the two halves (qwen2, gemma3).
    rope_neox: bool
    # Gemma 3 only; 0 = no sliding window.
    sliding_window: int = 0
    rope_base_local: float = 0.0
    global_every: int = 0
    # Architecture quirks, so every backend reads them from one place.
    embedding_scale: float = 1.0  # Gemma multiplies the embedding by sqrt(d_model)
    activation: str = "silu"  # the FFN gate: "silu" or "gelu_tanh" (Gemma)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Gemma 3)
    post_norms: bool = False  # RMSNorm of the attention and FFN outputs (Gemma 3)
    qkv_bias: bool = False  # q, k and v projections have biases (Qwen2)
    tied_output: bool = True  # the output projection is the token embedding

    @property
    def query_scale(self) -> float:
        """Queries are scaled by 1/sqrt(head_dim) in all three architectures (Gemma 3's
        query_pre_attn_scalar is head_dim in every release llama.cpp runs)."""
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        """True where a layer attends only to the last `sliding_window` positions."""
        return self.sliding_window > 0 and (layer + 1) % self.global_every != 0

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V cache one position takes over all layers."""
        return 2 * self.n_layers * self.kv_dim * dtype_bytes


_REQUIRED = object()


def _int(
    meta: dict[str, Any], key: str, path: object, low: int, high: int, default: Any = _REQUIRED
) -> int:
    if key not in meta and default is _REQUIRED:
        raise ModelFormatError(f"{path}: missing metadata key {key!r}")
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ModelFormatError(f"{path}: metadata {key!r} = {value!r} is not in [{low}, {high}]")
    return value


def _float(meta: dict[str, Any], key: str, path: object, default: float) -> float:
    value = meta.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
        or not math.isfinite(value)
    ):
        raise ModelFormatError(
            f"{path}: metadata {key!r} = {value!r} is not a finite positive number"
        )
    return float(value)


def _check_tokenizer_size(meta: dict[str, Any], path: object, vocab_size: int) -> None:
    """The tokenizer and the embedding must agree on the vocabulary: a token without an
    embedding row would fail inside a step (llama.cpp refuses such files too)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) != vocab_size:
        raise ModelFormatError(
            f"{path}: the tokenizer has {len(tokens)} tokens (tokenizer.ggml.tokens) but "
            f"token_embd.weight has {vocab_size} rows; they must be equal"
        )


def _check_rope_scaling_types(meta: dict[str, Any], path: object, arch: str) -> None:
    """RoPE scaling keys, where present, are a name and a number (the loader refuses any
    scaling it does not run; it must be able to read them first)."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if not isinstance(kind, str):
        raise ModelFormatError(f"{path}: metadata '{arch}.rope.scaling.type' is not a string")
    if f"{arch}.rope.scaling.factor" in meta:
        _float(meta, f"{arch}.rope.scaling.factor", path, 1.0)


def spec_from_gguf(gguf: GGUFFile) -> ModelSpec:
    """Read a ModelSpec from a GGUF file's metadata and tensor shapes.

    Raises `UnsupportedModelError` for an architecture we do not run and `ModelFormatError` for
    missing or absurd hyperparameters.
    """
    meta = gguf.metadata
    path = gguf.path
    arch = gguf.require("general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError(f"{path}: metadata 'general.architecture' is not a string")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHS)})"
        )
    d_model = _int(meta, f"{arch}.embedding_length", path, 1, MAX_WIDTH)
    n_heads = _int(meta, f"{arch}.attention.head_count", path, 1, MAX_HEADS)
    n_kv_heads = _int(meta, f"{arch}.attention.head_count_kv", path, 1, n_heads, n_heads)
    if n_heads % n_kv_heads:
        raise ModelFormatError(
            f"{path}: {n_heads} attention heads do not divide into {n_kv_heads} KV heads"
        )
    if d_model < n_heads and f"{arch}.attention.key_length" not in meta:
        raise ModelFormatError(
            f"{path}: {arch}.embedding_length {d_model} is smaller than the head count "
            f"{n_heads} and no {arch}.attention.key_length gives the head size"
        )
    head_dim = _int(meta, f"{arch}.attention.key_length", path, 1, MAX_WIDTH, d_model // n_heads)
    value_dim = _int(meta, f"{arch}.attention.value_length", path, 1, MAX_WIDTH, head_dim)
    if value_dim != head_dim:
        raise UnsupportedModelError(
            f"{path}: key length {head_dim} differs from value length {value_dim}"
        )
    rope_dim = _int(meta, f"{arch}.rope.dimension_count", path, 2, head_dim, head_dim)
    if rope_dim % 2:
        raise ModelFormatError(
            f"{path}: {arch}.rope.dimension_count = {rope_dim} is odd; RoPE rotates pairs"
        )
    vocab_size = gguf.tensor("token_embd.weight").shape[0]
    _check_tokenizer_size(meta, path, vocab_size)
    _check_rope_scaling_types(meta, path, arch)
    declared_vocab = _int(meta, f"{arch}.vocab_size", path, 1, 1 << 31, vocab_size)
    if declared_vocab != vocab_size:
        raise ModelFormatError(
            f"{path}: {arch}.vocab_size = {declared_vocab} but token_embd.weight has "
            f"{vocab_size} rows"
        )
    is_gemma3 = arch == "gemma3"
    has = gguf.tensors.__contains__
    return ModelSpec(
        arch=arch,
        n_layers=_int(meta, f"{arch}.block_count", path, 1, MAX_LAYERS),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=_int(meta, f"{arch}.feed_forward_length", path, 1, MAX_WIDTH),
        context_length=_int(meta, f"{arch}.context_length", path, 1, MAX_CONTEXT),
        vocab_size=vocab_size,
        rms_eps=_float(meta, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-5),
        rope_base=_float(meta, f"{arch}.rope.freq_base", path, 10000.0),
        rope_dim=rope_dim,
        rope_neox=arch in ("qwen2", "gemma3"),
        sliding_window=(
            _int(meta, "gemma3.attention.sliding_window", path, 1, MAX_CONTEXT) if is_gemma3 else 0
        ),
        rope_base_local=GEMMA3_LOCAL_ROPE_BASE if is_gemma3 else 0.0,
        global_every=GEMMA3_GLOBAL_EVERY if is_gemma3 else 0,
        embedding_scale=math.sqrt(d_model) if is_gemma3 else 1.0,
        activation="gelu_tanh" if is_gemma3 else "silu",
        qk_norm=has("blk.0.attn_q_norm.weight") or has("blk.0.attn_k_norm.weight"),
        post_norms=has("blk.0.post_attention_norm.weight") or has("blk.0.post_ffw_norm.weight"),
        qkv_bias=any(has(f"blk.0.attn_{part}.bias") for part in "qkv"),
        tied_output=not has("output.weight"),
    )
