"""Static budgets of the CUDA kernels, measured without a device.

    python benchmarks/cuda_budget.py [--json] [--gemma PATH]

1. Resources: every cuda_src/*.cu compiled for sm_90 (nvcc -cubin with the backend's
   options, ptxas -v): per hot entry point its registers, shared memory, spills, and the
   resident warps per SM that follow from sm_90's limits (65,536 registers allocated per warp
   in units of 256, 228 KB shared memory with 1 KB reserved per block, 64 warps, 32 blocks)
   for the block size the launch plan gives it.
2. The tensor-core matvec's inner loop (decode steps of up to 8 rows): the SASS (cuobjdump
   -sass) of mul_mat_vec_mma_q4_K / _q6_K, its K-block loop (the innermost loop, found by its
   backward branch, holding a K-block's 16 MMAs, a quarter of two rows' blocks a lane: 72
   weight bytes for Q4_K, 105 for Q6_K): its SASS instructions per weight byte, and whether its
   prefetch holds in the SASS: the copies of the K-block ahead (cp.async's LDGSTS, or plain
   loads) all issued before the first MMA of the block before it, no branch among its MMAs.
3. The batched product mul_mat_batch<N>_f16x2_q4_K / _q6_K_planar at N = 16, 32, 64 token
   columns (decode steps past 8 rows, the logits, prefill chunks at 64): its stage loop (the
   smallest loop holding a barrier and the stage's MMAs, 4 N / 8 of them a warp), counted
   statically (each branch's code once), the once-a-chunk loops inside it (the weight copies
   and the scale table) apart. A warp's stage takes 16 rows x 32 elements of weights (Q4_K
   288 bytes, Q6_K 420), so per weight byte of the step: the stage's warp instructions and
   HMMAs. Fitted to a + b x (N / 8): `a` (the weights' fetch and unpack, the pipeline) must
   not grow with N, and `b` is what each 8-column MMA tile costs beside its 4 HMMAs (its
   activation fragments, its epilogue, its share of the activations' copy and split).
4. Kernels of one decode step, from actors.compute.cuda_launches.forward_calls +
   candidate_calls: the Llama-3-8B shape of benchmarks/synthetic_gguf.py (Q4_K_M types) at one
   stream (the mma matvec) and at 32 and 64 (the batched product), and gemma-3 (the default
   model's file) at one stream; and of a 512-token prefill chunk of the 8B shape (the batched
   product).
Targets: Q4_K inner loop <= 4 SASS instructions per weight byte (the batched product: per
weight byte of a whole step, at any N), its weights' part not growing with N and at most
TARGET_BATCH_COLUMN_TILE instructions a column tile; no hot kernel below 16 resident warps per
SM; <= 7 kernels per layer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.compute import cuda_plan as plan  # noqa: E402

ARCH = "sm_90"
REGISTERS_PER_SM, REGISTER_UNIT = 65536, 256  # registers are allocated per warp in 256s
SHARED_PER_SM, SHARED_RESERVED_PER_BLOCK = 228 * 1024, 1024
# The most shared memory a block may ask for on the smallest of the supported devices (sm_86
# and sm_89: 99 KB; sm_80 163 KB, sm_90 227 KB).
SHARED_PER_BLOCK_ANYWHERE = 99 * 1024
WARPS_PER_SM, BLOCKS_PER_SM = 64, 32
TARGET_SASS_PER_BYTE, TARGET_WARPS, TARGET_KERNELS_PER_LAYER = 4.0, 16, 7
# The batched product's warp instructions a stage per 8-column MMA tile (its 4 HMMAs, its
# activation fragments and epilogue, its share of the activations' copy and split).
TARGET_BATCH_COLUMN_TILE = 64
KV_BLOCK_SIZE = 16  # tokens a KV block of the steps whose kernels are counted

# Hot entry points and their threads per block (from the launch plan's geometry).
_MATVEC_THREADS = math.prod(plan.matvec_launch(4096, 4096).block)
HOT_ENTRIES = {
    "matvec.cu": {name: _MATVEC_THREADS for name in (
        "mul_mat_vec_q5_K", "mul_mat_vec_q8_0", "mul_mat_vec_bf16",
        "mul_mat_vec_gate_up_silu_q5_K", "mul_mat_vec_gate_up_gelu_tanh_q8_0",
        "mul_mat_vec_qkv")},
    "matmul_batch.cu": {
        **{plan.batch_kernel(t, n): plan.BATCH_THREADS
           for t in ("Q4_K", "Q6_K") for n in plan.BATCH_TOKENS},
        **{plan.batch_gate_up_kernel("silu", "Q4_K", n): plan.BATCH_THREADS
           for n in plan.BATCH_TOKENS},
        **{plan.batch_qkv_kernel(n): plan.BATCH_THREADS
           for n in plan.BATCH_TOKENS if n <= plan.BATCH_QKV_TOKENS}},
    "matvec_mma.cu": {"mul_mat_vec_mma_q4_K": plan.MATVEC_MMA_THREADS,
                      "mul_mat_vec_mma_gate_up_silu_q4_K": plan.MATVEC_MMA_THREADS,
                      "mul_mat_vec_mma_q6_K": plan.MATVEC_MMA_THREADS,
                      "mul_mat_vec_mma_gate_up_silu_q6_K": plan.MATVEC_MMA_THREADS,
                      "mul_mat_vec_mma_qkv": plan.MATVEC_MMA_THREADS},
    "attention.cu": {"attention_decode": plan.DECODE_THREADS,
                     "attention_prefill": plan.ATTN_WARPS * 32},
    "norm.cu": {"residual_rms_norm": plan.NORM_THREADS},
    "qkv_finish.cu": {"qkv_finish": math.prod(plan.qkv_finish_launch(1, 48).block)},
    "activation.cu": {"gated_silu": plan.ELEMENTWISE_THREADS},
    "candidates.cu": {"top_candidates": plan.CANDIDATE_THREADS,
                      "apply_token_mask": plan.MASK_THREADS},
}
# The tensor-core matvec's loop: a K-block of its lane's two rows, a quarter of each
# (matvec_mma.cu: lane c takes its quarter of rows g and g + 8), 16 MMAs.
MMA_LOOP_BYTES = {"mul_mat_vec_mma_q4_K": 2 * 144 / 4, "mul_mat_vec_mma_q6_K": 2 * 210 / 4}
MMA_PER_BLOCK = 16  # a token's
MMA_PAIR_TOKENS = 2  # the tokens a pass of the plain and gate + up entries (matvec_mma.cu)
# The batched product's stage: a warp's 16 rows x 32 elements of weights, in bytes.
BATCH_STAGE_BYTES = {"Q4_K": 16 * 32 * 144 / 256, "Q6_K": 16 * 32 * 210 / 256}


def find_tool(name: str) -> str | None:
    """`name` on the PATH, in the CUDA toolkit folders, or in the nvidia-cuda-* wheels."""
    found = shutil.which(name)
    if found:
        return found
    candidates = [Path(p) / name for p in ("/usr/local/cuda/bin", "/usr/local/cuda-13.0/bin")]
    for entry in map(Path, sys.path):
        candidates += (entry / "nvidia").glob(f"*/bin/{name}")
    return next((str(p) for p in candidates if os.access(p, os.X_OK)), None)


def compile_cubin(source: Path, out: Path, nvcc: str) -> str:
    """nvcc -cubin for ARCH with ptxas -v; returns ptxas's report."""
    result = subprocess.run(
        [nvcc, *plan.nvcc_options(), "-cubin", f"-arch={ARCH}", "-Xptxas", "-v",
         f"-I{plan.kernel_source_dir()}", "-o", str(out), str(source)],
        capture_output=True, text=True, check=True)
    return result.stdout + result.stderr


