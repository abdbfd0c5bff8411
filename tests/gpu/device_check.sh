#!/usr/bin/env bash
# Every device check of the CUDA backend in one run, on the GPU machine, from the repo root, with
# .cudacarry/ carried (made here by tests/gpu/prepare_carry.sh):
#   1. PyCUDA from the bundle (.cudacarry/device_setup.sh) and the carried wheels;
#   2. pytest tests/gpu (each kernel against its numpy twin; the CUDA backend against the CPU
#      on the reference sequences; the engine on backend="cuda"), in four groups of a process
#      each (tests/gpu/conftest.py's GPU_TEST_GROUPS: the mma matvec's kernels, the batched
#      product's, the other kernels, the backend end to end) so that a fault costs its group
#      only;
#   3. beside the tests: benchmarks/synthetic_gguf.py, the Llama-3-8B-shaped Q4_K_M file, and
#      how long it takes there (SYNTHETIC_LAYERS, default 32), and the grown gemma-3;
#   4. benchmarks/bench_cuda.py (the decode products in effective TB/s: the mma matvec at 1
#      and 8 rows, the batched product at 16 / 32 / 64 and at 512 tokens; copy bandwidth;
#      whole-model decode at 1 / 8 / 32 / 64 streams and prefill 512 tok/s on that
#      file and, where its file is here, gemma-3-270m; launches per decode step);
#   5. compute-sanitizer, memcheck then racecheck, on the tensor-core kernels' tests at small
#      shapes (SANITIZE_K picks them), where compute-sanitizer is there;
#   6. Nsight Compute (ncu) on the benchmark's matrix kernels, where ncu is there.
# The model files and bench_cuda.json stay in /tmp for tests/gpu/device_anchors.sh: llama.cpp's
# CUDA figures on the same files and GPU, run next on the same machine.
# Results under $OUT: device_check.log (every part's output, the tests' recorded figures at
# the end of each group), bench_cuda.json, sanitize_memcheck.txt, sanitize_racecheck.txt,
# ncu.txt and device_check.json (exit codes and seconds of each part).
# Time: the whole run ends within TOTAL_S (420 s, so that it and device_anchors.sh's 150 s
# fit a 15-minute hold of the machine, its start included). Each part has a budget, cut to
# what is left: tests 200 s (TESTS_S; GROUP_MIN_S, 30, kept for each later group; TEST_S,
# 90, a test; the model files are written meanwhile, within SYNTHETIC_S, 90), the sanitizer
# 40 s (SANITIZE_S, half a tool; 0 = none), bench 180 s (BENCH_S), ncu 40 s (NCU_S; 0 =
# none).
# Rehearsal without a GPU: PYCUDA_CHECK=import with LD_LIBRARY_PATH at a libcuda stub
# (.cudacarry/make_libcuda_stub.sh): PyCUDA installs and imports, tests/gpu skips, no bench.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
py=${PY:-python3}
started=$(date +%s)
deadline=$(( started + ${TOTAL_S:-420} ))
log=$OUT/device_check.log
work=${WORK:-/tmp/device_check}
mkdir -p "$work"
exec > >(tee -a "$log") 2>&1  # every part's output, here and in the log

# A part's seconds: its budget $1, cut to what is left before the deadline less $2 (what the
# parts after it need at least); at least 1.
part_s() {
    local budget=$1 left=$(( deadline - $(date +%s) - ${2:-0} ))
    [ "$left" -lt "$budget" ] && budget=$left
    echo $(( budget < 1 ? 1 : budget ))
}

. ./.cudacarry/device_setup.sh || exit 1
# The setup can go wrong without saying so (a build error past its checks): without PyCUDA
# every device test would skip, so stop here rather than spend the device's time.
"$py" -c 'import pycuda.driver' || { echo "device_check: PyCUDA does not import" >&2; exit 1; }
# The carried wheels, where the interpreter lacks them (the GPU image does; a rehearsal's has them).
bash tests/gpu/install_carried_wheels.sh "$py" || exit 1
export PYTHONPATH=".:$PYTHONPATH"  # the checkout's actors, not an installed one
setup_s=$(( $(date +%s) - started ))

