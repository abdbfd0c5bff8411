"""GPU benchmark. Kernels: the decode products' effective bandwidth (weight bytes read / time)
on Llama-3-8B's FFN shapes: the tensor-core matvec (Q4_K, Q6_K row-planar as the device holds
it) at 1 and 8 rows, its regime, and the batched product (mul_mat_batch<N>: the same types)
at 16, 32 and 64 rows, beside the device's own copy bandwidth, and at a prefill chunk's rows
(PREFILL_TOKENS); timed with CUDA events around one replay of a CUDA graph of many launches,
not Python's launch loop (the weights cycle through enough copies that every launch reads
them from HBM, not from L2). Whole models through the
CUDA backend (wall clock per step, each step ending in its one synchronization): decode tok/s
at 1, 8, 32 and 64 streams and prefill-512 tok/s on a Llama-3-8B-shaped file
(benchmarks/synthetic_gguf.py), one-stream decode on gemma-3-270m, and the stream operations
and kernels of a decode step (the bare backend runs one step at a time: its random tokens
would drop every step run ahead). Whole models through the Engine (greedy, ignore_eos, a
fixed token count) at 1, 32 and 64 streams beside the bare backend's figures (the 8B also
with the run-ahead rule reversed at up to 32 streams, `llama3_8b_engine_other_run_ahead`: none
where it runs greedy steps ahead, every step where it does not): the
difference per decode step is what the actors cost; the backend's busy share of the run
(EngineStats.compute_busy_s) tells how much of it falls inside the backend's run calls.

    python benchmarks/bench_cuda.py [--json OUT.json] [--repeats N] [--model-8b PATH]
                                    [--gemma3 PATH]

Needs pycuda and a CUDA device (imported when run, so `--help` works anywhere). Targets:
Q4_K mma matvec on 4096 x 14336 >= 3.4 TB/s effective (copy: about 4.3 TB/s); 8B decode
>= 450 tok/s one stream, >= 4,000 tok/s at 32 streams, prefill 512 >= 10,000 tok/s;
gemma-3-270m >= 300 tok/s one stream.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from synthetic_gguf import random_blocks

from actors.compute import cuda_plan as plan
from actors.compute.cuda_weights import device_rows
from actors.model.gguf.quants import row_bytes

MATVEC_SHAPES = ((14336, 4096), (4096, 14336))  # (output rows, inputs): gate/up, down
MATVEC_BATCHES = (1, plan.MATVEC_MMA_MAX_ROWS)  # decode rows the mma matvec takes
PREFILL_TOKENS = 512
COPY_BYTES = 1 << 30
ANCHORS = {"matvec_q4_K_effective_TBps": 3.4, "copy_TBps_seen_on_h200": 4.3,
           "llama3_8b_decode_1_stream_tok_s": 450, "llama3_8b_decode_32_streams_tok_s": 4000,
           "llama3_8b_prefill_512_tok_s": 10000, "gemma3_270m_decode_1_stream_tok_s": 300}
DECODE_PROMPT = 32  # tokens each stream holds before its timed decode steps
DECODE_STEPS = 64
DECODE_STREAMS = (1, 8, 32, 64)
MODEL_BLOCK = 16
ENGINE_TOKENS = 64  # generated per stream through the Engine


def compile_module(file_name: str) -> Any:
    """A cuda_src file compiled as the backend compiles it, into the same cache folder."""
    import pycuda.driver as cuda
    from pycuda.compiler import SourceModule

    source = (plan.kernel_source_dir() / file_name).read_text()
    capability = cuda.Context.get_device().compute_capability()
    return SourceModule(source, **plan.source_module_options(capability))


def time_graph(launch: Any, repeats: int) -> float:
    """Seconds per launch(i, stream) (a kernel or a copy), from CUDA events around one replay
    of a graph of `repeats` of them (at least one: a fraction of --repeats may round to none;
    the graph replayed once before, after a warm-up of a tenth as many launched alone): the
    device's time, not Python's per launch (a few microseconds, as long as a small
    product)."""
    import pycuda.driver as cuda

    from actors.compute import cuda as backend  # its DriverGraphs: the libcuda graph calls

    repeats = max(repeats, 1)
    stream = cuda.Stream()
    for i in range(max(repeats // 10, 1)):
        launch(i, stream)
    graphs = backend.DriverGraphs()
    executable = graphs.capture(stream, lambda: [launch(i, stream) for i in range(repeats)])
    try:
        graphs.launch(executable, stream)
        start, end = cuda.Event(), cuda.Event()
        start.record(stream)
        graphs.launch(executable, stream)
        end.record(stream)
        end.synchronize()
    finally:
        graphs.destroy(executable)
    return end.time_since(start) / 1e3 / repeats


def weight_copies(matrix: np.ndarray, l2_bytes: int) -> list[Any]:
    """Enough device copies of `matrix` that cycling through them overflows L2 four times."""
    import pycuda.driver as cuda

    count = max(2, math.ceil(4 * l2_bytes / matrix.nbytes))
    return [cuda.to_device(matrix) for _ in range(count)]


def bench_copy(repeats: int) -> dict[str, float]:
    import pycuda.driver as cuda

    src, dst = cuda.mem_alloc(COPY_BYTES), cuda.mem_alloc(COPY_BYTES)
    seconds = time_graph(
        lambda i, stream: cuda.memcpy_dtod_async(dst, src, COPY_BYTES, stream), repeats)
    return {"bytes": COPY_BYTES, "us": seconds * 1e6,
            "TBps_read_plus_write": 2 * COPY_BYTES / seconds / 1e12}


# The files of the benchmarked products, compiled first.
MATVEC_FILE, BATCH_FILE = "matvec_mma.cu", "matmul_batch.cu"


def product_seconds(function: Any, launch: plan.Launch, copies: list[Any], type_name: str,
                    rows: int, n_in: int, tokens: int, repeats: int) -> float:
    """Seconds a launch of a product entry (weights, pitch, x, x_stride, y, y_stride, rows,
    n_in, tokens) over `tokens` random rows, each launch reading the next of `copies`."""
    import pycuda.driver as cuda

    x = cuda.to_device(np.random.default_rng(tokens).standard_normal((tokens, n_in))
                       .astype(np.float32))
    y = cuda.mem_alloc(tokens * rows * 4)
    pitch = np.int64(plan.row_pitch(type_name, n_in))
    return time_graph(
        lambda i, stream: function(copies[i % len(copies)], pitch, x, np.int32(n_in), y,
                                   np.int32(rows), np.int32(rows), np.int32(n_in),
                                   np.int32(tokens), grid=launch.grid, block=launch.block,
                                   shared=launch.shared, stream=stream),
        repeats)


def bench_products(module: Any, rng: np.random.Generator, l2_bytes: int, repeats: int,
                   counts: tuple[int, ...], kernel: Any, launch: Any,
                   shapes: tuple[tuple[int, int], ...] = MATVEC_SHAPES) -> list[dict[str, Any]]:
    """kernel(type, tokens) of each of plan.MATVEC_MMA_TYPES (as the device holds them) at each
    of `shapes` and each of `counts` rows, launch(rows, n_in, tokens) its geometry, the weights from
    HBM: the weights' bytes a second and the tensor cores' useful TFLOPs."""
    from actors.compute.cuda import entry_function

    results = []
    for type_name in plan.MATVEC_MMA_TYPES:
        for rows, n_in in shapes:
            matrix = random_blocks(rng, type_name, rows * n_in // 256).reshape(rows, -1)
            copies = weight_copies(device_rows(matrix, type_name, n_in), l2_bytes)
            for tokens in counts:
                name, geometry = kernel(type_name, tokens), launch(rows, n_in, tokens)
                seconds = product_seconds(entry_function(module, name), geometry, copies,
                                          type_name, rows, n_in, tokens, repeats)
                weight_bytes = rows * row_bytes(type_name, n_in)
                results.append({"kernel": name, "type": type_name, "grid": geometry.grid,
                                "rows": rows, "n_in": n_in, "tokens": tokens,
                                "copies": len(copies), "us": seconds * 1e6,
                                "effective_TBps": weight_bytes / seconds / 1e12,
                                "TFLOPs": 2 * rows * n_in * tokens / seconds / 1e12})
            for copy in copies:
                copy.free()
    return results


def batch_geometry(rows: int, n_in: int, tokens: int) -> plan.Launch:
    """The batched product's launch for `tokens` rows (its grid does not depend on n_in)."""
    return plan.batch_launch(rows, tokens)


