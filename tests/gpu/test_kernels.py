"""Every cuda_src kernel against its numpy twin, on the device (skipped without one).

Exactness where the kernel promises it (block decoding, KV rounding, penalties, candidate
selection), else the classic float32 summation bound or a stated tolerance. Launch geometry
and argument orders come from actors.compute.cuda_plan and the comments atop each .cu file:
these tests are also the executable statement of that contract for the CUDA backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from actors.compute import cuda_plan as plan
from actors.compute import cuda_packing as packing
from actors.compute.cuda_packing import row_arrays
from actors.compute.cuda_weights import device_rows
from actors.model.candidates import RowInputs, apply_token_masks, mask_words
from actors.model.elementwise import rms_norm
from actors.model.gguf.quants import dequantize
from actors.model.rope import apply_rope, inverse_frequencies, pair_order, rotation
from tests.cuda_samples import (
    assert_same_floats,
    finite_blocks,
    gated_twin,
    random_row_inputs,
    tile_product,
    top_candidates_twin,
)

Kernel = Callable[[str, str], Any]
ALL_TYPES = tuple(plan.KERNEL_TYPE_SUFFIX)
NULL = np.uintp(0)
U = 2.0**-24  # float32 unit roundoff


# Every device array a test makes lives until the test ends: `ptr(to_device(a))` hands a
# kernel the address of a temporary, which PyCUDA frees at once and the next allocation reuses
# (the first device run saw inputs aliasing each other and, later, a sticky address fault).
_LIVE_ARRAYS: list[Any] = []


@pytest.fixture(autouse=True)
def _device_arrays_live_for_the_test() -> Any:
    yield
    _LIVE_ARRAYS.clear()


def to_device(array: np.ndarray) -> Any:
    from pycuda import gpuarray

    device_array = gpuarray.to_gpu(np.ascontiguousarray(array))
    _LIVE_ARRAYS.append(device_array)
    return device_array


def nan_filled(*shape: int) -> Any:
    """A float32 device array of NaN: whatever a kernel fails to write stays visible."""
    return to_device(np.full(shape, np.nan, dtype=np.float32))


def ptr(array: Any) -> np.uintp:
    return np.uintp(int(array.gpudata))


def run(function: Any, launch: plan.Launch, *args: Any) -> None:
    import pycuda.driver as cuda

    function(*args, grid=launch.grid, block=launch.block, shared=launch.shared)
    cuda.Context.synchronize()


def pitched(raw: np.ndarray, type_name: str, row_length: int) -> np.ndarray:
    """Weight rows (rows, row bytes) laid out at the device row pitch."""
    out = np.zeros((raw.shape[0], plan.row_pitch(type_name, row_length)), dtype=np.uint8)
    out[:, : raw.shape[1]] = raw
    return out


def summation_bound(w: np.ndarray, x: np.ndarray, factor: float = 1.0) -> np.ndarray:
    """factor * n u / (1 - n u) * sum |x w| per (activation row, weight row): the worst error
    of a float32 dot product of n terms summed in any order."""
    nu = factor * w.shape[1] * U
    return nu / (1 - nu) * (np.abs(x) @ np.abs(w).T)


# --------------------------------------------------------------------------------------------
# Block decoding and matrix products


@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_get_rows_decodes_bit_for_bit(kernel: Kernel, type_name: str, scale: float) -> None:
    vocab, d = 40, 512
    raw = finite_blocks(type_name, vocab, d, np.random.default_rng(1))
    ids = np.array([3, 0, 39, 3, 17], dtype=np.int32)
    table, ids_dev, out = (to_device(device_rows(raw, type_name, d)), to_device(ids),
                           nan_filled(5, d))
    run(kernel("embedding.cu", plan.get_rows_kernel(type_name)),
        plan.get_rows_launch(len(ids), d), ptr(table),
        np.int64(plan.row_pitch(type_name, d)), ptr(ids_dev), ptr(out), np.int32(d),
        np.float32(scale))
    expected = dequantize(raw[ids], type_name, (len(ids), d)) * np.float32(scale)
    assert_same_floats(out.get(), expected)


def test_get_rows_of_a_planar_q6_K_table_decodes_bit_for_bit(kernel: Kernel) -> None:
    """get_rows_q6_K_planar (Q6_K embeddings are held row-planar): rows of 10 blocks, so a
    block's d lies in the first or second piece of the d plane."""
    vocab, d = 40, 2560
    raw = finite_blocks("Q6_K", vocab, d, np.random.default_rng(2))
    ids = np.array([3, 0, 39, 3, 17], dtype=np.int32)
    table, ids_dev, out = (to_device(plan.planar_q6_K_rows(raw)), to_device(ids),
                           nan_filled(5, d))
    run(kernel("embedding.cu", plan.get_rows_kernel("Q6_K")),
        plan.get_rows_launch(len(ids), d), ptr(table), np.int64(plan.row_pitch("Q6_K", d)),
        ptr(ids_dev), ptr(out), np.int32(d), np.float32(0.5))
    assert_same_floats(out.get(), dequantize(raw[ids], "Q6_K", (len(ids), d)) * np.float32(0.5))


def matvec(kernel: Kernel, raw: np.ndarray, type_name: str, x: np.ndarray,
           batch: int) -> np.ndarray:
    """mul_mat_vec_<type> of raw blocks (rows, row bytes) with the first `batch` rows of x
    (x's stride: its width); y has 3 spare columns, which must stay NaN."""
    rows, n_in = raw.shape[0], x.shape[1] - 4
    weights, y = to_device(pitched(raw, type_name, n_in)), nan_filled(batch, rows + 3)
    run(kernel("matvec.cu", plan.matvec_kernel(type_name)),
        plan.matvec_launch(rows, n_in), ptr(weights), np.int64(plan.row_pitch(type_name, n_in)),
        ptr(to_device(x[:batch])), np.int32(x.shape[1]), ptr(y), np.int32(rows + 3),
        np.int32(rows), np.int32(n_in), np.int32(batch))
    got = y.get()
    assert np.isnan(got[:, rows:]).all()
    return got[:, :rows]


def activations(rng: np.random.Generator, batch: int, n_in: int) -> np.ndarray:
    """batch rows of n_in normal floats, 4 spare columns (a stride past the row)."""
    x = np.zeros((batch, n_in + 4), dtype=np.float32)
    x[:, :n_in] = rng.standard_normal((batch, n_in))
    return x


@pytest.mark.parametrize("n_in", [2304, 8448])
@pytest.mark.parametrize("batch", [1, 3, 8, 9, 33, 64])
@pytest.mark.parametrize("type_name", plan.MATVEC_TYPES)
def test_matvec_within_the_summation_bound(kernel: Kernel, type_name: str, batch: int,
                                           n_in: int) -> None:
    """70 rows (not a multiple of a block's rows); 2304 inputs (9 K-blocks, one split) and
    8448 (33 K-blocks over 4 splits of 8 or 9); batches past the chunk of 8; strided x and y
    whose gaps must stay untouched."""
    rows = 70
    rng = np.random.default_rng(batch + n_in)
    raw = finite_blocks(type_name, rows, n_in, rng)
    x = activations(rng, batch, n_in)
    got = matvec(kernel, raw, type_name, x, batch)
    w = dequantize(raw, type_name, (rows, n_in)).astype(np.float64)
    x64 = x[:, :n_in].astype(np.float64)
    error = np.abs(got - x64 @ w.T)
    assert (error <= summation_bound(w, x64)).all()


