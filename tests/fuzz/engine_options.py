"""Engine.open: every option, hostile or plausible, on the tiny model. Either InvalidRequest
naming the option, before the model loads, or an engine that serves a request and then holds
nothing. (The KV pool's memory is the loader's to check; kv_blocks stays small here.)"""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path
from typing import Any

import anyio
from hypothesis import strategies as st

from actors import Engine, SamplingParams
from actors.errors import InvalidRequest
from tests.conftest import TINY_MODELS
from tests.fuzz.target import Escape, Target, only_project_errors
from tests.fuzz.values import hostile, plausible_or_hostile

OPTION_VALUES: dict[str, st.SearchStrategy] = {
    "backend": st.sampled_from(["auto", "cpu", "cuda", "tpu", ""]),
    "max_sequences": st.one_of(st.integers(1, 9), st.sampled_from([0, 2**20 + 1, 2**64])),
    "max_queued": st.one_of(st.integers(0, 9), st.sampled_from([-1, 2**20 + 1, 10**15])),
    "kv_blocks": st.one_of(st.none(), st.integers(1, 40), st.sampled_from([0, 10**12, 2**70])),
    "block_size": st.one_of(st.integers(1, 64), st.sampled_from([0, 10**9, 4097])),
    "prefill_chunk": st.one_of(st.integers(1, 600), st.sampled_from([0, 2**40])),
    "step_timeout_s": st.one_of(
        st.floats(5.0, 600.0), st.sampled_from([0, -1.0, float("inf"), float("nan"), True])
    ),
    "log_level": st.one_of(st.none(), st.sampled_from(["debug", "info", "warning", "loud"])),
    "log_file": st.one_of(st.none(), st.sampled_from(["engine.log", "", "..", "a\x00b"])),
}
OPTIONS = [name for name in inspect.signature(Engine.open).parameters if name not in ("cls", "path")]
assert set(OPTION_VALUES) == set(OPTIONS), f"an option is not fuzzed: {set(OPTIONS) ^ set(OPTION_VALUES)}"

cases = st.fixed_dictionaries(
    {}, optional={name: plausible_or_hostile(values) for name, values in OPTION_VALUES.items()}
)


def check(options: dict[str, Any]) -> str:
    with only_project_errors(options) as outcome:
        try:
            anyio.run(_serve_one, options)
        except InvalidRequest as exc:
            if exc.field not in options:
                raise Escape(f"InvalidRequest names {exc.field!r}, not an option given: {exc}") from exc
            raise
    return outcome[0]


async def _serve_one(options: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        options = {**options, "log_file": _inside(Path(folder), options.get("log_file"))}
        if options.get("log_level") is not None and options["log_file"] is None:
            options["log_file"] = Path(folder) / "engine.log"
        async with Engine.open(TINY_MODELS["llama-q4k-tiny"], **options) as engine:
            await engine.complete("hello", SamplingParams(max_tokens=3, temperature=0))
            await anyio.sleep(0.01)
            stats = engine.stats()
            if (stats.running, stats.waiting, stats.kv_blocks_used) != (0, 0, 0):
                raise Escape(f"the engine still holds {stats} after its only request")


def _inside(folder: Path, log_file: Any) -> Any:
    """A log file name kept inside the case's own folder (a fuzzed name must not litter the
    working directory); '' and '..' still name folders, and NUL stays NUL."""
    return folder / log_file.replace("/", "_") if isinstance(log_file, str) else log_file


TARGET = Target("Engine.open (every option)", cases, check)
