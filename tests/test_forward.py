"""Stepping through the block KV cache: token by token, chunked, batched, validated.

The full-sequence logits (`Model.logits`) are the yardstick; the reference tests check those
against transformers and llama.cpp. Tiny models carry the exhaustive checks; the real models
run a few cheap ones (gemma3 for the sliding window, smollm2 for real-vocabulary batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from actors.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    ModelFormatError,
    UnsupportedModelError,
)
from actors.model.forward import KVPool, StepItem
from actors.model.loaded import Model, load_model
from tests.conftest import REFERENCE_DIR, TINY_MODELS, gemma3_path, smollm2_path

STEP_TOLERANCE = 1e-3
BATCH_TOLERANCE = 1e-4
BLOCK = 16


def reference_tokens(name: str, index: int) -> list[int]:
    return np.load(REFERENCE_DIR / name / "logits.npz")[f"seq{index}_tokens"].tolist()


def blocks_for(first_block: int, n_positions: int) -> tuple[int, ...]:
    return tuple(range(first_block, first_block + -(-n_positions // BLOCK)))


def step_one_at_a_time(model: Model, tokens: Sequence[int]) -> np.ndarray:
    kv = model.new_kv_pool(-(-len(tokens) // BLOCK), BLOCK)
    table = tuple(range(kv.num_blocks))
    return np.concatenate(
        [model.step([StepItem((tok,), pos, table)], kv) for pos, tok in enumerate(tokens)]
    )


def step_in_chunks(
    model: Model, tokens: Sequence[int], bounds: Sequence[int]
) -> tuple[list[int], np.ndarray]:
    """Prefill `tokens` in chunks ending at each of `bounds`; return the last position of
    each chunk and the logits there."""
    kv = model.new_kv_pool(-(-len(tokens) // BLOCK), BLOCK)
    table = tuple(range(kv.num_blocks))
    starts = [0, *bounds[:-1]]
    rows = [model.step([StepItem(tuple(tokens[s:e]), s, table)], kv)
            for s, e in zip(starts, bounds)]
    return [e - 1 for e in bounds], np.concatenate(rows)


def random_bounds(rng: np.random.Generator, n: int, max_chunk: int) -> list[int]:
    bounds, pos = [], 0
    while pos < n:
        pos = min(n, pos + int(rng.integers(1, max_chunk + 1)))
        bounds.append(pos)
    return bounds


@pytest.fixture(scope="module")
def tiny_models() -> dict[str, Model]:
    return {name: load_model(path) for name, path in TINY_MODELS.items()}


@pytest.fixture(scope="module")
def smollm2() -> Model:
    return load_model(smollm2_path())


@pytest.fixture(scope="module")
def gemma3() -> Model:
    return load_model(gemma3_path())


# --- one token at a time and chunked prefill equal the full sequence --------------------


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_token_by_token_matches_full_sequence(tiny_models: dict[str, Model],
                                                   name: str) -> None:
    model = tiny_models[name]
    for index in range(6):
        tokens = reference_tokens(name, index)
        np.testing.assert_allclose(step_one_at_a_time(model, tokens), model.logits(tokens),
                                   atol=STEP_TOLERANCE, rtol=0)


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_random_chunks_match_full_sequence(tiny_models: dict[str, Model],
                                                name: str) -> None:
    model = tiny_models[name]
    rng = np.random.default_rng(7)
    for index in range(6):
        tokens = reference_tokens(name, index)
        full = model.logits(tokens)
        for _ in range(3):
            last, rows = step_in_chunks(model, tokens, random_bounds(rng, len(tokens), 12))
            np.testing.assert_allclose(rows, full[last], atol=STEP_TOLERANCE, rtol=0)


def test_smollm2_token_by_token_matches_full_sequence(smollm2: Model) -> None:
    tokens = reference_tokens("smollm2-135m", 0)[:24]
    np.testing.assert_allclose(step_one_at_a_time(smollm2, tokens), smollm2.logits(tokens),
                               atol=STEP_TOLERANCE, rtol=0)


def test_gemma3_token_by_token_matches_full_sequence(gemma3: Model) -> None:
    tokens = reference_tokens("gemma3-270m", 1)[:12]
    np.testing.assert_allclose(step_one_at_a_time(gemma3, tokens), gemma3.logits(tokens),
                               atol=STEP_TOLERANCE, rtol=0)


@pytest.fixture(scope="module")
def gemma3_long(gemma3: Model) -> tuple[list[int], np.ndarray]:
    """The 700-token sequence (crosses the 512-token window) and its full logits."""
    tokens = reference_tokens("gemma3-270m", 5)
    return tokens, gemma3.logits(tokens)


def test_gemma3_random_chunks_across_the_window(
    gemma3: Model, gemma3_long: tuple[list[int], np.ndarray]
) -> None:
    tokens, full = gemma3_long
    last, rows = step_in_chunks(gemma3, tokens,
                                random_bounds(np.random.default_rng(3), len(tokens), 300))
    np.testing.assert_allclose(rows, full[last], atol=STEP_TOLERANCE, rtol=0)


def test_gemma3_batched_decode_past_the_window(
    gemma3: Model, gemma3_long: tuple[list[int], np.ndarray]
) -> None:
    # Decode items are attended as one padded batch: a long sequence past the window next to
    # a short one must still see exactly its own last 512 positions.
    tokens, full = gemma3_long
    short = reference_tokens("gemma3-270m", 0)[:5]
    kv = gemma3.new_kv_pool(2 * -(-len(tokens) // BLOCK), BLOCK)
    long_table = blocks_for(0, len(tokens))
    short_table = blocks_for(len(long_table), len(tokens))
    prefix = 600
    gemma3.step([StepItem(tuple(tokens[:prefix]), 0, long_table, want_logits=False),
                 StepItem(tuple(short), 0, short_table, want_logits=False)], kv)
    for pos in range(prefix, prefix + 4):
        rows = gemma3.step([StepItem((short[pos % 5],), 5 + pos - prefix, short_table),
                            StepItem((tokens[pos],), pos, long_table)], kv)
        np.testing.assert_allclose(rows[1], full[pos], atol=STEP_TOLERANCE, rtol=0)


# --- batch invariance -----------------------------------------------------------------


def test_batch_invariance_with_mixed_lengths(smollm2: Model) -> None:
    """A sequence's logits do not depend on what shares its step."""
    seqs = [reference_tokens("smollm2-135m", i)[:n] for i, n in enumerate((20, 33, 7, 1))]
    alone = []
    for tokens in seqs:
        kv = smollm2.new_kv_pool(4, BLOCK)
        alone.append(smollm2.step([StepItem(tuple(tokens), 0, blocks_for(0, 64))], kv)[0])
    kv = smollm2.new_kv_pool(16, BLOCK)
    together = smollm2.step(
        [StepItem(tuple(t), 0, blocks_for(4 * i, 64)) for i, t in enumerate(seqs)], kv
    )
    np.testing.assert_allclose(together, np.stack(alone), atol=BATCH_TOLERANCE, rtol=0)


