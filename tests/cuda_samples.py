"""Sample blocks of every GGUF block type, shared by the CUDA tests (the host block-math test
and tests/gpu): random bytes with sane float16 scales, or blocks of finite values only."""

from __future__ import annotations

import numpy as np

from actors.model.quants import FORMATS, QUANTIZERS, quantize, row_bytes

# Byte offsets of each quantized type's float16 scale fields (d, and m / dmin where it has one).
HALF_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def random_blocks(type_name: str, rows: int, row_length: int,
                  rng: np.random.Generator) -> np.ndarray:
    """(rows, row bytes) of random bytes (every byte pattern is a block), with the scale
    halves of the quantized types replaced by random finite halves in [-2, 2]."""
    raw = rng.integers(0, 256, (rows, row_bytes(type_name, row_length)), dtype=np.uint8)
    if type_name in HALF_FIELDS:
        blocks = raw.reshape(-1, FORMATS[type_name].type_size)
        for start in HALF_FIELDS[type_name]:
            halves = rng.uniform(-2.0, 2.0, len(blocks)).astype(np.float16)
            blocks[:, start : start + 2] = halves.view(np.uint8).reshape(-1, 2)
    return raw


def finite_blocks(type_name: str, rows: int, row_length: int,
                  rng: np.random.Generator) -> np.ndarray:
    """(rows, row bytes) of blocks holding only finite values: standard normal floats
    quantized where the project has a quantizer, random blocks with sane scales (Q4_0, Q4_1),
    or the floats converted (BF16 by truncation)."""
    values = rng.standard_normal((rows, row_length)).astype(np.float32)
    if type_name in QUANTIZERS:
        return quantize(values, type_name)
    if type_name in HALF_FIELDS:
        return random_blocks(type_name, rows, row_length, rng)
    if type_name == "F16":
        return values.astype(np.float16).view(np.uint8)
    if type_name == "BF16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return values.view(np.uint8)


def assert_same_floats(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal bit patterns wherever the value is a number; NaN exactly where numpy has NaN (a
    NaN's payload is not part of the format: hardware conversions may quiet it)."""
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual), nan)
    mismatch = actual.view(np.uint32)[~nan] != expected.view(np.uint32)[~nan]
    assert not mismatch.any(), (
        f"{mismatch.sum()} values differ, first: got {actual[~nan][mismatch][0]!r} "
        f"numpy {expected[~nan][mismatch][0]!r}"
    )