@pytest.mark.parametrize("n_in", [4608, 33024])
@pytest.mark.parametrize("type_name", plan.MATVEC_TYPES)
def test_matvec_rows_do_not_depend_on_the_batch(kernel: Kernel, type_name: str,
                                                n_in: int) -> None:
    """Row b of y is bit for bit the same whether it is computed alone or among 9, 33 or 64
    activation rows (the batch-invariance decode relies on: a sequence's greedy tokens may
    not depend on how many streams share its step). 4608 inputs: chunks of 8 activation rows
    and two splits; 33,024: the affine types' run-sum table holds 3 rows a chunk, 4 splits."""
    rows = 70
    rng = np.random.default_rng(17)
    raw = finite_blocks(type_name, rows, n_in, rng)
    x = activations(rng, 64, n_in)
    full = matvec(kernel, raw, type_name, x, 64)
    for batch in (1, 9, 33):
        np.testing.assert_array_equal(matvec(kernel, raw, type_name, x, batch).view(np.uint32),
                                      full[:batch].view(np.uint32))
    alone = matvec(kernel, raw, type_name, x[37:], 1)  # row 37 as row 0 of a batch of one
    np.testing.assert_array_equal(alone[0].view(np.uint32), full[37].view(np.uint32))


@pytest.mark.parametrize("act", plan.ACTIVATIONS)
@pytest.mark.parametrize("type_name", ["Q5_K", "Q8_0", "BF16"])
@pytest.mark.parametrize("batch", [1, 9])
def test_fused_gate_up_equals_matvec_then_gated(kernel: Kernel, type_name: str, act: str,
                                                batch: int) -> None:
    """mul_mat_vec_gate_up_<act> == two mul_mat_vec into one gate|up buffer, then
    gated_<act>, bit for bit (gate scaled so silu / gelu see large and small arguments)."""
    ffn, n_in = 100, 4608
    rng = np.random.default_rng(19)
    gate, up = (finite_blocks(type_name, ffn, n_in, rng) for _ in range(2))
    x = activations(rng, batch, n_in)
    pitch = np.int64(plan.row_pitch(type_name, n_in))
    suffix = plan.kernel_suffix(type_name)
    gate_up = to_device(np.concatenate([matvec(kernel, gate, type_name, x, batch),
                                        matvec(kernel, up, type_name, x, batch)], axis=1))
    expected = nan_filled(batch, ffn)
    run(kernel("activation.cu", f"gated_{act}"), plan.elementwise_launch(batch * ffn),
        ptr(gate_up), ptr(expected), np.int32(batch), np.int32(ffn))
    fused = nan_filled(batch, ffn + 5)
    run(kernel("matvec.cu", f"mul_mat_vec_gate_up_{act}_{suffix}"),
        plan.matvec_launch(2 * ffn, n_in), ptr(to_device(pitched(gate, type_name, n_in))),
        ptr(to_device(pitched(up, type_name, n_in))), pitch, ptr(to_device(x)),
        np.int32(x.shape[1]), ptr(fused), np.int32(ffn + 5), np.int32(ffn), np.int32(n_in),
        np.int32(batch))
    got = fused.get()
    assert np.isnan(got[:, ffn:]).all()
    np.testing.assert_array_equal(got[:, :ffn].view(np.uint32), expected.get().view(np.uint32))


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_batched_product_matches_its_twin(kernel: Kernel, type_name: str, wide: bool) -> None:
    """100 rows x 70 tokens (a prefill chunk's 64-column blocks, partial at both edges),
    padded strides, and for
    the 32-element types a row of 17 groups (a partial last weight chunk); `wide` rows (2304
    / 2336 inputs: a planar Q6_K row's 9 blocks take both pieces of its d plane). tile_product
    sums the kernel's exact products; its float32 accumulation
    (per scale group, then across groups; the level and offset sums of a K-quant can cancel)
    stays within 4x the classic bound, and far below what one float16 rounding of the
    activations would cost, so a lost lo part or a misplaced scale fails."""
    rows, tokens = 100, 70
    k_quant = type_name in ("Q4_K", "Q5_K", "Q6_K")
    n_in = (2304 if k_quant else 2336) if wide else (512 if k_quant else 544)
    rng = np.random.default_rng(7)
    raw = finite_blocks(type_name, rows, n_in, rng)
    x = activations(rng, tokens, n_in)
    got = batched(kernel, raw, type_name, x, tokens)
    w = dequantize(raw, type_name, (rows, n_in)).astype(np.float64)
    x64 = x[:, :n_in].astype(np.float64)
    twin = tile_product(w, x[:, :n_in], type_name)
    error = np.abs(got - twin)
    assert (error <= summation_bound(w, x64, factor=4.0) + 1e-30).all()
    one_rounding = np.abs(x[:, :n_in].astype(np.float16).astype(np.float64) @ w.T - x64 @ w.T)
    # float32 summation here: ~0.0015 of it (numpy model of the kernel's sums); no lo: ~1
    assert error.mean() < 0.05 * one_rounding.mean()


def product_rows(function: Any, launch: plan.Launch, weights: np.ndarray, type_name: str,
                 x: np.ndarray, tokens: int, rows: int) -> np.ndarray:
    """A product entry's y (tokens x rows) for `weights` (rows at the device pitch) and the
    first `tokens` rows of x (its stride: its width); y's 3 spare columns must stay NaN."""
    n_in = x.shape[1] - 4
    y = nan_filled(tokens, rows + 3)
    run(function, launch, ptr(to_device(weights)), np.int64(plan.row_pitch(type_name, n_in)),
        ptr(to_device(x[:tokens])), np.int32(x.shape[1]), ptr(y), np.int32(rows + 3),
        np.int32(rows), np.int32(n_in), np.int32(tokens))
    got = y.get()
    assert np.isnan(got[:, rows:]).all()
    return got[:, :rows]


def gated(kernel: Kernel, act: str, gates: np.ndarray, ups: np.ndarray) -> Any:
    """gated_<act> on the device of gate and up products (tokens x ffn each) laid out in one
    gate|up buffer."""
    tokens, ffn = gates.shape
    gate_up = to_device(np.concatenate([gates, ups], axis=1))
    out = nan_filled(tokens, ffn)
    run(kernel("activation.cu", f"gated_{act}"), plan.elementwise_launch(tokens * ffn),
        ptr(gate_up), ptr(out), np.int32(tokens), np.int32(ffn))
    return out


def batched(kernel: Kernel, raw: np.ndarray, type_name: str, x: np.ndarray,
            tokens: int) -> np.ndarray:
    """mul_mat_batch<N> of raw blocks with the first `tokens` rows of x (stride: its width);
    y's 3 spare columns must stay NaN."""
    rows, n_in = raw.shape[0], x.shape[1] - 4
    return product_rows(kernel("matmul_batch.cu", plan.batch_kernel(type_name, tokens)),
                        plan.batch_launch(rows, tokens), device_rows(raw, type_name, n_in),
                        type_name, x, tokens, rows)


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_batched_product_gives_a_row_the_same_bits_at_any_rows(kernel: Kernel,
                                                                type_name: str) -> None:
    """mul_mat_batch<N> at 1 to 64 rows (N = 16, 32, 64; partial token tiles), 100 weight
    rows (a partial row block), a row of 17 groups for the 32-element types: each row's y bit
    for bit what a 70-row prefill chunk (two 64-column token tiles) gives it: the same sums
    whatever the rows beside it."""
    rows, tokens = 100, 70
    k_quant = type_name in ("Q4_K", "Q5_K", "Q6_K")
    n_in = 512 if k_quant else 544
    rng = np.random.default_rng(31)
    raw = finite_blocks(type_name, rows, n_in, rng)
    x = activations(rng, tokens, n_in)
    expected = batched(kernel, raw, type_name, x, tokens)
    for n in (1, 8, 9, 16, 17, 32, 33, 64):
        np.testing.assert_array_equal(batched(kernel, raw, type_name, x, n).view(np.uint32),
                                      expected[:n].view(np.uint32), err_msg=str(n))


