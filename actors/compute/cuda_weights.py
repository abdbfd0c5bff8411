"""The weights' device image for the CUDA backend: pure numpy, no pycuda.

Every tensor of the file lies in one device allocation (the arena), each at a cuMemAlloc-like
boundary: a matrix's blocks as the file stores them, rows cuda_plan.row_pitch apart; a vector
as float32. A matrix named among the `planar` ones (cuda_launches.planar_copies: on the
matvec_mma route, the Q6_K matrices mul_mat_vec_mma multiplies) has a second entry after it,
its row-planar copy (cuda_plan.planar_q6_K_rows) under its name + cuda_plan.PLANAR_SUFFIX, at
the same pitch; the other kernels keep reading the file-layout copy.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

import numpy as np

from actors.compute import cuda_plan as plan
from actors.errors import InvalidRequest
from actors.model.gguf.quants import dequantize

if TYPE_CHECKING:  # annotations only: the GPU machine's tests import this without `gguf`
    from actors.model.gguf.reader import TensorInfo

ARENA_ALIGN = 256  # each entry of the weight arena starts where cuMemAlloc would put it


def device_tensor_bytes(info: TensorInfo) -> int:
    """Device bytes of one GGUF tensor: matrices keep their blocks at a 16-byte row pitch;
    vectors (norms, biases, RoPE factors) are float32. A row-planar copy is as large."""
    if len(info.shape) == 1:
        return info.shape[0] * 4
    return math.prod(info.shape[:-1]) * plan.row_pitch(info.type_name, info.shape[-1])


def weight_bytes(tensors: Iterable[TensorInfo], planar: Collection[str] = ()) -> int:
    """Device bytes of all of a file's tensors (about the file's size) and of the row-planar
    copies of those named in `planar`."""
    return sum(device_tensor_bytes(info) * (2 if info.name in planar else 1)
               for info in tensors)


def arena_entries(info: TensorInfo, planar: Collection[str]) -> tuple[str, ...]:
    """The arena's entries of a tensor: its own, then its row-planar copy's if it has one."""
    return (info.name, info.name + plan.PLANAR_SUFFIX) if info.name in planar else (info.name,)


def weight_arena(tensors: Iterable[TensorInfo],
                 planar: Collection[str] = ()) -> tuple[dict[str, int], int]:
    """Each arena entry's byte offset in one device allocation holding them all (every
    tensor, and the row-planar copies of those named in `planar`), and the allocation's
    size."""
    offsets, cursor = {}, 0
    for info in tensors:
        for entry in arena_entries(info, planar):
            offsets[entry] = cursor
            cursor += -(-device_tensor_bytes(info) // ARENA_ALIGN) * ARENA_ALIGN
    return offsets, cursor


def arena_images(raw: np.ndarray, info: TensorInfo, planar: Collection[str],
                 chunk_rows: int = 4096) -> Iterable[tuple[str, int, np.ndarray]]:
    """What the arena holds of a tensor, from its raw GGUF bytes, as (entry, byte offset,
    bytes) chunks: its device image, then its row-planar copy's where it has one."""
    for entry in arena_entries(info, planar):
        for at, data in device_bytes_of(raw, info, chunk_rows, planar=entry != info.name):
            yield entry, at, data


def device_bytes_of(raw: np.ndarray, info: TensorInfo, chunk_rows: int = 4096,
                    planar: bool = False) -> Iterable[tuple[int, np.ndarray]]:
    """The device image of a tensor from its raw GGUF bytes, as (byte offset, bytes) chunks:
    a matrix's rows at `row_pitch`, its blocks as stored (the raw view itself where the pitch
    is the row's size) or with `planar` in the row-planar layout; a vector as float32."""
    if len(info.shape) == 1:
        yield 0, np.ascontiguousarray(dequantize(raw, info.type_name, info.shape),
                                      dtype=np.float32).view(np.uint8)
        return
    rows = raw.reshape(-1, raw.shape[-1])
    pitch = plan.row_pitch(info.type_name, info.shape[-1])
    if pitch == rows.shape[1] and not planar:
        yield 0, rows.reshape(-1)
        return
    for first in range(0, len(rows), chunk_rows):
        chunk = device_rows(rows[first : first + chunk_rows], info.type_name, info.shape[-1],
                            planar)
        yield first * pitch, chunk.reshape(-1)


def device_rows(rows: np.ndarray, type_name: str, row_length: int,
                planar: bool = False) -> np.ndarray:
    """(n, row_pitch) uint8 device rows of (n, row bytes) file rows of `row_length` elements:
    the blocks as stored then zeros, or with `planar` (Q6_K only) the row-planar layout."""
    if planar:
        if type_name not in plan.PLANAR_TYPES:
            raise InvalidRequest(f"only Q6_K matrices have a row-planar layout, not {type_name}",
                                 field="type")
        return plan.planar_q6_K_rows(rows)
    out = np.zeros((len(rows), plan.row_pitch(type_name, row_length)), dtype=np.uint8)
    out[:, : rows.shape[1]] = rows
    return out