def decode_tok_s(backend: Any, vocab: int, streams: int, steps: int,
                 rng: np.random.Generator) -> dict[str, Any]:
    """Each of `streams` sequences prefilled with DECODE_PROMPT tokens, then `steps` timed
    decode steps of one token per stream (after two that capture the bucket's graph)."""
    from actors.compute.contract import RowInputs, StepItem

    per_stream = -(-(DECODE_PROMPT + steps + 2) // MODEL_BLOCK)
    tables = [tuple(range(i * per_stream, (i + 1) * per_stream)) for i in range(streams)]
    rows = [RowInputs()] * streams
    prompt = [StepItem(tuple(int(t) for t in rng.integers(0, vocab, DECODE_PROMPT)), 0, table)
              for table in tables]
    backend.run(prompt, rows)

    def step(position: int) -> None:
        backend.run([StepItem((int(rng.integers(0, vocab)),), position, table)
                     for table in tables], rows)

    step(DECODE_PROMPT)
    step(DECODE_PROMPT + 1)
    started = time.perf_counter()
    for position in range(DECODE_PROMPT + 2, DECODE_PROMPT + 2 + steps):
        step(position)
    seconds = time.perf_counter() - started
    return {"streams": streams, "steps": steps, "tok_s": streams * steps / seconds,
            "ms_per_step": seconds / steps * 1e3,
            "launches_per_step": backend.launches_per_step,
            "kernels_per_step": backend.kernels_per_step}


def prefill_tok_s(backend: Any, vocab: int, tokens: int, repeats: int,
                  rng: np.random.Generator) -> dict[str, Any]:
    """One sequence's `tokens`-token prompt in one step, timed over `repeats` steps (after a
    first one), each rewriting the same blocks."""
    from actors.compute.contract import RowInputs, StepItem

    item = StepItem(tuple(int(t) for t in rng.integers(0, vocab, tokens)), 0,
                    tuple(range(-(-tokens // MODEL_BLOCK))))
    backend.run([item], [RowInputs()])
    started = time.perf_counter()
    for _ in range(repeats):
        backend.run([item], [RowInputs()])
    seconds = (time.perf_counter() - started) / repeats
    return {"tokens": tokens, "tok_s": tokens / seconds, "ms": seconds * 1e3,
            "launches_per_step": backend.launches_per_step}


def bench_model(path: Path, streams: tuple[int, ...], prefill: int | None,
                rng: np.random.Generator) -> dict[str, Any]:
    """Decode (and prefill) figures of the model file at `path` on the CUDA backend."""
    from actors.compute.backends import CudaFactory
    from actors.compute.contract import KVRequest
    from actors.model.loaded import open_model

    model = open_model(path)
    per_stream = -(-(DECODE_PROMPT + DECODE_STEPS + 2) // MODEL_BLOCK)
    blocks = max(max(streams) * per_stream, -(-(prefill or 0) // MODEL_BLOCK))
    started = time.perf_counter()
    # Steps one at a time (random tokens, not the greedy ones a step run ahead would feed):
    # the device's own speed; the Engine figures run steps ahead.
    backend = CudaFactory(run_ahead_rows=0).build(
        model, KVRequest(blocks=blocks, block_size=MODEL_BLOCK, max_sequences=max(streams)))
    report: dict[str, Any] = {"model": str(path), "build_s": time.perf_counter() - started}
    try:
        vocab = model.spec.vocab_size
        report["decode"] = [decode_tok_s(backend, vocab, n, DECODE_STEPS, rng) for n in streams]
        if prefill:
            report["prefill"] = prefill_tok_s(backend, vocab, prefill, 5, rng)
    finally:
        backend.close()
        model.gguf.close()
    return report


@asynccontextmanager
async def cuda_engine(path: Path, streams: tuple[int, ...],
                      run_ahead_rows: int | None = None) -> AsyncIterator[Any]:
    """An Engine on the CUDA backend for the file at `path`: Engine.open, or with
    `run_ahead_rows` Engine.open_backend over a CudaFactory running greedy steps of up to that
    many rows ahead (the same engine, the model opened here)."""
    from actors.compute.backends import CudaFactory
    from actors.compute.contract import KVRequest
    from actors.engine import Engine
    from actors.model.loaded import open_model

    per_stream = -(-(DECODE_PROMPT + ENGINE_TOKENS) // MODEL_BLOCK)
    kv_blocks = max(streams) * per_stream + 1
    if run_ahead_rows is None:
        async with Engine.open(path, backend="cuda", max_sequences=max(streams),
                               kv_blocks=kv_blocks, block_size=MODEL_BLOCK) as engine:
            yield engine
        return
    model = open_model(path)
    kv = KVRequest(blocks=kv_blocks, block_size=MODEL_BLOCK, max_sequences=max(streams))
    try:
        async with Engine.open_backend(
                partial(CudaFactory(run_ahead_rows=run_ahead_rows).build, model, kv),
                model.tokenizer, backend="cuda", max_sequences=max(streams)) as engine:
            yield engine
    finally:
        model.gguf.close()


async def engine_decode(path: Path, streams: tuple[int, ...], rng: np.random.Generator,
                        run_ahead_rows: int | None = None) -> list[dict[str, Any]]:
    """Each stream count in turn through one Engine: that many concurrent greedy requests of
    ENGINE_TOKENS tokens (ignore_eos) after DECODE_PROMPT-token prompts, after a warm-up that
    captures the decode graphs. Decode figures run from the last stream's first token to the
    last token (the prefill steps left out)."""
    import anyio

    from actors.params import SamplingParams

    params = SamplingParams(max_tokens=ENGINE_TOKENS, temperature=0.0, ignore_eos=True)
    async with cuda_engine(path, streams, run_ahead_rows) as engine:
        vocab = engine.info.vocab_size

        async def run(n: int,
                      request: SamplingParams) -> tuple[float, float, float, int, float]:
            """(start, last first token, end) wall clocks, the engine steps taken and the
            backend's own time in them (the compute thread's run calls)."""
            firsts: list[float] = []

            async def one() -> None:
                prompt = [int(t) for t in rng.integers(300, vocab, DECODE_PROMPT)]
                first = True
                async for chunk in engine.generate(prompt, request):
                    if first and chunk.token_id is not None:
                        firsts.append(time.perf_counter())
                        first = False

            before = engine.stats()
            started = time.perf_counter()
            async with anyio.create_task_group() as tasks:
                for _ in range(n):
                    tasks.start_soon(one)
            after = engine.stats()
            return (started, max(firsts), time.perf_counter(), after.steps - before.steps,
                    after.compute_busy_s - before.compute_busy_s)

        results = []
        for n in streams:
            await run(n, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            started, last_first, ended, steps, busy_s = await run(n, params)
            decode_s = ended - last_first
            results.append({
                "streams": n, "tokens": ENGINE_TOKENS, "steps": steps,
                # The share of the run's wall time the backend was busy (host work and device
                # in its run calls); the rest, the GPU waits for the actors.
                "backend_busy_share": busy_s / (ended - started),
                "backend_ms_per_step": busy_s / steps * 1e3,
                "tok_s": n * ENGINE_TOKENS / (ended - started),
                "decode_tok_s": n * (ENGINE_TOKENS - 1) / decode_s,
                "ms_per_decode_step": decode_s / (ENGINE_TOKENS - 1) * 1e3})
        return results


def bench_engine(path: Path, streams: tuple[int, ...], bare: Any, rng: np.random.Generator,
                 run_ahead_rows: int | None = None) -> list[dict[str, Any]]:
    """engine_decode's figures, each beside the bare backend's decode step at the same
    stream count (from `bare`, bench_model's report of the same file, where it has one):
    actors_ms_per_step is what the engine's actors add to a decode step (less what the steps
    run ahead hide)."""
    import anyio

    results = anyio.run(engine_decode, path, streams, rng, run_ahead_rows)
    bare_ms = {row["streams"]: row["ms_per_step"]
               for row in (bare or {}).get("decode", []) if "ms_per_step" in row}
    for row in results:
        if row["streams"] in bare_ms:
            row["bare_ms_per_step"] = bare_ms[row["streams"]]
            row["actors_ms_per_step"] = row["ms_per_decode_step"] - bare_ms[row["streams"]]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--model-8b", type=Path, help="a Llama-3-8B-shaped GGUF "
                        "(benchmarks/synthetic_gguf.py) for the whole-model figures")
    parser.add_argument("--gemma3", type=Path, help="gemma-3-270m's GGUF for its decode figure")
    parser.add_argument("--model", type=Path, action="append", default=[],
                        help="another GGUF (e.g. a shrunk real model) for decode at 1, 32 and 64 "
                        "streams, reported under its file's stem")
    parser.add_argument("--engine-streams", type=int, nargs="*", default=[1, 32, 64],
                        help="stream counts through the whole Engine (none: skip)")
    args = parser.parse_args()

    import pycuda.autoprimaryctx  # noqa: F401  (the primary context, which the backend shares)
    import pycuda.driver as cuda

    device = cuda.Context.get_device()
    l2_bytes = device.get_attribute(cuda.device_attribute.L2_CACHE_SIZE)
    rng = np.random.default_rng(0)
    report: dict[str, Any] = {"device": device.name(),
                              "compute_capability": list(device.compute_capability()),
                              "l2_bytes": l2_bytes, "anchors": ANCHORS}

    def section(name: str, measure: Any) -> Any:
        """One figure of the report, written out as soon as it is known: a device run cut
        short by its time limit keeps what it measured, and a failing section is recorded
        with its error instead of losing the others."""
        started = time.perf_counter()
        try:
            report[name] = measure()
        except Exception as exc:  # noqa: BLE001  (recorded in the report, the run goes on)
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        print(f"bench_cuda: {name} in {time.perf_counter() - started:.1f} s: "
              f"{json.dumps(report[name])}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        return report[name]

    compiled: dict[str, Any] = {}
    section("compile_s", lambda: compile_all(compiled))
    section("copy", lambda: bench_copy(args.repeats // 4))
    section("matvec_mma", lambda: bench_products(
        compiled[MATVEC_FILE], rng, l2_bytes, args.repeats, MATVEC_BATCHES,
        lambda t, _: plan.matvec_mma_kernel(t), lambda rows, n_in, _: plan.matvec_mma_launch(
            rows, n_in)))
    section("batch", lambda: bench_products(
        compiled[BATCH_FILE], rng, l2_bytes, args.repeats, plan.BATCH_TOKENS, plan.batch_kernel,
        batch_geometry))
    section("batch_prefill", lambda: bench_products(
        compiled[BATCH_FILE], rng, l2_bytes, max(args.repeats // 10, 3), (PREFILL_TOKENS,),
        plan.batch_kernel, batch_geometry, MATVEC_SHAPES[:1]))
    engine_streams = tuple(args.engine_streams)
    if args.model_8b:
        section("llama3_8b",
                lambda: bench_model(args.model_8b, DECODE_STREAMS, PREFILL_TOKENS, rng))
    if args.gemma3:
        section("gemma3_270m", lambda: bench_model(args.gemma3, (1,), None, rng))
    for path in args.model:
        section(path.stem, lambda: bench_model(path, DECODE_STREAMS, None, rng))
    # Through the Engine after every bare figure: a run cut short keeps those first.
    for key, path in [("llama3_8b", args.model_8b), ("gemma3_270m", args.gemma3),
                      *((path.stem, path) for path in args.model)]:
        if path and engine_streams:
            section(f"{key}_engine",
                    lambda: bench_engine(path, engine_streams, report.get(key), rng))
    if args.model_8b and engine_streams:
        # The other side of the run-ahead rule (cuda_ahead.RUN_AHEAD_MAX_ROWS) at up to 32
        # streams: one step at a time where the engine runs greedy steps ahead, every step
        # ahead where it does not; beside the engine's own figures, where the rule pays.
        section("llama3_8b_engine_other_run_ahead",
                lambda: other_run_ahead(args.model_8b, engine_streams, report.get("llama3_8b"),
                                        rng))
    print(json.dumps(report, indent=2))


def other_run_ahead(path: Path, streams: tuple[int, ...], bare: Any,
                    rng: np.random.Generator) -> list[dict[str, Any]]:
    """bench_engine at each of `streams` up to 32 with the run-ahead rule reversed: no step
    run ahead at counts the rule runs ahead, every step at the others (`run_ahead_rows` in
    each row)."""
    from actors.compute.cuda_ahead import RUN_AHEAD_MAX_ROWS

    return [{**row, "run_ahead_rows": rows}
            for n in streams if n <= 32
            for rows in [0 if n <= RUN_AHEAD_MAX_ROWS else n]
            for row in bench_engine(path, (n,), bare, rng, rows)]


def compile_all(compiled: dict[str, Any]) -> float:
    """Compiles the benchmarked files into `compiled`, one at a time (a file that fails
    leaves those before it); the seconds it took."""
    started = time.perf_counter()
    for name in (MATVEC_FILE, BATCH_FILE):
        compiled[name] = compile_module(name)
    return time.perf_counter() - started

if __name__ == "__main__":
    main()
