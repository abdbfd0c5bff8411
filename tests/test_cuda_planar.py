"""The row-planar Q6_K layout mul_mat_vec_mma_q6_K reads (cuda_plan.planar_q6_K_rows) against
a byte-by-byte reading of its definition, its inverse (the emulator's), the emulated
tensor-core matvec reading a planar copy (right with it, wrong with the file's layout), and
which launches read the planar copies (the matvec_mma route's Q6_K products alone)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from actors.compute import cuda_launches as launches
from actors.compute import cuda_plan as plan
from actors.compute import cuda_weights as weights
from actors.errors import InvalidRequest
from actors.model.arch import spec_from_gguf
from actors.model.forward import gelu_tanh
from actors.model.gguf.quantizers import quantize
from actors.model.gguf.quants import dequantize
from actors.model.gguf.reader import TensorInfo, open_gguf
from actors.model.step import StepItem, plan_step
from tests.conftest import TINY_MODELS
from tests.cuda_emulator import KernelTwins, Memory, file_q6_K_rows


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
    with pytest.raises(InvalidRequest, match="only Q6_K"):
        weights.device_rows(np.zeros((2, 144), dtype=np.uint8), "Q4_K", 256, planar=True)


ROWS, N_IN, BATCH = 24, 768, 3  # three blocks a row: the planar layout differs from the file's


def _upload(memory: Memory, raw: np.ndarray, planar: bool) -> int:
    """The device image of a (ROWS, N_IN) Q6_K matrix (the planar copy or the file layout)
    at a fresh address, as the backend uploads it."""
    info = TensorInfo("m", "Q6_K", 14, (ROWS, N_IN), 0, raw.size)
    address = memory.allocate(weights.device_tensor_bytes(info))
    for at, data in weights.device_bytes_of(raw, info, chunk_rows=10, planar=planar):
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
        gelu_tanh(gates, np.empty_like(gates)) * (x @ decoded["up"].T), rtol=1e-3, atol=1e-3)


DECODE_AND_PREFILL = [StepItem((5,), 3, (0,)), StepItem((7, 8, 9), 0, (1,))]


@pytest.mark.parametrize("untied", [False, True])
def test_only_the_matvec_mma_route_reads_planar_copies_of_the_q6_K_matrices_it_multiplies(
        untied: bool) -> None:
    """The tiny qwen2 (Q6_K tied embedding, v and down of layer 2) on each route: the mma
    route's Q6_K products, gate+up and the logits rows' included, read the planar copies and
    every other launch the file's layout. A Q6_K embedding that only get_rows reads (beside
    an output matrix) has no planar copy."""
    with open_gguf(TINY_MODELS["qwen2-q4k-tiny"]) as gguf:
        spec, layouts = spec_from_gguf(gguf), launches.tensor_layouts(gguf)
    embedding = layouts["token_embd.weight"]
    if untied:  # an output matrix of its own; gate and up of a layer in Q6_K too
        spec = dataclasses.replace(spec, tied_output=False)
        layouts["output.weight"] = launches.MatrixLayout("Q4_K", embedding.rows,
                                                         embedding.row_length)
        for part in ("gate", "up"):
            matrix = layouts[f"blk.1.ffn_{part}.weight"]
            layouts[f"blk.1.ffn_{part}.weight"] = dataclasses.replace(matrix, type_name="Q6_K")
    q6_K = {name for name, matrix in layouts.items() if matrix.type_name == "Q6_K"}
    expected = q6_K - {"token_embd.weight"} if untied else q6_K
    shape = launches.step_shape(plan_step(DECODE_AND_PREFILL, spec, 64, 16), 8,
                                launches.split_keys_for(spec.context_length),
                                spec.context_length)
    for route in plan.DECODE_ROUTES:
        planar = launches.planar_copies(spec, layouts, route)
        assert planar == (expected if route == "matvec_mma" else frozenset()), route
        calls = launches.forward_calls(spec, layouts, shape, launches.TILE_INPUT, route)
        for call in calls:
            matrices = [arg.name for arg in call.args if isinstance(arg, launches.Ref)
                        and arg.name.removesuffix(plan.PLANAR_SUFFIX) in layouts]
            # mul_mat_vec_mma_qkv reads each segment as its type's mma kernel does
            reads_planar = [call.kernel.startswith("mul_mat_vec_mma_") and (
                call.kernel.endswith("_q6_K") if call.kernel != "mul_mat_vec_mma_qkv"
                else layouts[name.removesuffix(plan.PLANAR_SUFFIX)].type_name == "Q6_K")
                for name in matrices]
            assert [name.endswith(plan.PLANAR_SUFFIX) for name in matrices] == reads_planar, \
                (route, call.kernel, matrices)
        mma_q6_K = [c for c in calls if c.kernel.startswith("mul_mat_vec_mma_")
                    and c.kernel.endswith("_q6_K")]
        assert bool(mma_q6_K) == (route == "matvec_mma")
        if untied and route == "matvec_mma":
            fused = plan.matvec_mma_gate_up_kernel(spec.activation, "Q6_K")
            assert [c.args[:2] for c in mma_q6_K if c.kernel == fused] == [
                (launches.Ref("blk.1.ffn_gate.weight.planar"),
                 launches.Ref("blk.1.ffn_up.weight.planar"))]
