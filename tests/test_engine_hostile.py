"""Hostile requests against a real engine (the tiny llama model: fast to open and step): each
is refused with the project's own error, nothing stays held, and the event loop keeps running
while the engine deals with it."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import anyio
import pytest

import actors.engine
import actors.session
from actors import Engine, SamplingParams
from actors.errors import ContextLengthExceeded, InvalidRequest, TemplateError
from actors.logreader import parse_log, request_rows
from actors.loop_stall import watch_loop
from tests.conftest import TINY_MODELS

pytestmark = pytest.mark.anyio

TINY = TINY_MODELS["llama-q4k-tiny"]
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
# Within every size limit, but 10^9 loop turns: only the time bound stops it.
SLOW_TEMPLATE = "{% for i in range(30000) %}{% for j in range(30000) %}{% endfor %}{% endfor %}"
# Refused by the size bounds as they start (with 10^5 ranges).
HUGE_TEMPLATES = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ 'a' * 10**9 }}",
    "{% for i in range(3000) %}{% for j in range(3000) %}xx{% endfor %}{% endfor %}",
    "{% for a in x %}" * 25 + "{% endfor %}" * 25,
    "{% if 1 %}" * 400 + "{% endif %}" * 400,
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def tiny_engine(**options: Any) -> AsyncIterator[Engine]:
    async with Engine.open(TINY, backend="cpu", **options) as engine:
        yield engine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


def nothing_held(engine: Engine) -> bool:
    stats = engine.stats()
    return (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)


async def test_an_error_after_the_slot_is_taken_gives_the_slot_back(monkeypatch) -> None:
    """Defect 1's class: whatever raises between admission and the token loop, the next
    request still gets in (with max_sequences=1, max_queued=0 a lost slot locks the engine)."""
    real = actors.session.SequenceSampling
    calls = []

    def fails_once(*args: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise OverflowError("built from a value validation let through")
        return real(*args)

    monkeypatch.setattr(actors.session, "SequenceSampling", fails_once)
    async with tiny_engine(max_sequences=1, max_queued=0) as engine:
        with pytest.raises(OverflowError):
            await engine.complete("hello", greedy(2))
        done = await engine.complete("hello", greedy(2))
        await anyio.sleep(0.05)
        assert done.finish_reason == "length"
        assert nothing_held(engine)


async def test_the_issues_locking_request_is_refused_at_the_door() -> None:
    async with tiny_engine(max_sequences=1, max_queued=0) as engine:
        with pytest.raises(InvalidRequest) as error:
            engine.generate(
                "hello",
                SamplingParams(max_tokens=2, repetition_window=2**63, repetition_penalty=1.1),
            )
        assert error.value.field == "repetition_window"
        assert (await engine.complete("hello", greedy(2))).finish_reason == "length"


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"kv_blocks": 10**12}, "kv_blocks"),
        ({"block_size": 10**9}, "block_size"),
        ({"max_queued": 10**15}, "max_queued"),
        ({"max_sequences": 2**80}, "max_sequences"),
        ({"prefill_chunk": 0}, "prefill_chunk"),
        ({"log_file": "a\x00b"}, "log_file"),  # found by the options fuzzer
        ({"log_file": 5}, "log_file"),
        ({"log_level": ["info"]}, "log_level"),
        ({"step_timeout_s": 2**1024}, "step_timeout_s"),  # past a float: found by the fuzzer
        ({"step_timeout_s": float("nan")}, "step_timeout_s"),
    ],
)
async def test_absurd_open_options_are_refused_before_loading(
    monkeypatch, tmp_path, options, field
) -> None:
    monkeypatch.setattr(actors.engine, "load_gguf", _never_called)
    monkeypatch.chdir(tmp_path)  # a log file name must not land in the repository
    with pytest.raises(InvalidRequest) as error:
        async with Engine.open(TINY, **options):
            pass
    assert error.value.field == field


@pytest.mark.slow
async def test_a_pool_past_this_machines_memory_is_an_invalid_request(smollm2_model_path) -> None:
    """Under the sanity bound (2**24 positions), but SmolLM2's pool would take 720 GiB."""
    with pytest.raises(InvalidRequest, match="do not fit in memory") as error:
        async with Engine.open(smollm2_model_path, backend="cpu", kv_blocks=2**24 // 16):
            pass
    assert error.value.field == "kv_blocks"


def _never_called(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the model was loaded before the options were checked")


async def test_malformed_requests_name_their_field() -> None:
    async with tiny_engine() as engine:
        for prompt in ([1, [2]], [[1, 2], [3, 4]], [2**70], ["a"]):
            with pytest.raises(InvalidRequest) as error:
                engine.generate(prompt, greedy(2))
            assert error.value.field == "prompt"
        with pytest.raises(InvalidRequest) as error:
            engine.chat([{"role": "user", "content": "x"}], greedy(2), template=5)
        assert error.value.field == "template"
        assert nothing_held(engine)


async def test_a_prompt_whose_bytes_cannot_fit_is_refused_without_tokenizing(monkeypatch) -> None:
    async with tiny_engine() as engine:
        monkeypatch.setattr(engine._tokenizer, "encode", _never_called)
        too_big = "x" * (engine.context_length * engine._tokenizer.max_token_bytes)
        with pytest.raises(ContextLengthExceeded, match="at least"):
            await _drain(engine.generate(too_big, greedy(2)))
        assert nothing_held(engine)


async def test_a_long_prompt_is_tokenized_off_the_event_loop(monkeypatch) -> None:
    async with tiny_engine() as engine:
        encode = engine._tokenizer.encode
        threads: list[int] = []

        def recording(*args: Any, **kwargs: Any) -> list[int]:
            threads.append(threading.get_ident())
            return encode(*args, **kwargs)

        monkeypatch.setattr(engine._tokenizer, "encode", recording)
        # Fits by its bytes, not once tokenized: the refusal comes from the first iteration.
        long_prompt = "ab " * 7000
        stream = engine.generate(long_prompt, greedy(2))
        with pytest.raises(ContextLengthExceeded):
            await stream.__anext__()
        assert threads and threading.get_ident() not in threads
        assert nothing_held(engine)


@pytest.mark.parametrize("template", HUGE_TEMPLATES)
async def test_a_huge_or_broken_template_fails_with_template_error(template) -> None:
    async with tiny_engine() as engine:
        with pytest.raises(TemplateError):
            await _drain(engine.chat([{"role": "user", "content": "hi"}], greedy(2), template))
        assert nothing_held(engine)


async def test_a_slow_template_times_out_while_another_stream_keeps_flowing() -> None:
    """The render runs in a worker thread until its time bound (the default 2 s): a stream
    that is already decoding must get tokens meanwhile, and the ticker must keep ticking."""
    messages = [{"role": "user", "content": "hi"}]
    async with tiny_engine() as engine, watch_loop() as watch:
        during_render: list[str] = []
        rendering = [False]
        decoding = anyio.Event()

        async def bystander() -> None:
            params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
            async with aclosing(engine.generate("hello", params)) as chunks:
                async for chunk in chunks:
                    decoding.set()
                    if rendering[0]:
                        during_render.append(chunk.text)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(bystander)
            await decoding.wait()
            rendering[0] = True
            ticks_before = watch.ticks
            with pytest.raises(TemplateError, match="time limit"):
                await _drain(engine.chat(messages, greedy(2), SLOW_TEMPLATE))
            rendering[0] = False
            tasks.cancel_scope.cancel()
        assert during_render, "the other stream froze while the template rendered"
        assert watch.ticks > ticks_before
        # The engine still answers through its chat path.
        assert await _drain(engine.chat(messages, greedy(2), PLAIN_TEMPLATE))
        await anyio.sleep(0.05)
        assert nothing_held(engine)


async def _drain(chunks: AsyncIterator[Any]) -> list[Any]:
    async with aclosing(chunks):
        return [chunk async for chunk in chunks]


async def test_a_cancelled_request_logs_its_time_to_first_token(tmp_path) -> None:
    """`q4k logs requests` shows the TTFT of a cancelled request that produced tokens."""
    log_path = tmp_path / "engine.log"
    async with tiny_engine(log_file=log_path) as engine:
        params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        async with aclosing(engine.generate("hello", params)) as chunks:
            async for _ in chunks:
                break
    log = parse_log([("engine", log_path.read_text().splitlines())])
    (row,) = request_rows(log)
    assert row.status == "cancelled" and row.ttft_ms is not None and row.ttft_ms > 0


class _UnreadablePath(os.PathLike):
    """An os.PathLike whose path cannot be read."""

    def __fspath__(self) -> str:
        raise OSError("no path")


@pytest.mark.parametrize("path", [b"model.gguf", 3, ["model.gguf"], _UnreadablePath()],
                         ids=["bytes", "int", "list", "raising-pathlike"])
def test_load_model_refuses_a_path_of_another_type_by_name(path: object) -> None:
    from actors import load_model

    with pytest.raises(InvalidRequest, match="path must be a model file path") as error:
        load_model(path)
    assert error.value.field == "path"
