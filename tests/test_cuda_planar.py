"""The row-planar Q6_K layout the device holds every Q6_K matrix in
(cuda_plan.planar_q6_K_rows) against a byte-by-byte reading of its definition, its inverse (the
emulator's), the emulated kernels reading a planar matrix (right with it, wrong with the
file's layout), and that every launch reads its Q6_K matrices that way."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from actors.compute import cuda_launches as launches
from actors.compute import cuda_plan as plan
from actors.compute import cuda_weights as weights
from actors.errors import InvalidRequest
from actors.model.arch import spec_from_gguf
from actors.model.gguf.quantizers import quantize
from actors.model.gguf.quants import dequantize
from actors.model.gguf.reader import TensorInfo, open_gguf
from actors.model.step import StepItem, plan_step
from tests.conftest import TINY_MODELS
from tests.cuda_emulator import KernelTwins, Memory, file_q6_K_rows
from tests.cuda_samples import gated_twin, planar_names, tile_product


def planar_offset(nb: int, k: int, i: int) -> int:
    """Where byte i of a row's block k (ql[128], qh[64], scales[16], d[2]) lies in the row:
    the blocks' first 192 bytes one after the other, then their scales, then their d."""
    if i < 192:
        return 192 * k + i
    if i < 208:
        return 192 * nb + 16 * k + i - 192
    return 208 * nb + 2 * k + i - 208


@pytest.mark.parametrize("nb", [1, 2, 3, 16, 56])
def test_planar_rows_move_each_byte_where_the_layout_says(nb: int) -> None:
    rng = np.random.default_rng(nb)
    rows = rng.integers(0, 256, (3, 210 * nb), dtype=np.uint8)
    pitch = plan.row_pitch("Q6_K", 256 * nb)
    expected = np.zeros((3, pitch), dtype=np.uint8)
    for r in range(3):
        for k in range(nb):
            for i in range(210):
                expected[r, planar_offset(nb, k, i)] = rows[r, 210 * k + i]
    planar = plan.planar_q6_K_rows(rows)
    np.testing.assert_array_equal(planar, expected)
    assert planar.dtype == np.uint8 and pitch % plan.ROW_ALIGN == 0
    np.testing.assert_array_equal(file_q6_K_rows(planar, 256 * nb), rows)


def test_planar_rows_refuse_a_row_of_partial_blocks() -> None:
    with pytest.raises(InvalidRequest, match="whole blocks"):
        plan.planar_q6_K_rows(np.zeros((2, 300), dtype=np.uint8))


ROWS, N_IN, BATCH = 24, 768, 3  # three blocks a row: the planar layout differs from the file's


def _upload(memory: Memory, raw: np.ndarray, planar: bool) -> int:
    """The device image of a (ROWS, N_IN) Q6_K matrix at a fresh address: as the backend
    uploads it (the planar copy), or its rows as the file holds them at the same pitch."""
    info = TensorInfo("m", "Q6_K", 14, (ROWS, N_IN), 0, raw.size)
    address = memory.allocate(weights.device_tensor_bytes(info))
    if not planar:
        pitch = plan.row_pitch("Q6_K", N_IN)
        rows = memory.view(address, np.uint8, ROWS * pitch).reshape(ROWS, pitch)
        rows[:, : raw.shape[1]] = raw
        return address
    for at, data in weights.device_bytes_of(raw, info, chunk_rows=10):
        memory.view(address + at, np.uint8, data.size)[:] = data
    return address


def _floats(memory: Memory, values: np.ndarray) -> int:
    address = memory.allocate(values.nbytes)
    memory.view(address, np.float32, values.size)[:] = values.ravel()
    return address


