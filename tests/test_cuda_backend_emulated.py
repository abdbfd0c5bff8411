"""actors.compute.cuda end to end on the host: the real backend (packing, pinned copies, the
launches of cuda_launches, graph capture and replay, candidate records, fetch_rows) over an
emulated device whose kernels are numpy twins of cuda_src (tests/cuda_emulator.py), against
the CPU model. Float16 KV and the tensor cores' float16 hi + lo activations are emulated, so this is
also the backend's precision against the CPU, measured before any device runs it."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from actors.compute.contract import KVRequest, RowInputs, StepItem
from actors.model.loaded import Model, load_model
from tests.conftest import REFERENCE_DIR, TINY_MODELS, gemma3_path, smollm2_path
from tests.cuda_emulator import EmulatedDevice
from tests.cuda_samples import (
    assert_streams_do_not_change_sequence_0,
    constrained_steps,
    greedy_sharing_steps,
    short_prompt_alone_and_shared,
)

TOLERANCE = 0.05  # the top-16 bound for a GPU against the CPU
TOP1_AGREEMENT = 0.99
BLOCK = 16


def reference_tokens(name: str, length: int) -> list[int]:
    """The first `length` tokens of the model's longest reference sequence."""
    data = np.load(REFERENCE_DIR / name / "logits.npz")
    longest = max((data[key] for key in data.files if key.endswith("_tokens")), key=len)
    return longest[:length].tolist()


