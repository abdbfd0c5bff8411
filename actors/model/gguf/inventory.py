"""What a GGUF model file holds, in figures: the report of `q4k inspect`, as pure functions the
loader (e.g. the `quant_mix` of `model_loaded`) can reuse."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from actors.errors import ModelFormatError
from actors.model.arch import ModelSpec, architecture_features, spec_from_gguf
from actors.model.gguf.reader import GGUFFile
from actors.model.gguf.string_array import StringArray

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class TypeShare:
    """How many tensors of one type a file holds, and their bytes in the file."""

    count: int
    n_bytes: int


def type_mix(gguf: GGUFFile) -> dict[str, TypeShare]:
    """Tensor count and bytes per tensor type, largest share first."""
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for info in gguf:
        counts[info.type_name] = counts.get(info.type_name, 0) + 1
        sizes[info.type_name] = sizes.get(info.type_name, 0) + info.n_bytes
    order = sorted(counts, key=lambda name: (-sizes[name], name))
    return {name: TypeShare(counts[name], sizes[name]) for name in order}


def parameter_count(gguf: GGUFFile) -> int:
    """Elements over all tensors."""
    return sum(info.n_elements for info in gguf)


def weight_bytes(gguf: GGUFFile) -> int:
    """Bytes of tensor data in the file, as stored (quantized)."""
    return sum(info.n_bytes for info in gguf)


@dataclass(frozen=True)
class Inventory:
    """The figures `q4k inspect` reports for one file."""

    path: str
    file_bytes: int
    gguf_version: int
    tensor_count: int
    metadata_count: int
    name: str | None
    spec: ModelSpec
    tokenizer_model: str | None
    tokenizer_pre: str | None
    tokenizer_vocab_size: int | None
    has_chat_template: bool
    tensor_types: dict[str, TypeShare]
    parameter_count: int
    weight_bytes: int

    @property
    def weight_bytes_f32(self) -> int:
        """Memory of every weight dequantized to float32."""
        return self.parameter_count * FLOAT32_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one position over all layers, in a float32 cache."""
        return self.spec.kv_bytes_per_token(FLOAT32_BYTES)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with stable snake_case keys."""
        hyperparameters = dataclasses.asdict(self.spec)
        del hyperparameters["arch"]
        return {
            "path": self.path,
            "file_bytes": self.file_bytes,
            "gguf_version": self.gguf_version,
            "tensor_count": self.tensor_count,
            "metadata_count": self.metadata_count,
            "name": self.name,
            "architecture": self.spec.arch,
            "hyperparameters": hyperparameters,
            "context_length": self.spec.context_length,
            "features": architecture_features(self.spec),
            "tokenizer": {
                "model": self.tokenizer_model,
                "pre": self.tokenizer_pre,
                "vocab_size": self.tokenizer_vocab_size,
            },
            "chat_template": self.has_chat_template,
            "tensor_types": {
                name: {"count": share.count, "bytes": share.n_bytes}
                for name, share in self.tensor_types.items()
            },
            "parameter_count": self.parameter_count,
            "weight_bytes": self.weight_bytes,
            "weight_bytes_f32": self.weight_bytes_f32,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }


def _optional_text(gguf: GGUFFile, key: str) -> str | None:
    value = gguf.metadata.get(key)
    if value is not None and not isinstance(value, str):
        raise ModelFormatError(f"{gguf.path}: metadata {key!r} should be a string, not {value!r}")
    return value


def _vocab_size(gguf: GGUFFile) -> int | None:
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    if not isinstance(tokens, StringArray | list):
        raise ModelFormatError(
            f"{gguf.path}: metadata 'tokenizer.ggml.tokens' should be an array of strings"
        )
    return len(tokens)


def inventory(gguf: GGUFFile) -> Inventory:
    """Take stock of an open file. Raises what `spec_from_gguf` raises for a model we cannot
    describe (`UnsupportedModelError`, `ModelFormatError`)."""
    return Inventory(
        path=str(gguf.path),
        file_bytes=gguf.file_size,
        gguf_version=gguf.version,
        tensor_count=len(gguf.tensors),
        metadata_count=len(gguf.metadata),
        name=_optional_text(gguf, "general.name"),
        spec=spec_from_gguf(gguf),
        tokenizer_model=_optional_text(gguf, "tokenizer.ggml.model"),
        tokenizer_pre=_optional_text(gguf, "tokenizer.ggml.pre"),
        tokenizer_vocab_size=_vocab_size(gguf),
        has_chat_template=bool(_optional_text(gguf, "tokenizer.chat_template")),
        tensor_types=type_mix(gguf),
        parameter_count=parameter_count(gguf),
        weight_bytes=weight_bytes(gguf),
    )
