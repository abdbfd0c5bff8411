"""The decode step the CUDA backend runs ahead (actors.compute.cuda_ahead): when it may, which
step it is, and, over the emulated device (tests/cuda_emulator.py, the kernels' numpy twins),
that a backend running steps ahead answers every step bit for bit as one that does not, taken
ahead or dropped."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

from actors import Engine, SamplingParams
from actors.compute import cuda_ahead
from actors.compute.contract import KVRequest, RowInputs, StepItem
from actors.model.loaded import Model, load_model
from actors.sampling import SequenceSampling
from tests.conftest import TINY_MODELS
from tests.cuda_emulator import EmulatedDevice
from tests.test_engine_fake import FakeTokenizer

BLOCK = 16
GREEDY = RowInputs()
# What the sampler asks for a greedy row with 4 logprobs (actors.sampling.SequenceSampling).
GREEDY_LOGPROBS = RowInputs(candidates=4, max_candidates=4, want_log_z=True, greedy=True)


def test_only_rows_that_must_take_their_first_candidate_run_ahead() -> None:
    assert cuda_ahead.takes_its_candidate(GREEDY)
    assert cuda_ahead.takes_its_candidate(RowInputs(want_log_z=True, inv_temp=2.0))
    assert cuda_ahead.takes_its_candidate(GREEDY_LOGPROBS)
    for row in (RowInputs(candidates=4), RowInputs(max_candidates=8), RowInputs(mass=0.9),
                RowInputs(allowed=np.ones(4, np.int32)),
                RowInputs(repetition_penalty=1.2, repeated=(3,)),
                RowInputs(presence_penalty=0.5), RowInputs(frequency_penalty=0.5),
                RowInputs(greedy=True, repetition_penalty=1.2, repeated=(3,)),
                RowInputs(greedy=True, allowed=np.ones(4, np.int32))):
        assert not cuda_ahead.takes_its_candidate(row), row
    # the sampler says which rows are greedy: temperature 0, logprobs or not
    for params, greedy in ((SamplingParams(temperature=0.0, logprobs=4), True),
                           (SamplingParams(temperature=0.0), True),
                           (SamplingParams(temperature=0.8, top_k=1), False)):
        row = SequenceSampling(params, [1, 2], 1024).row_inputs()
        assert row.greedy is greedy, params
    assert SequenceSampling(SamplingParams(temperature=0.0, logprobs=4), [1, 2],
                            1024).row_inputs() == GREEDY_LOGPROBS


def test_only_steps_of_up_to_the_measured_rows_run_ahead() -> None:
    """Past RUN_AHEAD_MAX_ROWS rows a dropped step (each time a sequence joins or ends) costs
    more than the host time it hides: no step follows a wider one."""
    def step(rows: int) -> list[StepItem]:
        return [StepItem((7,), 3, (i,), seq_id=i) for i in range(rows)]

    most = cuda_ahead.RUN_AHEAD_MAX_ROWS
    assert cuda_ahead.next_items(step(most), [GREEDY] * most, BLOCK, 64, 128) is not None
    assert cuda_ahead.next_items(step(most + 1), [GREEDY] * (most + 1), BLOCK, 64, 128) is None


def test_the_next_items_advance_each_sequence_inside_its_own_blocks() -> None:
    items = [StepItem((7,), 14, (3, 4), seq_id=1), StepItem((8,), 3, (5,), seq_id=2)]
    following = cuda_ahead.next_items(items, [GREEDY] * 2, BLOCK, 8, 128)
    assert following == (StepItem((), 15, (3,), True, 1), StepItem((), 4, (5,), True, 2))
    # the block of position 16 is in the table: the step crosses into it
    crossing = cuda_ahead.next_items([StepItem((7,), 15, (3, 4))], [GREEDY], BLOCK, 8, 128)
    assert crossing == (StepItem((), 16, (3, 4)),)
    # not when the table lacks it (the scheduler's tables end at the step's last block), names
    # a block outside the pool, or another item's table holds it (a shared block is full)
    for table in ((3,), (3, 9)):
        assert cuda_ahead.next_items([StepItem((7,), 15, table)], [GREEDY], BLOCK, 8, 128) is None
    shared = [StepItem((7,), 3, (5,)), StepItem((8,), 20, (5, 6))]
    assert cuda_ahead.next_items(shared, [GREEDY] * 2, BLOCK, 8, 128) is None
    assert cuda_ahead.next_items(items, [GREEDY, RowInputs(candidates=2)], BLOCK, 8, 128) is None
    # nor past the context: the sequence ends there
    assert cuda_ahead.next_items([StepItem((7,), 31, (3, 4, 5))], [GREEDY], BLOCK, 8, 32) is None


def test_the_step_asked_for_is_the_one_run_ahead_only_when_nothing_differs() -> None:
    items = [StepItem((7,), 14, (3, 4), seq_id=1), StepItem((8,), 3, (5,), seq_id=2)]
    following = cuda_ahead.next_items(items, [GREEDY] * 2, BLOCK, 8, 128)
    ahead = cuda_ahead.ahead_step(following, np.array([11, 12], np.int32), [GREEDY] * 2)
    asked = [StepItem((11,), 15, (3, 4), seq_id=1), StepItem((12,), 4, (5, 6), seq_id=2)]
    assert cuda_ahead.is_ahead_step(ahead, asked, [GREEDY] * 2)  # later blocks do not matter
    different = [
        [asked[0], StepItem((13,), 4, (5,), seq_id=2)],  # another token
        [asked[0], StepItem((12,), 5, (5,), seq_id=2)],  # another position
        [asked[0], StepItem((12,), 4, (6,), seq_id=2)],  # another block
        [asked[0], StepItem((12,), 4, (5,), seq_id=3)],  # another sequence
        [asked[0], StepItem((12,), 4, (5,), want_logits=False, seq_id=2)],
        [asked[0]],  # a sequence left
        asked[::-1],
    ]
    for step in different:
        assert not cuda_ahead.is_ahead_step(ahead, step, [GREEDY] * len(step)), step
    assert not cuda_ahead.is_ahead_step(ahead, asked, [GREEDY, RowInputs(want_log_z=True)])
    masked = RowInputs(allowed=np.ones(4, np.int32))  # a mask: refused, not compared
    assert not cuda_ahead.is_ahead_step(ahead, asked, [GREEDY, masked])


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model(TINY_MODELS["llama-q4k-tiny"])


def backends(module: Any, model: Model) -> tuple[Any, Any]:
    """A backend that runs steps ahead and one that does not, over one emulated device."""
    kv = KVRequest(blocks=48, block_size=BLOCK, max_sequences=4)
    return (module.build_cuda_backend(model, kv, 0.9),
            module.build_cuda_backend(model, kv, 0.9, run_ahead_rows=0))


def assert_same_step(pair: tuple[Any, Any], items: list[StepItem],
                     rows: list[RowInputs]) -> np.ndarray:
    """Both backends run the step: the same candidates and logits rows, bit for bit; the
    first candidates."""
    ahead, plain = (backend.run(items, rows) for backend in pair)
    for name in ("ids", "count", "logits", "log_z"):
        np.testing.assert_array_equal(np.asarray(getattr(ahead, name)).view(np.uint8),
                                      np.asarray(getattr(plain, name)).view(np.uint8), name)
    every = range(len(rows))
    np.testing.assert_array_equal(pair[0].fetch_rows(every).view(np.uint32),
                                  pair[1].fetch_rows(every).view(np.uint32))
    return ahead.ids[:, 0]


@pytest.mark.parametrize("greedy", [GREEDY, GREEDY_LOGPROBS])
def test_greedy_decoding_takes_the_steps_run_ahead_bit_for_bit(
        emulated: tuple[Any, EmulatedDevice], model: Model, greedy: RowInputs) -> None:
    """Two sequences decoding greedily past a block edge (their whole tables given): every
    decode step after the first is the one run ahead, and every answer is the plain
    backend's; a step that differs (another token fed, a sequence left, a row asking for
    more) drops the step run ahead and runs as usual, in the other lane; none is queued again
    until the step expected comes. Greedy rows asking for logprobs (four candidates and the
    log-partition) run ahead as well."""
    module, device = emulated
    pair = backends(module, model)
    tables = [(0, 1, 2), (3, 4, 5)]
    prompts = [(5, 17, 300, 42, 9, 11, 12), (8, 6, 4, 2, 1)]
    tokens = [assert_same_step(pair, [StepItem(p, 0, t)], [greedy])[0]
              for p, t in zip(prompts, tables)]
    positions = [len(p) for p in prompts]
    for step in range(14):
        items = [StepItem((int(token),), p + step, table, seq_id=i)
                 for i, (token, p, table) in enumerate(zip(tokens, positions, tables))]
        tokens = assert_same_step(pair, items, [greedy] * 2)
    assert pair[0].steps_run_ahead == 13 and pair[1].steps_run_ahead == 0
    held = [p + 14 for p in positions]
    # another token than the one fed: dropped, run as asked; the next step is not queued
    # (a dropped step cost a whole one), but is expected, and as it comes true the one after
    # it is queued again
    items = [StepItem((int(tokens[0]) + 1,), held[0], tables[0], seq_id=0),
             StepItem((int(tokens[1]),), held[1], tables[1], seq_id=1)]
    tokens = assert_same_step(pair, items, [greedy] * 2)
    for step in range(1, 4):
        items = [StepItem((int(token),), p + step, table, seq_id=i)
                 for i, (token, p, table) in enumerate(zip(tokens, held, tables))]
        tokens = assert_same_step(pair, items, [greedy] * 2)
    assert pair[0].steps_run_ahead == 15
    # a sequence leaves (dropped); then a row asking for four candidates
    tokens = assert_same_step(pair, [StepItem((int(tokens[0]),), held[0] + 4, tables[0])],
                              [greedy])
    assert_same_step(pair, [StepItem((int(tokens[0]),), held[0] + 5, tables[0])],
                     [RowInputs(candidates=4, want_log_z=True)])
    assert pair[0].steps_run_ahead == 15
    for backend in pair:
        backend.close()
    assert device.live == set()


@pytest.mark.slow  # the 600-token prompt through the emulated tiles: seconds
def test_no_step_runs_ahead_past_the_blocks_a_table_holds(
        emulated: tuple[Any, EmulatedDevice], model: Model) -> None:
    """The scheduler's tables end at a step's last block: at the block's last position the
    next step needs a block not given yet, so none runs ahead; the step after it does again.
    A prefill step larger than the workspace, with a step queued ahead, grows the workspace
    after the queued step is done; closing with one queued frees everything."""
    module, device = emulated
    pair = backends(module, model)
    prompt = tuple(range(1, 14))
    token = assert_same_step(pair, [StepItem(prompt, 0, (0,))], [GREEDY])[0]
    for position in range(13, 19):
        table = tuple(range(position // BLOCK + 1))
        token = assert_same_step(pair, [StepItem((int(token),), position, table)], [GREEDY])[0]
    # 14 and 15 run ahead; 16 not (15's table lacks block 1); 17 and 18 again
    assert pair[0].steps_run_ahead == 4
    long_prompt = tuple(int(t) % 200 + 1 for t in range(600))
    assert_same_step(pair, [StepItem(long_prompt, 0, tuple(range(2, 40)))], [GREEDY])
    assert_same_step(pair, [StepItem((int(token),), 19, (0, 1))], [GREEDY])
    for backend in pair:
        backend.close()
    assert device.live == set()


def test_a_backend_runs_ahead_only_the_steps_of_up_to_its_rows(
        emulated: tuple[Any, EmulatedDevice], model: Model) -> None:
    """Nine sequences decoding greedily: a backend that runs steps of up to 8 rows ahead
    (the default) runs each as asked; one told 9 takes every step after the first from the
    step queued ahead, with the same tokens."""
    module, _ = emulated
    kv = KVRequest(blocks=9 * 2, block_size=BLOCK, max_sequences=9)
    built = [module.build_cuda_backend(model, kv, 0.9),
             module.build_cuda_backend(model, kv, 0.9, run_ahead_rows=9)]
    tables = [(2 * i, 2 * i + 1) for i in range(9)]
    answers = []
    for backend in built:
        tokens = [int(backend.run([StepItem((5 + i, 7, 9), 0, table)], [GREEDY]).ids[0, 0])
                  for i, table in enumerate(tables)]
        taken = [tokens]
        for step in range(6):
            items = [StepItem((token,), 3 + step, table, seq_id=i)
                     for i, (token, table) in enumerate(zip(tokens, tables))]
            tokens = [int(t) for t in backend.run(items, [GREEDY] * 9).ids[:, 0]]
            taken.append(tokens)
        answers.append(taken)
    assert answers[0] == answers[1]
    assert [backend.steps_run_ahead for backend in built] == [0, 5]
    for backend in built:
        backend.close()


async def engine_run(module: Any, model: Model,
                     run_ahead_rows: int) -> tuple[list[list[int]], int]:
    """Three greedy requests at once through an Engine on the CUDA backend (emulated): their
    tokens, and the decode steps the backend answered from a step run ahead."""
    built: list[Any] = []

    def make() -> Any:
        kv = KVRequest(blocks=32, block_size=BLOCK, max_sequences=4)
        built.append(module.build_cuda_backend(model, kv, 0.9, run_ahead_rows=run_ahead_rows))
        return built[-1]

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 300, 42, 9, 11, 12], [8, 6, 4, 2, 1], list(range(20, 33))]
    tokens: list[list[int]] = [[] for _ in prompts]
    async with Engine.open_backend(make, FakeTokenizer(model.spec.vocab_size),
                                   max_sequences=4) as engine:
        async def one(index: int) -> None:
            tokens[index] = list((await engine.complete(prompts[index], params)).token_ids)

        async with anyio.create_task_group() as tasks:
            for index in range(len(prompts)):
                tasks.start_soon(one, index)
    return tokens, built[0].steps_run_ahead


def test_an_engine_takes_its_greedy_steps_ahead_and_answers_the_same(
        emulated: tuple[Any, EmulatedDevice], model: Model) -> None:
    """Through the actors (the scheduler's items, their tables a block early where the pool
    has room): most decode steps of three greedy requests are the ones run ahead, and every
    token is the one a backend that does not run ahead gives."""
    module, _ = emulated
    ahead, taken = anyio.run(engine_run, module, model, cuda_ahead.RUN_AHEAD_MAX_ROWS)
    plain, none = anyio.run(engine_run, module, model, 0)
    assert ahead == plain and all(len(t) == 24 for t in ahead)
    # 22 of the 23 decode steps here: all but the first (the one queued after the last is
    # dropped as the requests end)
    assert none == 0 and taken >= 20, taken