def compare(model: Model, backend: Any, tokens: list[int], split: int,
            sequences: int = 2) -> float:
    """Prefill tokens[:split] in two chunks, decode the rest as `sequences` sequences sharing
    each step (the others copies of the first in other blocks); the worst |delta| of the
    backend's rows at the CPU rows' top 16. The rows' argmax agrees with the CPU's at
    TOP1_AGREEMENT of the positions or more."""
    expected = model.logits(tokens)
    agreeing = checked = 0
    per_sequence = -(-len(tokens) // BLOCK)
    tables = [tuple(range(i * per_sequence, (i + 1) * per_sequence)) for i in range(sequences)]
    worst = 0.0

    def check(items: list[StepItem], positions: list[int]) -> None:
        nonlocal worst, agreeing, checked
        inputs = [RowInputs(candidates=4, want_log_z=True)] * len(positions)
        candidates = backend.run(items, inputs)
        rows = backend.fetch_rows(range(len(positions)))
        for row, position, ids in zip(rows, positions, candidates.ids):
            # A NaN would pass the bound below (max ignores it), so none may come back.
            assert np.isfinite(row).all(), position
            top = np.argsort(-expected[position])[:16]
            worst = max(worst, float(np.abs(row[top] - expected[position, top]).max()))
            agreeing += int(row.argmax() == top[0])
            checked += 1
            assert ids[0] == row.argmax()

    half = split // 2
    check([StepItem(tuple(tokens[:half]), 0, table) for table in tables], [half - 1] * sequences)
    check([StepItem(tuple(tokens[half:split]), half, tables[0]),
           *(StepItem(tuple(tokens[half:split]), half, table, want_logits=False)
             for table in tables[1:])], [split - 1])
    for position in range(split, len(tokens)):
        check([StepItem((tokens[position],), position, table) for table in tables],
              [position] * sequences)
    assert agreeing >= TOP1_AGREEMENT * checked, f"top-1 agrees at {agreeing} of {checked}"
    return worst


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_models_match_the_cpu(emulated: tuple[Any, EmulatedDevice], name: str) -> None:
    module, device = emulated
    model = load_model(TINY_MODELS[name])
    backend = module.build_cuda_backend(model, KVRequest(blocks=16, block_size=BLOCK,
                                                         max_sequences=2), 0.9)
    tokens = reference_tokens(name, 40)
    assert compare(model, backend, tokens, 30) <= TOLERANCE
    # Every decode step replays the one graph of bucket 2.
    assert device.captures == 1 and device.replays == len(tokens) - 30
    # Both files' Q6_K matrices (v and down of a layer, the output or the tied embedding;
    # down's three blocks a row laid out otherwise than in the file) go to the tensor cores,
    # held row-planar alone: the prompts' batched products read them so too.
    assert {"mul_mat_vec_mma_q6_K", "mul_mat_batch32_f16x2_q6_K_planar"} <= set(device.launches)
    # Their decode rows' q, k and v (Q4_K and Q6_K) in one launch with the finish.
    assert "mul_mat_vec_mma_qkv" in device.launches
    backend.close()
    assert device.live == set()


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_models_match_the_cpu_on_the_batched_product(emulated: tuple[Any, EmulatedDevice],
                                                          name: str) -> None:
    """The other regime: 9 sequences share each decode step, so every product of the step
    (q, k and v with their finish, o, gate + up with the activation, down, the logits) is
    the batched product's, its 16-column tiles."""
    module, device = emulated
    model = load_model(TINY_MODELS[name])
    backend = module.build_cuda_backend(model, KVRequest(blocks=36, block_size=BLOCK,
                                                         max_sequences=9), 0.9)
    tokens = reference_tokens(name, 40)
    assert compare(model, backend, tokens, 30, sequences=9) <= TOLERANCE
    assert device.captures == 1 and device.replays == len(tokens) - 30  # bucket 16
    assert {"mul_mat_batch16_qkv_f16x2", "mul_mat_batch16_f16x2_q4_K"} <= set(device.launches)
    assert any(kernel.startswith("mul_mat_batch16_gate_up_") for kernel in device.launches)
    assert not any(kernel.startswith("mul_mat_vec_mma_") for kernel in device.launches)
    backend.close()
    assert device.live == set()


def test_scaled_gemma3_matches_the_cpu_past_its_window(
        emulated: tuple[Any, EmulatedDevice]) -> None:
    """Gemma 3 as from 4B up (linear RoPE scaling x8 on the global layers, the sliding layers
    at their own base, unscaled), over 100 tokens of its long sequence: its 64-token window
    is passed in the second prefill chunk and by every decode step."""
    module, _ = emulated
    name = "gemma3-scaled-q4k-tiny"
    model = load_model(TINY_MODELS[name])
    assert model.spec.rope_linear_factor == 8.0 and model.spec.sliding_window == 64
    backend = module.build_cuda_backend(model, KVRequest(blocks=16, block_size=BLOCK,
                                                         max_sequences=2), 0.9)
    assert compare(model, backend, reference_tokens(name, 100), 80) <= TOLERANCE
    backend.close()


# Two sequences a step (the matvec) and nine (the batched product).
SEQUENCES = (2, 9)
# A real model's tokens: 30 prefilled, then decode steps enough to cross gemma's shrunk
# window; each step's logits rows over the vocabulary are most of a run's time.
REAL_MODEL_TOKENS = 34
# A real model's steps through the twins, its logits over a vocabulary each step: minutes.
SLOW_MODEL_TIMEOUT_S = 1200


@pytest.mark.slow
@pytest.mark.timeout(SLOW_MODEL_TIMEOUT_S)
@pytest.mark.parametrize("sequences", SEQUENCES)
def test_gemma3_matches_the_cpu(emulated: tuple[Any, EmulatedDevice],
                                sequences: int) -> None:
    """Sliding-window layers past the window are not reached in 34 tokens; the window is
    shrunk to 8 so that they are, on both sides."""
    module, _ = emulated
    model = load_model(gemma3_path())
    model.spec = model._transformer.spec = dataclasses.replace(model.spec, sliding_window=8)
    backend = module.build_cuda_backend(model, KVRequest(blocks=4 * sequences, block_size=BLOCK,
                                                         max_sequences=sequences), 0.9)
    tokens = reference_tokens("gemma3-270m", REAL_MODEL_TOKENS)
    assert compare(model, backend, tokens, 30, sequences) <= TOLERANCE
    backend.close()


@pytest.mark.slow
@pytest.mark.timeout(SLOW_MODEL_TIMEOUT_S)
@pytest.mark.parametrize("sequences", SEQUENCES)
def test_smollm2_matches_the_cpu(emulated: tuple[Any, EmulatedDevice],
                                 sequences: int) -> None:
    """The fourth model: llama's layout with Q4_1 and Q8_0 blocks and a tied output."""
    module, _ = emulated
    model = load_model(smollm2_path())
    backend = module.build_cuda_backend(model, KVRequest(blocks=4 * sequences, block_size=BLOCK,
                                                         max_sequences=sequences), 0.9)
    tokens = reference_tokens("smollm2-135m", REAL_MODEL_TOKENS)
    assert compare(model, backend, tokens, 30, sequences) <= TOLERANCE
    backend.close()


INVARIANCE_STREAMS = (1, 8, 9, 32, 64)


def test_greedy_tokens_do_not_depend_on_the_streams_sharing_the_step(
        emulated: tuple[Any, EmulatedDevice]) -> None:
    """Sequence 0 decoded beside 0, 7, 8, 31 and 63 others: its tokens are the same, and so
    are its logits rows bit for bit among the step sizes on the same kernels: 1 and 8 rows
    (the mma matvec) and 9, 32 and 64 (the batched product, whose sums are another
    summation of the same products)."""
    module, device = emulated
    model = load_model(TINY_MODELS["qwen2-q4k-tiny"])
    steps, most = 4, max(INVARIANCE_STREAMS)
    rng = np.random.default_rng(17)
    prompts = [rng.integers(1, model.spec.vocab_size, 3 + i % 4).tolist() for i in range(most)]
    backend = module.build_cuda_backend(model, KVRequest(blocks=most * 2, block_size=BLOCK,
                                                         max_sequences=most), 0.9)
    try:
        runs = {n: greedy_sharing_steps(backend, prompts[:n], steps, BLOCK)
                for n in INVARIANCE_STREAMS}
    finally:
        backend.close()
    for prefix in ("mul_mat_vec_mma_", "mul_mat_batch"):
        assert any(name.startswith(prefix) for name in device.launches), prefix
    assert_streams_do_not_change_sequence_0(runs)


def test_a_prompts_logits_do_not_depend_on_the_prompts_sharing_its_step(
        emulated: tuple[Any, EmulatedDevice]) -> None:
    """A 5-token prompt alone, then beside another short one and a 20-token one (30 prefill
    rows once took one launch all together): its logits row is the same bits."""
    module, _ = emulated
    model = load_model(TINY_MODELS["qwen2-q4k-tiny"])
    backend = module.build_cuda_backend(model, KVRequest(blocks=8, block_size=BLOCK,
                                                         max_sequences=4), 0.9)
    try:
        alone, together = short_prompt_alone_and_shared(backend)
    finally:
        backend.close()
    np.testing.assert_array_equal(together.view(np.uint32), alone.view(np.uint32))


def test_masked_rows_give_the_cpu_references_candidates(
        emulated: tuple[Any, EmulatedDevice]) -> None:
    """Structured output's masks on a prefill step (launch by launch) and a decode step (the
    graph) of three sequences, rows 0 and 2 masked and row 1 not: the CPU reference's
    candidates and rows (tests/cuda_samples.constrained_steps)."""
    module, device = emulated
    model = load_model(TINY_MODELS["qwen2-q4k-tiny"])
    backend = module.build_cuda_backend(model, KVRequest(blocks=8, block_size=BLOCK,
                                                         max_sequences=4), 0.9)
    try:
        constrained_steps(backend)
    finally:
        backend.close()
    # The decode step's graph, and its other lane's: its unconstrained run queued the next
    # greedy step ahead, which the constrained run (not that step) dropped.
    assert device.captures == 2 and device.launches.count("apply_token_mask") == 2


def test_a_prompt_on_the_batched_product_after_a_decode_row_matches_the_cpu(
        emulated: tuple[Any, EmulatedDevice]) -> None:
    """A decode row and a 20-token prompt in one step: the decode row's q, k and v finished
    in the mma matvec's fused QKV, the prompt's (rows 1 to 20) in the batched QKV's epilogue
    over its own rows (positions and slots from row 1 on): both logits rows match the CPU."""
    module, device = emulated
    model = load_model(TINY_MODELS["qwen2-q4k-tiny"])
    tokens = reference_tokens("qwen2-q4k-tiny", 30)
    backend = module.build_cuda_backend(model, KVRequest(blocks=8, block_size=BLOCK,
                                                         max_sequences=2), 0.9)
    try:
        backend.run([StepItem(tuple(tokens[:5]), 0, (0,))], [RowInputs()])
        backend.run([StepItem((tokens[5],), 5, (0,)), StepItem(tuple(tokens[10:30]), 0, (1, 2))],
                    [RowInputs()] * 2)
        rows = backend.fetch_rows([0, 1])
    finally:
        backend.close()
    assert "qkv_finish" not in device.launches
    assert device.launches.count("mul_mat_batch32_qkv_f16x2") == model.spec.n_layers
    for row, expected in zip(rows, (model.logits(tokens[:6])[5], model.logits(tokens[10:30])[19])):
        top = np.argsort(-expected)[:16]
        assert np.abs(row[top] - expected[top]).max() <= TOLERANCE
