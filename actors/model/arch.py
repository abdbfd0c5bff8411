"""Architectures: the hyperparameters of a model, read from GGUF metadata alone."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from actors.errors import ModelFormatError, UnsupportedModelError
from actors.model.gguf.reader import GGUFFile
from actors.model.gguf.string_array import StringArray

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "phi3")

# Architectures whose RoPE rotates the two halves of a head (llama.cpp's LLAMA_ROPE_TYPE_NEOX);
# llama's weights are permuted at conversion for the adjacent-pairs layout instead.
NEOX_ROPE_ARCHS = ("qwen2", "qwen3", "gemma3", "phi3")

# Gemma 3 alternates five sliding-window layers with one global layer unless the file says
# otherwise (`attention.sliding_window_pattern`); sliding layers use their own RoPE base
# (`rope.freq_base_swa`, 10000 where absent, as llama.cpp's `rope_freq_base_train_swa`).
GEMMA3_DEFAULT_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Gemma 3 27B (62 layers) scales queries by 1/sqrt(d_model / n_heads), the others by
# 1/sqrt(head_dim) (Gemma's `query_pre_attn_scalar`; llama.cpp picks it by layer count too).
GEMMA3_27B_LAYERS = 62

# The RoPE scaling llama.cpp assumes where a file names none but gives a factor.
DEFAULT_ROPE_SCALING = "linear"
# Tensors of Phi-3's LongRoPE (per-frequency factors for short and long contexts).
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")

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
    # NORM: rotate adjacent pairs (llama); NEOX: rotate the two halves (qwen2/3, gemma3, phi3).
    rope_neox: bool
    # Linear RoPE scaling of the global layers: positions divided by this factor.
    rope_linear_factor: float = 1.0
    # Gemma 3 only; 0 = no sliding window. sliding_layers[i]: layer i is a sliding layer.
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    rope_base_local: float = 0.0
    # Architecture quirks, so every backend reads them from one place.
    embedding_scale: float = 1.0  # Gemma multiplies the embedding by sqrt(d_model)
    activation: str = "silu"  # the FFN gate: "silu" or "gelu_tanh" (Gemma)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Gemma 3)
    post_norms: bool = False  # RMSNorm of the attention and FFN outputs (Gemma 3)
    qkv_bias: bool = False  # q, k and v projections have biases (Qwen2)
    tied_output: bool = True  # the output projection is the token embedding
    # The file fuses q|k|v into attn_qkv and gate|up into ffn_up (Phi-3); the model's tensors
    # present them split (actors.model.tensors), so only `q4k inspect` reads these.
    fused_qkv: bool = False
    fused_gate_up: bool = False
    rope_freqs: bool = False  # the file holds Llama 3's per-frequency factors (rope_freqs)
    # Queries are scaled by 1/sqrt(query_pre_attn_scalar); 0 means head_dim.
    query_pre_attn_scalar: float = 0.0

    @property
    def query_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        """True where a layer attends only to the last `sliding_window` positions."""
        return self.sliding_window > 0 and self.sliding_layers[layer]

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
    if isinstance(tokens, StringArray | list) and len(tokens) != vocab_size:
        raise ModelFormatError(
            f"{path}: the tokenizer has {len(tokens)} tokens (tokenizer.ggml.tokens) but "
            f"token_embd.weight has {vocab_size} rows; they must be equal"
        )


def rope_linear_factor(gguf: GGUFFile, arch: str) -> float:
    """The linear RoPE scaling factor of the global layers (1.0 = unscaled), read as llama.cpp
    reads it: `rope.scaling.factor` (or the older `rope.scale_linear`), the type `linear`
    where the file names none. Scaling this engine does not run (YaRN, LongRoPE, an attention
    factor) raises `UnsupportedModelError` naming it, rather than running wrong positions."""
    meta, path = gguf.metadata, gguf.path
    kind = meta.get(f"{arch}.rope.scaling.type", DEFAULT_ROPE_SCALING)
    if not isinstance(kind, str):
        raise ModelFormatError(f"{path}: metadata '{arch}.rope.scaling.type' is not a string")
    longrope = [name for name in LONGROPE_TENSORS if name in gguf.tensors]
    if kind == "longrope" or longrope:
        raise UnsupportedModelError(
            f"{path}: RoPE scaling 'longrope' (Phi-3's LongRoPE{', tensors ' if longrope else ''}"
            f"{', '.join(longrope)}) is not supported; the 4k-context Phi-3 files run"
        )
    factor_key = next((key for key in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear")
                       if key in meta), None)
    factor = 1.0 if factor_key is None else _float(meta, factor_key, path, 1.0)
    attn_factor = _float(meta, f"{arch}.rope.scaling.attn_factor", path, 1.0)
    if kind == "none" or (factor == 1.0 and attn_factor == 1.0):
        return 1.0
    if kind != "linear":
        raise UnsupportedModelError(
            f"{path}: RoPE scaling {kind!r} (factor {factor:g}) is not supported; linear "
            "scaling and Llama 3's rope_freqs are"
        )
    if attn_factor != 1.0:
        raise UnsupportedModelError(
            f"{path}: a RoPE attention factor ({arch}.rope.scaling.attn_factor = "
            f"{attn_factor:g}) is not supported"
        )
    return factor


def _gemma3_sliding_layers(meta: dict[str, Any], path: object, n_layers: int) -> tuple[bool, ...]:
    """Which layers slide, from `gemma3.attention.sliding_window_pattern` as llama.cpp reads
    it: a list of booleans (one a layer), or a period n (layer i slides unless i % n is n - 1;
    0: every layer), 6 where absent."""
    key = "gemma3.attention.sliding_window_pattern"
    pattern = meta.get(key, GEMMA3_DEFAULT_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != n_layers or not all(isinstance(flag, bool) for flag in pattern):
            raise ModelFormatError(
                f"{path}: metadata {key!r} is a list but not {n_layers} booleans (one a layer)"
            )
        return tuple(pattern)
    period = _int(meta, key, path, 0, MAX_LAYERS, GEMMA3_DEFAULT_PATTERN)
    return tuple(period == 0 or layer % period < period - 1 for layer in range(n_layers))


def _refuse_logit_softcapping(meta: dict[str, Any], path: object, arch: str) -> None:
    """Gemma 2's final-logit soft-capping; llama.cpp reads it for Gemma 3 too, where no
    released model sets it. Refused rather than ignored."""
    cap = meta.get(f"{arch}.final_logit_softcapping", 0.0)
    if cap not in (0, 0.0, None):
        raise UnsupportedModelError(
            f"{path}: final logit soft-capping ({arch}.final_logit_softcapping = {cap!r}) is "
            "not supported"
        )


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
    linear_factor = rope_linear_factor(gguf, arch)
    _refuse_logit_softcapping(meta, path, arch)
    declared_vocab = _int(meta, f"{arch}.vocab_size", path, 1, 1 << 31, vocab_size)
    if declared_vocab != vocab_size:
        raise ModelFormatError(
            f"{path}: {arch}.vocab_size = {declared_vocab} but token_embd.weight has "
            f"{vocab_size} rows"
        )
    is_gemma3 = arch == "gemma3"
    has = gguf.tensors.__contains__
    n_layers = _int(meta, f"{arch}.block_count", path, 1, MAX_LAYERS)
    # Phi-3's sliding-window key is ignored, as llama.cpp ignores it (its window is off).
    sliding_window = (
        _int(meta, "gemma3.attention.sliding_window", path, 1, MAX_CONTEXT) if is_gemma3 else 0
    )
    return ModelSpec(
        arch=arch,
        n_layers=n_layers,
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
        rope_neox=arch in NEOX_ROPE_ARCHS,
        rope_linear_factor=linear_factor,
        sliding_window=sliding_window,
        sliding_layers=(
            _gemma3_sliding_layers(meta, path, n_layers) if sliding_window else ()
        ),
        rope_base_local=(
            _float(meta, "gemma3.rope.freq_base_swa", path, GEMMA3_LOCAL_ROPE_BASE)
            if sliding_window else 0.0
        ),
        embedding_scale=math.sqrt(d_model) if is_gemma3 else 1.0,
        activation="gelu_tanh" if is_gemma3 else "silu",
        qk_norm=has("blk.0.attn_q_norm.weight") or has("blk.0.attn_k_norm.weight"),
        post_norms=has("blk.0.post_attention_norm.weight") or has("blk.0.post_ffw_norm.weight"),
        qkv_bias=any(has(f"blk.0.attn_{part}.bias") for part in ("q", "k", "v", "qkv")),
        tied_output=not has("output.weight"),
        rope_freqs=has("rope_freqs.weight"),
        fused_qkv=has("blk.0.attn_qkv.weight"),
        fused_gate_up=arch == "phi3" and not has("blk.0.ffn_gate.weight"),
        query_pre_attn_scalar=(
            d_model / n_heads if is_gemma3 and n_layers == GEMMA3_27B_LAYERS else 0.0
        ),
    )


def architecture_features(spec: ModelSpec) -> list[str]:
    """What sets this model apart from a plain llama, in words (`q4k inspect` lists them)."""
    rope = f"RoPE {'neox (halves)' if spec.rope_neox else 'norm (adjacent pairs)'}, base " \
           f"{_number(spec.rope_base)}"
    if spec.rope_dim < spec.head_dim:
        rope += f", {spec.rope_dim} of {spec.head_dim} dims"
    features = [rope]
    if spec.rope_freqs:
        features.append("Llama 3 per-frequency RoPE factors (rope_freqs)")
    if spec.rope_linear_factor != 1.0:
        scope = "global layers" if spec.sliding_window else "every layer"
        features.append(f"linear RoPE scaling x{spec.rope_linear_factor:g} on the {scope}")
    if spec.sliding_window:
        sliding = sum(spec.sliding_layers)
        features.append(
            f"sliding window of {spec.sliding_window:,} tokens on {sliding} of {spec.n_layers} "
            f"layers (RoPE base {_number(spec.rope_base_local)} there"
            f"{', unscaled' if spec.rope_linear_factor != 1.0 else ''})"
        )
    flags = (
        (spec.qkv_bias, "q/k/v biases"),
        (spec.qk_norm, "per-head q/k RMSNorm"),
        (spec.post_norms, "post-attention and post-FFN norms"),
        (spec.fused_qkv, "fused attn_qkv (split at load)"),
        (spec.fused_gate_up, "fused gate+up in ffn_up (split at load)"),
        (spec.embedding_scale != 1.0, f"embedding scaled by {spec.embedding_scale:g}"),
        (spec.tied_output, "output tied to the token embedding"),
    )
    features.extend(text for present, text in flags if present)
    features.append(f"FFN {'GELU (tanh)' if spec.activation == 'gelu_tanh' else 'SiLU'}-gated")
    features.append(f"queries scaled by 1/sqrt({spec.query_pre_attn_scalar or spec.head_dim:g})")
    return features


def _number(value: float) -> str:
    return f"{value:,.0f}" if value.is_integer() else f"{value:g}"