def test_the_emulated_mma_matvec_reads_a_q6_K_matrix_from_its_planar_copy() -> None:
    """mul_mat_vec_mma_q6_K's twin (and its gate+up's) on the planar copy gives the decoded
    matrix's products; on the file's layout it does not, so a wrong layout shows."""
    rng = np.random.default_rng(7)
    memory, pitch = Memory(), np.int64(plan.row_pitch("Q6_K", N_IN))
    twins = KernelTwins(memory)
    gate, up = (quantize(rng.standard_normal((ROWS, N_IN)).astype(np.float32), "Q6_K")
                for _ in range(2))
    x = rng.standard_normal((BATCH, N_IN)).astype(np.float32)
    x_at, y_at = _floats(memory, x), memory.allocate(4 * BATCH * ROWS)
    grid = plan.matvec_mma_launch(ROWS, N_IN).grid
    sizes = (np.int32(ROWS), np.int32(N_IN), np.int32(BATCH))

    def matvec(weights_at: int) -> np.ndarray:
        twins.launch(plan.matvec_mma_kernel("Q6_K"), grid,
                     (np.uintp(weights_at), pitch, np.uintp(x_at), np.int32(N_IN),
                      np.uintp(y_at), np.int32(ROWS), *sizes))
        return memory.view(y_at, np.float32, BATCH * ROWS).reshape(BATCH, ROWS).copy()

    decoded = {name: dequantize(raw, "Q6_K", (ROWS, N_IN)) for name, raw in
               (("gate", gate), ("up", up))}
    expected = x @ decoded["gate"].T
    np.testing.assert_allclose(matvec(_upload(memory, gate, planar=True)), expected,
                               rtol=1e-4, atol=1e-3)
    assert not np.allclose(matvec(_upload(memory, gate, planar=False)), expected, atol=1e-1)
    twins.launch(plan.matvec_mma_gate_up_kernel("gelu_tanh", "Q6_K"),
                 plan.matvec_mma_launch(2 * ROWS, N_IN).grid,
                 (np.uintp(_upload(memory, gate, planar=True)),
                  np.uintp(_upload(memory, up, planar=True)), pitch, np.uintp(x_at),
                  np.int32(N_IN), np.uintp(y_at), np.int32(ROWS), *sizes))
    gates = expected.astype(np.float32)
    np.testing.assert_allclose(
        memory.view(y_at, np.float32, BATCH * ROWS).reshape(BATCH, ROWS),
        gated_twin("gelu_tanh", gates, x @ decoded["up"].T), rtol=1e-3, atol=1e-3)


def test_the_emulated_planar_batched_product_and_gather_read_a_row_planar_matrix() -> None:
    """mul_mat_batch<N>_f16x2_q6_K_planar's twin on a planar matrix gives the batched
    product's sums of the decoded matrix, and get_rows_q6_K_planar's the decoded rows; on the
    file's layout they do not."""
    rng = np.random.default_rng(9)
    memory, pitch = Memory(), np.int64(plan.row_pitch("Q6_K", N_IN))
    twins = KernelTwins(memory)
    raw = quantize(rng.standard_normal((ROWS, N_IN)).astype(np.float32), "Q6_K")
    tokens = 12
    x = rng.standard_normal((tokens, N_IN)).astype(np.float32)
    x_at = _floats(memory, x)
    grid = plan.batch_launch(ROWS, tokens).grid

    def products(kernel: str, planar: bool) -> np.ndarray:
        y_at = memory.allocate(4 * tokens * ROWS)
        twins.launch(kernel, grid, (np.uintp(_upload(memory, raw, planar)), pitch,
                                    np.uintp(x_at), np.int32(N_IN), np.uintp(y_at),
                                    np.int32(ROWS), np.int32(ROWS), np.int32(N_IN),
                                    np.int32(tokens)))
        return memory.view(y_at, np.float32, tokens * ROWS).copy()

    planar_kernel = plan.batch_kernel("Q6_K", tokens)
    expected = tile_product(dequantize(raw, "Q6_K", (ROWS, N_IN)), x, "Q6_K").astype(
        np.float32).ravel()
    np.testing.assert_array_equal(products(planar_kernel, planar=True), expected)
    assert not np.allclose(products(planar_kernel, planar=False), expected, atol=1e-1)

    ids = np.array([3, 0, ROWS - 1], dtype=np.int32)
    ids_at = memory.allocate(ids.nbytes)
    memory.view(ids_at, np.int32, ids.size)[:] = ids
    out_at = memory.allocate(4 * ids.size * N_IN)
    for planar in (True, False):
        twins.launch(plan.get_rows_kernel("Q6_K"), (ids.size, 1, 1),
                     (np.uintp(_upload(memory, raw, planar)), pitch, np.uintp(ids_at),
                      np.uintp(out_at), np.int32(N_IN), np.float32(0.5)))
        gathered = memory.view(out_at, np.float32, ids.size * N_IN).reshape(ids.size, N_IN)
        expected = dequantize(raw, "Q6_K", (ROWS, N_IN))[ids] * np.float32(0.5)
        assert np.array_equal(gathered, expected) == planar


# A decode row, a short prefill item (the matvec's length) and a long one (the batched
# product's).
STEP_ITEMS = [StepItem((5,), 3, (0,)), StepItem((7, 8, 9), 0, (1,)),
              StepItem(tuple(range(10, 22)), 0, (2,))]