def ptxas_resources(report: str) -> dict[str, dict[str, int]]:
    """Function -> registers, shared bytes, spill bytes and stack frame, from ptxas -v."""
    resources: dict[str, dict[str, int]] = {}
    current = None
    for line in report.splitlines():
        if match := re.search(r"Compiling entry function '(\w+)'|Function properties for (\w+)",
                              line):
            current = match.group(1) or match.group(2)
            resources.setdefault(current, {"registers": 0, "shared": 0, "spills": 0,
                                           "stack": 0})
        elif current and (match := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill "
                                             r"stores, (\d+) bytes spill loads", line)):
            resources[current]["stack"] = int(match.group(1))
            resources[current]["spills"] = int(match.group(2)) + int(match.group(3))
        elif current and (match := re.search(r"Used (\d+) registers", line)):
            resources[current]["registers"] = int(match.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            resources[current]["shared"] = int(smem.group(1)) if smem else 0
    return resources


def resident_warps(registers: int, shared: int, threads: int) -> int:
    """Warps per SM of an sm_90 multiprocessor running blocks of `threads` threads."""
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = REGISTERS_PER_SM // (per_warp * warps)
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED_PER_BLOCK)
    blocks = min(by_registers, by_shared, WARPS_PER_SM // warps, BLOCKS_PER_SM)
    return blocks * warps


SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_instructions(cubin: Path, function: str, cuobjdump: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of one function's SASS."""
    # cuobjdump -sass runs nvdisasm, which the pip wheels put in a folder of their own.
    folders = [str(Path(tool).parent) for tool in (cuobjdump, find_tool("nvdisasm")) if tool]
    env = {**os.environ, "PATH": os.pathsep.join([*folders, os.environ.get("PATH", "")])}
    text = subprocess.run([cuobjdump, "-sass", "-fun", function, str(cubin)],
                          capture_output=True, text=True, check=True, env=env).stdout
    return [(int(m.group(1), 16), m.group(3), m.group(4)) for m in SASS_LINE.finditer(text)]


def branch_target(operands: str) -> int | None:
    match = re.search(r"0x([0-9a-f]+)", operands)
    return int(match.group(1), 16) if match else None


def innermost_loops(instructions: list[tuple[int, str, str]]) -> list[list[tuple[int, str, str]]]:
    """The bodies of the innermost loops (backward branches holding no other)."""
    by_address = {address: i for i, (address, _, _) in enumerate(instructions)}
    backward = [(by_address[t], i) for i, (address, opcode, operands) in enumerate(instructions)
                if opcode == "BRA" and (t := branch_target(operands)) is not None
                and t < address and t in by_address]
    return [instructions[start : stop + 1] for start, stop in backward
            if not any(start <= a and b < stop for a, b in backward if (a, b) != (start, stop))]


def mma_matvec_loop(instructions: list[tuple[int, str, str]], tokens: int = 1) -> dict:
    """The tensor-core matvec's K-block loop of a pass of `tokens` tokens (the innermost loop
    holding a K-block's MMAs for each of them) and its prefetch (mma_prefetch)."""
    mmas = MMA_PER_BLOCK * tokens
    loops = [body for body in innermost_loops(instructions)
             if sum(op.startswith("HMMA") for _, op, _ in body) == mmas]
    if len(loops) != 1:
        raise RuntimeError(f"expected one loop of {mmas} MMAs, found {len(loops)}")
    return {"block_instructions": len(loops[0]), "mma_per_block": mmas,
            **mma_prefetch(loops[0])}


def is_global_load(opcode: str) -> bool:
    """A load from global memory: into registers (LDG) or into shared memory (cp.async's
    LDGSTS); not LDGDEPBAR, which closes a group of copies."""
    return opcode.startswith("LDG") and not opcode.startswith("LDGDEPBAR")


def mma_prefetch(body: list[tuple[int, str, str]]) -> dict:
    """Where a K-block iteration's global loads (those of a K-block ahead) stand among its
    MMAs (the K-block's own): `prefetch_ahead` when every load comes before its first MMA
    and no branch lies among its MMAs (a load after an MMA of the K-block before its own
    waits out a DRAM latency the MMAs could have hidden)."""
    mmas = [i for i, (_, opcode, _) in enumerate(body) if opcode.startswith("HMMA")]
    loads = [i for i, (_, opcode, _) in enumerate(body) if is_global_load(opcode)]
    report = {
        "loads_per_block": len(loads),
        "loads_before_first_mma": sum(i < mmas[0] for i in loads),
        "branches_among_mmas": sum(opcode == "BRA" for _, opcode, _ in body[mmas[0]:mmas[-1]]),
    }
    report["prefetch_ahead"] = (len(loads) > 0
                                and report["loads_before_first_mma"] == len(loads)
                                and report["branches_among_mmas"] == 0)
    return report


def batch_stage(instructions: list[tuple[int, str, str]], tokens: int) -> dict:
    """The batched product's stage loop: the smallest loop holding a barrier and all of a
    warp's 4 tokens / 8 MMAs of a stage; its static instructions with the loops inside it
    (once a chunk: no MMA) apart."""
    mmas = 4 * tokens // 8
    by_address = {address: i for i, (address, _, _) in enumerate(instructions)}
    loops = [(by_address[t], i) for i, (address, opcode, operands) in enumerate(instructions)
             if opcode == "BRA" and (t := branch_target(operands)) is not None
             and t < address and t in by_address]

    def count(body: list[tuple[int, str, str]], prefix: str) -> int:
        return sum(opcode.startswith(prefix) for _, opcode, _ in body)

    stages = [(start, stop) for start, stop in loops
              if count(instructions[start : stop + 1], "BAR") >= 1
              and count(instructions[start : stop + 1], "HMMA") == mmas]
    if not stages:
        raise RuntimeError(f"no stage loop of {mmas} MMAs")
    start, stop = min(stages, key=lambda loop: loop[1] - loop[0])
    inner = [(a, b) for a, b in loops if start < a and b < stop
             and not any(start < c <= a and b <= d < stop and (c, d) != (a, b)
                         for c, d in loops)]
    chunk_loops = sum(b - a + 1 for a, b in inner)
    return {"stage_instructions": stop - start + 1 - chunk_loops,
            "chunk_loop_instructions": chunk_loops, "hmma_per_stage": mmas}


def batch_figures(stages: dict[int, dict], weight_bytes: float) -> dict:
    """Per weight byte of the step at each N, and the fit a + b (N / 8) of the stage's
    instructions over the pairs of consecutive N (`a` from each pair: equal where the weights'
    part does not grow with N)."""
    figures: dict = {}
    for tokens, stage in stages.items():
        figures[f"n{tokens}"] = {
            **stage,
            "warp_instructions_per_weight_byte": round(stage["stage_instructions"] /
                                                       weight_bytes, 3),
            "hmma_per_weight_byte": round(stage["hmma_per_stage"] / weight_bytes, 4)}
    ns = sorted(stages)
    fits = []
    for low, high in zip(ns, ns[1:]):
        tiles = (high - low) // 8
        b = (stages[high]["stage_instructions"] - stages[low]["stage_instructions"]) / tiles
        a = stages[low]["stage_instructions"] - b * low // 8
        fits.append({"tokens": [low, high], "weights_part": round(a, 1),
                     "weights_part_per_weight_byte": round(a / weight_bytes, 3),
                     "per_column_tile": round(b, 1),
                     "per_column_tile_beside_its_hmma": round(b - 4, 1)})
    figures["fits"] = fits
    return figures


def resources_section(nvcc: str, work: Path, cuobjdump: str | None) -> dict:
    report: dict = {"entries": {}, "matvec_mma_loops": {}, "batch_stages": {}}
    cubins = {source: work / f"{Path(source).stem}.cubin" for source in HOT_ENTRIES}
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:  # a minute or more a file
        reports = dict(zip(cubins, pool.map(
            lambda source: compile_cubin(plan.kernel_source_dir() / source, cubins[source],
                                         nvcc), cubins)))
    for source, entries in HOT_ENTRIES.items():
        cubin = cubins[source]
        resources = ptxas_resources(reports[source])
        for name, threads in entries.items():
            r = resources[name]
            dynamic = plan.dynamic_shared_bytes(name)
            report["entries"][name] = {
                **{k: r[k] for k in ("registers", "shared", "spills", "stack")},
                "dynamic_shared": dynamic,
                "threads": threads,
                "resident_warps_per_sm": resident_warps(r["registers"], r["shared"] + dynamic,
                                                        threads),
            }
        if source == "matmul_batch.cu" and cuobjdump:
            for type_name, weight_bytes in BATCH_STAGE_BYTES.items():
                stages = {n: batch_stage(sass_instructions(
                    cubin, plan.batch_kernel(type_name, n), cuobjdump), n)
                    for n in plan.BATCH_TOKENS}
                report["batch_stages"][type_name] = batch_figures(stages, weight_bytes)
        if source == "matvec_mma.cu" and cuobjdump:
            for name, lane_bytes in MMA_LOOP_BYTES.items():
                sass = sass_instructions(cubin, name, cuobjdump)
                loop, pair = mma_matvec_loop(sass), mma_matvec_loop(sass, MMA_PAIR_TOKENS)
                report["matvec_mma_loops"][name] = {
                    **loop, "lane_weight_bytes_per_block": lane_bytes,
                    "sass_per_weight_byte_batch1": round(
                        loop["block_instructions"] / lane_bytes, 2),
                    "pair": {**pair, "sass_per_weight_byte_a_token": round(
                        pair["block_instructions"] / lane_bytes / MMA_PAIR_TOKENS, 2)}}
    return report


def step_kernels(spec, items: list, blocks: int, layouts) -> dict[str, int]:
    """Kernels of one step of `items` (forward + candidates of its logits rows) and of its
    largest layer (the step adds the embedding, the final norm, the output product and
    candidates)."""
    from actors.compute import cuda_launches as launches
    from actors.model.step import plan_step

    step = plan_step(items, spec, blocks, KV_BLOCK_SIZE)
    shape = launches.step_shape(step, 8, launches.split_keys_for(spec.context_length),
                                spec.context_length)
    forward = launches.forward_calls(spec, layouts, shape, launches.TILE_INPUT)
    tail = launches.candidate_calls(spec, len(step.logit_rows), 1, any_penalty=False,
                                    n_masked=0)
    per_layer = max(len(launches.layer_calls(spec, layouts, shape, layer, launches.TILE_INPUT))
                    for layer in range(spec.n_layers))
    return {"layers": spec.n_layers, "kernels_per_step": len(forward) + len(tail),
            "kernels_per_layer": per_layer}


def decode_kernels(spec, layouts, streams: int = 1) -> dict[str, int]:
    """step_kernels of a decode step of `streams` sequences."""
    from actors.model.step import StepItem

    return step_kernels(spec, [StepItem((1,), 40, (3 * i, 3 * i + 1, 3 * i + 2))
                               for i in range(streams)], 3 * streams, layouts)


def prefill_kernels(spec, layouts, tokens: int) -> dict[str, int]:
    """step_kernels of one prompt of `tokens` tokens prefilled in one chunk."""
    from actors.model.step import StepItem

    blocks = -(-tokens // KV_BLOCK_SIZE)
    return step_kernels(spec, [StepItem(tuple(range(1, tokens + 1)), 0, tuple(range(blocks)))],
                        blocks, layouts)


def llama_8b_layouts():
    """The Llama-3-8B Q4_K_M shape's spec and tensors as they lie on the device."""
    from actors.compute.cuda_launches import MatrixLayout
    from actors.model.arch import ModelSpec
    from benchmarks.synthetic_gguf import LlamaShape, q4_k_m_types, tensor_shapes

    shape = LlamaShape()
    spec = ModelSpec(arch="llama", n_layers=shape.layers, d_model=shape.d_model,
                     n_heads=shape.heads, n_kv_heads=shape.kv_heads,
                     head_dim=shape.d_model // shape.heads, ffn_dim=shape.ffn,
                     context_length=shape.context, vocab_size=shape.vocab,
                     rms_eps=shape.rms_eps, rope_base=shape.rope_base,
                     rope_dim=shape.d_model // shape.heads, rope_neox=False)
    types = q4_k_m_types(shape)
    layouts = {name: MatrixLayout("F32", 1, dims[0]) if len(dims) == 1
               else MatrixLayout(types[name], math.prod(dims[:-1]), dims[-1])
               for name, dims in tensor_shapes(shape)}
    return spec, layouts


def gemma_layouts(path: Path | None):
    from actors.compute.cuda_launches import tensor_layouts
    from actors.model.arch import spec_from_gguf
    from actors.model.default_model import default_model_path
    from actors.model.gguf.reader import open_gguf

    gguf = open_gguf(path or default_model_path())
    try:
        return spec_from_gguf(gguf), tensor_layouts(gguf)
    finally:
        gguf.close()


def budgets(gemma_path: Path | None = None) -> dict:
    nvcc = find_tool("nvcc")
    if nvcc is None:
        raise SystemExit("nvcc not found: the budgets need it")
    cuobjdump = find_tool("cuobjdump")
    with tempfile.TemporaryDirectory() as work:
        report = resources_section(nvcc, Path(work), cuobjdump)
    if cuobjdump is None:
        report["loops_missing"] = ("cuobjdump not found (pip nvidia-cuda-cuobjdump and "
                                   "nvidia-cuda-nvdisasm provide it)")
    llama = llama_8b_layouts()
    report["decode_step"] = {
        "llama3_8b_q4_k_m": decode_kernels(*llama),
        **{f"llama3_8b_q4_k_m_{n}_streams": decode_kernels(*llama, n) for n in (32, 64)}}
    report["prefill_step"] = {"llama3_8b_q4_k_m_512_tokens": prefill_kernels(*llama, 512)}
    try:
        report["decode_step"]["gemma3"] = decode_kernels(*gemma_layouts(gemma_path))
    except (FileNotFoundError, OSError) as error:
        report["decode_step"]["gemma3_missing"] = str(error)
    report["targets"] = {
        "q4_K_sass_per_weight_byte_batch1": TARGET_SASS_PER_BYTE,
        "min_resident_warps_per_sm": TARGET_WARPS,
        "max_kernels_per_layer": TARGET_KERNELS_PER_LAYER,
    }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--gemma", type=Path, default=None, help="gemma-3 GGUF file")
    args = parser.parse_args()
    report = budgets(args.gemma)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for name, entry in report["entries"].items():
        print(f"{name:40s} regs {entry['registers']:3d}  smem {entry['shared']:6d}"
              f"{' + ' + str(entry['dynamic_shared']) if entry['dynamic_shared'] else ''}  "
              f"spills {entry['spills']}  warps/SM {entry['resident_warps_per_sm']}")
    for name, loop in report["matvec_mma_loops"].items():
        pair = loop["pair"]
        print(f"{name}: {loop['sass_per_weight_byte_batch1']} SASS / weight byte a token "
              f"({pair['sass_per_weight_byte_a_token']} in passes of {MMA_PAIR_TOKENS}), "
              f"prefetch ahead: {loop['prefetch_ahead']} / {pair['prefetch_ahead']} "
              f"({loop['loads_before_first_mma']} of {loop['loads_per_block']} loads of the "
              f"next K-block before the MMAs)")
    for type_name, figures in report["batch_stages"].items():
        for n in plan.BATCH_TOKENS:
            stage = figures[f"n{n}"]
            print(f"mul_mat_batch{n} {type_name}: {stage['warp_instructions_per_weight_byte']} "
                  f"warp instructions / weight byte a step, {stage['hmma_per_weight_byte']} "
                  f"HMMA / weight byte ({stage['stage_instructions']} a stage)")
        for fit in figures["fits"]:
            print(f"  N {fit['tokens']}: weights' part {fit['weights_part_per_weight_byte']} / "
                  f"weight byte, {fit['per_column_tile']} a column tile (4 of them HMMA)")
    for model, step in [*report["decode_step"].items(), *report["prefill_step"].items()]:
        print(f"{model}: {step}")


if __name__ == "__main__":
    main()
