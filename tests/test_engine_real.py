"""The engine end to end on real models (SmolLM2-135M; a few tokens per request)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path

import anyio
import numpy as np
import pytest

import actors.loader
from actors import EngineOverloaded
from actors.compute.cpu import CpuBackend
from actors.compute.contract import Candidates, RowInputs, StepItem
from actors.engine import Engine
from actors.errors import ContextLengthExceeded
from actors.model.loaded import Model, OpenedModel, open_model
from actors.params import SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "My favourite colour is",
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "In 1492, Columbus",
    "A haiku about the sea:",
    "def fibonacci(n):",
    "The three primary colours are",
    "Photosynthesis is the process by which",
    "The best way to learn a language is",
    "Mount Everest is located in",
    "A list of fruits: apple, banana,",
    "Dear Sir or Madam, I am writing to",
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def greedy(max_tokens: int, **extra: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


async def test_sixteen_concurrent_requests_match_each_alone_in_full_steps(
    smollm2: Model, tmp_path: Path
) -> None:
    log_file = tmp_path / "engine.jsonl"
    together: dict[int, tuple[int, ...]] = {}

    async def one(index: int) -> None:
        together[index] = (await engine.complete(PROMPTS[index], greedy(3))).token_ids

    async with Engine.open(smollm2, log_level="debug", log_file=log_file) as engine:
        async with anyio.create_task_group() as tasks:
            for index in range(16):
                tasks.start_soon(one, index)
        steps_together = engine.stats().steps
        alone = [(await engine.complete(prompt, greedy(3))).token_ids for prompt in PROMPTS]
    assert [together[index] for index in range(16)] == alone
    events = [json.loads(line) for line in log_file.read_text().splitlines()]
    steps = [event for event in events if event["event"] == "step"][:steps_together]
    decoding = [step["items"] for step in steps if step["decode_items"] == step["items"]]
    assert decoding and np.mean(decoding) >= 14
    # each step's time, and the CPU backend's own share of it (a forward: most of it)
    assert all(0 < step["compute_ms"] <= step["ms"] for step in steps)
    finished = [event for event in events if event["event"] == "request_finished"]
    assert len(finished) == 32 and all("request_id" in event for event in finished)
    names = {event["event"] for event in events}
    assert {"model_loaded", "engine_started", "request_admitted", "prefill_finished"} <= names
    (loaded,) = [event for event in events if event["event"] == "model_loaded"]
    assert loaded["arch"] == "llama" and loaded["backend"] == "cpu" and loaded["quant_mix"]


async def test_shared_prefix_is_reused_with_the_cold_answer(smollm2: Model) -> None:
    words = "one two three four five six seven eight nine ten".split()
    prefix = " ".join(words[i % 10] for i in range(400))
    prefix_ids = smollm2.tokenizer.encode(prefix)[:400]
    question = smollm2.tokenizer.encode(" eleven twelve")
    other = smollm2.tokenizer.encode(" and then")
    async with Engine.open(smollm2) as engine:
        cold = await engine.complete(prefix_ids + question, greedy(3))
    async with Engine.open(smollm2) as engine:
        await engine.complete(prefix_ids + other, greedy(1))
        warm = await engine.complete(prefix_ids + question, greedy(3))
    assert cold.usage.cached_tokens == 0
    assert warm.usage.cached_tokens >= 384
    assert warm.token_ids == cold.token_ids


async def test_stop_string_across_token_boundary(smollm2: Model) -> None:
    prompt = "Once upon a time, in a small village,"
    async with Engine.open(smollm2) as engine:
        pieces = [chunk.text async for chunk in engine.generate(prompt, greedy(8))]
        # Two characters from the end of one token's text and two from the start of the next.
        boundary = next(i for i in range(1, 7) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
        stop = pieces[boundary][-2:] + pieces[boundary + 1][:2]
        full = "".join(pieces)
        streamed = [chunk async for chunk in engine.generate(prompt, greedy(8, stop=[stop]))]
    text = "".join(chunk.text for chunk in streamed)
    assert text == full[: full.index(stop)]
    assert streamed[-1].finish_reason == "stop"
    assert all(stop not in seen for seen in accumulate(chunk.text for chunk in streamed))


async def test_context_finish_and_too_long_prompt(smollm2: Model) -> None:
    async with Engine.open(smollm2, kv_blocks=2, block_size=16) as engine:
        assert engine.context_length == 32
        prompt = list(range(100, 128))
        done = await engine.complete(prompt, greedy(50, ignore_eos=True))
        with pytest.raises(ContextLengthExceeded):
            engine.generate(list(range(100, 132)), greedy(5))
    assert done.finish_reason == "context"
    assert len(done.token_ids) == 4


async def test_overload_refuses_the_overflow_at_once_and_serves_the_rest(smollm2: Model) -> None:
    outcomes: list[str] = []

    async def one(index: int) -> None:
        try:
            stream = engine.generate(PROMPTS[index % 16], greedy(1))
        except EngineOverloaded:
            # Refused before any step has run: nothing waited.
            outcomes.append("refused" if engine.stats().steps == 0 else "refused late")
            return
        async for chunk in stream:
            if chunk.finish_reason is not None:
                outcomes.append(chunk.finish_reason)

    async with Engine.open(smollm2, max_sequences=4, max_queued=8) as engine:
        async with anyio.create_task_group() as tasks:
            for index in range(100):
                tasks.start_soon(one, index)
    assert sorted(outcomes) == ["length"] * 12 + ["refused"] * 88


class FlakyCpuBackend(CpuBackend):
    """Fails the first step that carries a decode at position `fail_at`."""

    def __init__(self, model: Model, fail_at: int) -> None:
        super().__init__(model, 64, 16)
        self.fail_at = fail_at
        self.failed: list[tuple[StepItem, ...]] = []

    def run(self, items: Sequence[StepItem], rows: Sequence[RowInputs]) -> Candidates:
        if not self.failed and any(item.start == self.fail_at for item in items):
            self.failed.append(tuple(items))
            raise RuntimeError("injected failure")
        return super().run(items, rows)


async def test_injected_failure_replays_only_that_steps_sequences(smollm2: Model) -> None:
    prompts = ["The capital of France is", "The quick brown fox"]
    async with Engine.open(smollm2) as engine:
        alone = [(await engine.complete(prompt, greedy(3))).token_ids for prompt in prompts]
        bystander_alone = (await engine.complete("In 1492, Columbus", greedy(3))).token_ids
    fail_at = len(smollm2.tokenizer.encode(prompts[0])) + 1
    backend = FlakyCpuBackend(smollm2, fail_at)
    results: dict[int, tuple[int, ...]] = {}

    async def one(index: int) -> None:
        results[index] = (await engine.complete(prompts[index], greedy(3))).token_ids

    async with Engine.open_backend(lambda: backend, smollm2.tokenizer) as engine:
        bystander = engine.generate("In 1492, Columbus", greedy(3))
        first = await bystander.__anext__()
        async with anyio.create_task_group() as tasks:
            for index in range(2):
                tasks.start_soon(one, index)
        rest = [chunk.token_id async for chunk in bystander if chunk.token_id is not None]
    assert [results[0], results[1]] == alone
    assert (first.token_id, *rest) == bystander_alone
    (failed,) = backend.failed
    assert len(failed) >= 1


async def test_multi_turn_chat_reuses_the_conversation(smollm2: Model) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    async with Engine.open(smollm2) as engine:
        first = [chunk async for chunk in engine.chat(messages, greedy(8))]
        messages += [
            {"role": "assistant", "content": "".join(chunk.text for chunk in first)},
            {"role": "user", "content": "And another one?"},
        ]
        second = [chunk async for chunk in engine.chat(messages, greedy(4))]
    assert first[-1].finish_reason in ("stop", "length")
    assert second[-1].usage.cached_tokens >= 16


@pytest.mark.parametrize("cancel_after", [0.0, 0.01, 0.1, 0.3])
async def test_cancelling_open_waits_for_the_load_and_leaves_no_thread(
    tiny_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch, cancel_after: float
) -> None:
    """Cancelled before, during or after a (slowed) load: `open` returns once the load is done,
    with the model file closed and the loader, compute and sampler threads gone."""
    loads: list[OpenedModel] = []
    finished: list[OpenedModel] = []

    def slow_load(path: Path) -> OpenedModel:
        model = open_model(path)
        loads.append(model)
        time.sleep(0.2)
        finished.append(model)
        return model

    monkeypatch.setattr(actors.loader, "open_model", slow_load)
    threads_before = threading.active_count()
    with anyio.move_on_after(cancel_after) as scope:
        async with Engine.open(tiny_model_paths["llama-q4k-tiny"], "cpu") as engine:
            assert (await engine.complete([1, 2, 3], greedy(2))).finish_reason == "length"
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert finished == loads
    assert all(model.gguf._file.closed for model in loads)
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("q4k-")]
    assert threading.active_count() <= threads_before


async def test_64_streams_move_candidates_not_logits_rows(gemma3_model_path: Path) -> None:
    """What crosses from the compute actor per chosen token, at 64 streams on gemma-3-270m
    (greedy and top-k rows, as the engine benchmark and most clients ask): at most 1% of a
    whole float32 logits row."""
    async with Engine.open(gemma3_model_path, max_sequences=64) as engine:
        params = [greedy(3, ignore_eos=True),
                  SamplingParams(max_tokens=3, temperature=0.7, top_k=40, ignore_eos=True)]
        async with anyio.create_task_group() as tasks:
            for index in range(64):
                tasks.start_soon(engine.complete, f"Story number {index}:", params[index % 2])
        stats = engine.stats()
        row_bytes = engine.info.vocab_size * 4
    chosen = 64 * 3
    assert stats.bytes_from_compute / chosen <= 0.01 * row_bytes
