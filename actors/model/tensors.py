"""The tensors a model's forward pass reads, under one set of names for every architecture.

A file's own tensors, except where an architecture stores them otherwise:
- Phi-3 fuses q | k | v into `attn_qkv` and gate | up into `ffn_up`. Each part is a range of
  whole rows, i.e. a contiguous span of the file, so it is presented as a tensor of its own
  (`attn_q`, `attn_k`, `attn_v`, `ffn_gate`, `ffn_up`): no copy, and every backend runs the
  one code path it runs for llama.
- RoPE's per-frequency factors (`rope_freqs.weight`) are presented as the global layers apply
  them: Llama 3's factors from the file times the linear scaling factor (Gemma 3 from 4B), so
  both backends divide the frequencies by one table. Sliding layers are unscaled.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

from actors.errors import ModelFormatError
from actors.model.arch import ModelSpec
from actors.model.gguf.quants import dequantize
from actors.model.gguf.reader import GGUFFile, TensorInfo

ROPE_FACTORS = "rope_freqs.weight"
F32_GGML_TYPE = 0


class ModelTensors:
    """Tensor infos and raw bytes by name, as `GGUFFile` gives them (`tensors`, `tensor`,
    `raw`, iteration), with fused matrices split and RoPE's factors folded (module doc)."""

    def __init__(self, gguf: GGUFFile, spec: ModelSpec) -> None:
        self.gguf = gguf
        self.path: Path = gguf.path
        self.tensors: dict[str, TensorInfo] = dict(gguf.tensors)
        self._derived: dict[str, np.ndarray] = {}
        for layer in range(spec.n_layers):
            prefix = f"blk.{layer}."
            if spec.fused_qkv:
                parts = ((prefix + "attn_q", spec.q_dim), (prefix + "attn_k", spec.kv_dim),
                         (prefix + "attn_v", spec.kv_dim))
                self._split(prefix + "attn_qkv.weight", [(f"{name}.weight", rows)
                                                         for name, rows in parts])
                if prefix + "attn_qkv.bias" in self.tensors:
                    self._split(prefix + "attn_qkv.bias", [(f"{name}.bias", rows)
                                                           for name, rows in parts])
            if spec.fused_gate_up:
                self._split(prefix + "ffn_up.weight", [(prefix + "ffn_gate.weight", spec.ffn_dim),
                                                       (prefix + "ffn_up.weight", spec.ffn_dim)])
        self._fold_rope_scaling(spec)

    def _split(self, name: str, parts: list[tuple[str, int]]) -> None:
        """Replace the fused tensor `name` by its parts, each a range of its rows (a vector's
        elements), in order."""
        fused = self.tensor(name)
        rows = sum(part_rows for _, part_rows in parts)
        if fused.shape[0] != rows:
            raise ModelFormatError(
                f"{self.path}: fused tensor {name!r} has {fused.shape[0]} rows; the model's "
                f"metadata gives {rows} ({' + '.join(str(r) for _, r in parts)})"
            )
        del self.tensors[name]
        if len(fused.shape) == 1:  # a bias: elements of one row are not separable bytes
            values = dequantize(self.gguf.raw_of(fused), fused.type_name, fused.shape)
            first = 0
            for part, part_rows in parts:
                self._add_derived(part, values[first : first + part_rows])
                first += part_rows
            return
        row_bytes = fused.row_bytes
        first = 0
        for part, part_rows in parts:
            self.tensors[part] = replace(
                fused, name=part, shape=(part_rows, *fused.shape[1:]),
                offset=fused.offset + first * row_bytes, n_bytes=part_rows * row_bytes,
            )
            first += part_rows

    def _fold_rope_scaling(self, spec: ModelSpec) -> None:
        if spec.rope_linear_factor == 1.0:
            return
        half = spec.rope_dim // 2
        factors = (
            dequantize(self.raw(ROPE_FACTORS), self.tensor(ROPE_FACTORS).type_name, (half,))
            .astype(np.float64) if ROPE_FACTORS in self.tensors else np.ones(half)
        )
        self._add_derived(ROPE_FACTORS, factors * spec.rope_linear_factor)

    def _add_derived(self, name: str, values: np.ndarray) -> None:
        data = np.ascontiguousarray(values, dtype=np.float32)
        self._derived[name] = data
        self.tensors[name] = TensorInfo(name=name, type_name="F32", ggml_type=F32_GGML_TYPE,
                                        shape=data.shape, offset=-1, n_bytes=data.nbytes)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.path}: missing tensor {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, shape `(*shape[:-1], row_bytes)` (see `GGUFFile.raw`)."""
        derived = self._derived.get(name)
        if derived is not None:
            return derived.view(np.uint8)
        return self.gguf.raw_of(self.tensor(name))

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())
