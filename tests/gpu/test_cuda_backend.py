"""The CUDA backend on the device (skipped without one): the whole model against the CPU on the
reference sequences of the four models, and the engine on backend="cuda" (concurrent greedy
equals solo, cancellation, an injected step failure, launches per decode step).

Model check: every reference sequence of a model at once, the first half prefilled in chunks
of varied sizes (several items per step: matvec, batched product and the gathered logits
rows), the rest decoded one token per sequence per step (the decode graphs). At every position
with a logits row: the CUDA row at the CPU row's top-16 ids within 0.05 of the CPU's, and the
teacher-forced top-1 of both agreeing at >= 99% of the positions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import gc
import importlib.metadata
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from actors.compute.backends import BACKENDS, CudaFactory
from actors.compute.contract import Candidates, KVRequest, RowInputs, StepItem
from actors.engine import Engine
from actors.errors import ModelFormatError
from actors.model.loaded import Model, load_model, open_model
from actors.params import SamplingParams
from tests.conftest import REFERENCE_DIR, TINY_MODELS, gemma3_path, smollm2_path
from tests.cuda_samples import (
    assert_streams_do_not_change_sequence_0,
    constrained_steps,
    greedy_sharing_steps,
    short_prompt_alone_and_shared,
)

MODELS = ("llama-q4k-tiny", "qwen2-q4k-tiny", "qwen3-q4k-tiny", "llama3-q4k-tiny",
          "gemma3-scaled-q4k-tiny", "phi3-q4k-tiny", "smollm2-135m", "gemma3-270m")
TOP16_TOLERANCE = 0.05
TOP1_AGREEMENT = 0.99
CHUNKS = (37, 5, 64, 200, 8, 9)  # prefill chunk sizes, in turn: matvec, batched, both sides of 8
BLOCK = 16


# Where a real model's file is absent (a device run carries at most 64 MiB, less than either
# file), its shrunk twin from ../shared/cuda/models, carried by tests/gpu/prepare_carry.sh:
# the same architecture, block types and first layers, the vocabulary cut to SHRUNK_VOCAB.
SHRUNK_DIR = Path(__file__).resolve().parents[2] / ".cudacarry" / "models"
SHRUNK_FILES = {"smollm2-135m": "smollm2-shrunk.gguf", "gemma3-270m": "gemma3-shrunk.gguf"}
SHRUNK_VOCAB = 8192


def full_model_path(name: str) -> Path | None:
    try:
        path = smollm2_path() if name == "smollm2-135m" else gemma3_path()
    except (ModelFormatError, importlib.metadata.PackageNotFoundError):
        return None
    return path if path.exists() else None


def model_path(name: str) -> Path:
    """The model's file: the tiny ones are in the tree; a real one's full file where installed,
    else its shrunk twin where carried, else a skip."""
    if name in TINY_MODELS:
        return TINY_MODELS[name]
    path = full_model_path(name)
    if path is not None:
        return path
    shrunk = SHRUNK_DIR / SHRUNK_FILES[name]
    if not shrunk.exists():
        pytest.skip(f"{name} is not on this machine: neither its package nor {shrunk}")
    return shrunk


def reference_sequences(name: str) -> list[list[int]]:
    """The reference token sequences of the model; for a shrunk twin `ids % SHRUNK_VOCAB`
    (valid ids of its cut vocabulary, as ../shared/cuda/README.md says)."""
    data = np.load(REFERENCE_DIR / name / "logits.npz")
    count = sum(1 for key in data.files if key.endswith("_tokens"))
    sequences = [data[f"seq{i}_tokens"] for i in range(count)]
    if name in SHRUNK_FILES and model_path(name).parent == SHRUNK_DIR:
        sequences = [tokens % SHRUNK_VOCAB for tokens in sequences]
    return [tokens.tolist() for tokens in sequences]


class CpuYardstick:
    """The CPU model's top-16 ids and logits and its argmax at every position of a sequence
    (the whole rows are not kept: gemma3's are 1 MB each)."""

    def __init__(self, model: Model, tokens: Sequence[int]) -> None:
        logits = model.logits(list(tokens))
        self.top16 = np.argsort(-logits, axis=1, kind="stable")[:, :16]
        self.top16_logits = np.take_along_axis(logits, self.top16, axis=1)
        self.argmax = logits.argmax(axis=1)


class Comparison:
    def __init__(self) -> None:
        self.worst = 0.0
        self.agreeing = 0
        self.positions = 0

    def add(self, cpu: CpuYardstick, position: int, row: np.ndarray) -> None:
        delta = np.abs(row[cpu.top16[position]] - cpu.top16_logits[position]).max()
        self.worst = max(self.worst, float(delta))
        self.agreeing += int(row.argmax() == cpu.argmax[position])
        self.positions += 1


def check_candidates(candidates: Candidates, rows: np.ndarray) -> None:
    for i, row in enumerate(rows):
        assert candidates.ids[i, 0] == row.argmax()
        assert candidates.count[i] >= 16
        np.testing.assert_array_equal(row[candidates.ids[i, :16]], candidates.logits[i, :16])


def run_and_compare(backend: Any, items: list[StepItem], positions: list[tuple[int, int]],
                    yardsticks: list[CpuYardstick], comparison: Comparison) -> None:
    inputs = [RowInputs(candidates=16, max_candidates=16, want_log_z=True)] * len(items)
    candidates = backend.run(items, inputs)
    rows = backend.fetch_rows(range(len(items)))
    check_candidates(candidates, rows)
    for (sequence, position), row in zip(positions, rows):
        comparison.add(yardsticks[sequence], position, row)


@pytest.fixture(scope="module", params=MODELS)
def compared(request: pytest.FixtureRequest) -> Iterator[tuple[str, Comparison]]:
    """Each model's reference sequences side by side."""
    name = request.param
    model = load_model(model_path(name))
    sequences = reference_sequences(name)
    yardsticks = [CpuYardstick(model, tokens) for tokens in sequences]
    per_sequence = -(-max(len(t) for t in sequences) // BLOCK)
    kv = KVRequest(blocks=per_sequence * len(sequences), block_size=BLOCK,
                   max_sequences=len(sequences))
    backend = CudaFactory().build(model, kv)
    tables = [tuple(range(i * per_sequence, (i + 1) * per_sequence))
              for i in range(len(sequences))]
    comparison = Comparison()
    held = [0] * len(sequences)
    step = 0
    try:
        while any(h < len(t) // 2 for h, t in zip(held, sequences)):  # prefill, chunked
            items, positions = [], []
            for i, tokens in enumerate(sequences):
                end = min(len(tokens) // 2, held[i] + CHUNKS[(step + i) % len(CHUNKS)])
                if end > held[i]:
                    items.append(StepItem(tuple(tokens[held[i] : end]), held[i], tables[i]))
                    positions.append((i, end - 1))
                    held[i] = end
            run_and_compare(backend, items, positions, yardsticks, comparison)
            step += 1
        while any(h < len(t) for h, t in zip(held, sequences)):  # decode, one token each
            items, positions = [], []
            for i, tokens in enumerate(sequences):
                if held[i] < len(tokens):
                    items.append(StepItem((tokens[held[i]],), held[i], tables[i]))
                    positions.append((i, held[i]))
                    held[i] += 1
            run_and_compare(backend, items, positions, yardsticks, comparison)
        yield name, comparison
    finally:
        backend.close()


# Each figure is recorded as a property, which conftest.py prints at the end of the run, so a
# device run reports how close the backend came, not only that it passed.
def test_top16_logits_within_tolerance_of_the_cpu(compared: tuple[str, Comparison],
                                                   record_property: Any) -> None:
    name, comparison = compared
    record_property("worst_top16_delta", f"{comparison.worst:.6f}")
    assert comparison.worst <= TOP16_TOLERANCE, (name, comparison.worst)


def test_teacher_forced_top1_agrees_with_the_cpu(compared: tuple[str, Comparison],
                                                 record_property: Any) -> None:
    name, comparison = compared
    agreement = comparison.agreeing / comparison.positions
    record_property("top1_agreement", f"{agreement:.6f} of {comparison.positions}")
    assert agreement >= TOP1_AGREEMENT, (name, agreement, comparison.positions)


# --- launches -------------------------------------------------------------------------------


def test_a_decode_step_is_a_handful_of_launches() -> None:
    model = open_model(TINY_MODELS["llama-q4k-tiny"])
    backend = BACKENDS["cuda"].build(model, KVRequest(blocks=16, block_size=BLOCK,
                                                      max_sequences=4))
    try:
        items = [StepItem((i + 1, i + 2), 0, (i,)) for i in range(3)]
        backend.run(items, [RowInputs()] * 3)
        eager = backend.launches_per_step
        for position in range(2, 5):
            backend.run([StepItem((7,), position, (i,)) for i in range(3)], [RowInputs()] * 3)
            # step arrays host -> device, the graph, rows host -> device, top_candidates,
            # records device -> host
            assert backend.launches_per_step == 5
        assert eager > 8 * model.spec.n_layers
        # Per layer: norm, qkv (finished in its epilogue), attention split and combine, o,
        # norm, gate+up, down; per step: embedding, final norm, output, top_candidates.
        assert backend.kernels_per_step <= 7 * model.spec.n_layers + 4
    finally:
        backend.close()
        model.gguf.close()


INVARIANCE_STREAMS = (1, 8, 9, 32, 64)


def test_greedy_tokens_do_not_depend_on_the_streams_sharing_the_step() -> None:
    """Sequence 0 decoded beside 0, 7, 8, 31 and 63 others: decode rows take the mma matvec
    up to 8 rows and the batched product past them, each with independent rows, so its
    tokens are the same, and its logits rows the same bits on the same kernels
    (assert_streams_do_not_change_sequence_0)."""
    model = open_model(TINY_MODELS["qwen2-q4k-tiny"])
    steps, most = 6, max(INVARIANCE_STREAMS)
    rng = np.random.default_rng(17)
    prompts = [rng.integers(1, model.spec.vocab_size, 3 + i % 4).tolist() for i in range(most)]
    backend = CudaFactory().build(
        model, KVRequest(blocks=most * 2, block_size=BLOCK, max_sequences=most))
    try:
        runs = {n: greedy_sharing_steps(backend, prompts[:n], steps, BLOCK)
                for n in INVARIANCE_STREAMS}
    finally:
        backend.close()
        model.gguf.close()
    assert_streams_do_not_change_sequence_0(runs)


def test_a_prompts_logits_do_not_depend_on_the_prompts_sharing_its_step() -> None:
    """Each prefill item takes the matvec or the batched product by its own length: a
    5-token prompt's logits row is the same bits alone and beside a short and a 20-token
    prompt."""
    model = open_model(TINY_MODELS["qwen2-q4k-tiny"])
    backend = BACKENDS["cuda"].build(model, KVRequest(blocks=8, block_size=BLOCK,
                                                      max_sequences=4))
    try:
        alone, together = short_prompt_alone_and_shared(backend)
    finally:
        backend.close()
        model.gguf.close()
    np.testing.assert_array_equal(together.view(np.uint32), alone.view(np.uint32))


def test_masked_rows_give_the_cpu_references_candidates() -> None:
    """Structured output's token masks (apply_token_mask before the penalties) on a prefill
    and a decode step: the CPU reference's candidates over the device's own rows."""
    model = open_model(TINY_MODELS["qwen2-q4k-tiny"])
    backend = BACKENDS["cuda"].build(model, KVRequest(blocks=8, block_size=BLOCK,
                                                      max_sequences=4))
    try:
        constrained_steps(backend)
    finally:
        backend.close()
        model.gguf.close()


# --- the engine on backend="cuda" -----------------------------------------------------------

# Token-id prompts of more than MATVEC_MAX_BATCH tokens: alone or together, a prompt's rows
# then take the batched product (and the decode rows theirs by their number), so each
# sequence's math is the same either way and greedy tokens must match exactly.
PROMPTS = [tuple(int(t) for t in np.random.default_rng(i).integers(10, 1000, 12 + i))
           for i in range(6)]
ENGINE_MODEL = "qwen2-q4k-tiny"


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy for exactly max_tokens tokens (an end-of-text token would end one early)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.parametrize("name", [ENGINE_MODEL, "smollm2-135m", "gemma3-270m"])
async def test_concurrent_greedy_equals_solo(name: str) -> None:
    together: dict[int, tuple[int, ...]] = {}
    async with Engine.open(model_path(name), backend="cuda", max_sequences=8) as engine:
        assert engine.info.on_gpu
        alone = [(await engine.complete(p, greedy(16))).token_ids for p in PROMPTS]

        async def one(index: int) -> None:
            together[index] = (await engine.complete(PROMPTS[index], greedy(16))).token_ids

        async with anyio.create_task_group() as tasks:
            for index in range(len(PROMPTS)):
                tasks.start_soon(one, index)
    assert [together[i] for i in range(len(PROMPTS))] == alone
    assert all(len(tokens) == 16 for tokens in alone)


@pytest.mark.anyio
async def test_cancelled_requests_free_their_blocks_and_others_carry_on() -> None:
    async with Engine.open(model_path(ENGINE_MODEL), backend="cuda") as engine:
        expected = (await engine.complete(PROMPTS[1], greedy(8))).token_ids
        taken = 0
        with anyio.CancelScope() as scope:
            async for _ in engine.generate(PROMPTS[0], greedy(200)):
                taken += 1
                if taken == 3:
                    scope.cancel()
                    await anyio.sleep(1)  # cancelled here, with the stream open
        assert scope.cancelled_caught
        assert (await engine.complete(PROMPTS[1], greedy(8))).token_ids == expected
        gc.collect()  # the dropped stream, then the actors' inboxes
        for _ in range(20):
            await anyio.sleep(0)
        stats = engine.stats()
        assert stats.running == stats.waiting == stats.kv_blocks_used == 0


class FlakyBackend:
    """A CUDA backend whose first step that carries a decode at `fail_at` raises."""

    def __init__(self, backend: Any, fail_at: int) -> None:
        self.backend, self.fail_at, self.failed = backend, fail_at, 0
        self.info = backend.info

    def run(self, items: Sequence[StepItem], rows: Sequence[RowInputs]) -> Candidates:
        if not self.failed and any(item.start == self.fail_at for item in items):
            self.failed += 1
            raise RuntimeError("injected failure")
        return self.backend.run(items, rows)

    def fetch_rows(self, indices: Sequence[int]) -> np.ndarray:
        return self.backend.fetch_rows(indices)

    def close(self) -> None:
        self.backend.close()


@pytest.mark.anyio
async def test_an_injected_step_failure_replays_on_the_gpu() -> None:
    path = model_path(ENGINE_MODEL)
    async with Engine.open(path, backend="cuda") as engine:
        alone = [(await engine.complete(p, greedy(6))).token_ids for p in PROMPTS[:3]]
    model = open_model(path)
    fail_at = len(PROMPTS[0]) + 2
    kv = KVRequest(blocks=256, block_size=BLOCK, max_sequences=8)
    flaky: list[FlakyBackend] = []

    def make_backend() -> FlakyBackend:
        flaky.append(FlakyBackend(BACKENDS["cuda"].build(model, kv), fail_at))
        return flaky[0]

    results: dict[int, tuple[int, ...]] = {}

    async def one(index: int) -> None:
        results[index] = (await engine.complete(PROMPTS[index], greedy(6))).token_ids

    async with Engine.open_backend(make_backend, model.tokenizer, backend="cuda") as engine:
        async with anyio.create_task_group() as tasks:
            for index in range(3):
                tasks.start_soon(one, index)
    model.gguf.close()
    assert flaky[0].failed == 1
    assert [results[i] for i in range(3)] == alone