def _reads_planar(kernel: str, layout: launches.MatrixLayout) -> bool:
    """Whether `kernel` reads a matrix of `layout`'s type row-planar: the planar entries
    (the batched product's, get_rows), and the Q6_K products of mul_mat_vec_mma (its qkv per
    segment) and of the batched QKV (a segment's type code is its held type's)."""
    batched_qkv = kernel.startswith("mul_mat_batch") and "_qkv_" in kernel
    return kernel.endswith(plan.PLANAR_KERNEL) or (
        (kernel.startswith("mul_mat_vec_mma_") or batched_qkv) and layout.type_name == "Q6_K")


@pytest.mark.parametrize("untied", [False, True])
def test_every_q6_K_matrix_lies_row_planar_and_is_read_so(untied: bool) -> None:
    """The tiny qwen2 (Q6_K tied embedding, v and down of layer 2): every Q6_K matrix lies on
    the device row-planar, once, and each launch that reads one (the mma matvec's products,
    gate + up and qkv, the logits rows, the batched product's and its qkv, the embedding
    gather; short
    prefill items on the matvec) reads that layout; no launch reads a matrix in a layout it
    does not have."""
    with open_gguf(TINY_MODELS["qwen2-q4k-tiny"]) as gguf:
        spec = spec_from_gguf(gguf)
        layouts = launches.tensor_layouts(gguf)
    q6_K = {name for name, matrix in layouts.items() if matrix.type_name == "Q6_K"}
    assert "token_embd.weight" in q6_K and len(q6_K) == 3
    if untied:  # its own output matrix; gate and up of a layer in Q6_K too
        spec = dataclasses.replace(spec, tied_output=False)
        embedding = layouts["token_embd.weight"]
        layouts["output.weight"] = launches.MatrixLayout("Q4_K", embedding.rows,
                                                         embedding.row_length)
        for part in ("gate", "up"):
            name = f"blk.1.ffn_{part}.weight"
            layouts[name] = dataclasses.replace(layouts[name], type_name="Q6_K")
    shape = launches.step_shape(plan_step(STEP_ITEMS, spec, 64, 16), 8,
                                launches.split_keys_for(spec.context_length),
                                spec.context_length)
    planar = planar_names(layouts)
    assert planar == q6_K | ({"blk.1.ffn_gate.weight", "blk.1.ffn_up.weight"} if untied
                             else set())
    calls = launches.forward_calls(spec, layouts, shape, launches.TILE_INPUT)
    read = set()
    for call in calls:
        for arg in call.args:
            if isinstance(arg, launches.Ref) and arg.name in layouts:
                layout = layouts[arg.name]
                if layout.type_name == "F32":
                    continue  # vectors, and float32 rows gathered by get_rows_f32
                assert layout.planar == _reads_planar(call.kernel, layout), \
                    (call.kernel, arg.name)
                read.add((call.kernel, arg.name))
    assert {kernel for kernel, name in read if name in planar} >= {
        "get_rows_q6_K_planar", "mul_mat_batch16_f16x2_q6_K_planar", "mul_mat_vec_mma_q6_K",
        "mul_mat_vec_mma_qkv", "mul_mat_batch16_qkv_f16x2"}
    assert launches.row_runs(shape) == [launches.RowRun(0, 4, launches.MATVEC),
                                        launches.RowRun(4, 12, launches.BATCH)]
    if untied:
        fused = plan.matvec_mma_gate_up_kernel(spec.activation, "Q6_K")
        assert [c.args[:2] for c in calls if c.kernel == fused] == [
            (launches.Ref("blk.1.ffn_gate.weight"), launches.Ref("blk.1.ffn_up.weight"))]


def test_every_q6_K_entry_reads_the_row_planar_layout() -> None:
    """Only Q6_K lies row-planar; its batched product's and get_rows' entries
    are their planar ones, the mma matvec's read that layout, the CUDA-core matvec has none."""
    assert [plan.holds_planar(t) for t in ("Q6_K", "Q4_K")] == [True, False]
    entries = {e for file in plan.kernel_entry_points().values() for e in file}
    q6_K = {e for e in entries if "_q6_K" in e}
    assert {e for e in q6_K if not e.endswith(plan.PLANAR_KERNEL)} == {
        plan.matvec_mma_kernel("Q6_K"),
        *(plan.matvec_mma_gate_up_kernel(a, "Q6_K") for a in plan.ACTIVATIONS)}
    assert {plan.batch_kernel("Q6_K", 512), plan.get_rows_kernel("Q6_K"),
            plan.batch_kernel("Q6_K", 9)} <= q6_K
    with pytest.raises(InvalidRequest, match="mul_mat_vec_mma"):
        plan.matvec_kernel("Q6_K")
