"""The CPU's quantized weights (actors.model.quantized): the kernels against the exact
dequantizer, every block type, both routes of the product, the models they run, and the
CPU backend's memory (its KV pool's default size).

Blocks are random bytes (every bit pattern of the quantized fields) with finite half-precision
scales, so each decoder meets negative int8 values, the top bits of the 6-bit K-quant scales
and set fifth bits. Products are held to float32 rounding of the exact dequantized product:
|error| <= K * 2^-24 * (|x| @ |W|.T) for rows of K elements, whatever the summation order; a
product of one-hot rows must give the dequantized levels bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from actors.compute.contract import KVRequest
from actors.compute.cpu import (
    KV_MEMORY_SHARE,
    KV_POSITIONS_PER_SEQUENCE,
    available_memory_bytes,
    build_cpu_backend,
    kv_budget_bytes,
    resident_bytes,
)
from actors.errors import InvalidRequest, ModelFormatError, UnsupportedModelError
from actors.model.gguf.quants import block_format, dequantize, row_bytes
from actors.model.loaded import load_model, open_model
from actors.model import quantized, quantized_kernels
from actors.model.quantized import QuantizedMatrix, QuantizedPart, part_of_blocks
from actors.model.quantized_kernels import (
    TYPE_CODES,
    claim_chunk,
    finish_chunk,
    run_rows,
    run_shared,
    serve_calls,
)
from tests.conftest import TINY_MODELS, gemma3_path

# Byte ranges of each block type's half-precision fields (d, and m / dmin where it has one).
HALF_FIELDS = {
    "Q4_0": [(0, 2)], "Q4_1": [(0, 4)], "Q5_0": [(0, 2)], "Q5_1": [(0, 4)], "Q8_0": [(0, 2)],
    "Q4_K": [(0, 4)], "Q5_K": [(0, 4)], "Q6_K": [(208, 210)],
}
ALL_TYPES = tuple(TYPE_CODES)
ROW_COUNTS = (1, 2, 3, 4, 5, 8, 9, 13, 17)
WIDTH = 512
N_ROWS = 40
UNIT_ROUNDOFF = 2.0**-24


def random_blocks(type_name: str, n_rows: int, width: int, seed: int = 0) -> np.ndarray:
    """(n_rows, row bytes) of `type_name`: random bytes, finite half scales (floats: random
    values of the type)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((n_rows, width), dtype=np.float32)
    if type_name == "F32":
        return values.view(np.uint8).copy()
    if type_name == "F16":
        return values.astype(np.float16).view(np.uint8).copy()
    if type_name == "BF16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).copy()
    fmt = block_format(type_name)
    raw = rng.integers(0, 256, (n_rows, row_bytes(type_name, width)), dtype=np.uint8)
    blocks = raw.reshape(n_rows, -1, fmt.type_size)
    for start, stop in HALF_FIELDS[type_name]:
        halves = rng.uniform(-0.02, 0.02, blocks.shape[:2] + ((stop - start) // 2,))
        blocks[:, :, start:stop] = halves.astype(np.float16).view(np.uint8)
    return raw


def error_bound(x: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """The float32 rounding bound of x @ levels.T computed in any order."""
    return x.shape[1] * UNIT_ROUNDOFF * (np.abs(x) @ np.abs(levels.T)) * 1.01 + 1e-30


def exact_product(x: np.ndarray, levels: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ levels.T.astype(np.float64)


@pytest.fixture(scope="module", params=ALL_TYPES)
def matrix(request: pytest.FixtureRequest) -> tuple[str, QuantizedMatrix, np.ndarray]:
    """(type, the matrix, its levels by quants.dequantize)."""
    type_name = request.param
    raw = random_blocks(type_name, N_ROWS, WIDTH, seed=TYPE_CODES[type_name])
    return (type_name, QuantizedMatrix.of_blocks(type_name, raw, WIDTH),
            dequantize(raw, type_name, (N_ROWS, WIDTH)))


def test_rows_dequantize_exactly(matrix: tuple[str, QuantizedMatrix, np.ndarray]) -> None:
    type_name, weights, levels = matrix
    ids = np.array([3, 0, N_ROWS - 1, 3, 17])
    assert np.array_equal(weights.lookup(ids), levels[ids]), type_name
    assert np.array_equal(weights.lookup(np.arange(N_ROWS)), levels), type_name


@pytest.mark.parametrize("n_x", ROW_COUNTS)
def test_direct_product_is_the_dequantized_product(
    matrix: tuple[str, QuantizedMatrix, np.ndarray], n_x: int
) -> None:
    type_name, weights, levels = matrix
    x = np.random.default_rng(n_x).standard_normal((n_x, WIDTH), dtype=np.float32)
    out = weights.apply(x, np.empty((n_x, N_ROWS), dtype=np.float32))
    error = np.abs(out - exact_product(x, levels))
    assert (error <= error_bound(x, levels)).all(), f"{type_name}: max error {error.max()}"


@pytest.mark.parametrize("n_x", (1, 3, 4, 7, 8, 12))
def test_one_hot_rows_give_the_levels_bit_for_bit(
    matrix: tuple[str, QuantizedMatrix, np.ndarray], n_x: int
) -> None:
    type_name, weights, levels = matrix
    for first in range(0, WIDTH, 97):
        columns = np.arange(first, min(first + n_x, WIDTH))
        x = np.zeros((columns.size, WIDTH), dtype=np.float32)
        x[np.arange(columns.size), columns] = 1.0
        if columns.size > weights.direct_rows_limit:
            continue
        out = weights.apply(x, np.empty((columns.size, N_ROWS), dtype=np.float32))
        assert np.array_equal(out, levels[:, columns].T), f"{type_name} columns {columns}"


def test_both_routes_run_and_agree(matrix: tuple[str, QuantizedMatrix, np.ndarray]) -> None:
    type_name, weights, levels = matrix
    limit = weights.direct_rows_limit
    x = np.random.default_rng(5).standard_normal((limit + 24, WIDTH), dtype=np.float32)
    wide = weights.apply(x, np.empty((len(x), N_ROWS), dtype=np.float32))
    narrow = weights.apply(x[:limit], np.empty((limit, N_ROWS), dtype=np.float32))
    for out, rows in ((wide, x), (narrow, x[:limit])):
        error = np.abs(out - exact_product(rows, levels))
        assert (error <= error_bound(rows, levels)).all(), f"{type_name}: max {error.max()}"


@pytest.mark.parametrize("shared_slab_bytes", (1 << 23, 4 * WIDTH * 8))
@pytest.mark.parametrize("n_x", (20, 70))
def test_every_slab_route_gives_the_product(
    matrix: tuple[str, QuantizedMatrix, np.ndarray], n_x: int, shared_slab_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slabs shared by the kernel threads (a matrix larger than a shared slab, a few dozen
    rows of x), or one slab at a time for BLAS's threads, several slabs or one: the same
    product."""
    type_name, weights, levels = matrix
    monkeypatch.setattr(quantized, "SHARED_SLAB_BYTES", shared_slab_bytes)
    monkeypatch.setattr(quantized, "PER_THREAD_MIN_BYTES", shared_slab_bytes)
    monkeypatch.setattr(quantized, "MIN_SLAB_ROWS", 8)
    monkeypatch.setattr(quantized, "PARALLEL_MIN_WORK", 0)
    x = np.random.default_rng(n_x).standard_normal((n_x, WIDTH), dtype=np.float32)
    out = weights.apply(x, np.full((n_x, N_ROWS), np.nan, dtype=np.float32))
    error = np.abs(out - exact_product(x, levels))
    assert (error <= error_bound(x, levels)).all(), f"{type_name}: max error {error.max()}"


def test_parts_and_row_orders_place_every_output_feature() -> None:
    """A fused matrix of parts of different types, rows taken in a permuted order: output
    feature first + j of a part is its blocks' row rows[j], on both routes."""
    q4k = random_blocks("Q4_K", 24, 256, seed=1)
    q8 = random_blocks("Q8_0", 8, 256, seed=2)
    order = np.random.default_rng(3).permutation(24)
    weights = QuantizedMatrix([part_of_blocks("Q4_K", q4k, 0, order),
                               part_of_blocks("Q8_0", q8, 24)], 256)
    levels = np.concatenate([dequantize(q4k, "Q4_K", (24, 256))[order],
                             dequantize(q8, "Q8_0", (8, 256))])
    assert weights.out_features == 32 and weights.nbytes == q4k.nbytes + q8.nbytes
    assert weights.buffer.nbytes == q4k.nbytes + q8.nbytes  # two arrays: copied end to end
    assert np.array_equal(weights.lookup(np.array([25, 2, 31])), levels[[25, 2, 31]])
    for n_x in (1, 6, weights.direct_rows_limit + 30):
        x = np.random.default_rng(n_x).standard_normal((n_x, 256), dtype=np.float32)
        out = weights.apply(x, np.empty((n_x, 32), dtype=np.float32))
        assert (np.abs(out - exact_product(x, levels)) <= error_bound(x, levels)).all()


def test_bad_input_is_refused_by_name() -> None:
    raw = random_blocks("Q8_0", 8, 64)
    weights = QuantizedMatrix.of_blocks("Q8_0", raw, 64)
    x = np.ones((2, 64), dtype=np.float32)
    with pytest.raises(InvalidRequest) as wrong_width:
        weights.apply(np.ones((2, 32), dtype=np.float32), np.empty((2, 8), dtype=np.float32))
    assert wrong_width.value.field == "x"
    with pytest.raises(InvalidRequest) as wrong_out:
        weights.apply(x, np.empty((2, 9), dtype=np.float32))
    assert wrong_out.value.field == "out"
    with pytest.raises(InvalidRequest) as strided_out:
        weights.apply(x, np.empty((2, 16), dtype=np.float32)[:, ::2])
    assert strided_out.value.field == "out"
    for ids in ([8], [-1], [[1]]):
        with pytest.raises(InvalidRequest) as bad_ids:
            weights.lookup(np.array(ids))
        assert bad_ids.value.field == "ids"
    with pytest.raises(UnsupportedModelError):
        part_of_blocks("IQ2_XXS", raw, 0)
    with pytest.raises(ModelFormatError, match="not rows of 96 elements"):
        QuantizedMatrix.of_blocks("Q8_0", raw, 96)
    with pytest.raises(ModelFormatError, match="past its 8 rows"):
        QuantizedMatrix.of_blocks("Q8_0", raw, 64, np.array([0, 8]))
    with pytest.raises(ModelFormatError, match="starts at output feature 9"):
        QuantizedMatrix([part_of_blocks("Q8_0", raw, 0), part_of_blocks("Q8_0", raw, 9)], 64)


def test_other_float_layouts_of_x_give_the_same_product() -> None:
    raw = random_blocks("Q6_K", 8, 256)
    weights = QuantizedMatrix.of_blocks("Q6_K", raw, 256)
    x = np.random.default_rng(0).standard_normal((3, 512), dtype=np.float32)
    reference = weights.apply(np.ascontiguousarray(x[:, ::2]), np.empty((3, 8), np.float32))
    readonly = np.ascontiguousarray(x[:, ::2])
    readonly.flags.writeable = False
    for layout in (x[:, ::2], x[:, ::2].astype(np.float64), readonly):
        assert np.array_equal(weights.apply(layout, np.empty((3, 8), np.float32)), reference)


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_quantized_model_matches_the_float32_model(name: str) -> None:
    """Decode-sized steps take the direct route, long prompts the slab route: both within
    float32 rounding of the float32 reference model's logits."""
    quantized = load_model(TINY_MODELS[name])
    reference = load_model(TINY_MODELS[name], weights="float32")
    assert isinstance(quantized.weights.layers[0].qkv, QuantizedMatrix)
    ids = [int(t) for t in np.random.default_rng(0).integers(1, 1000, 90)]
    for tokens in (ids[:3], ids):
        np.testing.assert_allclose(quantized.logits(tokens), reference.logits(tokens),
                                   atol=1e-3, rtol=0)


def test_weights_take_the_files_bytes_read_in_place() -> None:
    """gemma-3-270m: every matrix is a view of the mapped file (nothing copied), and the
    weights hold at most 1.15x the file's tensor bytes (the vectors as float32)."""
    model = load_model(gemma3_path())
    file_bytes = sum(info.n_bytes for info in model.gguf.tensors.values())
    assert model.weights.n_bytes <= 1.15 * file_bytes
    mapped = model.gguf.raw("token_embd.weight")
    part: QuantizedPart = model.weights.token_embd.parts[0]
    assert np.shares_memory(part.blocks, mapped) and model.weights.tied_output
    assert not part.blocks.flags.writeable
    # The kernel reads the file's own bytes: a fused matrix's parts are not copied together.
    qkv = model.weights.layers[0].qkv
    assert qkv.buffer.nbytes == model.gguf.file_size
    assert all(np.shares_memory(qkv.buffer, model.gguf.raw(f"blk.0.attn_{name}.weight"))
               for name in "qkv")


def test_one_compiled_kernel_serves_every_type_and_route() -> None:
    """Every call above went through one specialization: no layout of x, out or the blocks
    compiles the kernel again (minutes each, cold), and the entry points share it."""
    for type_name in ALL_TYPES:
        weights = QuantizedMatrix.of_blocks(type_name, random_blocks(type_name, 4096, 256), 256)
        for n_x in (1, weights.direct_rows_limit + 1):
            weights.apply(np.ones((n_x, 256), np.float32), np.empty((n_x, 4096), np.float32))
        weights.lookup(np.arange(4))
    assert len(run_rows.signatures) == 1
    assert len(run_shared.signatures) <= 1 and len(serve_calls.signatures) <= 1
    # compiled in this process only where numba's cache did not hold the entry points (CI)
    assert len(quantized_kernels._rows_job_of_type.signatures) <= 1


def test_compiled_calls_are_shared_as_the_helpers_allow() -> None:
    """A decoding step's calls (run_calls): each call big enough is shared, in chunks,
    unless the slow-helper rule still holds calls to run alone; those count down call by
    call, the step's calls together."""
    threads = quantized._KernelThreads(1)
    seen = []

    def run(call: np.ndarray, first: int, chunks: np.ndarray) -> int:
        seen.append((first, chunks.tolist()))
        return 0

    big, small = quantized.WATCHED_MIN_WORK, quantized.WATCHED_MIN_WORK - 1
    most = threads.size * quantized.CHUNKS_PER_THREAD
    items = np.array([5, 100, 100, 100, 100], dtype=np.int64)
    threads._solo_calls = 2
    threads.run_calls(items, np.array([big, big, big, small, big]), run)
    threads.run_calls(items, np.array([big, big, big, small, big]), run)
    assert seen == [(1, [0, 0, most, 0, most]), (6, [5, most, most, 0, most])]
    assert threads._solo_calls == 0


def test_each_chunk_of_each_shared_call_runs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Helpers take a call from their inbox or by watching for the next one, and may find a
    call both ways: still each chunk of each call runs exactly once, all of them before the
    call returns, and none again later."""
    monkeypatch.setattr(quantized, "PARALLEL_MIN_WORK", 0)
    threads = quantized._threads
    calls = []
    for number in range(300):
        ran = np.zeros(threads.size * quantized.CHUNKS_PER_THREAD, dtype=np.int64)
        seen_chunks = []

        def task(n_chunks: int, counters: np.ndarray, ran: np.ndarray = ran,
                 seen_chunks: list[int] = seen_chunks, slow: bool = number % 3 == 0) -> None:
            seen_chunks.append(n_chunks)
            chunk = claim_chunk(counters)
            while chunk < n_chunks:
                ran[chunk] += 1
                if slow:
                    time.sleep(1e-4)
                finish_chunk(counters)
                chunk = claim_chunk(counters)

        threads.run(task, 64, 1)
        n_chunks = seen_chunks[0]
        assert set(seen_chunks) == {n_chunks}
        assert (ran[:n_chunks] == 1).all() and not ran[n_chunks:].any(), (number, ran)
        calls.append((ran, ran.copy()))
    time.sleep(0.05)
    assert all(np.array_equal(ran, finished) for ran, finished in calls)


def test_shared_compiled_calls_give_the_products_of_the_caller_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Helpers run compiled calls from the fields published for them, one call after another
    while they watch: calls on different matrices, shapes and jobs in quick succession (a
    helper may still be reading one call's fields when the next is published) each give the
    caller-alone result bit for bit (each output feature is summed by one thread, whichever)."""
    matrices = [QuantizedMatrix.of_blocks(type_name, random_blocks(type_name, 300, WIDTH), WIDTH)
                for type_name in ("Q4_K", "Q8_0", "Q4_1", "F16")]
    rng = np.random.default_rng(3)
    cases = [(matrices[i % len(matrices)],
              rng.standard_normal((1 + i % 5, WIDTH), dtype=np.float32)) for i in range(200)]
    monkeypatch.setattr(quantized, "PARALLEL_MIN_WORK", 1 << 62)
    alone = [weights.apply(x, np.empty((len(x), 300), np.float32)) for weights, x in cases]
    looked_up = [weights.lookup(np.arange(0, 300, 7)) for weights in matrices]
    monkeypatch.setattr(quantized, "PARALLEL_MIN_WORK", 0)
    for (weights, x), expected in zip(cases, alone):
        out = weights.apply(x, np.full((len(x), 300), np.nan, np.float32))
        assert np.array_equal(out, expected)
    for weights, expected in zip(matrices, looked_up):
        assert np.array_equal(weights.lookup(np.arange(0, 300, 7)), expected)


def test_default_kv_pool_is_sized_from_the_model_and_the_machine() -> None:
    spec = open_model(gemma3_path()).spec
    per_position = spec.kv_bytes_per_token()
    plenty = 1 << 50
    assert kv_budget_bytes(spec, 1, plenty) == spec.context_length * per_position
    assert kv_budget_bytes(spec, 64, plenty) == 64 * KV_POSITIONS_PER_SEQUENCE * per_position
    assert kv_budget_bytes(spec, 64, 1 << 30) == int(KV_MEMORY_SHARE * (1 << 30))
    tiny = load_model(TINY_MODELS["llama-q4k-tiny"])
    backend = build_cpu_backend(tiny, KVRequest(blocks=None, block_size=16, max_sequences=2), ())
    positions = backend.info.num_blocks * 16
    assert positions == max(tiny.spec.context_length, 2 * KV_POSITIONS_PER_SEQUENCE)
    assert 0 < resident_bytes() < available_memory_bytes() + resident_bytes()


WARM_UP_CHECK = """
import json, sys
from actors.logs import configure_logging
from actors.compute.cpu import WARM_UP_TASK, CpuBackend
from actors.model.decode_layer import decode_blocks
from actors.model.loaded import load_model
from actors.model.quantized_kernels import run_rows

class Counting(CpuBackend):
    steps = 0

    def run(self, items, rows):
        Counting.steps += 1
        return super().run(items, rows)

configure_logging("info", sys.stderr, as_json=True)
model = load_model(sys.argv[1])
before = (len(run_rows.signatures), len(decode_blocks.signatures))
Counting(model, 4, 16)
after = (len(run_rows.signatures), len(decode_blocks.signatures))
Counting(model, 4, 16)
print(json.dumps([before, after, Counting.steps, WARM_UP_TASK]))
"""


def test_the_first_backend_of_a_process_compiles_the_kernels_before_any_request(
    tiny_model_paths: dict[str, Path],
) -> None:
    """A fresh process's first CpuBackend runs a prefill and a decoding step itself (its own
    steps, not a subclass's `run`), so numba compiles the products and the decoding block
    under a logged progress task, before any request; the second backend does not."""
    done = subprocess.run([sys.executable, "-c", WARM_UP_CHECK,
                           str(tiny_model_paths["llama-q4k-tiny"])],
                          capture_output=True, text=True, check=True, timeout=900)
    before, after, steps, task = json.loads(done.stdout)
    assert before == [0, 0] and after == [1, 1] and steps == 0
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    done_counts = [event["done"] for event in events
                   if event.get("event") == "progress" and event.get("task") == task]
    assert done_counts == [0, 2]