# The benchmark's model files are written while the tests run (CPU and disk work, where the
# tests mostly wait on the GPU), each into its own log, shown once it is done: the 8B-shaped
# Q4_K_M file, and, where gemma-3-270m's own file (a PyPI package) is not installed, the
# carried shrunk file grown back to the real one's 18 layers and 262,144 tokens.
model_8b=/tmp/llama3-8b-synthetic.gguf
(
    written=$(date +%s)
    timeout "${SYNTHETIC_S:-90}" "$py" benchmarks/synthetic_gguf.py "$model_8b" \
        --layers "${SYNTHETIC_LAYERS:-32}"
    rc=$?
    echo $(( $(date +%s) - written )) > "$work/synthetic.s"
    exit $rc
) > "$work/synthetic.log" 2>&1 &
synthetic_pid=$!
gemma3="" grow_pid=""
if [ "${PYCUDA_CHECK:-}" != import ]; then
    gemma3=$("$py" -c 'from tests.conftest import gemma3_path; print(gemma3_path())' 2>/dev/null)
    case "$gemma3" in
        */gemma3-shrunk.gguf|'')
            gemma3=/tmp/gemma3-270m-grown.gguf
            "$py" benchmarks/grow_gguf.py .cudacarry/models/gemma3-shrunk.gguf "$gemma3" \
                --layers 18 --vocab 262144 > "$work/grow.log" 2>&1 &
            grow_pid=$! ;;
    esac
fi

# The kernels compiled once, all files side by side, into the cache folder the tests and the
# backend share (compile_cubins: no context needed); the tests, compiling file by file as they
# go, then find every file there. A file that fails here fails its own tests again below.
capability=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)
if [ -n "$capability" ]; then
    compile_started=$(date +%s)
    "$py" -c 'import sys; from actors.compute.cuda import compile_cubins
compile_cubins(tuple(int(part) for part in sys.argv[1].split(".")))' "$capability" \
        || echo "device_check: the kernels' compile failed (each file's tests show where)"
    echo "device_check: kernels compiled in $(( $(date +%s) - compile_started )) s"
fi

# A test that hangs is cut at its own limit where pytest-timeout is there (the GPU image has it).
per_test=()
"$py" -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout "${TEST_S:-90}")
# The groups of tests/gpu/conftest.py (GPU_TEST_GROUPS), a process each: a kernel fault that
# leaves the CUDA context unusable costs its own group only. Each may use what is left of the
# test budget but GROUP_MIN_S for each group after it (the kernels compiled once, in PyCUDA's
# cache folder, for all); the tests leave 190 s for the sanitizer and the benchmark.
tests_rc=0
groups_rc=""
tests_started=$(date +%s)
tests_deadline=$(( tests_started + $(part_s "${TESTS_S:-200}" 190) ))
left_after=3
for group in mma_matvec batched kernels backend; do
    limit=$(( tests_deadline - $(date +%s) - left_after * ${GROUP_MIN_S:-30} ))
    [ "$limit" -ge "${GROUP_MIN_S:-30}" ] || limit=${GROUP_MIN_S:-30}
    left_after=$((left_after - 1))
    GPU_TEST_GROUP=$group timeout "$limit" "$py" -m pytest -q -p no:cacheprovider -rs \
        --durations=6 "${per_test[@]}" tests/gpu
    rc=$?
    groups_rc="$groups_rc\"$group\": $rc, "
    [ "$rc" = 0 ] || tests_rc=$rc
done
tests_s=$(( $(date +%s) - tests_started ))

wait "$synthetic_pid"
synthetic_rc=$?
cat "$work/synthetic.log"
synthetic_s=$(cat "$work/synthetic.s" 2>/dev/null || echo null)
if [ -n "$grow_pid" ]; then
    wait "$grow_pid" || gemma3=""
    cat "$work/grow.log"
fi

