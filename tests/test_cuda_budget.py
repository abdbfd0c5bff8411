"""benchmarks/cuda_budget.py runs without a device: ptxas resources and occupancy of the hot
kernels, the matvec inner loops' SASS per weight byte (skipped without cuobjdump) and the
kernels of a decode step."""

from __future__ import annotations

import pytest

from benchmarks import cuda_budget

pytestmark = pytest.mark.skipif(cuda_budget.find_tool("nvcc") is None,
                                reason="nvcc is not installed on this machine")


def test_occupancy_arithmetic_of_sm_90() -> None:
    assert cuda_budget.resident_warps(32, 0, 256) == 64
    assert cuda_budget.resident_warps(128, 1024, 256) == 16  # 4096 registers a warp
    assert cuda_budget.resident_warps(96, 0, 256) == 16  # 2 blocks: 3 would need 73,728
    assert cuda_budget.resident_warps(40, 100 * 1024, 128) == 8  # shared memory bound


def test_budget_report() -> None:
    report = cuda_budget.budgets()
    entries = report["entries"]
    assert set(entries) == {name for names in cuda_budget.HOT_ENTRIES.values()
                            for name in names}
    assert all(e["spills"] == 0 and e["resident_warps_per_sm"] >= 16 for e in entries.values())
    if cuda_budget.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump is not installed (pip nvidia-cuda-cuobjdump provides one)")
    for name, loop in report["matvec_loops"].items():
        assert loop["chunk_row_regions"] == 8, name  # one region per activation row
        assert 0 < loop["batch1_pass_instructions"] < loop["chunk_pass_instructions"]
    # the static budget the Q4_K decode product is held to (the matvec_mma route's),
    # held by its Q6_K twin too (the 8B Q4_K_M's v, down and output)
    assert set(report["matvec_mma_loops"]) == {"mul_mat_vec_mma_q4_K", "mul_mat_vec_mma_q6_K"}
    for name, mma_loop in report["matvec_mma_loops"].items():
        assert mma_loop["sass_per_weight_byte_batch1"] <= cuda_budget.TARGET_SASS_PER_BYTE, name
    llama = report["decode_step"]["llama3_8b_q4_k_m"]
    assert llama["layers"] == 32
    assert llama["kernels_per_layer"] <= cuda_budget.TARGET_KERNELS_PER_LAYER
    tiles = report["decode_step"]["llama3_8b_q4_k_m_decode_tiles"]
    # q, k and v with their finish in one launch on the decode tiles too, gate + up + act one
    assert tiles["kernels_per_layer"] == llama["kernels_per_layer"]
    mma = report["decode_step"]["llama3_8b_q4_k_m_matvec_mma"]
    # q, k and v in one launch on the mma matvec too (mul_mat_vec_mma_qkv)
    assert mma["kernels_per_layer"] == llama["kernels_per_layer"]
