"""actors.compute.cuda_plan: the CUDA backend's host-side decisions, tested without a GPU."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from actors.compute import cuda_launches as launches
from actors.compute import cuda_memory as memory
from actors.compute import cuda_packing as packing
from actors.compute import cuda_plan as plan
from actors.compute import cuda_weights
from actors.errors import ComputeError, InvalidRequest
from actors.model.arch import ModelSpec
from actors.model.gguf.reader import TensorInfo

LLAMA3_8B = ModelSpec(arch="llama", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
                      head_dim=128, ffn_dim=14336, context_length=8192, vocab_size=128256,
                      rms_eps=1e-5, rope_base=500000.0, rope_dim=128, rope_neox=False)


def tensor(name: str, type_name: str, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo(name=name, type_name=type_name, ggml_type=0, shape=shape, offset=0,
                      n_bytes=0)


def test_kernel_sources_are_found_in_the_checkout() -> None:
    found = {path.name for path in plan.kernel_source_dir().glob("*.cu")}
    assert found == set(plan.kernel_entry_points())


def test_kernels_compile_without_fast_math() -> None:
    """Fast math would change expf, division and the decode's rounding: the exact-decode and
    tolerance claims of the kernels assume IEEE float32."""
    options = plan.nvcc_options()
    assert not any("fast" in option or "fmad" in option for option in options)


def test_every_block_type_has_a_kernel_suffix() -> None:
    from actors.model.gguf.quants import FORMATS

    assert set(plan.KERNEL_TYPE_SUFFIX) == set(FORMATS)
    assert plan.kernel_suffix("Q4_K") == "q4_K"
    with pytest.raises(InvalidRequest, match="Q2_K"):
        plan.kernel_suffix("Q2_K")


def test_importing_actors_and_the_plan_never_imports_pycuda() -> None:
    code = ("import sys, actors, actors.compute.cuda_plan; "
            "sys.exit(1 if any(m.startswith('pycuda') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize(("max_batch", "expected"), [
    (1, (1,)), (2, (1, 2)), (5, (1, 2, 4, 8)), (64, (1, 2, 4, 8, 16, 32, 64)),
    (65, (1, 2, 4, 8, 16, 32, 64, 128)),
])
def test_graph_buckets_are_powers_of_two_covering_the_batch(
    max_batch: int, expected: tuple[int, ...]
) -> None:
    assert launches.graph_buckets(max_batch) == expected


def test_bucket_is_the_smallest_that_holds_the_batch() -> None:
    buckets = launches.graph_buckets(64)
    chosen = [launches.bucket_for(n, buckets) for n in range(1, 65)]
    assert chosen[:9] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert all(b >= n and (b == 1 or b // 2 < n) for n, b in enumerate(chosen, start=1))
    for bad in (0, 65):
        with pytest.raises(InvalidRequest):
            launches.bucket_for(bad, buckets)


def test_row_pitch_rounds_rows_up_to_16_bytes() -> None:
    assert plan.row_pitch("Q4_K", 4096) == 16 * 144  # 2304, already aligned
    assert plan.row_pitch("Q8_0", 96) == 112  # 3 blocks of 34 bytes = 102
    assert plan.row_pitch("Q6_K", 256) == 224  # 210
    with pytest.raises(InvalidRequest, match="32-element"):
        plan.row_pitch("F16", 100)


def test_the_weight_arena_pitches_matrices_and_widens_vectors() -> None:
    tensors = [tensor("blk.0.ffn_down.weight", "Q6_K", (4096, 14336)),
               tensor("blk.0.attn_q.weight", "Q8_0", (3, 96)),
               tensor("blk.0.attn_norm.weight", "F16", (4096,))]
    assert [cuda_weights.device_tensor_bytes(t) for t in tensors] == [
        4096 * 56 * 210, 3 * 112, 4096 * 4]
    # each entry where cuMemAlloc would put it: 256-byte boundaries
    assert cuda_weights.weight_arena(tensors) == (
        {"blk.0.ffn_down.weight": 0, "blk.0.attn_q.weight": 4096 * 56 * 210,
         "blk.0.attn_norm.weight": 4096 * 56 * 210 + 512}, 4096 * 56 * 210 + 512 + 4096 * 4)


def test_kv_block_bytes_are_float16_k_and_v_of_every_layer() -> None:
    assert memory.kv_block_bytes(LLAMA3_8B, 16) == 2 * 32 * 16 * 1024 * 2  # 2 MiB


def test_workspace_buffers_scale_with_the_step() -> None:
    small = memory.workspace_buffers(LLAMA3_8B, memory.StepLimits(8, 8, 4, 64))
    big = memory.workspace_buffers(LLAMA3_8B, memory.StepLimits(16, 8, 4, 64))
    assert small["gate_up"] == 8 * 2 * 14336 * 4
    assert small["logits"] == 8 * 128256 * 4
    assert small["partial_acc"] == 8 * 32 * 4 * 128 * 4
    assert small["attention_counters"] == 8 * 32 * 4  # at most one per (sequence, head)
    assert small["qkv_counters"] == (32 + 2 * 8) * 4  # one per head of the qkv row
    # ... per 32-token tile of the batched product's fused QKV, over all of a step's tokens
    # (a prefill chunk takes it too)
    many = memory.workspace_buffers(LLAMA3_8B, memory.StepLimits(64, 33, 4, 64))
    assert many["qkv_counters"] == (32 + 2 * 8) * 2 * 4
    chunk = memory.workspace_buffers(LLAMA3_8B, memory.StepLimits(520, 8, 4, 64))
    assert chunk["qkv_counters"] == (32 + 2 * 8) * 17 * 4
    assert small["candidate_partials"] == 8 * 32 * (2 + 2 * 64) * 4
    assert small["candidate_counters"] == 8 * 4
    assert set(memory.ZEROED_BUFFERS) <= set(small)
    assert big["x"] == 2 * small["x"] and big["logits"] == small["logits"]


def test_memory_plan_gives_the_rest_to_kv_blocks() -> None:
    gib = 1 << 30
    planned = memory.plan_memory(free_bytes=100 * gib, fraction=0.9, weights=5 * gib,
                                 workspace=gib, block_bytes=2 * 1024 * 1024)
    assert planned.kv_blocks == (90 * gib - 6 * gib) // (2 * 1024 * 1024)
    assert planned.kv_bytes <= 84 * gib


def test_memory_plan_refuses_a_model_that_does_not_fit() -> None:
    with pytest.raises(ComputeError, match="MiB short"):
        memory.plan_memory(free_bytes=1 << 30, fraction=0.5, weights=1 << 29, workspace=1,
                           block_bytes=1 << 20)
    with pytest.raises(InvalidRequest, match="fraction"):
        memory.plan_memory(1 << 30, 1.5, 0, 0, 1)


def test_matrix_kernels_are_named_for_the_layout_the_device_holds() -> None:
    """The matvec has entries only for the types the mma matvec does not serve; a Q6_K
    matrix is read row-planar by every other family."""
    assert plan.matvec_kernel("Q8_0") == "mul_mat_vec_q8_0"
    with pytest.raises(InvalidRequest, match="mul_mat_vec_mma"):
        plan.matvec_kernel("Q4_K")
    assert plan.matvec_mma_kernel("Q6_K") == "mul_mat_vec_mma_q6_K"
    assert plan.batch_kernel("Q6_K", 9) == "mul_mat_batch16_f16x2_q6_K_planar"
    assert plan.batch_kernel("BF16", 512, "f16x2") == "mul_mat_batch64_f16x2_bf16"
    assert plan.get_rows_kernel("Q6_K") == "get_rows_q6_K_planar"
    assert plan.get_rows_kernel("Q4_K") == "get_rows_q4_K"
    with pytest.raises(InvalidRequest, match="tile input"):
        plan.batch_kernel("Q4_K", 512, "f16")
    # token tiles fastest: the 8 blocks sharing a 64-row weight tile run together
    assert plan.batch_launch(4096, 512) == plan.Launch((8, 64, 1), (128, 1, 1))
    assert plan.batch_launch(100, 65) == plan.Launch((2, 2, 1), (128, 1, 1))
    assert plan.batch_launch(262144, 9) == plan.Launch((1, 4096, 1), (128, 1, 1))


def test_matvec_splits_follow_n_in_only() -> None:
    """Gate/up (4096 inputs), down (14336) and a small model's 640: the split count is a
    power of two up to the block's warps, the block keeps 256 threads, the grid covers the
    rows; qkv takes the three matrices' blocks one after the other."""
    assert [plan.matvec_splits(n) for n in (640, 2048, 4096, 8192, 14336, 65536)] == \
        [1, 1, 2, 4, 4, 8]
    assert plan.matvec_launch(14336, 4096) == plan.Launch((896, 1, 1), (128, 2, 1))
    assert plan.matvec_launch(4096, 14336) == plan.Launch((512, 1, 1), (64, 4, 1))
    assert plan.matvec_launch(70, 640) == plan.Launch((3, 1, 1), (256, 1, 1))
    assert plan.qkv_launch(4096, 1024, 1024, 4096) == plan.Launch((384, 1, 1), (128, 2, 1))
    assert plan.qkv_launch(4000, 1, 1, 4096).grid == (252, 1, 1)