# 5. compute-sanitizer on the tensor-core kernels at small shapes: memcheck (out-of-bounds and
#    misaligned accesses, the cp.async copies' included), then racecheck (shared-memory hazards
#    between a block's threads: the staging ring, the activation tables, the epilogues).
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
sanitize_rc='"skipped: no compute-sanitizer"'
if [ -n "$sanitizer" ] && [ "${PYCUDA_CHECK:-}" != import ] && [ "${SANITIZE_S:-40}" != 0 ]; then
    sanitize_rc=""
    selection=${SANITIZE_K:-"(matvec_mma_matches_its_twin and 512) or (fused_matvec_mma_gate_up and silu) or (batched_product_gives_a_row and (Q4_K or Q6_K)) or (fused_qkv_equals and llama and 9 and (mma or batched))"}
    for tool in memcheck racecheck; do
        timeout "$(part_s $(( ${SANITIZE_S:-40} / 2 )) 150)" "$sanitizer" --tool "$tool" \
            --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider -k "$selection" \
            tests/gpu/test_kernels.py > "$OUT/sanitize_$tool.txt" 2>&1
        sanitize_rc="$sanitize_rc\"$tool\": $?, "
        tail -3 "$OUT/sanitize_$tool.txt"
    done
    sanitize_rc="{${sanitize_rc%, }}"
fi

if [ "${PYCUDA_CHECK:-}" = import ]; then
    bench_rc='"skipped: PYCUDA_CHECK=import (no device)"'
else
    model_args=()
    [ "$synthetic_rc" = 0 ] || model_8b=""
    [ -n "$model_8b" ] && model_args+=(--model-8b "$model_8b")
    [ -n "$gemma3" ] && model_args+=(--gemma3 "$gemma3")
    for shrunk in .cudacarry/models/*.gguf; do [ -f "$shrunk" ] && model_args+=(--model "$shrunk"); done
    timeout "$(part_s "${BENCH_S:-180}" 30)" "$py" benchmarks/bench_cuda.py \
        --json "$OUT/bench_cuda.json" "${model_args[@]}"
    bench_rc=$?
fi

# The model files and our figures stay for tests/gpu/device_anchors.sh, the next call on this
# machine (llama.cpp's tools do not fit this call's carry beside the shrunk models).
printf 'model_8b=%s\ngemma3=%s\n' "$model_8b" "$gemma3" > "$work/models.env"
[ -f "$OUT/bench_cuda.json" ] && cp "$OUT/bench_cuda.json" "$work/"

# 6. Nsight Compute on the benchmarked matrix kernels (each launched a few times): DRAM
#    throughput, instructions, time, bytes read, shared-memory bank conflicts, warps active.
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
ncu_rc='"skipped: no ncu"'
if [ -n "$ncu" ] && [ "${PYCUDA_CHECK:-}" != import ] && [ "${NCU_S:-40}" != 0 ]; then
    timeout "$(part_s "${NCU_S:-40}" 5)" "$ncu" --clock-control none -k regex:mul_mat \
        --metrics dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,gpu__time_duration.sum,dram__bytes_read.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__warps_active.avg.pct_of_peak_sustained_active \
        "$py" benchmarks/bench_cuda.py --repeats 2 > "$OUT/ncu.txt" 2>&1
    ncu_rc=$?
fi
total_s=$(( $(date +%s) - started ))
# Which card gave the figures (the absolute anchors are an H200's; an H100 serves as well).
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
printf '{"gpu": "%s", "setup_s": %s, "tests_rc": %s, "test_groups_rc": {%s}, "tests_s": %s, "sanitize_rc": %s, "bench_rc": %s, "synthetic_rc": %s, "synthetic_s": %s, "ncu_rc": %s, "total_s": %s}\n' \
    "${gpu:-none}" "$setup_s" "$tests_rc" "${groups_rc%, }" "$tests_s" "$sanitize_rc" "$bench_rc" "$synthetic_rc" "$synthetic_s" "$ncu_rc" "$total_s" \
    > "$OUT/device_check.json"
cat "$OUT/device_check.json"
[ "$tests_rc" = 0 ] && [ "$synthetic_rc" = 0 ] && { [ "${PYCUDA_CHECK:-}" = import ] || [ "$bench_rc" = 0 ]; }