def greedy(model: Model, prompts: list[list[int]], n_new: int, concurrency: int) -> list[list[int]]:
    """Greedy continuations, `concurrency` sequences stepped together; each later sequence
    joins (prefills) while the earlier ones of its batch are decoding."""
    kv = model.new_kv_pool(4 * len(prompts), BLOCK)
    tables = [blocks_for(4 * i, 64) for i in range(len(prompts))]
    out: list[list[int]] = [[] for _ in prompts]
    for first in range(0, len(prompts), concurrency):
        live = list(range(first, min(first + concurrency, len(prompts))))
        held = {i: 0 for i in live}
        pending = {i: list(prompts[i]) for i in live}
        # Stagger: sequence j of the batch starts prefilling at step j.
        for tick in range(n_new + len(live)):
            items, owners = [], []
            for j, i in enumerate(live):
                if j > tick or len(out[i]) == n_new:
                    continue
                items.append(StepItem(tuple(pending[i]), held[i], tables[i]))
                owners.append(i)
            if not items:
                continue
            logits = model.step(items, kv)
            for i, row in zip(owners, logits):
                held[i] += len(pending[i])
                token = int(row.argmax())
                out[i].append(token)
                pending[i] = [token]
    return out


def test_greedy_continuations_identical_at_any_concurrency(smollm2: Model) -> None:
    prompts = [reference_tokens("smollm2-135m", i)[:n] for i, n in enumerate((9, 14, 5, 11))]
    one = greedy(smollm2, prompts, 6, 1)
    assert greedy(smollm2, prompts, 6, 2) == one
    assert greedy(smollm2, prompts, 6, 4) == one


def test_only_items_wanting_logits_get_rows(tiny_models: dict[str, Model]) -> None:
    model = tiny_models["llama-q4k-tiny"]
    tokens = reference_tokens("llama-q4k-tiny", 0)
    kv = model.new_kv_pool(8, BLOCK)
    rows = model.step([StepItem(tuple(tokens[:10]), 0, blocks_for(0, 64), want_logits=False),
                       StepItem(tuple(tokens[:3]), 0, blocks_for(4, 64))], kv)
    assert rows.shape == (1, model.spec.vocab_size) and rows.dtype == np.float32
    np.testing.assert_allclose(rows[0], model.logits(tokens[:3])[-1], atol=BATCH_TOLERANCE)
    # The first item's KV was written though it asked for no logits.
    rest = model.step([StepItem(tuple(tokens[10:12]), 10, blocks_for(0, 64))], kv)
    np.testing.assert_allclose(rest[0], model.logits(tokens[:12])[-1], atol=STEP_TOLERANCE)
    empty = model.step([StepItem((1,), 0, blocks_for(0, 1), want_logits=False)], kv)
    assert empty.shape == (0, model.spec.vocab_size)


