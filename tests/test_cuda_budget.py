"""benchmarks/cuda_budget.py runs without a device: ptxas resources and occupancy of the hot
kernels, the tensor-core matvec's and the batched product's SASS per weight byte (skipped
without cuobjdump) and the kernels of a decode step."""

from __future__ import annotations

import pytest

from actors.compute import cuda_plan as plan
from benchmarks import cuda_budget

pytestmark = [pytest.mark.skipif(cuda_budget.find_tool("nvcc") is None,
                                 reason="nvcc is not installed on this machine"),
              # the report compiles every hot file: minutes on a loaded two-core machine
              pytest.mark.timeout(1200)]


def test_occupancy_arithmetic_of_sm_90() -> None:
    assert cuda_budget.resident_warps(32, 0, 256) == 64
    assert cuda_budget.resident_warps(128, 1024, 256) == 16  # 4096 registers a warp
    assert cuda_budget.resident_warps(96, 0, 256) == 16  # 2 blocks: 3 would need 73,728
    assert cuda_budget.resident_warps(40, 100 * 1024, 128) == 8  # shared memory bound


def test_mma_prefetch_needs_the_next_k_blocks_loads_before_this_ones_mmas() -> None:
    """mma_prefetch on K-block iterations written out (M: two of the block's 16 MMAs): its
    copies of the next block (cp.async, closed by LDGDEPBAR) or plain loads all ahead of its
    first MMA pass; one load among the MMAs (what ptxas made of register loads), one after
    them, a branch among the MMAs, or no load at all fail."""
    def body(pattern: str) -> list[tuple[int, str, str]]:
        opcodes = {"C": "LDGSTS.E.BYPASS.128", "L": "LDG.E.128.CONSTANT", "D": "LDGDEPBAR",
                   "M": "HMMA.16816.F32", "B": "BRA", "i": "IADD3"}
        return [(16 * i, opcodes[letter], "") for i, letter in enumerate(pattern)]

    ahead = "B" + "CCCCCC" + "D" + "i" + "MMMMMMMM" + "i"
    assert cuda_budget.mma_prefetch(body(ahead)) == {
        "loads_per_block": 6, "loads_before_first_mma": 6, "branches_among_mmas": 0,
        "prefetch_ahead": True}
    assert cuda_budget.mma_prefetch(body("LLLL" + "MMMMMMMM"))["prefetch_ahead"]
    for late in ("CCCCC" + "MMM" + "C" + "MMMMM", "CCCCCC" + "MMMMMMMM" + "C",
                 "CCCCCC" + "MMMM" + "B" + "MMMM", "D" + "MMMMMMMM"):
        assert not cuda_budget.mma_prefetch(body(late))["prefetch_ahead"], late


