"""Block formats: dequantization bit-identical to gguf.quants on every tensor of the four models,
quantizers byte-identical to llama.cpp's reference (quantize_pairs.npz, gguf's own ports)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from actors.errors import InvalidRequest, ModelFormatError, UnsupportedModelError
from actors.model.gguf.quantizers import quantize
from actors.model.gguf.quants import FORMATS, dequantize
from actors.model.gguf.reader import open_gguf

from tests.conftest import REFERENCE_DIR, TINY_MODELS, gemma3_path, smollm2_path

# Rows compared per tensor: a contiguous run (crossing several decode chunks) plus the last
# row, so the 262144-row gemma3 embedding costs no more than a small tensor.
SAMPLE_ROWS = 1500
MODELS = [*TINY_MODELS, "smollm2-135m", "gemma3-270m"]


def _model_path(name: str) -> Path:
    if name == "smollm2-135m":
        return smollm2_path()
    if name == "gemma3-270m":
        return gemma3_path()
    return TINY_MODELS[name]


def _gguf_reference(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    out = gguf_quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[type_name])
    return np.asarray(out, dtype=np.float32).reshape(shape)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("model", MODELS)
def test_dequantize_bit_identical_on_every_tensor(model: str) -> None:
    gguf_file = open_gguf(_model_path(model))
    mismatched = []
    for info in gguf_file.tensors.values():
        raw = gguf_file.raw(info.name)
        shape = info.shape
        if len(shape) > 1 and shape[0] > SAMPLE_ROWS:
            rows = np.r_[0:SAMPLE_ROWS, shape[0] - 1]
            raw = raw[rows]
            shape = (len(rows), *shape[1:])
        ours = dequantize(raw, info.type_name, shape)
        if not _same_bits(ours, _gguf_reference(raw, info.type_name, shape)):
            mismatched.append((info.name, info.type_name))
    assert mismatched == []


def _random_tensor_bytes(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks whose float16 scales are finite (so the comparison sees no NaN)."""
    rng = np.random.default_rng(seed)
    if type_name in ("F32", "F16"):
        dtype = np.float32 if type_name == "F32" else np.float16
        return rng.standard_normal((rows, cols)).astype(dtype).view(np.uint8)
    if type_name == "BF16":
        bits = rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    fmt = FORMATS[type_name]
    blocks = rng.integers(0, 256, (rows * cols // fmt.block_size, fmt.type_size), dtype=np.uint8)
    halves = rng.uniform(-2, 2, (blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    scale_bytes = {"Q6_K": [208], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2]}
    for start in scale_bytes.get(type_name, [0]):
        blocks[:, start : start + 2] = halves[:, 0:2]
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", list(FORMATS))
def test_dequantize_bit_identical_on_random_blocks(type_name: str) -> None:
    # Covers the types none of the four models uses (Q4_0, Q5_1, Q5_K, F16, BF16) and blocks
    # far from any trained weight distribution; 2100 rows cross decode-chunk boundaries.
    raw = _random_tensor_bytes(type_name, 2100, 512)
    ours = dequantize(raw, type_name, (2100, 512))
    assert _same_bits(ours, _gguf_reference(raw, type_name, (2100, 512)))


def test_dequantize_accepts_flat_bytes_and_any_rank() -> None:
    raw = _random_tensor_bytes("Q4_K", 6, 256)
    expected = dequantize(raw, "Q4_K", (6, 256))
    assert dequantize(raw.reshape(-1), "Q4_K", (2, 3, 256)).shape == (2, 3, 256)
    assert _same_bits(dequantize(raw.reshape(-1), "Q4_K", (1536,)), expected.reshape(-1))


@pytest.mark.parametrize("type_name", list(FORMATS))
def test_dequantize_never_writes_its_input(type_name: str) -> None:
    """One block (a contiguous slice) and a read-only one, as a mapped file gives them."""
    raw = _random_tensor_bytes(type_name, 1, 256)
    before = raw.copy()
    first = dequantize(raw, type_name, (1, 256))
    assert np.array_equal(raw, before)
    raw.flags.writeable = False
    assert _same_bits(dequantize(raw, type_name, (1, 256)), first)


def test_dequantize_returns_a_new_array_for_float_tensors() -> None:
    raw = np.arange(8, dtype=np.float32).view(np.uint8)
    out = dequantize(raw, "F32", (2, 4))
    out[0, 0] = 42.0
    assert raw.view(np.float32)[0] == 0.0


def test_dequantize_unknown_type_names_it() -> None:
    with pytest.raises(UnsupportedModelError, match="IQ2_XXS"):
        dequantize(np.zeros(66, np.uint8), "IQ2_XXS", (256,))


def test_dequantize_wrong_byte_count_is_a_format_error() -> None:
    with pytest.raises(ModelFormatError, match="144 bytes, got 143"):
        dequantize(np.zeros(143, np.uint8), "Q4_K", (256,))


def test_dequantize_row_not_whole_blocks_is_a_format_error() -> None:
    with pytest.raises(ModelFormatError, match="not a whole number"):
        dequantize(np.zeros(144, np.uint8), "Q4_K", (2, 128))


def test_dequantize_needs_bytes() -> None:
    with pytest.raises(ModelFormatError, match="uint8"):
        dequantize(np.zeros(36, np.float32), "Q4_K", (256,))


# ---------------------------------------------------------------------------------------------
# Quantizers


def _quantize_pairs() -> list[tuple[str, str, np.ndarray, np.ndarray]]:
    pairs = np.load(REFERENCE_DIR / "quantize_pairs.npz")
    found = []
    for key in pairs.files:
        name, _, kind = key.rpartition("__")
        if kind != "f32":
            for type_name in ("Q4_K", "Q6_K"):
                if kind == type_name:
                    found.append((name, type_name, pairs[f"{name}__f32"], pairs[key]))
    return found


@pytest.mark.parametrize(
    ("name", "type_name", "weights", "expected"),
    _quantize_pairs(),
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_quantize_byte_identical_to_llama_cpp(
    name: str, type_name: str, weights: np.ndarray, expected: np.ndarray
) -> None:
    ours = quantize(weights, type_name)
    assert ours.dtype == np.uint8 and ours.shape == expected.shape
    assert np.array_equal(ours, expected), f"{name}: {(ours != expected).sum()} bytes differ"


def _awkward_rows(seed: int = 3) -> np.ndarray:
    """Rows with what trips quantizers: zeros, constants, ties, one outlier, tiny values."""
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((12, 512)) * rng.uniform(0.01, 3, (12, 1))).astype(np.float32)
    rows[0] = 0
    rows[1] = 0.75
    rows[2, :64] = 0.5
    rows[3, 7] = 40.0
    rows[4] *= np.float32(1e-20)
    rows[5, ::2] = -rows[5, 1::2]
    rows[6] = np.abs(rows[6])  # positive only: the searches clamp the min to 0
    return rows


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q5_1"])
def test_quantize_matches_gguf_ports_of_the_reference(type_name: str) -> None:
    rows = _awkward_rows()
    expected = gguf_quants.quantize(rows, GGMLQuantizationType[type_name])
    assert np.array_equal(quantize(rows, type_name), expected)


@pytest.mark.parametrize(
    ("type_name", "max_relative_rmse"),
    [
        ("Q4_K", 0.12),
        ("Q5_K", 0.06),
        ("Q6_K", 0.03),
        ("Q8_0", 0.01),
        ("Q5_0", 0.06),
        ("Q5_1", 0.06),
    ],
)
def test_quantize_round_trip_is_close(type_name: str, max_relative_rmse: float) -> None:
    rows = _awkward_rows()
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = quantize(rows, type_name)
    assert blocks.shape == (12, 512 // block_size * type_size)
    restored = dequantize(blocks, type_name, rows.shape)
    assert np.all(restored[0] == 0)
    np.testing.assert_allclose(restored[1], 0.75, rtol=2e-3)
    normal = rows[7:]
    error = np.sqrt(np.mean((restored[7:] - normal) ** 2) / np.mean(normal**2))
    assert error < max_relative_rmse


def test_more_bits_give_less_error() -> None:
    rows = _awkward_rows()[7:]
    errors = [
        np.mean((dequantize(quantize(rows, t), t, rows.shape) - rows) ** 2)
        for t in ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
    ]
    assert errors == sorted(errors, reverse=True)


def test_quantize_keeps_leading_axes() -> None:
    x = np.random.default_rng(0).standard_normal((2, 3, 256)).astype(np.float32)
    blocks = quantize(x, "Q6_K")
    assert blocks.shape == (2, 3, 210)
    assert np.array_equal(blocks.reshape(6, 210), quantize(x.reshape(6, 256), "Q6_K"))


def test_quantize_unsupported_type_names_it() -> None:
    with pytest.raises(UnsupportedModelError, match="Q2_K"):
        quantize(np.zeros((1, 256), np.float32), "Q2_K")


def test_quantize_row_not_whole_blocks_names_the_input() -> None:
    with pytest.raises(InvalidRequest, match="not a whole number") as caught:
        quantize(np.zeros((1, 640), np.float32), "Q4_K")
    assert caught.value.field == "x"


def test_quantize_needs_float32() -> None:
    with pytest.raises(InvalidRequest, match="float32"):
        quantize(np.zeros((1, 256), np.float64), "Q4_K")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_refuses_non_finite_values(bad: float) -> None:
    x = np.zeros((2, 256), np.float32)
    x[1, 17] = bad
    with pytest.raises(InvalidRequest, match="NaN or infinite"):
        quantize(x, "Q4_K")
