"""The weights' device image for the CUDA backend: pure numpy, no pycuda.

Every tensor of the file lies in one device allocation (the arena), each at a cuMemAlloc-like
boundary: a matrix's blocks as the file stores them, rows cuda_plan.row_pitch apart; a vector
as float32. A matrix of a type held row-planar (cuda_plan.holds_planar: Q6_K) lies there in
the row-planar layout instead (cuda_plan.planar_q6_K_rows: the same bytes at the same pitch,
reordered).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from actors.compute import cuda_plan as plan
from actors.model.gguf.quants import dequantize

if TYPE_CHECKING:  # annotations only: the GPU machine's tests import this without `gguf`
    from actors.model.gguf.reader import TensorInfo

ARENA_ALIGN = 256  # each entry of the weight arena starts where cuMemAlloc would put it


def device_tensor_bytes(info: TensorInfo) -> int:
    """Device bytes of one GGUF tensor: matrices keep their blocks at a 16-byte row pitch;
    vectors (norms, biases, RoPE factors) are float32. A row-planar matrix is as large."""
    if len(info.shape) == 1:
        return info.shape[0] * 4
    return math.prod(info.shape[:-1]) * plan.row_pitch(info.type_name, info.shape[-1])


def weight_arena(tensors: Iterable[TensorInfo]) -> tuple[dict[str, int], int]:
    """Each tensor's byte offset in one device allocation holding them all, and the
    allocation's size."""
    offsets, cursor = {}, 0
    for info in tensors:
        offsets[info.name] = cursor
        cursor += -(-device_tensor_bytes(info) // ARENA_ALIGN) * ARENA_ALIGN
    return offsets, cursor


def device_bytes_of(raw: np.ndarray, info: TensorInfo,
                    chunk_rows: int = 4096) -> Iterable[tuple[int, np.ndarray]]:
    """The device image of a tensor from its raw GGUF bytes, as (byte offset, bytes) chunks:
    a matrix's rows at `row_pitch`, its blocks as stored (the raw view itself where the pitch
    is the row's size) or row-planar (device_rows); a vector as float32."""
    if len(info.shape) == 1:
        yield 0, np.ascontiguousarray(dequantize(raw, info.type_name, info.shape),
                                      dtype=np.float32).view(np.uint8)
        return
    rows = raw.reshape(-1, raw.shape[-1])
    pitch = plan.row_pitch(info.type_name, info.shape[-1])
    if pitch == rows.shape[1] and not plan.holds_planar(info.type_name):
        yield 0, rows.reshape(-1)
        return
    for first in range(0, len(rows), chunk_rows):
        chunk = device_rows(rows[first : first + chunk_rows], info.type_name, info.shape[-1])
        yield first * pitch, chunk.reshape(-1)


def device_rows(rows: np.ndarray, type_name: str, row_length: int) -> np.ndarray:
    """(n, row_pitch) uint8 device rows of (n, row bytes) file rows of `row_length` elements:
    the blocks as stored then zeros, or for a type held row-planar (Q6_K) that layout."""
    if plan.holds_planar(type_name):
        return plan.planar_q6_K_rows(rows)
    out = np.zeros((len(rows), plan.row_pitch(type_name, row_length)), dtype=np.uint8)
    out[:, : rows.shape[1]] = rows
    return out