def test_batch_stage_counts_its_loop_without_the_once_a_chunk_loops_inside() -> None:
    """batch_stage on a listing written out: a stage loop (a barrier, the 8 MMAs of N = 16)
    holding a copy loop; the fit of three stage sizes growing by 20 a column tile."""
    opcodes = ["IADD3", "BAR.SYNC", "LDS", "IADD3", "BRA 2", *["HMMA.16816.F32"] * 8,
               "FFMA", "BRA 1", "EXIT"]  # BRA i: back to instruction i
    listing = [(16 * i, "BRA", f"0x{16 * int(op[4:]):x}") if op.startswith("BRA ")
               else (16 * i, op, "") for i, op in enumerate(opcodes)]
    stage = cuda_budget.batch_stage(listing, 16)
    assert stage == {"stage_instructions": 14 - 3, "chunk_loop_instructions": 3,
                     "hmma_per_stage": 8}
    figures = cuda_budget.batch_figures(
        {n: {"stage_instructions": 60 + 20 * n // 8, "hmma_per_stage": n // 2}
         for n in (16, 32, 64)}, 100.0)
    assert [fit["weights_part"] for fit in figures["fits"]] == [60.0, 60.0]
    assert [fit["per_column_tile"] for fit in figures["fits"]] == [20.0, 20.0]
    assert figures["n64"]["warp_instructions_per_weight_byte"] == 2.2


@pytest.fixture(scope="module")
def report() -> dict:
    return cuda_budget.budgets()


def test_budget_report(report: dict) -> None:
    entries = report["entries"]
    assert set(entries) == {name for names in cuda_budget.HOT_ENTRIES.values()
                            for name in names}
    assert all(e["spills"] == 0 and e["resident_warps_per_sm"] >= 16 for e in entries.values())
    # static and dynamic shared memory within what any supported device gives a block
    assert all(e["shared"] + e["dynamic_shared"] <= cuda_budget.SHARED_PER_BLOCK_ANYWHERE
               for e in entries.values())
    if cuda_budget.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump is not installed (pip nvidia-cuda-cuobjdump provides one)")
    # the static budget the Q4_K decode product of up to 8 rows is held to, held by its Q6_K
    # twin too (the 8B Q4_K_M's v and down)
    assert set(report["matvec_mma_loops"]) == {"mul_mat_vec_mma_q4_K", "mul_mat_vec_mma_q6_K"}
    for name, mma_loop in report["matvec_mma_loops"].items():
        assert mma_loop["sass_per_weight_byte_batch1"] <= cuda_budget.TARGET_SASS_PER_BYTE, name
        # no branch among a pass's MMAs (the mid-pass exit let ptxas sink the loads past them)
        assert mma_loop["branches_among_mmas"] == 0, (name, mma_loop)
        # two tokens a pass share each unpacked fragment: well under twice one token's work
        pair = mma_loop["pair"]
        assert pair["branches_among_mmas"] == 0, (name, pair)
        assert pair["sass_per_weight_byte_a_token"] < 0.7 * mma_loop["sass_per_weight_byte_batch1"]
    # the batched product (decode steps past 8 rows, and the logits): each weight byte
    # fetched and unpacked once a step, whatever the rows
    assert set(report["batch_stages"]) == {"Q4_K", "Q6_K"}
    for name, figures in report["batch_stages"].items():
        for n in plan.BATCH_TOKENS:
            stage = figures[f"n{n}"]
            assert stage["hmma_per_stage"] == n // 2, (name, n)  # 2 k-steps x hi, lo x N / 8
            # a whole step of 64 rows costs less than the mma matvec's budget for one row
            assert stage["warp_instructions_per_weight_byte"] <= cuda_budget.TARGET_SASS_PER_BYTE
        # the weights' part does not grow with the rows: from 32 to 64 columns each added
        # 8-column tile costs its MMAs and a bounded per-token share, nothing per weight byte
        fewer, more = figures["fits"]
        assert more["weights_part_per_weight_byte"] <= 1.1 * fewer["weights_part_per_weight_byte"]
        assert more["per_column_tile"] <= cuda_budget.TARGET_BATCH_COLUMN_TILE, (name, more)
    llama = report["decode_step"]["llama3_8b_q4_k_m"]
    assert llama["layers"] == 32
    assert llama["kernels_per_layer"] <= cuda_budget.TARGET_KERNELS_PER_LAYER
    for streams in (32, 64):
        # q, k and v with their finish in one launch on the batched product too, gate + up
        # + act one
        batched = report["decode_step"][f"llama3_8b_q4_k_m_{streams}_streams"]
        assert batched["kernels_per_layer"] == llama["kernels_per_layer"]
    # A prefill chunk's layer on the batched product: the same count (its attention in place
    # of the decode rows')
    prefill = report["prefill_step"]["llama3_8b_q4_k_m_512_tokens"]
    assert prefill["kernels_per_layer"] == llama["kernels_per_layer"]


def test_mma_matvec_copies_each_k_block_before_the_mmas_of_the_one_before(report: dict) -> None:
    """In the SASS of the mma matvec's K-block loop, the copies of the warp's next K-block
    (cp.async into its staging ring) all come before the first MMA of this one, and no branch
    lies among the MMAs: the next block's bytes fly while this one multiplies."""
    if cuda_budget.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump is not installed (pip nvidia-cuda-cuobjdump provides one)")
    for name, mma_loop in report["matvec_mma_loops"].items():
        for loop in (mma_loop, mma_loop["pair"]):  # a token a pass, and two
            assert loop["prefetch_ahead"], (name, loop)
            assert loop["loads_per_block"] == {"mul_mat_vec_mma_q4_K": 6,
                                               "mul_mat_vec_mma_q6_K": 10}[name]
