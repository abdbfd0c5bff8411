"""The block math of cuda_src/quant_blocks.cuh, compiled for the host with g++ and checked bit
for bit against actors.model.gguf.quants.dequantize on every block type.

The kernels decode with the very same `__host__ __device__` functions (with __fmul_rn /
__fadd_rn on the device, which round like the host's -ffp-contract=off build), so this proves
the quant math in CI without a GPU.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from actors.compute.cuda_plan import MATVEC_TYPES, kernel_source_dir, planar_q6_K_rows, row_pitch
from actors.model.gguf.quantizers import QUANTIZERS, quantize
from actors.model.gguf.quants import FORMATS, dequantize
from tests.cuda_samples import (
    HALF_FIELDS,
    activation_parts,
    assert_same_floats,
    finite_blocks,
    float16_parts,
    random_blocks,
    split_exponents,
)

GROUP = 32
ALL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F32", "F16", "BF16")
ROWS, ROW_LENGTH = 48, 512
# Half bit patterns at the edges: +-0, the smallest and largest subnormals, the smallest
# normal, the largest finite, +-inf and a NaN.
EDGE_HALVES = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0x7C00, 0xFC00, 0x7E00],
                       dtype=np.uint16)
HOST_SOURCE = Path(__file__).parent / "cuda_blockmath_host.cpp"


@pytest.fixture(scope="module")
def blockmath(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not on the PATH: cannot build the host block-math library")
    library = tmp_path_factory.mktemp("blockmath") / "blockmath.so"
    subprocess.run(
        [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-Wall",
         "-Wextra", "-Werror", f"-I{kernel_source_dir()}", str(HOST_SOURCE), "-o", str(library)],
        check=True, capture_output=True, text=True,
    )
    return ctypes.CDLL(str(library))


def _pointer(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)


def host_rows(lib: ctypes.CDLL, export: str, raw: np.ndarray, type_name: str, rows: int,
              row_length: int) -> np.ndarray:
    """Whole rows as floats through the host export `<export>_<type>` (dequantize: the exact
    decode; tile_values: the tiles' levels, scales and offsets)."""
    out = np.empty((rows, row_length), dtype=np.float32)
    raw = np.ascontiguousarray(raw)
    getattr(lib, f"{export}_{_suffix(type_name)}")(
        _pointer(raw), ctypes.c_int64(rows), ctypes.c_int64(row_length // GROUP), _pointer(out))
    return out


def pitched(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Rows at the device's 16-byte row pitch (the slices' wide loads assume it)."""
    out = np.zeros((raw.shape[0], row_pitch(type_name, ROW_LENGTH)), dtype=np.uint8)
    out[:, : raw.shape[1]] = raw
    return out


def host_slices(lib: ctypes.CDLL, raw: np.ndarray, type_name: str,
                x: np.ndarray | None = None) -> np.ndarray:
    """slice_weights_<type> (x None: every weight rebuilt from its slice) or slice_dot_<type>
    (each row's dot product with x)."""
    rows, rows_pitched = raw.shape[0], pitched(raw, type_name)
    args = [_pointer(rows_pitched), ctypes.c_int64(rows),
            ctypes.c_int64(rows_pitched.shape[1]), ctypes.c_int64(ROW_LENGTH)]
    if x is None:
        out = np.empty((rows, ROW_LENGTH), dtype=np.float32)
        getattr(lib, f"slice_weights_{_suffix(type_name)}")(*args, _pointer(out))
    else:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty(rows, dtype=np.float32)
        getattr(lib, f"slice_dot_{_suffix(type_name)}")(*args, _pointer(x), _pointer(out))
    return out


def _suffix(type_name: str) -> str:
    """GGUF name -> the kernels' suffix: lower case except the K-quants' K (llama.cpp style)."""
    return type_name.lower().replace("_k", "_K")


def edge_blocks(type_name: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks whose scale fields cycle through EDGE_HALVES (every combination of d and
    m for the two-scale types)."""
    raw = random_blocks(type_name, ROWS, ROW_LENGTH, rng)
    blocks = raw.reshape(-1, FORMATS[type_name].type_size)
    fields = HALF_FIELDS[type_name]
    index = np.arange(len(blocks))
    for k, start in enumerate(fields):
        chosen = EDGE_HALVES[(index // len(EDGE_HALVES) ** k) % len(EDGE_HALVES)]
        blocks[:, start : start + 2] = chosen.view(np.uint8).reshape(-1, 2)
    return raw


def float_type_bytes(type_name: str, rng: np.random.Generator) -> np.ndarray:
    """F16 and BF16: every 16-bit pattern; F32: random bits plus the special values."""
    if type_name in ("F16", "BF16"):
        every = np.arange(1 << 16, dtype=np.uint16)
        return every.view(np.uint8).reshape(-1, 2 * ROW_LENGTH)
    bits = rng.integers(0, 1 << 32, ROWS * ROW_LENGTH, dtype=np.uint64).astype(np.uint32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38],
                        dtype=np.float32)
    bits[: specials.size] = specials.view(np.uint32)
    return bits.view(np.uint8).reshape(ROWS, 4 * ROW_LENGTH)


def test_suffixes_cover_every_format() -> None:
    assert set(ALL_TYPES) == set(FORMATS)


@pytest.mark.parametrize("type_name", [t for t in ALL_TYPES if t in QUANTIZERS])
def test_quantized_blocks_decode_bit_for_bit(blockmath: ctypes.CDLL, type_name: str) -> None:
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((ROWS, ROW_LENGTH)) * rng.uniform(1e-3, 10, (ROWS, 1)))
    raw = quantize(x.astype(np.float32), type_name)
    expected = dequantize(raw, type_name, (ROWS, ROW_LENGTH))
    assert_same_floats(host_rows(blockmath, "dequantize", raw, type_name, ROWS, ROW_LENGTH), expected)


@pytest.mark.parametrize("edges", [False, True], ids=["random", "edges"])
@pytest.mark.parametrize("type_name", list(HALF_FIELDS))
def test_random_and_edge_blocks_decode_bit_for_bit(
    blockmath: ctypes.CDLL, type_name: str, edges: bool
) -> None:
    rng = np.random.default_rng(7)
    raw = edge_blocks(type_name, rng) if edges else random_blocks(type_name, ROWS, ROW_LENGTH, rng)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = dequantize(raw, type_name, (ROWS, ROW_LENGTH))
    assert_same_floats(host_rows(blockmath, "dequantize", raw, type_name, ROWS, ROW_LENGTH), expected)


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_types_decode_bit_for_bit(blockmath: ctypes.CDLL, type_name: str) -> None:
    raw = float_type_bytes(type_name, np.random.default_rng(3))
    rows = raw.shape[0]
    expected = dequantize(raw, type_name, (rows, ROW_LENGTH))
    assert_same_floats(host_rows(blockmath, "dequantize", raw, type_name, rows, ROW_LENGTH), expected)


@pytest.mark.parametrize(("type_name", "kind"), [
    (t, kind) for t in ALL_TYPES for kind in ("quantized", "random", "edges")
    if t in HALF_FIELDS or kind == "quantized"])  # float types: no scale fields to vary
def test_tile_levels_rebuild_every_value_bit_for_bit(blockmath: ctypes.CDLL, type_name: str,
                                                     kind: str) -> None:
    """The tiles' levels (four elements in two float16 pairs), scales and offsets of
    tile_levels.cuh give back quants.py's values: the pairing, the bit extraction and the
    per-element scale group are right for every element of every block type."""
    rng = np.random.default_rng(11)
    if type_name not in HALF_FIELDS:
        raw = float_type_bytes(type_name, rng)
    elif kind == "quantized":
        raw = finite_blocks(type_name, ROWS, ROW_LENGTH, rng)
    else:
        raw = edge_blocks(type_name, rng) if kind == "edges" else random_blocks(
            type_name, ROWS, ROW_LENGTH, rng)
    rows = raw.shape[0]
    with np.errstate(invalid="ignore", over="ignore"):
        expected = dequantize(raw, type_name, (rows, ROW_LENGTH))
    assert_same_floats(host_rows(blockmath, "tile_values", raw, type_name, rows, ROW_LENGTH), expected)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("kind", ["quantized", "random", "edges"])
def test_mma_lane_values_rebuild_every_value_bit_for_bit(blockmath: ctypes.CDLL, kind: str,
                                                         type_name: str) -> None:
    """What each lane of the tensor-core matvec takes from a block (matvec_mma_blocks.cuh:
    Q4_K's chunk words as float16 pairs with its two sub-blocks' scales and mins from one
    lane-uniform formula; Q6_K's three runs as four quarters' level bytes, paired by a byte
    permute, with its four sub-blocks' int8 scales) gives back quants.py's values: every
    element, every lane."""
    rng = np.random.default_rng(13)
    if kind == "quantized":
        raw = finite_blocks(type_name, ROWS, ROW_LENGTH, rng)
    else:
        raw = edge_blocks(type_name, rng) if kind == "edges" else random_blocks(
            type_name, ROWS, ROW_LENGTH, rng)
    raw = np.ascontiguousarray(raw)
    rows = raw.shape[0]
    with np.errstate(invalid="ignore", over="ignore"):
        expected = dequantize(raw, type_name, (rows, ROW_LENGTH))
    out = np.empty((rows, ROW_LENGTH), dtype=np.float32)
    lane_values = getattr(blockmath, f"mma_lane_values_{_suffix(type_name)}")
    lane_values(_pointer(raw), ctypes.c_int64(rows * ROW_LENGTH // 256), _pointer(out))
    assert_same_floats(out, expected)


@pytest.mark.parametrize("blocks_a_row", [1, 3, 9, 17])
@pytest.mark.parametrize("kind", ["quantized", "random", "edges"])
def test_planar_q6_K_rows_decode_and_stage_bit_for_bit(blockmath: ctypes.CDLL, kind: str,
                                                       blocks_a_row: int) -> None:
    """Row-planar Q6_K rows (the layout the device holds every Q6_K matrix in) give back
    quants.py's values through get_rows_q6_K_planar's decode, and through the batched product's
    staging of each block (type_q6_K_planar's pieces from three planes, d at its slot in the d
    piece) and tile_levels: every element, rows of 1 to 17 blocks (a d piece holds 8), no
    piece read past the row's pitch."""
    rng = np.random.default_rng(17 + blocks_a_row)
    if kind == "quantized":
        raw = finite_blocks("Q6_K", ROWS, ROW_LENGTH, rng)
    else:
        raw = edge_blocks("Q6_K", rng) if kind == "edges" else random_blocks(
            "Q6_K", ROWS, ROW_LENGTH, rng)
    blocks = raw.reshape(-1, FORMATS["Q6_K"].type_size)
    rows = len(blocks) // blocks_a_row
    raw = blocks[: rows * blocks_a_row].reshape(rows, -1)
    row_length = 256 * blocks_a_row
    planar = planar_q6_K_rows(raw)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = dequantize(raw, "Q6_K", (rows, row_length))
    args = (_pointer(planar), ctypes.c_int64(rows), ctypes.c_int64(planar.shape[1]),
            ctypes.c_int64(row_length))
    decoded, staged = (np.empty((rows, row_length), dtype=np.float32) for _ in range(2))
    blockmath.dequantize_planar_q6_K(*args, _pointer(decoded))
    assert_same_floats(decoded, expected)
    assert blockmath.tile_values_q6_K_planar(*args, _pointer(staged)) == 0
    assert_same_floats(staged, expected)


def test_edge_halves_reach_both_scales_of_two_scale_types() -> None:
    """The edge generator really puts every (d, m) edge pair into some block."""
    raw = edge_blocks("Q4_K", np.random.default_rng(0)).reshape(-1, 144)
    pairs = {(int(d), int(m)) for d, m in raw[:, :4].view(np.uint16)}
    assert len(pairs) == len(EDGE_HALVES) ** 2


# Types whose slices hold biased levels (1 + v / 2^bits, unbiased through the offset term):
# their rebuilt weights round differently from quants.py, the others' are exact.
BIASED_TYPES = ("Q4_1", "Q5_1", "Q5_K")


@pytest.mark.parametrize("type_name", MATVEC_TYPES)
def test_matvec_slices_cover_every_weight(blockmath: ctypes.CDLL, type_name: str) -> None:
    """Every element of every block comes from exactly one slice run, with the level, scale
    and offset that rebuild quants.py's weight: bit for bit, or for biased levels within a
    few roundings of the block's scale."""
    rng = np.random.default_rng(11)
    raw = finite_blocks(type_name, ROWS, ROW_LENGTH, rng)
    expected = dequantize(raw, type_name, (ROWS, ROW_LENGTH))
    rebuilt = host_slices(blockmath, raw, type_name)
    if type_name not in BIASED_TYPES:
        assert_same_floats(rebuilt, expected)
        return
    # level * scale' + offset' with scale' = 2^bits scale: each rounding <= u * 2 |scale'|.
    per_block = expected.reshape(ROWS, -1, FORMATS[type_name].block_size)
    spread = np.abs(per_block).max(axis=2, keepdims=True) * 2.0**-18
    error = np.abs(rebuilt.reshape(per_block.shape) - per_block)
    assert (error <= spread).all(), f"worst {(error - spread).max():.3g}"


@pytest.mark.parametrize("type_name", MATVEC_TYPES)
def test_matvec_slice_dot_products_within_float32_bound(blockmath: ctypes.CDLL,
                                                        type_name: str) -> None:
    """The factored slice dot products (what a kernel lane sums), row by row, are within the
    bound the GPU test holds the kernel to: n u / (1 - n u) * sum |w_i x_i|."""
    rng = np.random.default_rng(13)
    raw = finite_blocks(type_name, ROWS, ROW_LENGTH, rng)
    weights = dequantize(raw, type_name, (ROWS, ROW_LENGTH)).astype(np.float64)
    for x in (rng.standard_normal(ROW_LENGTH), rng.uniform(0.5, 1.0, ROW_LENGTH)):
        x = x.astype(np.float32)
        exact = weights @ x.astype(np.float64)
        nu = ROW_LENGTH * 2.0**-24
        bound = nu / (1 - nu) * (np.abs(weights) @ np.abs(x.astype(np.float64)))
        error = np.abs(host_slices(blockmath, raw, type_name, x).astype(np.float64) - exact)
        assert (error <= bound).all(), f"worst error / bound {(error / bound).max():.3g}"


# --------------------------------------------------------------------------------------------
# The activations' float16 hi + lo split (cuda_src/activation_split.cuh)

# Group magnitudes M the split must hold: past float16's range (7e4, 1e5: float16 inf), far
# past it (1e30, float32's largest), the edges of the band split unscaled ([2^-2, 2^15)) and of
# float16's (65504, 65520), float16's subnormals (1e-5) and float32's (1e-40, 1e-45).
EXTREME_MAGNITUDES = (7e4, 1e5, 1e30, 3.4e38, 65504.0, 65520.0, 32768.0, 32767.0, 0.25,
                      0.2499, 1e-5, 1e-30, 1e-40, 1e-45)


def host_split_scales(lib: ctypes.CDLL, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """split_scales: each 32-element group's 2^-e and 2^e, as the kernels find them."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    down, up = (np.empty(x.size // GROUP, dtype=np.float32) for _ in range(2))
    lib.split_scales(_pointer(x), ctypes.c_int64(x.size // GROUP), _pointer(down), _pointer(up))
    return down, up


def extreme_groups(rng: np.random.Generator) -> np.ndarray:
    """(groups, 32) float32: per magnitude M of EXTREME_MAGNITUDES, a group of values up to M
    (one of them -M) and a group of standard normal values with one M among them."""
    groups = []
    for magnitude in EXTREME_MAGNITUDES:
        spread = np.float32(magnitude) * rng.uniform(-1.0, 1.0, GROUP).astype(np.float32)
        spread[rng.integers(GROUP)] = -np.float32(magnitude)
        mixed = rng.standard_normal(GROUP).astype(np.float32)
        mixed[rng.integers(GROUP)] = np.float32(magnitude)
        groups += [spread, mixed]
    return np.stack(groups)


def test_split_scales_equal_the_twin(blockmath: ctypes.CDLL) -> None:
    """2^-e and 2^e of every group (random bits of every finite float, zeros, the extreme
    groups) are the twin's exponents (tests/cuda_samples.split_exponents), exactly."""
    rng = np.random.default_rng(61)
    bits = rng.integers(0, 0x7F800000, (4096, GROUP), dtype=np.uint32)
    bits |= rng.integers(0, 2, bits.shape, dtype=np.uint32) << 31
    x = np.concatenate([bits.view(np.float32), np.zeros((1, GROUP), dtype=np.float32),
                        extreme_groups(rng)])
    down, up = host_split_scales(blockmath, x)
    e = split_exponents(x)[:, 0]
    assert set(np.unique(e)) > {-126, 0, 113}  # both ends and the unscaled band
    np.testing.assert_array_equal(up, np.exp2(e).astype(np.float32))
    np.testing.assert_array_equal(down, np.exp2(-e).astype(np.float32))


def test_split_holds_every_finite_activation() -> None:
    """Against float64: each group's hi + lo (times 2^e) is finite and within 2^-22 M of each
    x (float32 subnormals exactly), so a product with levels (integers, as the kernels'
    weights) is within 2^-22 M sum |level| of the exact one, where the plain split's parts are
    inf or NaN for every group of M >= 65520."""
    rng = np.random.default_rng(67)
    x = extreme_groups(rng)
    hi, lo = activation_parts(x)
    x64 = x.astype(np.float64)
    largest = np.abs(x64).max(axis=1, keepdims=True)
    assert np.isfinite(hi).all() and np.isfinite(lo).all()
    assert (np.abs(hi + lo - x64) <= 2.0**-22 * largest).all()
    subnormal = largest[:, 0] < 2.0**-126
    assert subnormal.any()
    np.testing.assert_array_equal((hi + lo)[subnormal], x64[subnormal])
    levels = rng.integers(-32, 32, (GROUP, 8)).astype(np.float64)
    error = np.abs((hi + lo) @ levels - x64 @ levels)
    assert (error <= 2.0**-22 * largest * (np.abs(levels).sum(axis=0))).all()
    with np.errstate(over="ignore", invalid="ignore"):  # float16's inf, inf - inf
        plain_hi, plain_lo = float16_parts(x)
        plain_finite = np.isfinite(plain_hi + plain_lo).all(axis=1)
    past_float16 = largest[:, 0] >= 65520.0
    assert past_float16.sum() >= 8
    assert not plain_finite[past_float16].any()


def test_split_is_the_plain_one_below_float16s_limit() -> None:
    """Groups whose largest magnitude lies in [2^-2, 2^15) are split unscaled (e = 0), and
    those in [2^15, 65520) scaled by 2^-1: both give the plain split's parts bit for bit."""
    rng = np.random.default_rng(71)
    largest = np.exp2(rng.uniform(-2.0, 16.0, 2048)).astype(np.float32)
    largest = np.minimum(largest, np.float32(65519.0))
    x = rng.uniform(-1.0, 1.0, (largest.size, GROUP)).astype(np.float32) * largest[:, None]
    x[:, 0] = largest
    e = split_exponents(x)[:, 0]
    assert set(np.unique(e)) == {0, 1}
    np.testing.assert_array_equal(e == 0, largest < 2.0**15)
    for got, plain in zip(activation_parts(x), float16_parts(x)):
        np.testing.assert_array_equal(got, plain)
