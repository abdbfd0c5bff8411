"""Fault injection on a real model: a step that raises, NaN rows or a hung step for chosen
sequences. The hit requests replay (alone) or fail with ComputeError; every other request
completes with exactly the tokens it gives alone, and nothing stays held."""

from __future__ import annotations


import anyio
import pytest

from actors.compute.faults import Fault
from actors.engine import Engine
from actors.fault_drill import DrillResult, run_with_fault
from actors.model.loaded import Model
from actors.params import SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "In 1492, Columbus",
    "My favourite food is",
    "The quick brown fox",
    "Dear Sir or Madam,",
]
TOKENS = 5
POISONED = 3  # the request the faults pick


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def prompt_ids(smollm2: Model) -> list[list[int]]:
    # The tokenizer adds no BOS to SmolLM2 prompts, so each prompt's first tokens mark it.
    return [smollm2.tokenizer.encode(prompt) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def alone(smollm2: Model, prompt_ids: list[list[int]]) -> list[tuple[int, ...]]:
    async def solo() -> list[tuple[int, ...]]:
        async with Engine.open(smollm2) as engine:
            return [(await engine.complete(ids, greedy())).token_ids for ids in prompt_ids]

    return anyio.run(solo)


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


async def run_all(
    smollm2: Model, prompt_ids: list[list[int]], fault: Fault, step_timeout_s: float = 300.0
) -> tuple[list[tuple[int, ...] | str], DrillResult]:
    """Every prompt at once with `fault`: each result is the tokens or "failed"."""
    drill = await run_with_fault(smollm2, prompt_ids, fault, greedy(),
                                 step_timeout_s=step_timeout_s)
    return ["failed" if got is None else got for got in drill.tokens], drill


@pytest.mark.parametrize("kind", ["raise", "nan"])
async def test_a_poisoned_sequence_fails_alone(
    smollm2: Model, prompt_ids: list[list[int]], alone: list[tuple[int, ...]], kind: str
) -> None:
    fault = Fault(kind=kind, prompt_prefix=tuple(prompt_ids[POISONED][:2]))
    results, drill = await run_all(smollm2, prompt_ids, fault)
    assert results[POISONED] == "failed"
    others = [index for index in range(len(PROMPTS)) if index != POISONED]
    assert [results[index] for index in others] == [alone[index] for index in others]
    assert drill.injected[kind] >= 2 and drill.blocks_held == 0


@pytest.mark.parametrize("kind", ["raise", "nan"])
async def test_a_passing_fault_is_replayed_away(
    smollm2: Model, prompt_ids: list[list[int]], alone: list[tuple[int, ...]], kind: str
) -> None:
    fault = Fault(kind=kind, prompt_prefix=tuple(prompt_ids[POISONED][:2]), times=1)
    results, drill = await run_all(smollm2, prompt_ids, fault)
    assert results == alone
    assert drill.injected[kind] == 1 and drill.blocks_held == 0


async def test_a_step_past_its_deadline_is_replayed(
    smollm2: Model, prompt_ids: list[list[int]], alone: list[tuple[int, ...]]
) -> None:
    # The late answer comes within the second deadline: the step itself takes well under 5 s
    # even on a loaded machine.
    fault = Fault(kind="hang", prompt_prefix=tuple(prompt_ids[POISONED][:2]), times=1,
                  hang_s=7.0)
    results, drill = await run_all(smollm2, prompt_ids, fault, step_timeout_s=6.0)
    assert results == alone
    assert drill.injected["hang"] == 1 and drill.blocks_held == 0


async def test_a_backend_that_stops_answering_is_lost_not_waited_on(
    smollm2: Model, prompt_ids: list[list[int]]
) -> None:
    """Hung for longer than two deadlines: every request in flight fails, the engine block
    ends without waiting for the stuck thread."""
    fault = Fault(kind="hang", prompt_prefix=tuple(prompt_ids[POISONED][:2]), times=1,
                  hang_s=4.0)
    with anyio.fail_after(30):
        results, _ = await run_all(smollm2, prompt_ids, fault, step_timeout_s=0.5)
    assert "failed" in results

