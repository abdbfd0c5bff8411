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


def test_mma_prefetch_needs_each_k_block_loaded_before_the_mmas_of_the_one_before() -> None:
    """mma_prefetch on passes written out: loads (6 a K-block) ahead of the MMAs of the
    K-block before theirs pass; the loads sunk after the first MMAs and a mid-pass branch
    (the SASS ptxas once made of mul_mat_vec_mma_q4_K) fail, and so does either alone."""
    def body(pattern: str) -> list[tuple[int, str, str]]:
        opcodes = {"L": ["LDG.E.128.CONSTANT"], "M": ["HMMA.16816.F32"] * 16, "B": ["BRA"],
                   "i": ["IADD3"]}
        listing = [op for letter in pattern for op in opcodes[letter]]
        return [(16 * i, op, "") for i, op in enumerate(listing)]

    ahead = "LLLLLL" + "iM" + "LLLLLL" + "Mi"
    assert cuda_budget.mma_prefetch(body(ahead))["prefetch_ahead"]
    late = "M" + "B" + "LLLLLLLLLLLL" + "M"
    assert not cuda_budget.mma_prefetch(body(late))["prefetch_ahead"]
    assert not cuda_budget.mma_prefetch(body("LLLLLL" + "M" + "B" + "LLLLLL" + "M"))[
        "prefetch_ahead"]
    assert not cuda_budget.mma_prefetch(body("LLLLLL" + "M" + "M" + "LLLLLL"))[
        "prefetch_ahead"]


@pytest.fixture(scope="module")
def report() -> dict:
    return cuda_budget.budgets()


def test_budget_report(report: dict) -> None:
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
        # no branch among a pass's MMAs (the mid-pass exit let ptxas sink the loads past them)
        assert mma_loop["branches_among_mmas"] == 0, (name, mma_loop)
    llama = report["decode_step"]["llama3_8b_q4_k_m"]
    assert llama["layers"] == 32
    assert llama["kernels_per_layer"] <= cuda_budget.TARGET_KERNELS_PER_LAYER
    tiles = report["decode_step"]["llama3_8b_q4_k_m_decode_tiles"]
    # q, k and v with their finish in one launch on the decode tiles too, gate + up + act one
    assert tiles["kernels_per_layer"] == llama["kernels_per_layer"]
    mma = report["decode_step"]["llama3_8b_q4_k_m_matvec_mma"]
    # q, k and v in one launch on the mma matvec too (mul_mat_vec_mma_qkv)
    assert mma["kernels_per_layer"] == llama["kernels_per_layer"]


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="ptxas interleaves each K-block's loads with the MMAs of the block "
                   "before (register-aware scheduling: the loads' registers are those the MMAs "
                   "free); a register double buffer cannot pin them ahead")
def test_mma_matvec_loads_each_k_block_before_the_mmas_of_the_one_before(report: dict) -> None:
    if cuda_budget.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump is not installed (pip nvidia-cuda-cuobjdump provides one)")
    for name, mma_loop in report["matvec_mma_loops"].items():
        assert mma_loop["prefetch_ahead"], (name, mma_loop)
