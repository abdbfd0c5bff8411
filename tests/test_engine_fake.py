"""The engine's control flow with a counting fake compute backend (no model, fast).

The fake is what the real backends are tested against for bookkeeping: it keeps a per-block
record of the tokens written at each position, and its "logits" pick a token that is a
function of everything the sequence's block table says the KV holds. So a wrong block table,
a bad prefix reuse or a lost position changes the output, exactly as it would with a model.
It is written against actors.compute.contract alone: the proof that a backend needs nothing
else (no import of the CPU backend or the forward).
"""

from __future__ import annotations

import gc
import json
import random
import threading
import time
from collections.abc import Callable, Sequence

import anyio
import numpy as np
import pytest

from actors import EngineClosed, EngineOverloaded, InvalidRequest
from actors.compute.contract import (
    BackendLostError,
    Candidates,
    ComputeInfo,
    RowInputs,
    StepItem,
    apply_penalties,
    apply_token_masks,
    top_candidates,
)
from actors.compute.faults import Fault, FaultyBackend
from actors.engine import Engine, collect
from actors.logs import logging_to
from actors.errors import ComputeError, ContextLengthExceeded
from actors.params import SamplingParams

VOCAB = 64
EOS = 1
LETTERS = "abcdefghijklmnopqrstuvwxyz"