# --- model surface --------------------------------------------------------------------


def test_model_surface(tiny_models: dict[str, Model], smollm2: Model, gemma3: Model) -> None:
    assert gemma3.spec.arch == "gemma3" and smollm2.spec.arch == "llama"
    assert "tokenizer" not in vars(gemma3), "the tokenizer must load lazily"
    assert smollm2.chat_template is not None and "<|im_start|>" in smollm2.chat_template
    # Tied output: one float32 copy of the embedding serves lookup and projection.
    assert gemma3.weights.tied_output
    assert gemma3.weights.token_embd.shape == (640, 262144)
    assert gemma3.weights.n_bytes < 1.1e9
    assert not tiny_models["llama-q4k-tiny"].weights.tied_output
    assert tiny_models["qwen2-q4k-tiny"].weights.tied_output
    assert all(layer.qkv_bias is not None for layer in tiny_models["qwen2-q4k-tiny"].weights.layers)
    kv = gemma3.new_kv_pool(3)
    assert (kv.num_blocks, kv.block_size) == (3, 16)
    assert kv.bytes_per_block == 16 * 2 * 18 * 256 * 4
    logits = gemma3.logits([2, 818])
    assert logits.shape == (2, 262144) and logits.dtype == np.float32


# --- bad input --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> Model:
    return load_model(TINY_MODELS["llama-q4k-tiny"])


@pytest.mark.parametrize(
    ("items", "field"),
    [
        ([], "items"),
        (["not an item"], "items"),
        ([StepItem((), 0, (0,))], "tokens"),
        ([StepItem((1024,), 0, (0,))], "tokens"),
        ([StepItem((-1,), 0, (0,))], "tokens"),
        ([StepItem((1.5,), 0, (0,))], "tokens"),  # type: ignore[arg-type]
        ([StepItem((True,), 0, (0,))], "tokens"),
        ([StepItem("ab", 0, (0,))], "tokens"),  # type: ignore[arg-type]
        ([StepItem((1,), 0, (0.0,))], "blocks"),  # type: ignore[arg-type]
        ([StepItem((1,), -1, (0,))], "start"),
        ([StepItem((1,) * 17, 0, (0,))], "blocks"),
        ([StepItem((1,), 0, (4,))], "blocks"),
        ([StepItem((1,), 0, (0,)), StepItem((2,), 0, (0,))], "blocks"),
    ],
)
def test_bad_items_are_refused_by_field(tiny: Model, items: list, field: str) -> None:
    kv = tiny.new_kv_pool(4, BLOCK)
    with pytest.raises(InvalidRequest) as error:
        tiny.step(items, kv)
    assert error.value.field == field


def test_context_length_is_enforced(tiny: Model) -> None:
    kv = tiny.new_kv_pool(129, BLOCK)
    with pytest.raises(ContextLengthExceeded):
        tiny.step([StepItem((1,), tiny.spec.context_length, tuple(range(129)))], kv)
    with pytest.raises(ContextLengthExceeded):
        tiny.logits([1] * (tiny.spec.context_length + 1))
    with pytest.raises(InvalidRequest):
        tiny.logits([])


def test_kv_pool_sizes_and_model_are_checked(tiny: Model, smollm2: Model) -> None:
    with pytest.raises(InvalidRequest) as error:
        tiny.new_kv_pool(0)
    assert error.value.field == "num_blocks"
    with pytest.raises(InvalidRequest) as error:
        KVPool(tiny.spec, 4, block_size=0)
    assert error.value.field == "block_size"
    with pytest.raises(InvalidRequest) as error:
        tiny.step([StepItem((1,), 0, (0,))], smollm2.new_kv_pool(1))
    assert error.value.field == "kv"


def _write_gguf(path: Path, arch: str, with_layers: bool, rope_scaling: bool = False) -> Path:
    writer = GGUFWriter(str(path), arch)
    if rope_scaling:
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", 4.0)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_context_length(32)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    if with_layers:
        writer.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="mamba"):
        load_model(_write_gguf(tmp_path / "m.gguf", "mamba", with_layers=True))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="blk.0.attn_q.weight"):
        load_model(_write_gguf(tmp_path / "m.gguf", "llama", with_layers=True))


def test_rope_scaling_is_refused_not_ignored(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'yarn'"):
        load_model(_write_gguf(tmp_path / "m.gguf", "llama", with_layers=True,
                               rope_scaling=True))
