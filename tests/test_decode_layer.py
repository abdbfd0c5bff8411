"""The compiled decoding block (actors.model.decode_layer) against the numpy block it stands
in for, on every reference architecture, and the steps it takes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from actors.model import quantized
from actors.model.decode_layer import DecodeLayers
from actors.model.forward import KVPool, Transformer, attention_groups
from actors.model.loaded import load_model
from actors.model.step import StepItem, plan_step
from tests.conftest import TINY_MODELS, gemma3_path, smollm2_path

# The two blocks differ in the last bits of exp and RoPE's products (measured: at most 1.5e-4
# on gemma-3-270m's logits, which reach 97).
BLOCK_TOLERANCE = 1e-3
POOL_BLOCKS, BLOCK_SIZE = 48, 16
MODELS = (*TINY_MODELS, "gemma3-270m", "smollm2-135m")


def _path(name: str) -> Path:
    if name in TINY_MODELS:
        return TINY_MODELS[name]
    return gemma3_path() if name == "gemma3-270m" else smollm2_path()


def _decode(transformer: Transformer, prompts: list[tuple[int, ...]],
            steps: int) -> tuple[np.ndarray, KVPool]:
    """Prefill the prompts together, then `steps` greedy decoding steps of all of them: each
    step's logits (steps, sequences, vocab) and the pool."""
    spec = transformer.spec
    kv = KVPool(spec, POOL_BLOCKS, BLOCK_SIZE)
    tables = [tuple(range(4 * s, 4 * s + 4)) for s in range(len(prompts))]
    plan = plan_step([StepItem(p, 0, t) for p, t in zip(prompts, tables)], spec, POOL_BLOCKS,
                     BLOCK_SIZE)
    logits = transformer.logits(transformer.hidden_states(plan, kv)[plan.logit_rows])
    rows = []
    for step in range(steps):
        plan = plan_step([StepItem((int(row.argmax()),), len(p) + step, t)
                          for row, p, t in zip(logits, prompts, tables)], spec, POOL_BLOCKS,
                         BLOCK_SIZE)
        logits = transformer.logits(transformer.hidden_states(plan, kv)[plan.logit_rows])
        rows.append(logits)
    return np.stack(rows), kv


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("n_sequences", [1, 3])
def test_compiled_block_decodes_as_the_numpy_block(name: str, n_sequences: int) -> None:
    model = load_model(_path(name))
    compiled = Transformer(model.spec, model.weights)
    reference = Transformer(model.spec, model.weights)
    assert compiled.decode_layers is not None
    reference.decode_layers = None
    rng = np.random.default_rng(len(name))
    prompts = [tuple(int(t) for t in rng.integers(10, min(model.spec.vocab_size, 30000),
                                                  5 + 4 * s)) for s in range(n_sequences)]
    ours, our_kv = _decode(compiled, prompts, 4)
    theirs, their_kv = _decode(reference, prompts, 4)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=BLOCK_TOLERANCE)
    assert (ours.argmax(axis=-1) == theirs.argmax(axis=-1)).all()
    np.testing.assert_allclose(our_kv.k, their_kv.k, rtol=0, atol=BLOCK_TOLERANCE)
    np.testing.assert_allclose(our_kv.v, their_kv.v, rtol=0, atol=BLOCK_TOLERANCE)


def test_compiled_block_gives_the_same_bits_shared_or_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each output feature is one thread's whole sum, whichever thread takes its chunk.
    model = load_model(TINY_MODELS["qwen3-q4k-tiny"])
    prompts = [(11, 12, 13, 14), (21, 22, 23)]
    results = []
    for minimum in (0, 1 << 62):
        monkeypatch.setattr(quantized, "WATCHED_MIN_WORK", minimum)
        results.append(_decode(Transformer(model.spec, model.weights), prompts, 3)[0])
    np.testing.assert_array_equal(results[0], results[1])


def test_only_steps_of_few_single_tokens_take_the_compiled_block() -> None:
    model = load_model(TINY_MODELS["llama-q4k-tiny"])
    transformer = Transformer(model.spec, model.weights)
    layers = transformer.decode_layers
    assert layers is not None

    def served(items: list[StepItem]) -> bool:
        plan = plan_step(items, model.spec, 64, BLOCK_SIZE)
        return layers.serves(plan, attention_groups(plan, model.spec.sliding_window))

    limit = model.weights.layers[0].qkv.direct_rows_limit  # type: ignore[union-attr]
    assert served([StepItem((5,), 3, (s,)) for s in range(limit)])
    assert not served([StepItem((5,), 3, (s % 64,)) for s in range(limit + 1)])
    assert not served([StepItem((5,), 3, (0,)), StepItem((5, 6), 0, (1,))])


def test_float32_weights_keep_the_numpy_block() -> None:
    model = load_model(TINY_MODELS["llama-q4k-tiny"], weights="float32")
    assert Transformer(model.spec, model.weights).decode_layers is None


def test_matrices_outside_the_models_buffer_keep_the_numpy_block() -> None:
    # One call reaches every layer's blocks through one buffer: a matrix built in memory (its
    # blocks copied) lies outside the file's, and the step keeps the numpy block, decoding the
    # same tokens.
    model = load_model(TINY_MODELS["qwen3-q4k-tiny"])
    first = model.weights.layers[0]
    moved = quantized.QuantizedMatrix(
        [quantized.QuantizedPart(part.type_name, part.blocks.copy(), part.rows, part.first)
         for part in first.down.parts],  # type: ignore[union-attr]
        first.down.in_features)  # type: ignore[union-attr]
    weights = dataclasses.replace(
        model.weights, layers=(dataclasses.replace(first, down=moved),
                               *model.weights.layers[1:]))
    assert Transformer(model.spec, weights).decode_layers is None
    prompts = [(11, 12, 13, 14)]
    ours = _decode(Transformer(model.spec, weights), prompts, 3)[0]
    theirs = _decode(Transformer(model.spec, model.weights), prompts, 3)[0]
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=BLOCK_TOLERANCE)


def test_layers_that_differ_in_query_key_norms_keep_the_numpy_block() -> None:
    model = load_model(TINY_MODELS["qwen3-q4k-tiny"])
    transformer = Transformer(model.spec, model.weights)
    norms = list(transformer.qk_norms)
    assert DecodeLayers.of(model.spec, model.weights.layers, norms) is not None
    norms[-1] = None
    assert DecodeLayers.of(model.spec, model.weights.layers, norms) is None