@pytest.mark.parametrize("act", plan.ACTIVATIONS)
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "BF16"])
@pytest.mark.parametrize("tokens", [9, 33, 64])
def test_batched_gate_up_equals_the_batched_products_then_gated(kernel: Kernel, type_name: str,
                                                                act: str, tokens: int) -> None:
    """mul_mat_batch<N>_gate_up_<act> == mul_mat_batch<N> of gate and of up into one gate|up
    buffer, then gated_<act>, bit for bit (70 ffn rows: a partial block of 32)."""
    ffn, n_in = 70, 1024
    rng = np.random.default_rng(23)
    gate, up = (finite_blocks(type_name, ffn, n_in, rng) for _ in range(2))
    x = activations(rng, tokens, n_in)
    expected = gated(kernel, act, *(batched(kernel, raw, type_name, x, tokens)
                                    for raw in (gate, up)))
    gate_w, up_w = (device_rows(raw, type_name, n_in) for raw in (gate, up))
    fused = nan_filled(tokens, ffn + 5)
    run(kernel("matmul_batch.cu", plan.batch_gate_up_kernel(act, type_name, tokens)),
        plan.batch_launch(ffn, tokens, plan.BATCH_ROWS // 2), ptr(to_device(gate_w)),
        ptr(to_device(up_w)), np.int64(plan.row_pitch(type_name, n_in)), ptr(to_device(x)),
        np.int32(x.shape[1]), ptr(fused), np.int32(ffn + 5), np.int32(ffn), np.int32(n_in),
        np.int32(tokens))
    got = fused.get()
    assert np.isnan(got[:, ffn:]).all()
    np.testing.assert_array_equal(got[:, :ffn].view(np.uint32), expected.get().view(np.uint32))


def matvec_mma(kernel: Kernel, raw: np.ndarray, type_name: str, x: np.ndarray,
               batch: int) -> np.ndarray:
    """mul_mat_vec_mma_<type> of raw blocks with the first `batch` rows of x (x's stride: its
    width); y's 3 spare columns must stay NaN."""
    rows, n_in = raw.shape[0], x.shape[1] - 4
    return product_rows(kernel("matvec_mma.cu", plan.matvec_mma_kernel(type_name)),
                        plan.matvec_mma_launch(rows, n_in), device_rows(raw, type_name, n_in),
                        type_name, x, batch, rows)


@pytest.mark.parametrize("type_name", plan.MATVEC_MMA_TYPES)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("n_in", [512, 4096, 8448, 14336])
def test_matvec_mma_matches_its_twin(kernel: Kernel, n_in: int, batch: int,
                                     type_name: str) -> None:
    """The tensor-core matvec against the batched product's twin (the same numbers: x split
    into float16 hi + lo, exact levels): 70 rows (a partial row tile); 512 inputs (2 K-blocks:
    six warps idle), 4096, 8448 (a full activation table, then a piece of one K-block) and
    14336 (the 8B down projection: 32 + 24). Within 4x the classic bound, and far below one float16
    rounding of x: a lost lo part, a level off its bias or a misplaced scale fails."""
    rows = 70
    rng = np.random.default_rng(41 + n_in)
    raw = finite_blocks(type_name, rows, n_in, rng)
    x = activations(rng, batch, n_in)
    got = matvec_mma(kernel, raw, type_name, x, batch)
    w = dequantize(raw, type_name, (rows, n_in)).astype(np.float64)
    x64 = x[:, :n_in].astype(np.float64)
    error = np.abs(got - tile_product(w, x[:, :n_in], type_name))
    assert (error <= summation_bound(w, x64, factor=4.0) + 1e-30).all()
    one_rounding = np.abs(x[:, :n_in].astype(np.float16).astype(np.float64) @ w.T - x64 @ w.T)
    assert error.mean() < 0.05 * one_rounding.mean()


def extreme_activations(rng: np.random.Generator, batch: int, n_in: int) -> np.ndarray:
    """activations() whose 32-element groups take turns at magnitudes float16 cannot hold
    (7e4, 1e5, 1e30) or resolve (1e-5, 1e-30, float32 subnormals at 1e-40) beside plain ones,
    and every 8th group ones with a 1e5 among them."""
    x = activations(rng, batch, n_in)
    magnitudes = np.array([1.0, 7e4, 1e5, 1e30, 1e-5, 1e-30, 1e-40, 1.0], dtype=np.float32)
    groups = x[:, :n_in].reshape(batch, -1, 32)
    turn = (np.arange(groups.shape[1]) + np.arange(batch)[:, None]) % magnitudes.size
    groups *= magnitudes[turn][..., None]
    groups[:, 7::8] = 1.0
    groups[:, 7::8, 5] = 1e5
    return x


@pytest.mark.parametrize(("shape", "type_name"),
                         [("batched", type_name) for type_name in ALL_TYPES]
                         + [("matvec_mma", type_name) for type_name in plan.MATVEC_MMA_TYPES])
def test_tensor_core_products_hold_any_finite_activation(kernel: Kernel, shape: str,
                                                         type_name: str) -> None:
    """Activations past float16's range and below its resolution (extreme_activations): each
    tensor-core product within 4x the classic bound of the float64 product plus what the
    float16 split may cost (2^-22 of each 32-element group's largest magnitude an element),
    finite where the plain split turned every row holding 65,520 or more into NaN."""
    rows, tokens, n_in = 70, 9, 2048
    rng = np.random.default_rng(47)
    raw = finite_blocks(type_name, rows, n_in, rng)
    x = extreme_activations(rng, tokens, n_in)
    if shape == "matvec_mma":
        got = matvec_mma(kernel, raw, type_name, x, tokens)
    else:
        got = batched(kernel, raw, type_name, x, tokens)
    w = dequantize(raw, type_name, (rows, n_in)).astype(np.float64)
    x64 = x[:, :n_in].astype(np.float64)
    largest = np.abs(x64).reshape(tokens, -1, 32).max(axis=2, keepdims=True)
    split_bound = 2.0**-22 * (np.broadcast_to(largest, (tokens, n_in // 32, 32))
                              .reshape(tokens, n_in) @ np.abs(w).T)
    assert np.isfinite(got).all()
    assert (np.abs(got - x64 @ w.T) <= summation_bound(w, x64, factor=4.0) + split_bound).all()


@pytest.mark.parametrize("type_name", plan.MATVEC_MMA_TYPES)
def test_matvec_mma_rows_do_not_depend_on_the_batch(kernel: Kernel, type_name: str) -> None:
    """The mma matvec's promise: row b of y is bit for bit the same alone or among 9,
    33 or 64 tokens, whatever its place in the batch (4608 inputs)."""
    rows, n_in = 70, 4608
    rng = np.random.default_rng(43)
    raw = finite_blocks(type_name, rows, n_in, rng)
    x = activations(rng, 64, n_in)
    full = matvec_mma(kernel, raw, type_name, x, 64)
    for batch in (1, 9, 33):
        np.testing.assert_array_equal(
            matvec_mma(kernel, raw, type_name, x, batch).view(np.uint32),
            full[:batch].view(np.uint32))
    alone = matvec_mma(kernel, raw, type_name, x[37:], 1)
    np.testing.assert_array_equal(alone[0].view(np.uint32), full[37].view(np.uint32))


@pytest.mark.parametrize("type_name", plan.MATVEC_MMA_TYPES)
@pytest.mark.parametrize("act", plan.ACTIVATIONS)
@pytest.mark.parametrize("batch", [1, 9])
def test_fused_matvec_mma_gate_up_equals_matvec_mma_then_gated(kernel: Kernel, act: str,
                                                                batch: int,
                                                                type_name: str) -> None:
    """mul_mat_vec_mma_gate_up_<act>_<type> == mul_mat_vec_mma_<type> of gate and of up into
    one gate|up buffer, then gated_<act>, bit for bit: a row's sums are the same in rows g
    and g + 8 of the MMA tile (ffn 100: a partial last block)."""
    ffn, n_in = 100, 4608
    rng = np.random.default_rng(47)
    gate, up = (finite_blocks(type_name, ffn, n_in, rng) for _ in range(2))
    x = activations(rng, batch, n_in)
    expected = gated(kernel, act, *(matvec_mma(kernel, raw, type_name, x, batch)
                                    for raw in (gate, up)))
    fused = nan_filled(batch, ffn + 5)
    run(kernel("matvec_mma.cu", plan.matvec_mma_gate_up_kernel(act, type_name)),
        plan.matvec_mma_launch(2 * ffn, n_in),
        ptr(to_device(device_rows(gate, type_name, n_in))),
        ptr(to_device(device_rows(up, type_name, n_in))),
        np.int64(plan.row_pitch(type_name, n_in)), ptr(to_device(x)), np.int32(x.shape[1]),
        ptr(fused), np.int32(ffn + 5), np.int32(ffn), np.int32(n_in), np.int32(batch))
    got = fused.get()
    assert np.isnan(got[:, ffn:]).all()
    np.testing.assert_array_equal(got[:, :ffn].view(np.uint32), expected.get().view(np.uint32))


# --------------------------------------------------------------------------------------------
# Norms, RoPE, activations, KV


@pytest.mark.parametrize("delta_kind", ["none", "plain", "post_norm"])
def test_residual_rms_norm(kernel: Kernel, delta_kind: str) -> None:
    rows, d, eps = 5, 640, 1e-6
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((rows, d)) * 3).astype(np.float32)
    delta = rng.standard_normal((rows, d)).astype(np.float32)
    delta_weight = rng.uniform(0.5, 1.5, d).astype(np.float32)
    weight = rng.uniform(0.5, 1.5, d).astype(np.float32)
    x_dev, out = to_device(x), nan_filled(rows, d)
    run(kernel("norm.cu", "residual_rms_norm"), plan.norm_launch(rows), ptr(x_dev),
        NULL if delta_kind == "none" else ptr(to_device(delta)),
        ptr(to_device(delta_weight)) if delta_kind == "post_norm" else NULL,
        ptr(to_device(weight)), ptr(out), np.int32(d), np.float32(eps))
    expected_x = x.copy()
    if delta_kind == "plain":
        expected_x += delta
    elif delta_kind == "post_norm":
        expected_x += rms_norm(delta, delta_weight, eps)
    np.testing.assert_allclose(x_dev.get(), expected_x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.get(), rms_norm(expected_x, weight, eps), rtol=1e-5,
                               atol=1e-6)


def test_head_rms_norm_touches_only_its_heads(kernel: Kernel) -> None:
    tokens, heads, head_dim, stride, eps = 3, 9, 64, 1000, 1e-6
    rng = np.random.default_rng(3)
    x = rng.standard_normal((tokens, stride)).astype(np.float32)
    weight = rng.uniform(0.5, 1.5, head_dim).astype(np.float32)
    x_dev = to_device(x)
    run(kernel("norm.cu", "head_rms_norm"), plan.head_norm_launch(tokens, heads), ptr(x_dev),
        np.int32(stride), np.int32(heads), np.int32(head_dim), ptr(to_device(weight)),
        np.float32(eps))
    got = x_dev.get()
    span = heads * head_dim
    expected = rms_norm(x[:, :span].reshape(tokens, heads, head_dim), weight, eps)
    np.testing.assert_allclose(got[:, :span].reshape(tokens, heads, head_dim), expected,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[:, span:], x[:, span:])


@pytest.mark.parametrize("rope_dim", [64, 32])
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("with_factors", [False, True])
@pytest.mark.parametrize("base", [10000.0, 1000000.0])
def test_rope_matches_rope_py(kernel: Kernel, rope_dim: int, neox: bool, with_factors: bool,
                              base: float) -> None:
    """On the GGUF feature order; rope.py's twin rotates pair_order-permuted features."""
    tokens, heads, head_dim, stride = 4, 3, 64, 3 * 64 + 8
    rng = np.random.default_rng(4)
    positions = np.array([0, 1, 777, 8191], dtype=np.int32)
    factors = rng.uniform(1.0, 8.0, rope_dim // 2).astype(np.float32) if with_factors else None
    x = rng.standard_normal((tokens, stride)).astype(np.float32)
    x_dev = to_device(x)
    run(kernel("rope.cu", "rope"), plan.rope_launch(tokens, heads), ptr(x_dev), np.int32(stride),
        ptr(to_device(positions)), np.int32(heads), np.int32(head_dim), np.int32(rope_dim),
        np.float64(base), ptr(to_device(factors)) if with_factors else NULL, np.int32(neox))
    order = pair_order(head_dim, rope_dim, neox)
    permuted = x[:, : heads * head_dim].reshape(tokens, heads, head_dim)[..., order].copy()
    apply_rope(permuted, rotation(positions, inverse_frequencies(base, rope_dim, factors)))
    expected = np.empty_like(permuted)
    expected[..., order] = permuted
    got = x_dev.get()
    np.testing.assert_allclose(got[:, : heads * head_dim].reshape(expected.shape), expected,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[:, heads * head_dim :], x[:, heads * head_dim :])


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activations(kernel: Kernel, activation: str) -> None:
    tokens, ffn = 3, 1000
    rng = np.random.default_rng(5)
    gate_up = (rng.standard_normal((tokens, 2 * ffn)) * 4).astype(np.float32)
    gate_up[0, :3] = [-100.0, 100.0, 0.0]  # exp overflow and the zero
    out = nan_filled(tokens, ffn)
    run(kernel("activation.cu", f"gated_{activation}"), plan.elementwise_launch(tokens * ffn),
        ptr(to_device(gate_up)), ptr(out), np.int32(tokens), np.int32(ffn))
    expected = gated_twin(activation, gate_up[:, :ffn], gate_up[:, ffn:])
    np.testing.assert_allclose(out.get(), expected, rtol=5e-6, atol=1e-30)


def test_add_bias_touches_only_its_columns(kernel: Kernel) -> None:
    tokens, stride, n = 4, 384, 256
    rng = np.random.default_rng(6)
    y = rng.standard_normal((tokens, stride)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    y_dev = to_device(y)
    run(kernel("bias.cu", "add_bias"), plan.elementwise_launch(tokens * n), ptr(y_dev),
        np.int32(stride), ptr(to_device(bias)), np.int32(tokens), np.int32(n))
    expected = y.copy()
    expected[:, :n] += bias
    np.testing.assert_array_equal(y_dev.get(), expected)


def test_kv_write_rounds_into_the_paged_layout(kernel: Kernel) -> None:
    tokens, kv_dim, stride, blocks, block_size = 5, 256, 3 * 256, 4, 16
    rng = np.random.default_rng(6)
    qkv = rng.standard_normal((tokens, stride)).astype(np.float32)
    slots = np.array([0, 17, 63, 5, 40], dtype=np.int32)
    sentinel = np.full((blocks * block_size, kv_dim), -7.0, dtype=np.float16)
    k_cache, v_cache, qkv_dev = to_device(sentinel), to_device(sentinel), to_device(qkv)
    k_at = np.uintp(int(qkv_dev.gpudata) + 4 * 256)  # k and v sit after q in each row
    v_at = np.uintp(int(qkv_dev.gpudata) + 4 * 512)
    run(kernel("kv_cache.cu", "kv_write"), plan.elementwise_launch(tokens * kv_dim), k_at, v_at,
        np.int32(stride), ptr(to_device(slots)), np.int32(tokens), np.int32(kv_dim),
        ptr(k_cache), ptr(v_cache))
    for cache, first in ((k_cache, 256), (v_cache, 512)):
        expected = sentinel.copy()
        expected[slots] = qkv[:, first : first + kv_dim].astype(np.float16)
        np.testing.assert_array_equal(cache.get().view(np.uint16), expected.view(np.uint16))


def at(array: Any, floats: int) -> np.uintp:
    """The address `floats` float32s into a device array."""
    return np.uintp(int(array.gpudata) + 4 * floats)


def finish_quirks(quirks: str, rng: np.random.Generator, heads: int, kv_heads: int,
                  head_dim: int) -> dict[str, Any]:
    """qkv_finish's per-model arguments: llama rotates part of each head (rope_dim half of it)
    in NORM pairs with frequency factors, qwen2 adds its three biases (NEOX), gemma-3 norms
    q and k heads (NEOX)."""
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    rope_dim = head_dim // 2 if quirks == "llama" else head_dim
    return {
        "biases": [ptr(to_device(rng.standard_normal(n).astype(np.float32)))
                   if quirks == "qwen2" else NULL for n in (q_dim, kv_dim, kv_dim)],
        "norms": [ptr(to_device(rng.uniform(0.5, 1.5, head_dim).astype(np.float32)))
                  if quirks == "gemma3" else NULL for _ in "qk"],
        "eps": np.float32(1e-6), "rope_dim": np.int32(rope_dim),
        "base": np.float64({"llama": 500000.0, "qwen2": 1000000.0, "gemma3": 10000.0}[quirks]),
        "factors": (ptr(to_device(rng.uniform(1.0, 8.0, rope_dim // 2).astype(np.float32)))
                    if quirks == "llama" else NULL),
        "neox": np.int32(quirks != "llama"),
    }


def finish_args(quirks: dict[str, Any], positions: Any, slots: Any, k_cache: Any,
                v_cache: Any) -> tuple[Any, ...]:
    """qkv_finish's arguments from q_bias to v_cache (mul_mat_vec_qkv's after head_dim)."""
    return (*quirks["biases"], *quirks["norms"], quirks["eps"], ptr(positions),
            quirks["rope_dim"], quirks["base"], quirks["factors"], quirks["neox"], ptr(slots),
            ptr(k_cache), ptr(v_cache))


@pytest.mark.parametrize("quirks", ["llama", "qwen2", "gemma3"])
def test_qkv_finish_equals_the_separate_kernels_bit_for_bit(kernel: Kernel, quirks: str) -> None:
    """qkv_finish against add_bias x3 (qwen2), head_rms_norm x2 (gemma-3), rope and kv_write
    run one after another on the same rows: the same bits in the rows and in both caches. The
    llama case rotates part of each head (rope_dim 32 of 64) with frequency factors; padding
    columns past v and cache slots nobody writes stay as they were."""
    tokens, heads, kv_heads, head_dim, block_size = 5, 8, 2, 64, 16
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    stride = q_dim + 2 * kv_dim + 8
    rng = np.random.default_rng({"llama": 1, "qwen2": 2, "gemma3": 3}[quirks])
    qkv = (rng.standard_normal((tokens, stride)) * 3).astype(np.float32)
    positions = np.array([0, 1, 77, 4095, 9], dtype=np.int32)
    slots = np.array([0, 17, 63, 5, 40], dtype=np.int32)
    sentinel = np.full((4 * block_size, kv_dim), -7.0, dtype=np.float16)
    model = finish_quirks(quirks, rng, heads, kv_heads, head_dim)
    biases, norms, eps = model["biases"], model["norms"], model["eps"]
    rope_dim, base, factors, neox = (model[k] for k in ("rope_dim", "base", "factors", "neox"))
    positions_dev, slots_dev = to_device(positions), to_device(slots)

    separate, k_sep, v_sep = to_device(qkv), to_device(sentinel), to_device(sentinel)
    for column, bias, n in zip((0, q_dim, q_dim + kv_dim), biases, (q_dim, kv_dim, kv_dim)):
        if bias != NULL:
            run(kernel("bias.cu", "add_bias"), plan.elementwise_launch(tokens * n),
                at(separate, column), np.int32(stride), bias, np.int32(tokens), np.int32(n))
    for column, norm, count in zip((0, q_dim), norms, (heads, kv_heads)):
        if norm != NULL:
            run(kernel("norm.cu", "head_rms_norm"), plan.head_norm_launch(tokens, count),
                at(separate, column), np.int32(stride), np.int32(count), np.int32(head_dim),
                norm, eps)
    run(kernel("rope.cu", "rope"), plan.rope_launch(tokens, heads + kv_heads), ptr(separate),
        np.int32(stride), ptr(positions_dev), np.int32(heads + kv_heads), np.int32(head_dim),
        rope_dim, base, factors, neox)
    run(kernel("kv_cache.cu", "kv_write"), plan.elementwise_launch(tokens * kv_dim),
        at(separate, q_dim), at(separate, q_dim + kv_dim), np.int32(stride), ptr(slots_dev),
        np.int32(tokens), np.int32(kv_dim), ptr(k_sep), ptr(v_sep))

    fused, k_fused, v_fused = to_device(qkv), to_device(sentinel), to_device(sentinel)
    run(kernel("qkv_finish.cu", "qkv_finish"), plan.qkv_finish_launch(tokens, heads + 2 * kv_heads),
        ptr(fused), np.int32(stride), np.int32(heads), np.int32(kv_heads), np.int32(head_dim),
        *finish_args(model, positions_dev, slots_dev, k_fused, v_fused))

    np.testing.assert_array_equal(fused.get().view(np.uint32), separate.get().view(np.uint32))
    np.testing.assert_array_equal(fused.get()[:, -8:], qkv[:, -8:])
    for got, expected in ((k_fused, k_sep), (v_fused, v_sep)):
        np.testing.assert_array_equal(got.get().view(np.uint16), expected.get().view(np.uint16))
    assert (k_fused.get()[1] == -7.0).all()  # slot 1: nobody's


# (heads, kv_heads, head_dim, n_in, block types of q, k, v) for each fused QKV kernel. The
# matvec's blocks hold 16 rows at n_in 4608 (two K-splits) and 32 below 4096, the mma
# matvec's 16: heads span several blocks, a block holds two or more heads, and heads
# straddle block edges (a block holds parts of two of them); every segment ends in a
# partial block. The CUDA-core matvec serves the types the mma kernel does not (Q4_K,
# Q6_K; Q6_K rows row-planar).
QKV_SHAPES = {
    "matvec": {
        "heads_span_blocks": (5, 1, 72, 4608, ("Q5_K", "Q8_0", "Q5_1")),
        "blocks_hold_heads": (9, 3, 16, 1024, ("Q8_0", "F16", "Q5_0")),
        "heads_straddle_blocks": (6, 2, 24, 512, ("Q5_K", "Q4_1", "BF16")),
    },
    "matvec_mma": {
        "heads_span_blocks": (5, 1, 72, 4608, ("Q4_K", "Q4_K", "Q6_K")),
        "blocks_hold_heads": (12, 4, 8, 512, ("Q6_K", "Q4_K", "Q4_K")),
        "heads_straddle_blocks": (6, 2, 24, 512, ("Q6_K", "Q6_K", "Q4_K")),
    },
    # 64-row blocks: heads of 128 span blocks, blocks hold eight heads of 8, heads of 48
    # straddle block edges.
    "batched": {
        "heads_span_blocks": (3, 1, 128, 512, ("Q4_K", "Q4_K", "Q6_K")),
        "blocks_hold_heads": (16, 8, 8, 544, ("Q8_0", "F16", "Q5_0")),
        "heads_straddle_blocks": (6, 2, 48, 512, ("Q5_K", "Q4_1", "BF16")),
    },
}
QKV_CASES = [(kernels, shape) for kernels, shapes in QKV_SHAPES.items() for shape in shapes]


def product_launch(kernel: Kernel, kernels: str, type_name: str, matrix: Any, rows: int,
                   n_in: int, x: Any, y: Any, y_stride: int, batch: int) -> None:
    """One matrix's product on `kernels` (QKV_SHAPES' keys: mul_mat_vec, mul_mat_vec_mma or
    the batched product)."""
    if kernels == "batched":
        function, launch = (kernel("matmul_batch.cu", plan.batch_kernel(type_name, batch)),
                            plan.batch_launch(rows, batch))
    elif kernels == "matvec":
        function, launch = (kernel("matvec.cu", plan.matvec_kernel(type_name)),
                            plan.matvec_launch(rows, n_in))
    else:
        function, launch = (kernel("matvec_mma.cu", plan.matvec_mma_kernel(type_name)),
                            plan.matvec_mma_launch(rows, n_in))
    run(function, launch, ptr(matrix), np.int64(plan.row_pitch(type_name, n_in)), ptr(x),
        np.int32(n_in + 4), y, np.int32(y_stride), np.int32(rows), np.int32(n_in),
        np.int32(batch))


@pytest.mark.parametrize("batch", [1, 8, 9, 33])
@pytest.mark.parametrize(("kernels", "shape"), QKV_CASES)
@pytest.mark.parametrize("quirks", ["llama", "qwen2", "gemma3"])
def test_fused_qkv_equals_three_products_then_qkv_finish(kernel: Kernel, quirks: str,
                                                         kernels: str, shape: str,
                                                         batch: int) -> None:
    """mul_mat_vec_qkv ("matvec"), mul_mat_vec_mma_qkv ("matvec_mma") and
    mul_mat_batch<N>_qkv ("batched": heads counted per token tile of at most 32 rows):
    products, then each head finished by the block that stores its last rows, against the
    same kernels' product of each matrix into its columns then qkv_finish: the same bits in
    every y row, its padding left NaN, and both caches; the head counters are zero again
    after the launch, and a second launch gives the same bits."""
    heads, kv_heads, head_dim, n_in, types = QKV_SHAPES[kernels][shape]
    counts = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    width, stride, kv_dim = sum(counts), sum(counts) + 2, counts[1]
    rng = np.random.default_rng(batch)
    raws = [finite_blocks(t, n, n_in, rng) for t, n in zip(types, counts)]
    weights = [to_device(device_rows(raw, t, n_in)) for raw, t in zip(raws, types)]
    x = to_device(activations(rng, batch, n_in))
    positions = to_device(rng.integers(0, 8192, batch).astype(np.int32))
    slots = to_device(rng.permutation(4 * batch)[:batch].astype(np.int32))
    model = finish_quirks(quirks, rng, heads, kv_heads, head_dim)
    sentinel = np.full((4 * batch, kv_dim), -7.0, dtype=np.float16)

    separate, k_sep, v_sep = nan_filled(batch, stride), to_device(sentinel), to_device(sentinel)
    for matrix, type_name, rows, column in zip(weights, types, counts,
                                               (0, counts[0], counts[0] + counts[1])):
        product_launch(kernel, kernels, type_name, matrix, rows, n_in, x, at(separate, column),
                       stride, batch)
    run(kernel("qkv_finish.cu", "qkv_finish"), plan.qkv_finish_launch(batch, heads + 2 * kv_heads),
        ptr(separate), np.int32(stride), np.int32(heads), np.int32(kv_heads), np.int32(head_dim),
        *finish_args(model, positions, slots, k_sep, v_sep))

    token_tiles = -(-batch // plan.BATCH_QKV_TOKENS) if kernels == "batched" else 1
    counters = to_device(np.zeros((heads + 2 * kv_heads) * token_tiles, dtype=np.int32))
    segments = []
    for matrix, type_name, rows in zip(weights, types, counts):
        segments += [ptr(matrix), np.int64(plan.row_pitch(type_name, n_in)),
                     np.int32(plan.kernel_type_code(type_name)), np.int32(rows)]
    if kernels == "matvec":
        fused_kernel, fused_launch = (kernel("matvec.cu", "mul_mat_vec_qkv"),
                                      plan.qkv_launch(*counts, n_in))
    elif kernels == "batched":
        fused_kernel, fused_launch = (kernel("matmul_batch.cu", plan.batch_qkv_kernel(batch)),
                                      plan.batch_qkv_launch(counts, batch))
    else:
        fused_kernel, fused_launch = (kernel("matvec_mma.cu", "mul_mat_vec_mma_qkv"),
                                      plan.matvec_mma_qkv_launch(*counts))
    for _ in range(2):  # the first launch must leave the counters as the second needs them
        fused, k_fused, v_fused = (nan_filled(batch, stride), to_device(sentinel),
                                   to_device(sentinel))
        run(fused_kernel, fused_launch, *segments,
            ptr(x), np.int32(n_in + 4), ptr(fused), np.int32(stride), np.int32(n_in),
            np.int32(batch), np.int32(head_dim),
            *finish_args(model, positions, slots, k_fused, v_fused), ptr(counters))
        assert not counters.get().any()
        got = fused.get()
        assert np.isnan(got[:, width:]).all()
        np.testing.assert_array_equal(got.view(np.uint32), separate.get().view(np.uint32))
        for cache, expected in ((k_fused, k_sep), (v_fused, v_sep)):
            np.testing.assert_array_equal(cache.get().view(np.uint16),
                                          expected.get().view(np.uint16))


# --------------------------------------------------------------------------------------------
# Attention


class PagedSequences:
    """Random float16 K/V for sequences of the given lengths, each in its own shuffled blocks
    of one pool, and the float64 attention they should produce."""

    def __init__(self, lengths: list[int], kv_heads: int, head_dim: int, block_size: int,
                 rng: np.random.Generator) -> None:
        self.block_size = block_size
        needed = [-(-n // block_size) for n in lengths]
        pool = rng.permutation(sum(needed) + 3)  # a few blocks belong to nobody
        self.tables = packing.block_table_array(
            [pool[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(lengths))],
            rows=len(lengths), stride=max(needed), fill=0)
        shape = (len(pool), block_size, kv_heads, head_dim)
        self.k = rng.standard_normal(shape).astype(np.float16)
        self.v = rng.standard_normal(shape).astype(np.float16)

    def attend(self, seq: int, q: np.ndarray, position: int, window: int,
               scale: float) -> np.ndarray:
        """q (heads, head_dim) float32 at `position` -> (heads * head_dim,) float64."""
        first = max(0, position - window + 1) if window else 0
        keys = np.arange(first, position + 1)
        blocks = self.tables[seq, keys // self.block_size]
        k = self.k[blocks, keys % self.block_size].astype(np.float64)  # (S, kv_heads, dim)
        v = self.v[blocks, keys % self.block_size].astype(np.float64)
        heads, kv_heads = q.shape[0], k.shape[1]
        kv_of_head = np.arange(heads) // (heads // kv_heads)
        scores = np.einsum("hd,shd->hs", (q * np.float32(scale)).astype(np.float64),
                           k[:, kv_of_head])
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        return np.einsum("hs,shd->hd", weights, v[:, kv_of_head]).ravel()


HEAD_SHAPES = [(8, 2, 128), (4, 1, 256), (4, 4, 64)]
# Decode blocks take a KV head's group of q heads, 8 at most: groups of 8, of 12 (8 + 4 in
# two blocks, with head_dim 96: 12 vectors a row, so 8 of 128 threads idle) and of 3.
DECODE_HEAD_SHAPES = [*HEAD_SHAPES, (16, 2, 64), (24, 2, 96), (9, 3, 64)]


class DecodeRun:
    """attention_decode over `cache` for queries at `positions`: NaN-filled partials (what a
    split leaves unwritten stays NaN), zeroed counters, NaN-filled strided output."""

    def __init__(self, cache: PagedSequences, positions: np.ndarray, heads: int, kv_heads: int,
                 head_dim: int, split_keys: int, splits: int, rng: np.random.Generator) -> None:
        self.cache, self.positions, self.splits = cache, positions, splits
        self.heads, self.kv_heads, self.head_dim, self.split_keys = heads, kv_heads, head_dim, \
            split_keys
        n = len(positions)
        self.q_stride, self.out_stride = heads * head_dim + 32, heads * head_dim + 16
        self.q = rng.standard_normal((n, self.q_stride)).astype(np.float32)
        self.launch = plan.attention_decode_launch(n, heads, kv_heads, splits)
        self.acc = nan_filled(n, heads, splits, head_dim)
        self.best, self.total = nan_filled(n, heads, splits), nan_filled(n, heads, splits)
        self.counters = to_device(np.zeros(n * self.launch.grid[1], dtype=np.int32))
        self.device = {name: to_device(array) for name, array in (
            ("q", self.q), ("k", cache.k), ("v", cache.v), ("tables", cache.tables),
            ("positions", positions))}

    def run(self, kernel: Kernel, window: int) -> np.ndarray:
        """One launch; the output rows (n, out_stride)."""
        out = nan_filled(len(self.positions), self.out_stride)
        d = self.device
        run(kernel("attention.cu", "attention_decode"), self.launch, ptr(d["q"]),
            np.int32(self.q_stride), ptr(d["k"]), ptr(d["v"]), ptr(d["tables"]),
            np.int32(self.cache.tables.shape[1]), ptr(d["positions"]),
            np.int32(self.cache.block_size), np.int32(self.heads), np.int32(self.kv_heads),
            np.int32(self.head_dim), np.float32(self.scale), np.int32(window),
            np.int32(self.split_keys), ptr(self.acc), ptr(self.best), ptr(self.total),
            ptr(self.counters), ptr(out), np.int32(self.out_stride))
        return out.get()

    @property
    def scale(self) -> float:
        return 1.0 / np.sqrt(self.head_dim)

    def check(self, got: np.ndarray, window: int) -> None:
        """Every row against float64 attention, the gaps untouched, the counters back to
        zero, and partials written only by the splits that hold keys, where several do."""
        width = self.heads * self.head_dim
        for s, position in enumerate(self.positions):
            expected = self.cache.attend(s, self.q[s, :width].reshape(self.heads, -1),
                                         int(position), window, self.scale)
            np.testing.assert_allclose(got[s, :width], expected, rtol=1e-4, atol=1e-5)
        assert np.isnan(got[:, width:]).all()
        assert not self.counters.get().any()
        best = self.best.get()
        for s, position in enumerate(self.positions):
            visible = min(int(position) + 1, window) if window else int(position) + 1
            used = min(self.splits, -(-visible // self.split_keys))
            written = ~np.isnan(best[s])  # (heads, splits)
            assert (written[:, :used] == (used > 1)).all() and not written[:, used:].any()


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), DECODE_HEAD_SHAPES)
def test_flash_decoding_over_paged_kv(kernel: Kernel, heads: int, kv_heads: int,
                                      head_dim: int, window: int) -> None:
    """Sequences of 1, 130 and 300 keys over splits of 128: one split written straight to
    the output, two and three merged by the last block."""
    rng = np.random.default_rng(heads + head_dim + window)
    lengths, block_size, split_keys = [1, 130, 300], 16, 128
    cache = PagedSequences(lengths, kv_heads, head_dim, block_size, rng)
    positions = np.array(lengths, dtype=np.int32) - 1
    decode = DecodeRun(cache, positions, heads, kv_heads, head_dim, split_keys,
                       plan.decode_splits(max(lengths), split_keys), rng)
    decode.check(decode.run(kernel, window), window)


@pytest.mark.parametrize("window", [0, 700])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 128), (4, 1, 256),
                                                             (24, 2, 96)])
def test_flash_decoding_long_contexts_many_and_empty_splits(
        kernel: Kernel, heads: int, kv_heads: int, head_dim: int, window: int) -> None:
    """An 8192-key graph grid (128 splits of 64) over sequences of 5, 1000 and 4097 keys
    (most splits empty; with a window of 700 all but 11 or 12); blocks of 32 positions. A
    second launch over the counters the first left gives the same bits, whichever block
    finished last."""
    rng = np.random.default_rng(heads * head_dim + window)
    lengths, block_size, split_keys = [5, 1000, 4097], 32, 64
    cache = PagedSequences(lengths, kv_heads, head_dim, block_size, rng)
    positions = np.array(lengths, dtype=np.int32) - 1
    decode = DecodeRun(cache, positions, heads, kv_heads, head_dim, split_keys,
                       plan.decode_splits(8192, split_keys), rng)
    first = decode.run(kernel, window)
    decode.check(first, window)
    np.testing.assert_array_equal(decode.run(kernel, window).view(np.uint32),
                                  first.view(np.uint32))


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEAD_SHAPES)
def test_causal_prefill_over_a_cached_prefix(kernel: Kernel, heads: int, kv_heads: int,
                                             head_dim: int, window: int) -> None:
    """Item 0: a fresh 37-token prompt; item 1: 20 tokens after a 100-token cached prefix."""
    rng = np.random.default_rng(heads * head_dim + window)
    starts, counts, block_size = [0, 100], [37, 20], 16
    cache = PagedSequences([s + n for s, n in zip(starts, counts)], kv_heads, head_dim,
                           block_size, rng)
    first_rows = np.array([0, counts[0]], dtype=np.int32)
    width = heads * head_dim
    q = rng.standard_normal((sum(counts), width)).astype(np.float32)
    out = nan_filled(sum(counts), width)
    scale = 1.0 / np.sqrt(head_dim)
    run(kernel("attention.cu", "attention_prefill"),
        plan.attention_prefill_launch(max(counts), heads, len(counts)), ptr(to_device(q)),
        np.int32(width), ptr(to_device(cache.k)), ptr(to_device(cache.v)),
        ptr(to_device(cache.tables)), np.int32(cache.tables.shape[1]),
        ptr(to_device(first_rows)), ptr(to_device(np.array(counts, dtype=np.int32))),
        ptr(to_device(np.array(starts, dtype=np.int32))), np.int32(block_size), np.int32(heads),
        np.int32(kv_heads), np.int32(head_dim), np.float32(scale), np.int32(window), ptr(out),
        np.int32(width))
    got = out.get()
    for item, (start, count) in enumerate(zip(starts, counts)):
        for i in range(count):
            row = first_rows[item] + i
            expected = cache.attend(item, q[row].reshape(heads, head_dim), start + i, window,
                                    scale)
            np.testing.assert_allclose(got[row], expected, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Token candidates


def csr(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.concatenate([[0], np.cumsum([len(v) for v in lists])]).astype(np.int32)
    flat = np.array([i for v in lists for i in v], dtype=np.int32)
    return offsets, flat if flat.size else np.zeros(1, dtype=np.int32)


def test_penalties_and_biases_equal_the_samplers_float64_math(kernel: Kernel) -> None:
    vocab = 5000
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal((3, vocab)) * 5).astype(np.float32)
    logits[0, 5] = 0.0
    repeated = [[5, 17, 900], [], [1, 2, 3, 4999]]
    counted = [[17, 40], [7], []]
    counts = [[2, 1], [3], []]
    repetition = np.array([1.3, 1.0, 0.8])
    presence = np.array([0.5, 0.2, 0.0])
    frequency = np.array([0.1, 0.3, 0.0])
    # Logit biases on a penalized token (17), a plain one, and none on row 1.
    biased = [[3, 17], [], [4999]]
    biases = [[-100.0, 7.25], [], [100.0]]
    rep_offsets, rep_ids = csr(repeated)
    count_offsets, count_ids = csr(counted)
    _, count_values = csr(counts)
    bias_offsets, bias_ids = csr(biased)
    bias_values = np.array([b for row in biases for b in row], dtype=np.float64)
    logits_dev = to_device(logits)
    run(kernel("candidates.cu", "apply_penalties"), plan.penalties_launch(3), ptr(logits_dev),
        np.int32(vocab), ptr(to_device(rep_offsets)), ptr(to_device(rep_ids)),
        ptr(to_device(repetition)), ptr(to_device(count_offsets)), ptr(to_device(count_ids)),
        ptr(to_device(count_values)), ptr(to_device(presence)), ptr(to_device(frequency)),
        ptr(to_device(bias_offsets)), ptr(to_device(bias_ids)), ptr(to_device(bias_values)))
    expected = logits.copy()
    for row in range(3):
        ids = sorted(set(repeated[row]) | set(counted[row]))
        values = logits[row, ids].astype(np.float64)
        in_rep = np.isin(ids, repeated[row])
        values = np.where(in_rep, np.where(values > 0, values / repetition[row],
                                           values * repetition[row]), values)
        c = np.zeros(len(ids))
        c[np.searchsorted(ids, counted[row])] = counts[row]
        values -= presence[row] * (c > 0) + frequency[row] * c
        expected[row, ids] = values.astype(np.float32)
        expected[row, biased[row]] = (expected[row, biased[row]].astype(np.float64)
                                      + biases[row]).astype(np.float32)
    np.testing.assert_array_equal(logits_dev.get().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("vocab", [1000, 262144])
def test_token_mask_equals_apply_token_masks(kernel: Kernel, vocab: int) -> None:
    """Rows 1, 2 and 4 of 5 masked, packed by row_arrays: random words (sign bits set too),
    only the last token allowed, every token allowed. Bit for bit apply_token_masks; the
    unmasked rows and the allowed logits are neither read nor written (their NaNs stay).
    1000 ids: a partial last word and a partial last block."""
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((5, vocab)) * 4).astype(np.float32)
    logits[[0, 4], [7, vocab - 1]] = np.nan
    masks = rng.integers(0, 1 << 32, (3, mask_words(vocab)), dtype=np.uint32)
    masks[1] = 0
    masks[1, -1] = 1 << ((vocab - 1) % 32)
    masks[2] = 0xFFFFFFFF
    masks = masks.view(np.int32)
    rows = [RowInputs(), RowInputs(allowed=masks[0]), RowInputs(allowed=masks[1]), RowInputs(),
            RowInputs(allowed=masks[2])]
    packed = row_arrays(rows, vocab)
    logits_dev = to_device(logits)
    run(kernel("candidates.cu", "apply_token_mask"), plan.token_mask_launch(3, vocab),
        ptr(logits_dev), np.int32(vocab), ptr(to_device(packed.arrays["mask_rows"])),
        ptr(to_device(packed.arrays["mask_words"])))
    expected = logits.copy()
    apply_token_masks(expected, rows)
    got = logits_dev.get()
    assert_same_floats(got, expected)
    assert np.isfinite(got[2]).sum() == 1 and np.isnan(got[4, vocab - 1])


def top_candidate_records(kernel: Kernel, logits: np.ndarray, arrays: dict[str, np.ndarray],
                          width: int) -> np.ndarray:
    """top_candidates' records for rows packed by cuda_packing.row_arrays; the launch must
    leave its counters zero."""
    rows, vocab = logits.shape
    out = to_device(np.full((rows, plan.candidate_record_words(width)), -1, np.int32))
    partials = to_device(np.full((rows, plan.MAX_SLICES * plan.SLICE_WORDS), -1, np.int32))
    counters = to_device(np.zeros(rows, np.int32))
    run(kernel("candidates.cu", "top_candidates"), plan.candidates_launch(rows, width, vocab),
        ptr(to_device(logits)), np.int32(vocab), ptr(to_device(arrays["least"])),
        ptr(to_device(arrays["most"])), ptr(to_device(arrays["mass"])),
        ptr(to_device(arrays["inv_temp"])), np.int32(width), ptr(out), ptr(partials),
        ptr(counters))
    assert not counters.get().any()
    return out.get()


def assert_exact_candidates(records: np.ndarray, logits: np.ndarray, ks: list[int],
                            inv_temp: list[float], width: int) -> None:
    """Each row's first k ids and logits are the exact top k (ties by the lower id); its
    log_z within 1e-4 of float64 (NaN for a row with no finite logit)."""
    vocab = logits.shape[1]
    for row, k in enumerate(ks):
        order = np.lexsort((np.arange(vocab), -logits[row]))[:k]
        np.testing.assert_array_equal(records[row, 2 : 2 + k], order)
        np.testing.assert_array_equal(records[row, 2 + width : 2 + width + k].view(np.uint32),
                                      logits[row, order].view(np.uint32))
        top = np.float64(logits[row, order[0]])
        log_z = records[row, 1:2].view(np.float32)[0]
        if not np.isfinite(top):
            assert np.isnan(log_z)
            continue
        expected = np.log(np.exp((logits[row].astype(np.float64) - top) * inv_temp[row]).sum())
        assert abs(log_z - expected) <= 1e-4


@pytest.mark.parametrize("vocab", [3000, 50000])
@pytest.mark.parametrize("k", [1, 7, 64, 1024])
def test_top_candidates_argmax_and_log_partition(kernel: Kernel, k: int, vocab: int) -> None:
    """Rows: plain normal; heavy ties (5 distinct values); signed zeros and -inf; all equal.
    Candidates and their order are exact; log_z within 1e-4; no mass asked: count = k. With
    50000 ids, k <= 64 rows are cut into 13 slices (ties across slices)."""
    rng = np.random.default_rng(9)
    logits = np.stack([
        rng.standard_normal(vocab),
        rng.integers(0, 5, vocab),
        np.where(rng.random(vocab) < 0.5, -0.0, 0.0),
        np.full(vocab, 1.5),
    ]).astype(np.float32)
    logits[2, ::7] = -np.inf
    logits[2, 11] = 0.25
    inv_temp = [1.0, 0.5, 2.0, 1.0]
    packed = row_arrays([RowInputs(candidates=k, max_candidates=k, inv_temp=t)
                         for t in inv_temp], vocab)
    records = top_candidate_records(kernel, logits, packed.arrays, k)
    assert (records[:, 0] == k).all()
    assert_exact_candidates(records, logits, [k] * len(logits), inv_temp, k)


def test_top_candidates_mixes_sliced_and_whole_rows(kernel: Kernel) -> None:
    """A 262144-id launch (32 slices) whose rows ask for 1, 64, 65, 1024, 1 and 33
    candidates (k <= 64 sliced, the others whole): the top logit in the last slice, at the
    first id, twice in a whole row and twice across slices; row 4 all -inf: one candidate
    (id 0), log_z NaN. A second launch over the counters the first left gives the same
    records."""
    vocab = 262144
    rng = np.random.default_rng(13)
    logits = (rng.standard_normal((6, vocab)) * 3).astype(np.float32)
    logits[0, vocab - 5] = 40.0
    logits[1, 0] = 40.0
    logits[2, [9000, 200000]] = 40.0
    logits[5, [100, 250000]] = 40.0
    logits[4] = -np.inf
    ks = [1, 64, 65, 1024, 1, 33]
    inv_temp = [1.0, 0.7, 1.3, 1.0, 1.0, 2.0]
    packed = row_arrays([RowInputs(candidates=k, max_candidates=k, inv_temp=t)
                         for k, t in zip(ks, inv_temp)], vocab)
    records = top_candidate_records(kernel, logits, packed.arrays, packed.width)
    np.testing.assert_array_equal(records[:, 0], [1, 64, 65, 1024, 1, 33])
    assert_exact_candidates(records, logits, ks, inv_temp, packed.width)
    np.testing.assert_array_equal(
        top_candidate_records(kernel, logits, packed.arrays, packed.width), records)


def test_top_candidates_count_follows_the_mass_rule(kernel: Kernel) -> None:
    """Counts as the numpy twin (float32 sums in another order: one either way at a
    boundary), and never short of the contract: at least `candidates`, the mass reached or
    the row's most. Rows asking for up to 64 (over 5 slices) and for more."""
    vocab = 20000
    rng = np.random.default_rng(12)
    rows = random_row_inputs(rng, 16, vocab)
    logits = (rng.standard_normal((16, vocab)) * 4).astype(np.float32)
    packed = row_arrays(rows, vocab)
    records = top_candidate_records(kernel, logits, packed.arrays, packed.width)
    twin = top_candidates_twin(logits, packed.arrays, packed.width)
    for row, inputs in enumerate(rows):
        count, most = int(records[row, 0]), int(packed.arrays["most"][row])
        assert abs(count - int(twin[row, 0])) <= 1
        assert min(inputs.candidates, vocab) <= count <= most
        ids = records[row, 2 : 2 + count]
        np.testing.assert_array_equal(ids, twin[row, 2 : 2 + count])
        if inputs.mass > 0 and count < most:
            weights = np.exp((logits[row].astype(np.float64) - logits[row].max())
                             * inputs.inv_temp)
            assert weights[ids].sum() >= inputs.mass * weights.sum() * (1 - 1e-5)
