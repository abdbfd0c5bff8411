"""Stepping through the block KV cache: token by token, chunked, batched, validated.

The stepping tests run through the compute contract on every backend that can run here
(`backend_name`): a backend is built from the model by its factory and driven by `Stepper`,
which asks for candidates and fetches the whole rows, checking the one against the other. The
full-sequence logits of the CPU model (`Model.logits`) are the yardstick; the reference tests
check those against transformers and llama.cpp. Tiny models carry the exhaustive checks; the
real models run a few cheap ones (gemma3 for the sliding window, smollm2 for real-vocabulary
batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from actors.compute.backends import BACKENDS
from actors.compute.contract import Candidates, ComputeBackend, KVRequest, RowInputs
from actors.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    ModelFormatError,
    UnsupportedModelError,
)
from actors.model.forward import KVPool
from actors.model.loaded import Model, load_model
from actors.model.step import StepItem
from tests.conftest import REFERENCE_DIR, TINY_MODELS, gemma3_path

# Against the CPU model's own full-sequence logits: whole rows on the CPU; a GPU (float16 KV,
# other summation orders) at each reference row's top GPU_TOP_IDS tokens, within GPU_TOLERANCE.
STEP_TOLERANCE = 1e-3
BATCH_TOLERANCE = 1e-4
GPU_TOP_IDS = 16
GPU_TOLERANCE = 0.05
BLOCK = 16
POOL_BLOCKS = 128
CANDIDATES = 16


@pytest.fixture(scope="module", params=list(BACKENDS))
def backend_name(request: pytest.FixtureRequest) -> str:
    reason = BACKENDS[request.param].unavailable_reason()
    if reason is not None:
        pytest.skip(f"backend {request.param} cannot run here: {reason}")
    return request.param


class Stepper:
    """A backend driven through the compute contract, answering whole logits rows like
    `Model.step` (so every stepping test runs on every backend); each step's candidates are
    checked against the rows fetched after it."""

    def __init__(self, backend_name: str, model: Model, num_blocks: int = POOL_BLOCKS) -> None:
        kv = KVRequest(blocks=num_blocks, block_size=BLOCK, max_sequences=1)
        self.backend: ComputeBackend = BACKENDS[backend_name].build(model, kv)
        self.on_gpu = self.backend.info.on_gpu

    def assert_close(self, rows: np.ndarray, reference: np.ndarray, tolerance: float) -> None:
        """`rows` match `reference`: whole rows within `tolerance` on the CPU, each row's
        top GPU_TOP_IDS reference tokens within GPU_TOLERANCE on a GPU."""
        rows, reference = np.atleast_2d(rows), np.atleast_2d(reference)
        if not self.on_gpu:
            np.testing.assert_allclose(rows, reference, atol=tolerance, rtol=0)
            return
        top = np.argsort(-reference, axis=1)[:, :GPU_TOP_IDS]
        np.testing.assert_allclose(np.take_along_axis(rows, top, axis=1),
                                   np.take_along_axis(reference, top, axis=1),
                                   atol=GPU_TOLERANCE, rtol=0)

    def step(self, items: Sequence[StepItem]) -> np.ndarray:
        # Refused items (the bad-input tests) are asked for one row: the backend must refuse
        # them for what they are before it counts rows.
        wanted = sum(1 for item in items if getattr(item, "want_logits", True))
        inputs = [RowInputs(candidates=CANDIDATES, want_log_z=True)] * wanted
        candidates = self.backend.run(items, inputs)
        rows = self.backend.fetch_rows(range(wanted))
        check_candidates(candidates, rows, CANDIDATES)
        return rows

    def close(self) -> None:
        self.backend.close()


def check_candidates(candidates: Candidates, rows: np.ndarray, asked: int) -> None:
    """The candidates are each row's `asked` most likely tokens (ties by id) with their
    logits, and log_z is the row's log-partition."""
    if rows.shape[0] == 0:
        return
    vocab = rows.shape[1]
    width = min(asked, vocab)
    order = np.lexsort((np.broadcast_to(np.arange(vocab), rows.shape), -rows), axis=1)
    top = np.take_along_axis(rows, order[:, :width], axis=1)
    np.testing.assert_array_equal(candidates.count, width)
    np.testing.assert_array_equal(candidates.logits[:, :width], top)
    np.testing.assert_array_equal(candidates.ids[:, :width], order[:, :width])
    shifted = rows.astype(np.float64) - rows.max(axis=1, keepdims=True)
    np.testing.assert_allclose(candidates.log_z, np.log(np.exp(shifted).sum(axis=1)),
                               rtol=0, atol=1e-5)