class CountingBackend:
    """Counts forward passes and records what every step carried. A step `fail_when` picks
    fails: `failure="raise"` raises from the forward, `"nan"` answers NaN logits (the KV is
    written; the sampler cannot choose), `"lost"` raises BackendLostError. `model` picks the
    token after a sequence (its logit 1, the others' 0) over `vocab_size` tokens."""

    def __init__(
        self,
        *,
        num_blocks: int = 512,
        block_size: int = 4,
        context_length: int = 256,
        step_seconds: float = 0.0,
        fail_when: Callable[[Sequence[StepItem]], bool] | None = None,
        failure: str = "raise",
        vocab_size: int = VOCAB,
        model: Callable[[np.ndarray], int] | None = None,
    ) -> None:
        self.info = ComputeInfo(
            arch="fake",
            on_gpu=False,
            context_length=context_length,
            vocab_size=vocab_size,
            num_blocks=num_blocks,
            block_size=block_size,
        )
        self.kv = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.steps: list[tuple[StepItem, ...]] = []
        self.failed_steps: list[tuple[StepItem, ...]] = []
        self.closed = False
        self.last_rows = np.zeros((0, vocab_size), dtype=np.float32)
        self._model = next_token if model is None else model
        self._step_seconds = step_seconds
        self._fail_when = fail_when
        self._failure = failure

    def run(self, items: Sequence[StepItem], rows: Sequence[RowInputs]) -> Candidates:
        logits = self._logits(items)
        apply_token_masks(logits, rows)
        apply_penalties(logits, rows)
        self.last_rows = logits
        return top_candidates(logits, rows)

    def fetch_rows(self, indices: Sequence[int]) -> np.ndarray:
        return self.last_rows[list(indices)]

    def _logits(self, items: Sequence[StepItem]) -> np.ndarray:
        if self._step_seconds:
            time.sleep(self._step_seconds)
        failing = self._fail_when is not None and self._fail_when(items)
        if failing:
            self.failed_steps.append(tuple(items))
            if self._failure == "raise":
                raise RuntimeError("injected failure")
            if self._failure == "lost":
                raise BackendLostError("injected: the device is gone")
        else:
            self.steps.append(tuple(items))
        size = self.info.block_size
        rows = []
        for item in items:
            positions = np.arange(item.start, item.start + len(item.tokens))
            table = np.asarray(item.blocks)
            held = self.kv[table[: -(-item.start // size)]].reshape(-1)[: item.start]
            assert (held >= 0).all(), "a step resumed past what the KV holds"
            self.kv[table[positions // size], positions % size] = item.tokens
            if item.want_logits:
                end = item.start + len(item.tokens)
                rows.append(self.kv[table].reshape(-1)[:end])
        logits = np.zeros((len(rows), self.info.vocab_size), dtype=np.float32)
        for row, seen in zip(logits, rows):
            row[self._model(seen)] = 1.0
        if failing:
            logits[:] = np.nan
        return logits

    def close(self) -> None:
        self.closed = True

    def passes_of(self, first_token: int) -> int:
        """How many steps carried the sequence whose prompt starts with `first_token`."""
        return sum(
            any(item.start == 0 and item.tokens[0] == first_token for item in step)
            or any(item.start > 0 and item.seq_id in self._seq_ids(first_token) for item in step)
            for step in self.steps
        )

    def _seq_ids(self, first_token: int) -> set[int]:
        return {
            item.seq_id
            for step in self.steps
            for item in step
            if item.start == 0 and item.tokens[0] == first_token
        }


def next_token(seen: np.ndarray) -> int:
    """The fake model: a token from the whole sequence, never EOS or 0."""
    weights = np.arange(1, len(seen) + 1, dtype=np.int64)
    return int((seen * weights).sum() % (VOCAB - 2)) + 2


class FakeDecoder:
    def __init__(self, tokenizer: FakeTokenizer) -> None:
        self._tokenizer = tokenizer

    def push(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def flush(self) -> str:
        return ""


class FakeTokenizer:
    """Each token is two letters, so stop strings can straddle tokens; `vocab_size` that of
    the model it stands beside (the fake model's by default)."""

    bos_id = None
    eos_id = EOS
    stop_ids = frozenset({EOS})

    def __init__(self, vocab_size: int = VOCAB) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = False) -> list[int]:
        return [ord(char) % (VOCAB - 2) + 2 for char in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(LETTERS[i % 26] + LETTERS[(i // 26) % 26] for i in ids if i != EOS)

    def incremental_decoder(self) -> FakeDecoder:
        return FakeDecoder(self)


def solo_tokens(prompt: Sequence[int], n: int) -> list[int]:
    """What the fake model answers to `prompt`, greedy, `n` tokens."""
    seen = list(prompt)
    out = []
    for _ in range(n):
        token = next_token(np.asarray(seen))
        out.append(token)
        seen.append(token)
    return out


def greedy(max_tokens: int, **extra: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


def open_fake(backend: CountingBackend, **options: object):
    return Engine.open_backend(lambda: backend, FakeTokenizer(), **options)


async def take(stream, count: int | None = None) -> list[int]:
    """Token ids of the first `count` chunks (all when None); closes the stream."""
    tokens = []
    async with _closing(stream):
        async for chunk in stream:
            if chunk.token_id is not None:
                tokens.append(chunk.token_id)
            if count is not None and len(tokens) >= count:
                break
    return tokens


async def settle() -> None:
    """Let the actors handle what is in their inboxes (collecting dropped streams first)."""
    gc.collect()
    for _ in range(20):
        await anyio.sleep(0)


def _closing(stream):
    from contextlib import aclosing

    return aclosing(stream)


PROMPT = [5, 6, 7, 8, 9, 10, 11]

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_budget_of_8_is_8_tokens_from_8_passes() -> None:
    backend = CountingBackend()
    async with open_fake(backend) as engine:
        done = await engine.complete(PROMPT, greedy(8))
    assert list(done.token_ids) == solo_tokens(PROMPT, 8)
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == 8
    assert len(backend.steps) == 8
    assert [len(step[0].tokens) for step in backend.steps] == [len(PROMPT)] + [1] * 7
    assert backend.closed


async def test_stats_split_the_steps_time_between_the_backend_and_the_actors() -> None:
    """compute_busy_s counts the backend's own time in its run calls: eight steps of a
    backend that takes 20 ms each put at least 160 ms there, and no more than the wall time
    the requests took (the rest is the actors')."""
    backend = CountingBackend(step_seconds=0.02)
    async with open_fake(backend) as engine:
        before = engine.stats()
        started = time.perf_counter()
        await engine.complete(PROMPT, greedy(8))
        wall = time.perf_counter() - started
        busy = engine.stats().compute_busy_s - before.compute_busy_s
    assert len(backend.steps) == 8
    assert 8 * 0.02 <= busy <= wall


async def test_cancelled_before_admission_costs_no_forward_pass() -> None:
    backend = CountingBackend()
    async with open_fake(backend, max_sequences=1, max_queued=4) as engine:
        holder = engine.generate([20, 21], greedy(4))
        first = await holder.__anext__()
        assert first.token_id is not None
        # The only running slot is held by `holder` (parked: its caller is not pulling).
        with anyio.move_on_after(0.05):
            await take(engine.generate([30, 31, 32], greedy(4)))
        await settle()
        assert engine.stats().waiting == 0
        rest = await take(holder)
    assert [first.token_id, *rest] == solo_tokens([20, 21], 4)
    assert len(backend.steps) == 4
    assert all(item.tokens[:1] != (30,) for step in backend.steps for item in step)


async def _run_with_company(engine: Engine, victim: Callable[[], object]) -> None:
    """Run `victim` while three other sequences keep the steps going."""
    async with anyio.create_task_group() as tasks:
        for first in (40, 41, 42):
            tasks.start_soon(take, engine.generate([first, 3, 3], greedy(30)))
        await victim()


@pytest.mark.parametrize("how", ["cancel", "break"])
async def test_stopping_after_k_tokens_leaves_no_later_step(how: str) -> None:
    backend = CountingBackend(step_seconds=0.001)
    k = 5
    prompt = [50, 4, 4, 4]
    got: list[int] = []

    async def victim() -> None:
        if how == "cancel":
            with anyio.CancelScope() as scope:
                async for chunk in engine.generate(prompt, greedy(30)):
                    got.append(chunk.token_id)
                    if len(got) == k:
                        scope.cancel()
                        await anyio.sleep(1)  # cancelled here, with the stream open
        else:
            async for chunk in engine.generate(prompt, greedy(30)):
                got.append(chunk.token_id)
                if len(got) == k:
                    break  # the stream is dropped, not closed: garbage collection closes it

    async with open_fake(backend) as engine:
        await _run_with_company(engine, victim)
        await settle()
        stats = engine.stats()
    assert got == solo_tokens(prompt, 30)[:k]
    assert backend.passes_of(50) == k
    assert stats.running == stats.waiting == stats.kv_blocks_used == 0


async def test_a_thousand_random_cancellations_leave_nothing_held() -> None:
    backend = CountingBackend(step_seconds=0.0002)
    rng = random.Random(7)
    limiter = anyio.CapacityLimiter(16)
    outputs: list[tuple[list[int], list[int]]] = []

    async def one(index: int) -> None:
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 12))]
        mode = rng.choice(["deadline", "break", "aclose", "complete"])
        async with limiter:
            if mode == "deadline":
                with anyio.move_on_after(rng.random() * 0.01):
                    tokens: list[int] = []
                    async for chunk in engine.generate(prompt, greedy(12)):
                        tokens.append(chunk.token_id)
                outputs.append((prompt, tokens))
            elif mode == "break":
                k = rng.randrange(1, 12)
                tokens = []
                async for chunk in engine.generate(prompt, greedy(12)):
                    tokens.append(chunk.token_id)
                    if len(tokens) == k:
                        break
                outputs.append((prompt, tokens))
            else:
                stream = engine.generate(prompt, greedy(12))
                count = rng.randrange(0, 12) if mode == "aclose" else None
                outputs.append((prompt, await take(stream, count)))

    # Streams dropped after `break` hold their slot until collected: leave queue room.
    async with open_fake(backend, max_sequences=16, max_queued=16) as engine:
        async with anyio.create_task_group() as tasks:
            for index in range(1000):
                tasks.start_soon(one, index)
        await settle()
        stats = engine.stats()
        assert stats.running == stats.waiting == stats.kv_blocks_used == 0
        assert engine._admission.live == 0
        done = await engine.complete(PROMPT, greedy(10))
        assert list(done.token_ids) == solo_tokens(PROMPT, 10)
    # Whatever each request got is a prefix of what it would get alone.
    for prompt, tokens in outputs:
        assert tokens == solo_tokens(prompt, len(tokens))


async def test_concurrent_requests_match_solo_and_share_steps() -> None:
    backend = CountingBackend()
    prompts = [[i + 2, 9, 9, i + 3] for i in range(16)]
    results: dict[int, list[int]] = {}

    async def one(index: int) -> None:
        results[index] = list((await engine.complete(prompts[index], greedy(20))).token_ids)

    async with open_fake(backend) as engine:
        async with anyio.create_task_group() as tasks:
            for index in range(16):
                tasks.start_soon(one, index)
    for index, prompt in enumerate(prompts):
        assert results[index] == solo_tokens(prompt, 20)
    decode_steps = [step for step in backend.steps if all(len(i.tokens) == 1 for i in step)]
    assert np.mean([len(step) for step in decode_steps]) >= 14


async def test_prefix_is_reused_and_gives_the_cold_answer() -> None:
    backend = CountingBackend(block_size=4)
    shared = [(i * 7) % 60 + 2 for i in range(40)]
    async with open_fake(backend) as engine:
        cold = await engine.complete(shared + [5, 6], greedy(6))
        warm = await engine.complete(shared + [5, 6], greedy(6))
        other = await engine.complete(shared + [7], greedy(6))
        assert engine.stats().kv_blocks_cached > 0
    assert cold.usage.cached_tokens == 0
    assert warm.usage.cached_tokens == 40
    assert other.usage.cached_tokens == 40
    assert warm.token_ids == cold.token_ids == tuple(solo_tokens(shared + [5, 6], 6))
    assert list(other.token_ids) == solo_tokens(shared + [7], 6)


async def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    backend = CountingBackend(block_size=4)
    prompt = list(range(2, 18))  # exactly four full blocks
    async with open_fake(backend) as engine:
        first = await engine.complete(prompt, greedy(3))
        again = await engine.complete(prompt, greedy(3))
    assert again.usage.cached_tokens == 12
    assert again.token_ids == first.token_ids == tuple(solo_tokens(prompt, 3))


async def test_full_cache_waits_or_preempts_but_never_fails() -> None:
    # 12 blocks of 4 = 48 positions; four requests of ~30 positions each cannot all fit.
    backend = CountingBackend(num_blocks=12, block_size=4, context_length=4096)
    prompts = [[i + 2] * 10 for i in range(4)]
    results: dict[int, list[int]] = {}

    async def one(index: int) -> None:
        results[index] = list((await engine.complete(prompts[index], greedy(20))).token_ids)

    async with open_fake(backend) as engine:
        assert engine.context_length == 48
        async with anyio.create_task_group() as tasks:
            for index in range(4):
                tasks.start_soon(one, index)
        assert engine.stats().kv_blocks_used == 0
    for index, prompt in enumerate(prompts):
        assert results[index] == solo_tokens(prompt, 20)


async def test_decode_items_hold_their_next_positions_block_where_the_pool_has_room() -> None:
    """A decode item's table covers the next position too, a step early, in a step of
    decoding sequences alone where the pool has a free block for every running sequence
    besides (a backend may then run the next step ahead, actors.compute.cuda_ahead); with no
    block to spare it ends at the item's own."""
    roomy = CountingBackend(num_blocks=64, block_size=4, context_length=4096)
    tight = CountingBackend(num_blocks=4, block_size=4, context_length=4096)
    for backend in (roomy, tight):
        async with open_fake(backend) as engine:
            done = await engine.complete([5, 6, 7], greedy(12))
        assert list(done.token_ids) == solo_tokens([5, 6, 7], 12)
    # The decode items at the last position of a block (3, 7, 11): the next block with them,
    # but for the tight pool's last one (one block free, one running sequence: none spare).
    for backend, tables in ((roomy, [2, 3, 4]), (tight, [2, 3, 3])):
        decode = [item for step in backend.steps for item in step if item.start >= 3]
        assert [len(item.blocks) for item in decode if item.start % 4 == 3] == tables
        assert all(len(item.blocks) >= item.start // 4 + 1 for item in decode)


async def test_overload_is_refused_at_once() -> None:
    backend = CountingBackend()
    results: dict[int, list[int]] = {}

    async def queued() -> None:
        results[2] = await take(engine.generate([4, 3], greedy(5)))

    async with open_fake(backend, max_sequences=2, max_queued=1) as engine:
        running = [engine.generate([i + 2, 3], greedy(5)) for i in range(2)]
        firsts = [(await stream.__anext__()).token_id for stream in running]
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(queued)
            await settle()
            assert (engine.stats().running, engine.stats().waiting) == (2, 1)
            with pytest.raises(EngineOverloaded):
                engine.generate([9, 9], greedy(5))
            for index, stream in enumerate(running):
                results[index] = [firsts[index], *await take(stream)]
        # Room again once they are done.
        assert (await engine.complete([9, 9], greedy(2))).finish_reason == "length"
    for index in range(3):
        assert results[index] == solo_tokens([index + 2, 3], 5)


@pytest.mark.parametrize("failure", ["raise", "nan"])
async def test_one_failed_step_is_replayed_for_its_sequences_only(failure: str) -> None:
    failures = []

    def fail_once(items: Sequence[StepItem]) -> bool:
        hit = not failures and len(items) == 2 and items[0].start == 6
        if hit:
            failures.append(len(backend.steps))  # where the next step will be recorded
        return hit

    backend = CountingBackend(fail_when=fail_once, failure=failure)
    prompts = {first: [first, 34, 35] for first in (33, 36)}
    results: dict[int, list[int]] = {}

    async def one(first: int) -> None:
        results[first] = list((await engine.complete(prompts[first], greedy(8))).token_ids)

    async with open_fake(backend) as engine:
        # A third sequence, parked outside the failed step, must be left alone.
        bystander = engine.generate([50, 51], greedy(6))
        first_token = (await bystander.__anext__()).token_id
        async with anyio.create_task_group() as tasks:
            for first in prompts:
                tasks.start_soon(one, first)
        rest = await take(bystander)
    for first, prompt in prompts.items():
        assert results[first] == solo_tokens(prompt, 8)
    assert [first_token, *rest] == solo_tokens([50, 51], 6)
    (failed,) = backend.failed_steps
    failed_ids = {item.seq_id for item in failed}
    # The steps after the failure replay each of its sequences alone, from an empty KV.
    after = backend.steps[failures[0] : failures[0] + 2]
    assert [len(step) for step in after] == [1, 1]
    assert {step[0].seq_id for step in after} == failed_ids
    assert all(step[0].start == 0 and len(step[0].tokens) == 7 for step in after)


@pytest.mark.parametrize("failure", ["raise", "nan"])
async def test_repeated_failure_fails_only_that_sequence(failure: str) -> None:
    def fail_for_60(items: Sequence[StepItem]) -> bool:
        return any(item.start == 0 and item.tokens[0] == 60 for item in items)

    backend = CountingBackend(fail_when=fail_for_60, failure=failure)
    async with open_fake(backend) as engine:
        fine = engine.generate([20, 21], greedy(5))
        first_token = (await fine.__anext__()).token_id
        with pytest.raises(ComputeError):
            await engine.complete([60, 61], greedy(5))
        rest = await take(fine)
        await settle()
        assert engine.stats().kv_blocks_used == 0
    assert [first_token, *rest] == solo_tokens([20, 21], 5)
    assert [len(step) for step in backend.failed_steps] == [1, 1]


async def test_stop_strings_across_tokens_are_never_emitted() -> None:
    backend = CountingBackend()
    answer = solo_tokens(PROMPT, 10)
    text = FakeTokenizer().decode(answer)
    stop = text[5:8]  # starts inside the third token, ends inside the fourth
    async with open_fake(backend) as engine:
        pieces = [chunk.text async for chunk in engine.generate(PROMPT, greedy(10, stop=(stop,)))]
        done = await engine.complete(PROMPT, greedy(10, stop=(stop,)))
    assert "".join(pieces) == text[:5] == done.text
    assert done.finish_reason == "stop"
    assert stop not in "".join(pieces)


async def test_stop_token_ends_with_stop() -> None:
    backend = CountingBackend()
    answer = solo_tokens(PROMPT, 10)
    async with open_fake(backend) as engine:
        done = await engine.complete(PROMPT, greedy(10, stop_token_ids=(answer[3],)))
    assert list(done.token_ids) == answer[:3]
    assert done.finish_reason == "stop"


async def test_context_finish_when_the_context_runs_out() -> None:
    backend = CountingBackend(context_length=12)
    async with open_fake(backend) as engine:
        done = await engine.complete(PROMPT, greedy(50))
        with pytest.raises(ContextLengthExceeded):
            engine.generate(list(range(2, 14)), greedy(5))
    assert done.finish_reason == "context"
    assert len(done.token_ids) == 12 - len(PROMPT)


async def test_strict_max_tokens_refuses_what_cannot_fit_naming_both_numbers() -> None:
    backend = CountingBackend(context_length=12)
    async with open_fake(backend) as engine:
        with pytest.raises(ContextLengthExceeded) as caught:
            engine.generate(PROMPT, greedy(6), strict_max_tokens=True)
        assert backend.steps == []
        done = await collect(engine.generate(PROMPT, greedy(5), strict_max_tokens=True))
    assert caught.value.field == "max_tokens"
    message = str(caught.value)
    assert "context is 12 tokens" in message and "needs 13" in message
    assert f"{len(PROMPT)} in the prompt and 6 in max_tokens" in message
    assert "at most 5" in message
    assert done.finish_reason == "length" and len(done.token_ids) == 5


async def test_bad_requests_are_refused_before_any_work() -> None:
    backend = CountingBackend()
    async with open_fake(backend) as engine:
        for prompt in ("", [], [VOCAB + 5], [1.5], None):
            with pytest.raises(InvalidRequest) as caught:
                engine.generate(prompt, greedy(3))
            assert caught.value.field == "prompt"
        with pytest.raises(InvalidRequest) as caught:
            engine.generate([3], greedy(3, stop_token_ids=(VOCAB + 1,)))
        assert caught.value.field == "stop_token_ids"
    assert backend.steps == []


async def test_after_close_everything_raises_engine_closed() -> None:
    threads_before = threading.active_count()
    backend = CountingBackend()
    async with open_fake(backend) as engine:
        parked = engine.generate(PROMPT, greedy(5))
        await parked.__anext__()
    for call in (
        lambda: engine.generate(PROMPT, greedy(3)),
        lambda: engine.stats(),
        lambda: engine.tokenize("x"),
        lambda: engine.detokenize([3]),
        lambda: engine.chat([{"role": "user", "content": "x"}]),
    ):
        with pytest.raises(EngineClosed):
            call()
    with pytest.raises(EngineClosed):
        await engine.complete(PROMPT, greedy(3))
    with pytest.raises(EngineClosed):
        await parked.__anext__()
    assert backend.closed
    assert threading.active_count() <= threads_before


async def test_errors_in_the_callers_block_are_not_wrapped() -> None:
    with pytest.raises(EngineOverloaded):
        async with open_fake(CountingBackend(), max_sequences=1, max_queued=0) as engine:
            stream = engine.generate(PROMPT, greedy(3))
            await stream.__anext__()
            engine.generate(PROMPT, greedy(3))


@pytest.mark.parametrize("kind", ["raise", "nan"])
async def test_one_bad_sequence_fails_alone_in_a_batch_of_seven(kind: str) -> None:
    """A backend that fails (or answers NaN) for one sequence's steps only: that request
    fails with ComputeError, the six batched with it give exactly their solo tokens."""
    prompts = [[first, 40, 41] for first in range(10, 17)]
    bad = 3
    fault = Fault(kind=kind, prompt_prefix=tuple(prompts[bad]))
    backend = FaultyBackend(CountingBackend(), [fault])
    results: dict[int, object] = {}

    async def one(index: int) -> None:
        try:
            results[index] = list((await engine.complete(prompts[index], greedy(6))).token_ids)
        except ComputeError:
            results[index] = "failed"

    async with Engine.open_backend(lambda: backend, FakeTokenizer()) as engine:
        async with anyio.create_task_group() as tasks:
            for index in range(7):
                tasks.start_soon(one, index)
        await settle()
        assert engine.stats().kv_blocks_used == 0
    assert results.pop(bad) == "failed"
    assert results == {index: solo_tokens(prompts[index], 6) for index in results}


async def test_a_lost_backend_fails_what_is_in_flight_and_refuses_new_work(
    tmp_path,
) -> None:
    """A backend that can no longer run (a sticky device error) is never replayed onto:
    every request in flight fails with ComputeError, later ones are refused at once."""
    lost = False

    def lose_device(items: Sequence[StepItem]) -> bool:
        nonlocal lost
        lost = lost or any(item.start >= 4 for item in items)
        return lost

    backend = CountingBackend(fail_when=lose_device, failure="lost")
    log_file = tmp_path / "engine.jsonl"
    with logging_to("info", log_file):
        async with open_fake(backend) as engine:
            outcomes: list[str] = []

            async def one(first: int) -> None:
                try:
                    await engine.complete([first, 3], greedy(8))
                    outcomes.append("finished")
                except ComputeError as exc:
                    outcomes.append("lost" if "lost" in str(exc) else str(exc))

            async with anyio.create_task_group() as tasks:
                for first in (5, 6, 7):
                    tasks.start_soon(one, first)
            with pytest.raises(ComputeError, match="lost"):
                engine.generate([9, 9], greedy(2))
            assert engine.stats().running == 0
    assert outcomes == ["lost"] * 3
    # One failing step, and nothing after it: no replay onto a dead device.
    assert len(backend.failed_steps) == 1
    events = [json.loads(line)["event"] for line in log_file.read_text().splitlines()]
    assert "backend_lost" in events


async def test_a_backend_that_fails_to_start_fails_open() -> None:
    def broken() -> CountingBackend:
        raise ComputeError("no device")

    with pytest.raises(ComputeError, match="no device"):
        async with Engine.open_backend(broken, FakeTokenizer()):
            pass


async def test_a_seed_gives_the_same_tokens_whatever_runs_alongside() -> None:
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    async with open_fake(CountingBackend()) as engine:
        alone = (await engine.complete(PROMPT, seeded)).token_ids
        together: dict[int, tuple[int, ...]] = {}

        async def one(index: int) -> None:
            params = seeded if index == 0 else SamplingParams(max_tokens=9, seed=index)
            together[index] = (await engine.complete(PROMPT, params)).token_ids

        async with anyio.create_task_group() as tasks:
            for index in range(8):
                tasks.start_soon(one, index)
    assert together[0] == alone
    # The sampling really is random here: other seeds take other paths.
    assert len({together[index][:9] for index in range(8)}) > 1


@pytest.mark.parametrize(
    ("options", "field"),
    [({"max_sequences": 0}, "max_sequences"), ({"max_queued": -1}, "max_queued"),
     ({"prefill_chunk": 0}, "prefill_chunk")],
)
async def test_bad_engine_options_name_the_field(options: dict[str, int], field: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        async with open_fake(CountingBackend(), **options):
            pass
    assert caught.value.field == field


async def test_bad_backend_name_and_log_level_are_refused() -> None:
    with pytest.raises(InvalidRequest) as caught:
        async with Engine.open(backend="tpu"):
            pass
    assert caught.value.field == "backend"
    with pytest.raises(InvalidRequest) as caught:
        async with Engine.open(log_level="loud"):
            pass
    assert caught.value.field == "log_level"


async def test_cancelling_the_whole_engine_block_stops_cleanly() -> None:
    threads_before = threading.active_count()
    backend = CountingBackend(step_seconds=0.005)
    with anyio.move_on_after(0.1) as scope:
        async with open_fake(backend) as engine:
            async with anyio.create_task_group() as tasks:
                for first in range(2, 10):
                    tasks.start_soon(take, engine.generate([first], greedy(200)))
    assert scope.cancelled_caught
    assert backend.closed
    assert threading.active_count() <= threads_before