def test_kernel_type_codes_follow_the_suffix_order() -> None:
    assert [plan.kernel_type_code(t) for t in plan.KERNEL_TYPE_SUFFIX] == list(range(11))
    assert plan.kernel_type_code("Q6_K") == 7
    with pytest.raises(InvalidRequest):
        plan.kernel_type_code("IQ2_XS")


def test_launches_cover_their_work() -> None:
    assert plan.get_rows_launch(7, 4096) == plan.Launch((7, 1, 1), (128, 1, 1))
    assert plan.get_rows_launch(7, 640) == plan.Launch((7, 1, 1), (32, 1, 1))
    assert plan.head_norm_launch(5, 9) == plan.Launch((3, 5, 1), (128, 1, 1))
    assert plan.rope_launch(5, 32) == plan.Launch((32, 5, 1), (64, 1, 1))
    assert plan.elementwise_launch(1000) == plan.Launch((4, 1, 1), (256, 1, 1))
    assert plan.elementwise_launch(1 << 40).grid[0] == plan.GRID_LIMIT
    # A block per KV head and split takes the q heads of its group, 8 at most.
    assert plan.attention_decode_launch(4, 32, 8, 16) == plan.Launch((16, 8, 4), (128, 1, 1))
    assert plan.attention_decode_launch(2, 4, 4, 3) == plan.Launch((3, 4, 2), (128, 1, 1))
    assert plan.attention_decode_launch(1, 24, 2, 1).grid == (1, 4, 1)  # groups of 12: 8 + 4
    assert plan.attention_prefill_launch(13, 8, 2) == plan.Launch((2, 8, 2), (128, 1, 1))
    assert plan.candidates_launch(3, 64, 1000).grid == (1, 3, 1)
    assert plan.candidates_launch(3, 64, 49152).grid == (12, 3, 1)  # slices of 4096 ids
    assert plan.candidates_launch(3, 64, 262144).grid == (32, 3, 1)  # at most 32 slices
    with pytest.raises(InvalidRequest):
        plan.rope_launch(70000, 8)  # past the grid's y limit


