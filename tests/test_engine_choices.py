"""Several answers to one prompt (`n`) on the counting fake backend: the prompt prefilled once
and shared through the prefix cache, each answer on its own seed stream and ending on its own,
and closing the stream ending them all."""

from __future__ import annotations

from collections import Counter
from contextlib import aclosing

import pytest

from actors import InvalidRequest
from actors.messages import Chunk
from actors.params import SamplingParams
from tests.test_engine_fake import CountingBackend, open_fake, settle

pytestmark = pytest.mark.anyio
PROMPT = [(i * 7) % 60 + 2 for i in range(10)]  # two full blocks of 4, and 2 tokens
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def by_answer(stream) -> dict[int, list[Chunk]]:
    """Each answer's chunks, by index."""
    answers: dict[int, list[Chunk]] = {}
    async with aclosing(stream):
        async for chunk in stream:
            answers.setdefault(chunk.index, []).append(chunk)
    return answers


def tokens_of(chunks: list[Chunk]) -> tuple[int, ...]:
    return tuple(chunk.token_id for chunk in chunks if chunk.token_id is not None)


async def test_three_answers_share_one_prefill_and_each_finishes() -> None:
    backend = CountingBackend(block_size=4)
    async with open_fake(backend) as engine:
        answers = await by_answer(engine.generate(PROMPT, SAMPLED, n=3))
        steps = list(backend.steps)
        again = await by_answer(engine.generate(PROMPT, SAMPLED, n=3))
        alone = await engine.complete(PROMPT, SAMPLED)
    assert sorted(answers) == [0, 1, 2]
    for chunks in answers.values():
        assert [chunk.finish_reason for chunk in chunks] == [None] * 5 + ["length"]
        assert len(tokens_of(chunks)) == 6
    assert len({tokens_of(chunks) for chunks in answers.values()}) == 3
    # Reproducible, and answer 0 is the answer the seed gives alone.
    assert {i: tokens_of(c) for i, c in again.items()} == {i: tokens_of(c)
                                                           for i, c in answers.items()}
    assert tokens_of(answers[0]) == alone.token_ids
    # The prompt's full blocks were computed once; each answer computed its last, partial one.
    computed = Counter(position for step in steps for item in step
                       for position in range(item.start, item.start + len(item.tokens))
                       if position < len(PROMPT))
    assert computed == Counter({**dict.fromkeys(range(8), 1), 8: 3, 9: 3})
    assert [answers[i][-1].usage.cached_tokens for i in range(3)] == [0, 8, 8]
    assert all(answers[i][-1].usage.prompt_tokens == len(PROMPT) for i in range(3))


async def test_closing_the_stream_ends_every_answer() -> None:
    backend = CountingBackend(block_size=4)
    params = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True)
    async with open_fake(backend, max_sequences=4, max_queued=0) as engine:
        for taken in (0, 1, 5):  # before the others start, as they start, once all run
            stream = engine.generate(PROMPT, params, n=4)
            async with aclosing(stream):
                for _ in range(taken):
                    await anext(stream)
            await settle()
            assert (engine.stats().running, engine.stats().waiting) == (0, 0)
            # Every slot came back: a request for four answers is taken again.
            assert len(await by_answer(engine.generate(PROMPT, greedy_params(), n=4))) == 4
            await settle()


def greedy_params() -> SamplingParams:
    return SamplingParams(max_tokens=2, temperature=0.0)


@pytest.mark.parametrize("n", [0, 5, 129, True, 2.0])
async def test_n_past_the_bounds_is_refused_naming_it(n: object) -> None:
    async with open_fake(CountingBackend(), max_sequences=4) as engine:
        with pytest.raises(InvalidRequest) as caught:
            engine.generate(PROMPT, greedy_params(), n=n)
        assert caught.value.field == "n"
        with pytest.raises(InvalidRequest):
            engine.chat([{"role": "user", "content": "hi"}], greedy_params(), n=n)
