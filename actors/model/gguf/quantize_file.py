"""Quantize a GGUF model file into a new one, with llama.cpp's per-tensor type recipe.

The recipe follows llama.cpp's `llama_tensor_get_type` (no importance matrix) for the
supported file types:

- Only matrices are quantized. 1-D tensors (norms, biases) and every `*_norm.weight` keep
  their float type (F32 stays F32; a quantized one is written as F32).
- The output projection (`output.weight`, or `token_embd.weight` when the embedding is tied
  and there is no `output.weight`) gets Q6_K, or Q8_0 when its rows are not a multiple of
  256 or the recipe is Q8_0 anyway.
- Q4_K_M: Q4_K, with Q6_K for the attn_v and ffn_down tensors of the layers llama.cpp's
  `use_more_bits` picks (the first and last eighth of the layers and every third one between);
  a fused attn_qkv counts as an attn_v (llama.cpp's "attention-v-like" category).
- Q4_K_S: Q4_K, with Q5_K for the first 4 attn_v tensors and the ffn_down of the first eighth
  of the layers.
- Q6_K and Q8_0: that type for every matrix.
- A row length that is not a multiple of the chosen type's block falls back like llama.cpp:
  Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when even 32 does not divide it.

Tensors whose type does not change are copied byte for byte; the others are dequantized to
float32 (when quantized) and quantized again, in row chunks so memory stays bounded. Metadata
is copied with its GGUF value types; `general.file_type` is set to the recipe's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_VERSION, GGMLQuantizationType, Keys

from actors.errors import InvalidRequest, ModelFormatError, UnsupportedModelError
from actors.model.gguf.quantizers import QUANTIZERS, quantize
from actors.model.gguf.quants import FORMATS, dequantize, row_bytes
from actors.model.gguf.reader import GGUFFile, TensorInfo, open_gguf
from actors.progress import Progress

FILE_TYPES: dict[str, LlamaFileType] = {
    "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M,
    "Q4_K_S": LlamaFileType.MOSTLY_Q4_K_S,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
}
_BASE_TYPE = {"Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K", "Q6_K": "Q6_K", "Q8_0": "Q8_0"}
# llama.cpp's fallback when a row is not a whole number of the chosen type's blocks.
_FALLBACK_TYPE = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_FLOAT_TYPES = ("F32", "F16", "BF16")
# Convert this many elements at a time (dequantized float32 plus the quantizer's temporaries).
CHUNK_ELEMENTS = 1 << 22
# Keys the writer sets itself, or that describe the source's quantization.
_KEYS_NOT_COPIED = {
    Keys.General.ARCHITECTURE,
    Keys.General.FILE_TYPE,
    Keys.General.QUANTIZATION_VERSION,
}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, and every
    third layer in between."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


def _fits(type_name: str, row_length: int) -> bool:
    return row_length % FORMATS[type_name].block_size == 0


def _is_attn_v_like(name: str) -> bool:
    """attn_v, or a fused attn_qkv that holds it: the tensors most sensitive to quantization."""
    return "attn_v.weight" in name or "attn_qkv.weight" in name


def plan_tensor_types(tensors: Sequence[TensorInfo], recipe: str) -> dict[str, str]:
    """The type each tensor gets under `recipe` (see the module docstring), in file order."""
    if recipe not in FILE_TYPES:
        raise InvalidRequest(
            f"unknown quantization type {recipe!r} (choose from {', '.join(FILE_TYPES)})",
            field="type",
        )
    base = _BASE_TYPE[recipe]
    names = [info.name for info in tensors]
    output_name = "output.weight" if "output.weight" in names else "token_embd.weight"
    n_attn_v = sum(_is_attn_v_like(name) for name in names)
    n_ffn_down = sum("ffn_down" in name for name in names)
    i_attn_v = i_ffn_down = 0
    plan: dict[str, str] = {}
    for info in tensors:
        name, row_length = info.name, info.shape[-1]
        if len(info.shape) < 2 or name.endswith("_norm.weight"):
            plan[name] = info.type_name if info.type_name in _FLOAT_TYPES else "F32"
            continue
        target = base
        if name == output_name:
            target = "Q8_0" if base == "Q8_0" or row_length % 256 else "Q6_K"
        elif _is_attn_v_like(name):
            if recipe == "Q4_K_M" and use_more_bits(i_attn_v, n_attn_v):
                target = "Q6_K"
            elif recipe == "Q4_K_S" and i_attn_v < 4:
                target = "Q5_K"
            i_attn_v += 1
        elif "ffn_down" in name:
            if recipe == "Q4_K_M" and use_more_bits(i_ffn_down, n_ffn_down):
                target = "Q6_K"
            elif recipe == "Q4_K_S" and i_ffn_down < n_ffn_down // 8:
                target = "Q5_K"
            i_ffn_down += 1
        if not _fits(target, row_length):
            target = _FALLBACK_TYPE.get(target, "F16")
            if not _fits(target, row_length):
                target = "F16"
        plan[name] = target
    return plan


def _converted_bytes(gguf_file: GGUFFile, info: TensorInfo, target: str) -> np.ndarray:
    """The tensor's data in `target`, as (rows, row_bytes) uint8, converted in row chunks."""
    raw = gguf_file.raw(info.name).reshape(math.prod(info.shape[:-1]), info.row_bytes)
    if target == info.type_name:
        return raw
    row_length = info.shape[-1]
    out = np.empty((raw.shape[0], row_bytes(target, row_length)), dtype=np.uint8)
    step = max(CHUNK_ELEMENTS // max(row_length, 1), 1)
    for start in range(0, raw.shape[0], step):
        rows = raw[start : start + step]
        values = dequantize(rows, info.type_name, (rows.shape[0], row_length))
        try:
            out[start : start + step] = _encode(values, target)
        except InvalidRequest as exc:
            raise ModelFormatError(f"{gguf_file.path}: tensor {info.name!r}: {exc}") from None
    return out


def _encode(values: np.ndarray, target: str) -> np.ndarray:
    if target in QUANTIZERS:
        return quantize(values, target)
    if target == "F32":
        return values.view(np.uint8)
    if target == "F16":
        return values.astype(np.float16).view(np.uint8)
    raise UnsupportedModelError(f"cannot write tensors of type {target}")


def _metadata_fields(
    gguf_file: GGUFFile,
) -> Iterable[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    """(key, value, type, item type) of each metadata entry worth copying."""
    for key, value in gguf_file.metadata.items():
        if key in _KEYS_NOT_COPIED:
            continue
        kind, item_kind = gguf_file.metadata_types[key]
        if item_kind == GGUFValueType.ARRAY:
            raise UnsupportedModelError(f"metadata {key!r} nests arrays, which cannot be copied")
        if kind == GGUFValueType.ARRAY:
            if len(value) == 0:
                continue  # gguf's writer refuses empty arrays; an empty list carries nothing
            value = value.tolist() if isinstance(value, np.ndarray) else value
        yield key, value, kind, item_kind


def _discard(writer: GGUFWriter, partial: Path) -> None:
    """Close and delete an unfinished output file."""
    try:
        writer.close()
    finally:
        partial.unlink(missing_ok=True)


def _tensor_bytes(info: TensorInfo, type_name: str) -> int:
    return math.prod(info.shape[:-1]) * row_bytes(type_name, info.shape[-1])


def _write_gguf(
    gguf_file: GGUFFile,
    writer: GGUFWriter,
    plan: dict[str, str],
    recipe: str,
    show_progress: bool | None,
) -> None:
    """Metadata (with the new file type), tensor table, then each tensor converted in turn.

    Progress counts writing the metadata and tensor table as one more step."""
    tensors = list(gguf_file.tensors.values())
    title = f"quantizing {gguf_file.path.name}"
    with Progress(title, len(tensors) + 1, show_bar=show_progress) as progress:
        for key, value, kind, item_kind in _metadata_fields(gguf_file):
            writer.add_key_value(key, value, kind, sub_type=item_kind)
            if key == Keys.General.ALIGNMENT:
                writer.data_alignment = int(value)
        writer.add_file_type(int(FILE_TYPES[recipe]))
        writer.add_quantization_version(GGML_QUANT_VERSION)
        for info in tensors:
            target = plan[info.name]
            writer.add_tensor_info(
                info.name,
                info.shape,
                np.dtype(np.float32),
                _tensor_bytes(info, target),
                raw_dtype=GGMLQuantizationType[target],
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        progress.advance()
        for info in tensors:
            writer.write_tensor_data(_converted_bytes(gguf_file, info, plan[info.name]))
            progress.advance()


def quantize_file(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    recipe: str = "Q4_K_M",
    *,
    show_progress: bool | None = None,
) -> dict[str, int]:
    """Write `source` quantized with `recipe` (a key of FILE_TYPES) to `destination`.

    Returns the output's type mix: tensor count per type. The file is written next to
    `destination` under a temporary name and renamed into place when complete, so a failure
    never leaves a partial file. `show_progress=None` shows a bar only on a terminal.
    """
    source, destination = Path(source), Path(destination)
    with open_gguf(source) as gguf_file:
        plan = plan_tensor_types(list(gguf_file.tensors.values()), recipe)
        if destination.exists() and destination.resolve() == source.resolve():
            raise InvalidRequest("the output file must differ from the input", field="output")
        partial = destination.with_name(destination.name + ".partial")
        writer = GGUFWriter(partial, gguf_file.require("general.architecture"))
        try:
            _write_gguf(gguf_file, writer, plan, recipe, show_progress)
            writer.close()
            partial.replace(destination)
        except OSError as exc:
            _discard(writer, partial)
            raise InvalidRequest(f"cannot write {destination}: {exc}", field="output") from None
        except BaseException:
            _discard(writer, partial)
            raise
    mix: dict[str, int] = {}
    for target in plan.values():
        mix[target] = mix.get(target, 0) + 1
    return mix