def reference_tokens(name: str, index: int) -> list[int]:
    return np.load(REFERENCE_DIR / name / "logits.npz")[f"seq{index}_tokens"].tolist()


def blocks_for(first_block: int, n_positions: int) -> tuple[int, ...]:
    return tuple(range(first_block, first_block + -(-n_positions // BLOCK)))


def step_one_at_a_time(stepper: Stepper, tokens: Sequence[int]) -> np.ndarray:
    table = blocks_for(0, len(tokens))
    return np.concatenate(
        [stepper.step([StepItem((tok,), pos, table)]) for pos, tok in enumerate(tokens)]
    )


def step_in_chunks(
    stepper: Stepper, tokens: Sequence[int], bounds: Sequence[int]
) -> tuple[list[int], np.ndarray]:
    """Prefill `tokens` in chunks ending at each of `bounds`; return the last position of
    each chunk and the logits there."""
    table = blocks_for(0, len(tokens))
    starts = [0, *bounds[:-1]]
    rows = [stepper.step([StepItem(tuple(tokens[s:e]), s, table)])
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
def gemma3() -> Model:
    return load_model(gemma3_path())


@pytest.fixture(scope="module")
def tiny_steppers(tiny_models: dict[str, Model], backend_name: str):
    steppers = {name: Stepper(backend_name, model) for name, model in tiny_models.items()}
    yield steppers
    for stepper in steppers.values():
        stepper.close()


@pytest.fixture(scope="module")
def smollm2_stepper(smollm2: Model, backend_name: str):
    stepper = Stepper(backend_name, smollm2)
    yield stepper
    stepper.close()


@pytest.fixture(scope="module")
def gemma3_stepper(gemma3: Model, backend_name: str):
    stepper = Stepper(backend_name, gemma3)
    yield stepper
    stepper.close()


# --- one token at a time and chunked prefill equal the full sequence --------------------


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_token_by_token_matches_full_sequence(tiny_models: dict[str, Model],
                                                   tiny_steppers: dict[str, Stepper],
                                                   name: str) -> None:
    model, stepper = tiny_models[name], tiny_steppers[name]
    for index in range(6):
        tokens = reference_tokens(name, index)
        stepper.assert_close(step_one_at_a_time(stepper, tokens), model.logits(tokens),
                             STEP_TOLERANCE)


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_random_chunks_match_full_sequence(tiny_models: dict[str, Model],
                                                tiny_steppers: dict[str, Stepper],
                                                name: str) -> None:
    model, stepper = tiny_models[name], tiny_steppers[name]
    rng = np.random.default_rng(7)
    for index in range(6):
        tokens = reference_tokens(name, index)
        full = model.logits(tokens)
        for _ in range(3):
            last, rows = step_in_chunks(stepper, tokens, random_bounds(rng, len(tokens), 12))
            stepper.assert_close(rows, full[last], STEP_TOLERANCE)


def test_smollm2_token_by_token_matches_full_sequence(smollm2: Model,
                                                      smollm2_stepper: Stepper) -> None:
    tokens = reference_tokens("smollm2-135m", 0)[:24]
    smollm2_stepper.assert_close(step_one_at_a_time(smollm2_stepper, tokens),
                                 smollm2.logits(tokens), STEP_TOLERANCE)


def test_gemma3_token_by_token_matches_full_sequence(gemma3: Model,
                                                     gemma3_stepper: Stepper) -> None:
    tokens = reference_tokens("gemma3-270m", 1)[:12]
    gemma3_stepper.assert_close(step_one_at_a_time(gemma3_stepper, tokens),
                                gemma3.logits(tokens), STEP_TOLERANCE)


@pytest.fixture(scope="module")
def gemma3_long(gemma3: Model) -> tuple[list[int], np.ndarray]:
    """The 700-token sequence (crosses the 512-token window) and its full logits."""
    tokens = reference_tokens("gemma3-270m", 5)
    return tokens, gemma3.logits(tokens)


def test_gemma3_random_chunks_across_the_window(
    gemma3_stepper: Stepper, gemma3_long: tuple[list[int], np.ndarray]
) -> None:
    tokens, full = gemma3_long
    last, rows = step_in_chunks(gemma3_stepper, tokens,
                                random_bounds(np.random.default_rng(3), len(tokens), 300))
    gemma3_stepper.assert_close(rows, full[last], STEP_TOLERANCE)


def test_gemma3_batched_decode_past_the_window(
    gemma3_stepper: Stepper, gemma3_long: tuple[list[int], np.ndarray]
) -> None:
    # Decode items are attended as one padded batch: a long sequence past the window next to
    # a short one must still see exactly its own last 512 positions.
    tokens, full = gemma3_long
    short = reference_tokens("gemma3-270m", 0)[:5]
    long_table = blocks_for(0, len(tokens))
    short_table = blocks_for(len(long_table), len(tokens))
    prefix = 600
    gemma3_stepper.step([StepItem(tuple(tokens[:prefix]), 0, long_table, want_logits=False),
                         StepItem(tuple(short), 0, short_table, want_logits=False)])
    for pos in range(prefix, prefix + 4):
        rows = gemma3_stepper.step([StepItem((short[pos % 5],), 5 + pos - prefix, short_table),
                                    StepItem((tokens[pos],), pos, long_table)])
        gemma3_stepper.assert_close(rows[1], full[pos], STEP_TOLERANCE)


# --- batch invariance -----------------------------------------------------------------


def test_batch_invariance_with_mixed_lengths(smollm2_stepper: Stepper) -> None:
    """A sequence's logits do not depend on what shares its step."""
    seqs = [reference_tokens("smollm2-135m", i)[:n] for i, n in enumerate((20, 33, 7, 1))]
    alone = [smollm2_stepper.step([StepItem(tuple(tokens), 0, blocks_for(0, 64))])[0]
             for tokens in seqs]
    together = smollm2_stepper.step(
        [StepItem(tuple(t), 0, blocks_for(4 * i, 64)) for i, t in enumerate(seqs)]
    )
    smollm2_stepper.assert_close(together, np.stack(alone), BATCH_TOLERANCE)


def greedy(stepper: Stepper, prompts: list[list[int]], n_new: int,
           concurrency: int) -> list[list[int]]:
    """Greedy continuations, `concurrency` sequences stepped together; each later sequence
    joins (prefills) while the earlier ones of its batch are decoding."""
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
            logits = stepper.step(items)
            for i, row in zip(owners, logits):
                held[i] += len(pending[i])
                token = int(row.argmax())
                out[i].append(token)
                pending[i] = [token]
    return out


def test_greedy_continuations_identical_at_any_concurrency(smollm2_stepper: Stepper) -> None:
    prompts = [reference_tokens("smollm2-135m", i)[:n] for i, n in enumerate((9, 14, 5, 11))]
    one = greedy(smollm2_stepper, prompts, 6, 1)
    assert greedy(smollm2_stepper, prompts, 6, 2) == one
    assert greedy(smollm2_stepper, prompts, 6, 4) == one


def test_only_items_wanting_logits_get_rows(tiny_models: dict[str, Model],
                                            tiny_steppers: dict[str, Stepper]) -> None:
    model, stepper = tiny_models["llama-q4k-tiny"], tiny_steppers["llama-q4k-tiny"]
    tokens = reference_tokens("llama-q4k-tiny", 0)
    rows = stepper.step([StepItem(tuple(tokens[:10]), 0, blocks_for(0, 64), want_logits=False),
                         StepItem(tuple(tokens[:3]), 0, blocks_for(4, 64))])
    assert rows.shape == (1, model.spec.vocab_size) and rows.dtype == np.float32
    stepper.assert_close(rows[0], model.logits(tokens[:3])[-1], BATCH_TOLERANCE)
    # The first item's KV was written though it asked for no logits.
    rest = stepper.step([StepItem(tuple(tokens[10:12]), 10, blocks_for(0, 64))])
    stepper.assert_close(rest[0], model.logits(tokens[:12])[-1], STEP_TOLERANCE)
    empty = stepper.step([StepItem((1,), 0, blocks_for(0, 1), want_logits=False)])
    assert empty.shape == (0, model.spec.vocab_size)


def test_penalties_are_applied_to_the_rows_and_the_candidates(
    tiny_models: dict[str, Model], tiny_steppers: dict[str, Stepper]
) -> None:
    model, stepper = tiny_models["llama-q4k-tiny"], tiny_steppers["llama-q4k-tiny"]
    tokens = reference_tokens("llama-q4k-tiny", 1)[:9]
    plain = model.logits(tokens)[-1]
    top = np.argsort(-plain)[:3].tolist()
    inputs = RowInputs(candidates=8, want_log_z=True, repetition_penalty=1.5, repeated=(top[0],),
                       presence_penalty=0.5, frequency_penalty=0.25, generated=tuple(top[1:]),
                       generated_counts=(1, 3))
    candidates = stepper.backend.run([StepItem(tuple(tokens), 0, blocks_for(0, 16))], [inputs])
    (row,) = stepper.backend.fetch_rows([0])
    expected = plain.astype(np.float64)
    expected[top[0]] = expected[top[0]] / 1.5 if expected[top[0]] > 0 else expected[top[0]] * 1.5
    expected[top[1]] -= 0.5 + 0.25
    expected[top[2]] -= 0.5 + 0.75
    stepper.assert_close(row, expected, BATCH_TOLERANCE)
    check_candidates(candidates, row[None], 8)


# --- bad input: refused before anything runs, the backend usable after -------------------


@pytest.fixture(scope="module")
def tiny() -> Model:
    return load_model(TINY_MODELS["llama-q4k-tiny"])


@pytest.fixture(scope="module")
def small_pool_stepper(tiny: Model, backend_name: str):
    stepper = Stepper(backend_name, tiny, num_blocks=4)
    yield stepper
    stepper.close()


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
        # one bad item among good ones (whose values are checked a whole step at a time)
        ([StepItem((1,), 0, (0,)), StepItem((2,), 0, (True,))], "blocks"),
        ([StepItem((1,), 0, (0,)), StepItem((2.0,), 16, (1, 2))], "tokens"),  # type: ignore[arg-type]
        ([StepItem((1,), 0, (0,)), StepItem(((2,),), 0, (1,))], "tokens"),  # type: ignore[arg-type]
        ([StepItem((1,), 0, (0,)), StepItem((2,), 0, (9,))], "blocks"),
        ([StepItem((1,), 0, (0,)), StepItem((2,), True, (1,))], "start"),  # type: ignore[arg-type]
    ],
)
def test_bad_items_are_refused_by_field(small_pool_stepper: Stepper, tiny: Model, items: list,
                                        field: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        small_pool_stepper.step(items)
    assert error.value.field == field
    # A refused step leaves the backend as it was.
    rows = small_pool_stepper.step([StepItem((1, 2, 3), 0, (0,))])
    small_pool_stepper.assert_close(rows[0], tiny.logits([1, 2, 3])[-1], STEP_TOLERANCE)


def test_rows_must_match_the_items_that_want_logits(small_pool_stepper: Stepper) -> None:
    with pytest.raises(InvalidRequest) as error:
        small_pool_stepper.backend.run([StepItem((1,), 0, (0,))], [])
    assert error.value.field == "rows"


def test_context_length_is_enforced(tiny: Model, backend_name: str) -> None:
    stepper = Stepper(backend_name, tiny, num_blocks=129)
    with pytest.raises(ContextLengthExceeded):
        stepper.step([StepItem((1,), tiny.spec.context_length, tuple(range(129)))])
    stepper.close()
    with pytest.raises(ContextLengthExceeded):
        tiny.logits([1] * (tiny.spec.context_length + 1))
    with pytest.raises(InvalidRequest):
        tiny.logits([])


# --- model surface --------------------------------------------------------------------


def test_model_surface(tiny_models: dict[str, Model], smollm2: Model, gemma3: Model) -> None:
    assert gemma3.spec.arch == "gemma3" and smollm2.spec.arch == "llama"
    assert "tokenizer" not in vars(gemma3), "the tokenizer must load lazily"
    assert smollm2.chat_template is not None and "<|im_start|>" in smollm2.chat_template
    # Tied output: one copy of the embedding's blocks serves lookup and projection.
    assert gemma3.weights.tied_output
    embedding = gemma3.weights.token_embd
    assert (embedding.out_features, embedding.in_features) == (262144, 640)
    assert gemma3.weights.n_bytes < 260e6
    assert not tiny_models["llama-q4k-tiny"].weights.tied_output
    assert tiny_models["qwen2-q4k-tiny"].weights.tied_output
    assert all(layer.qkv_bias is not None for layer in tiny_models["qwen2-q4k-tiny"].weights.layers)
    kv = gemma3.new_kv_pool(3)
    assert (kv.num_blocks, kv.block_size) == (3, 16)
    assert kv.bytes_per_block == 16 * 2 * 18 * 256 * 4
    logits = gemma3.logits([2, 818])
    assert logits.shape == (2, 262144) and logits.dtype == np.float32


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