def test_decode_splits_cover_the_context() -> None:
    assert plan.decode_splits(8192, 512) == 16
    assert plan.decode_splits(8193, 512) == 17
    with pytest.raises(InvalidRequest, match="multiple of 64"):
        plan.decode_splits(8192, 100)


def test_candidate_count_is_bounded_by_vocab_and_kernel() -> None:
    for bad in (0, 1025):
        with pytest.raises(InvalidRequest):
            plan.candidates_launch(1, bad, 5000)
    with pytest.raises(InvalidRequest):
        plan.candidates_launch(1, 11, 10)


def test_block_tables_are_padded_per_row() -> None:
    table = packing.block_table_array([[4, 5, 6], [], [9]], rows=4, stride=4, fill=-1)
    np.testing.assert_array_equal(table, [[4, 5, 6, -1], [-1] * 4, [9, -1, -1, -1], [-1] * 4])
    assert table.dtype == np.int32
    with pytest.raises(InvalidRequest):
        packing.block_table_array([[1, 2, 3]], rows=1, stride=2, fill=0)
    # The same from a 2-d array (a step's padded tables) and the entries used in each row,
    # wider or narrower than the stride
    for tables in ([[4, 5, 6, 7, 0], [3, 0, 0, 0, 0], [9, 8, 0, 0, 0]], [[4, 5], [3, 1], [9, 8]]):
        np.testing.assert_array_equal(
            packing.block_table_array(np.array(tables), rows=4, stride=4, fill=-1,
                                      used=np.array([2, 0, 1])),
            [[4, 5, -1, -1], [-1] * 4, [9, -1, -1, -1], [-1] * 4])
    with pytest.raises(InvalidRequest):
        packing.block_table_array(np.zeros((1, 3)), rows=1, stride=2, fill=0,
                                  used=np.array([3]))


def test_pack_int32_aligns_each_array_to_16_bytes() -> None:
    packed = packing.pack_int32({"a": np.arange(3, dtype=np.int32),
                              "b": np.arange(10, dtype=np.int32).reshape(2, 5),
                              "c": np.array([7], dtype=np.int32)})
    assert packed.offsets == {"a": 0, "b": 4, "c": 16}
    assert packed.buffer.dtype == np.int32 and packed.buffer.flags.c_contiguous
    assert packed.buffer.size == 20
    np.testing.assert_array_equal(packed.view("b"), np.arange(10).reshape(2, 5))
    np.testing.assert_array_equal(packed.view("c"), [7])


def test_decode_step_pads_to_the_bucket_with_harmless_rows() -> None:
    packed = packing.pack_decode_step(token_ids=[11, 12, 13], positions=[40, 3, 0],
                                   slots=[40 + 16 * 2, 3, 16 * 7], tables=[[0, 1, 2], [5], [7]],
                                   bucket=4, table_stride=3, pad_slot=999, pad_block=63)
    np.testing.assert_array_equal(packed.view("token_ids"), [11, 12, 13, 0])
    np.testing.assert_array_equal(packed.view("positions"), [40, 3, 0, 0])
    np.testing.assert_array_equal(packed.view("slots"), [72, 3, 112, 999])
    np.testing.assert_array_equal(packed.view("block_tables"),
                                  [[0, 1, 2], [5, 63, 63], [7, 63, 63], [63, 63, 63]])
    with pytest.raises(InvalidRequest):
        packing.pack_decode_step([1] * 5, [0] * 5, [0] * 5, [[0]] * 5, 4, 1, 0, 0)
