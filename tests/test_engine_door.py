"""The engine's door: a model source of the wrong type is an
InvalidRequest naming `path`; a log stream that fails mid-run (a full disk) never fails a
request, and is reported once; ten million token ids or two million chat messages are refused
from their length, without holding the event loop."""

from __future__ import annotations

import gc
import io
from pathlib import Path
from typing import Any

import anyio
import pytest

import actors.engine
from actors import Engine, SamplingParams
from actors.errors import ContextLengthExceeded, InvalidRequest
from actors.logs import failed_log_lines
from actors.loop_stall import watch_loop
from tests.conftest import TINY_MODELS

pytestmark = pytest.mark.anyio

TINY = TINY_MODELS["llama-q4k-tiny"]
# The loop's worst gap while a huge request is refused (the old door took about a second); a
# collection of the caller's own huge list can still land in the window, hence gc.collect().
STALL_BOUND_MS = 100
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


class _BytesPath:
    def __fspath__(self) -> bytes:
        return bytes(TINY)


@pytest.mark.parametrize(
    "path", [bytes(TINY), 42, [str(TINY)], 3.5, {"path": str(TINY)}, _BytesPath()],
    ids=["bytes", "int", "list", "float", "dict", "pathlike-of-bytes"],
)  # fmt: skip
async def test_a_model_source_of_the_wrong_type_names_path(monkeypatch, path: Any) -> None:
    monkeypatch.setattr(actors.engine, "load_gguf", _never_called)
    with pytest.raises(InvalidRequest, match="path must be") as error:
        async with Engine.open(path):
            pass
    assert error.value.field == "path"


def _never_called(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the model was loaded before the path was checked")


class DiskFull(io.StringIO):
    """A log stream whose writes start failing after `good` lines, as a full disk's do."""

    def __init__(self, good: int) -> None:
        super().__init__()
        self.good = good

    def write(self, text: str) -> int:
        if self.good <= 0:
            raise OSError(28, "No space left on device")
        self.good -= 1
        return super().write(text)


async def test_a_log_stream_failing_mid_run_never_fails_a_request(capsys) -> None:
    stream = DiskFull(good=2)
    async with Engine.open(TINY, backend="cpu", log_level="debug", log_file=stream) as engine:
        for _ in range(3):
            completion = await engine.complete("hello", greedy(3))
            assert len(completion.token_ids) == 3
        with pytest.raises(InvalidRequest):  # a refusal is logged too, and still raised
            engine.generate([], greedy(2))
        failed = failed_log_lines()
    assert failed > 3
    reports = [line for line in capsys.readouterr().err.splitlines() if "log destination" in line]
    assert len(reports) == 1 and "No space left on device" in reports[0]


async def test_ten_million_token_ids_are_refused_by_their_length() -> None:
    ids = [1] * 10_000_000
    async with Engine.open(TINY, backend="cpu") as engine:
        gc.collect()
        async with watch_loop() as watch:
            with pytest.raises(ContextLengthExceeded, match="10000000 tokens"):
                engine.generate(ids, greedy(2))
            await anyio.sleep(0.05)
    assert watch.worst_stall_ms < STALL_BOUND_MS


async def test_two_million_messages_are_refused_by_their_count() -> None:
    messages = [{"role": "user", "content": "hi"}] * 2_000_000
    async with Engine.open(TINY, backend="cpu") as engine:
        gc.collect()
        async with watch_loop() as watch:
            with pytest.raises(ContextLengthExceeded, match="2,000,000 messages") as error:
                engine.chat(messages, greedy(2), template=PLAIN_TEMPLATE)
            await anyio.sleep(0.05)
        assert error.value.field == "messages"
    assert watch.worst_stall_ms < STALL_BOUND_MS


async def test_long_id_lists_and_chats_under_the_context_are_checked_off_the_loop(
    monkeypatch,
) -> None:
    """Past the inline bound but within the context: checked in a worker thread, so their
    errors come from the first iteration."""
    monkeypatch.setattr(actors.engine, "_CHECK_INLINE_ITEMS", 8)
    async with Engine.open(TINY, backend="cpu") as engine:
        stream = engine.generate([1, 2, 3] * 4 + [10**6], greedy(2))
        with pytest.raises(InvalidRequest, match="outside"):
            await stream.__anext__()
        completion = await actors.engine.collect(engine.generate([1, 2, 3] * 4, greedy(2)))
        assert len(completion.token_ids) == 2
        messages: list[Any] = [{"role": "user", "content": "hi"}] * 12
        stream = engine.chat([*messages, {"role": "wizard"}], greedy(2), template=PLAIN_TEMPLATE)
        with pytest.raises(InvalidRequest, match="wizard"):
            await stream.__anext__()
        completion = await actors.engine.collect(
            engine.chat(messages, greedy(2), template=PLAIN_TEMPLATE)
        )
        assert len(completion.token_ids) == 2


def test_path_check_takes_paths(tmp_path: Path) -> None:
    for path in (None, "model.gguf", tmp_path / "model.gguf"):
        actors.engine._check_model_path(path)
