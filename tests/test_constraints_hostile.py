"""Hostile structured-output constraints against a real engine (the tiny llama):
none crashes the process (the deep ones run in a child process, so a crash fails the test
rather than pytest), compiles count against admission, end on cancel, close and their
deadline, a matcher's error state is an error the caller sees, and a costly constraint holds
back only its own sequence. No test here depends on timing: each checks an outcome."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import pytest

import actors.engine_door
from actors import Engine, SamplingParams, StructuredOutput
from actors.errors import EngineClosed, EngineOverloaded, InvalidRequest
from actors.messages import Chunk
from actors.structured import COMPILE_THREADS, JSON_LAYOUT, Constraint, GrammarCompiler
from tests.conftest import TINY_MODELS
from tests.fuzz import FUZZ_EXAMPLES

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
TINY = TINY_MODELS["llama-q4k-tiny"]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def greedy(structured: StructuredOutput | None = None, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured=structured)


async def drained(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    async with aclosing(chunks) as stream:
        return [chunk async for chunk in stream]


# --- nothing crashes the process --------------------------------------------------------------

# (builder in tests.fuzz.constraints, its arguments, the StructuredOutput field, expected):
# chains past the depth that overflowed an 8 MiB stack (about 900 references, 2,700 rules;
# 85 references to objects nested 45 deep, the costliest shape a level, overflowed it too),
# up to the bound (8,192 levels), and past it.
DEEP_CASES: dict[str, tuple[str, list[Any], str, str]] = {
    "$ref x 1,200 through properties": ("ref_chain", [1_200, "properties"], "json_schema", "ok"),
    "$ref x 2,000 through items": ("ref_chain", [2_000, "items"], "json_schema", "ok"),
    "$ref x 2,000 through patternProperties": ("ref_chain", [2_000, "patternProperties"],
                                               "json_schema", "ok"),
    # Compiles; its Earley rows then pass the parser's limit of 2,000 items.
    "$ref x 2,000 through anyOf": ("ref_chain", [2_000, "anyOf"], "json_schema",
                                   "InvalidRequest"),
    "$ref x 4,000 bare, in definitions": ("ref_chain", [4_000, "bare", "definitions"],
                                          "json_schema", "ok"),
    "$ref x 2,500 through additionalProperties": ("ref_chain", [2_500, "additionalProperties"],
                                                  "json_schema", "ok"),
    "$ref x 85, each 45 objects deep": ("ref_chain", [85, "required-property", "$defs", 45],
                                        "json_schema", "ok"),
    "$ref x 5,000 through properties": ("ref_chain", [5_000, "properties"], "json_schema",
                                        "InvalidRequest"),
    "$ref x 200, each 45 objects deep": ("ref_chain", [200, "required-property", "$defs", 45],
                                         "json_schema", "InvalidRequest"),
    "schema nested 130 deep": ("nested_schema", [130], "json_schema", "InvalidRequest"),
    "Lark: 4,000 rules": ("lark_rule_chain", [4_000], "grammar", "ok"),
    "Lark: 3,500 terminals": ("lark_rule_chain", [3_500, 0, True], "grammar", "ok"),
    "Lark: 280 rules, each in 28 groups": ("lark_rule_chain", [280, 28], "grammar", "ok"),
    "Lark: 9,000 rules": ("lark_rule_chain", [9_000], "grammar", "InvalidRequest"),
    "Lark: %json of $ref x 1,500": ("ref_json_block", [1_500, "items"], "grammar", "ok"),
    "GBNF: 300 rules": ("gbnf_rule_chain", [300], "grammar", "ok"),
    "GBNF: 3,000 rules": ("gbnf_rule_chain", [3_000], "grammar", "InvalidRequest"),
    # Not Lark: llguidance's own check of the syntax was quadratic in blank lines.
    "300,000 blank lines": ("blank_lines", [300_000], "grammar", "InvalidRequest"),
}

_CHILD = textwrap.dedent("""
    import json, sys
    import anyio
    from actors import Engine, SamplingParams, StructuredOutput
    from actors.errors import Q4KError
    from tests.fuzz import constraints

    def blank_lines(count):
        return "\\n" * count + "x"

    def ref_json_block(length, link):
        return constraints.lark_json_block(constraints.ref_chain(length, link))

    async def main(model, cases):
        async with Engine.open(model, backend="cpu") as engine:
            for name, (builder, args, field) in cases.items():
                make = getattr(constraints, builder, None) or globals()[builder]
                try:
                    structured = StructuredOutput(**{field: make(*args)})
                    done = await engine.complete("Answer:", SamplingParams(
                        temperature=0, max_tokens=8, structured=structured))
                    outcome = "ok"
                except Q4KError as exc:
                    outcome = type(exc).__name__
                print(json.dumps([name, outcome]), flush=True)

    anyio.run(main, sys.argv[1], json.loads(sys.stdin.read()))
""")


def test_no_constraint_crashes_the_process() -> None:
    cases = {name: case[:3] for name, case in DEEP_CASES.items()}
    child = subprocess.run([sys.executable, "-c", _CHILD, str(TINY)], input=json.dumps(cases),
                           capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert child.returncode == 0, f"the child ended with {child.returncode}: {child.stderr[-2000:]}"
    outcomes = dict(json.loads(line) for line in child.stdout.splitlines())
    assert outcomes == {name: case[3] for name, case in DEEP_CASES.items()}


def test_the_constraint_fuzz_target_finds_no_escape() -> None:
    """tests/fuzz/constraints.py through benchmarks/fuzz.py, in a child process."""
    child = subprocess.run(
        [sys.executable, "benchmarks/fuzz.py", "--target", "constraints",
         "--examples", str(FUZZ_EXAMPLES)],
        capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    assert "0 escapes" in child.stdout


def test_a_schema_nested_past_what_python_encodes_is_an_invalid_request() -> None:
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(5_000):
        inner["items"] = inner = {}
    looped: dict[str, Any] = {"type": "object"}
    looped["properties"] = {"self": looped}
    for schema in (deep, looped):
        with pytest.raises(InvalidRequest) as error:
            StructuredOutput(json_schema=schema)
        assert error.value.field == "structured.json_schema"


# --- compiles: admission, their turn, cancel, close, deadline ---------------------------------


class HeldCompiles:
    """Makes every compile wait until `release()`: a compile as slow as the test needs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = 0
        self._lock = threading.Lock()
        self._go = threading.Event()
        compile_now = GrammarCompiler.constraint

        def held(compiler: GrammarCompiler, *args: Any) -> Constraint:
            with self._lock:
                self.started += 1
            self._go.wait()
            return compile_now(compiler, *args)

        monkeypatch.setattr(GrammarCompiler, "constraint", held)

    def release(self) -> None:
        self._go.set()


async def _waiting_for(condition: Callable[[], bool]) -> None:
    while not condition():
        await anyio.sleep(0.01)


async def test_requests_count_against_admission_while_they_compile(monkeypatch) -> None:
    held = HeldCompiles(monkeypatch)
    pick = greedy(StructuredOutput(choice=["yes", "no"]))
    answers: list[str] = []
    async with Engine.open(TINY, backend="cpu", max_sequences=1, max_queued=1) as engine:

        async def ask() -> None:
            answers.append((await engine.complete("Well?", pick)).text)

        async with anyio.create_task_group() as requests:
            requests.start_soon(ask)
            requests.start_soon(ask)
            # One compiles (held), the other waits for its turn if there is one thread: both
            # count against the limits.
            await _waiting_for(lambda: held.started >= 1 and engine._admission.live == 2)
            with pytest.raises(EngineOverloaded):
                engine.generate("Well?", pick)
            held.release()
        assert len(answers) == 2 and set(answers) <= {"yes", "no"}
        await _waiting_for(lambda: engine._admission.live == 0)


async def test_a_cancelled_request_never_starts_its_waiting_compile(monkeypatch) -> None:
    held = HeldCompiles(monkeypatch)
    pick = greedy(StructuredOutput(choice=["on", "off"]))
    async with Engine.open(TINY, backend="cpu") as engine:
        async with anyio.create_task_group() as running:
            for _ in range(COMPILE_THREADS):
                running.start_soon(engine.complete, "Switch:", pick)
            await _waiting_for(lambda: held.started == COMPILE_THREADS)
            with anyio.CancelScope() as waiting:
                running.start_soon(_cancel_soon, waiting)
                await engine.complete("Switch:", pick)  # waits for a turn: cancelled there
            assert waiting.cancelled_caught
            held.release()
        assert held.started == COMPILE_THREADS
        await _waiting_for(lambda: engine._admission.live == 0)
        assert (await engine.complete("Switch:", pick)).text in ("on", "off")


async def _cancel_soon(scope: anyio.CancelScope) -> None:
    await anyio.sleep(0.2)
    scope.cancel()


async def test_close_ends_the_requests_waiting_for_their_compile(monkeypatch) -> None:
    held = HeldCompiles(monkeypatch)
    pick = greedy(StructuredOutput(choice=["up", "down"]))
    failures: list[BaseException] = []
    async with Engine.open(TINY, backend="cpu") as engine:

        async def ask() -> None:
            try:
                await engine.complete("Way:", pick)
            except EngineClosed as exc:
                failures.append(exc)

        async with anyio.create_task_group() as requests:
            for _ in range(COMPILE_THREADS + 2):  # running and waiting their turn
                requests.start_soon(ask)
            await _waiting_for(lambda: held.started == COMPILE_THREADS)
            await anyio.sleep(0.05)
            engine.close()
        # Every request ended while their compiles were still held.
        assert len(failures) == COMPILE_THREADS + 2 and held.started == COMPILE_THREADS
        held.release()


async def test_a_compile_past_its_deadline_is_an_invalid_request(monkeypatch) -> None:
    held = HeldCompiles(monkeypatch)
    monkeypatch.setattr(actors.engine_door, "COMPILE_SECONDS", 0.3)
    async with Engine.open(TINY, backend="cpu") as engine:
        with pytest.raises(InvalidRequest, match="did not compile within") as error:
            await engine.complete("Date:", greedy(StructuredOutput(regex="[0-9]{4}")))
        assert error.value.field == "structured.regex"
        assert engine._admission.live == 0
        held.release()
        answer = await engine.complete("Date:", greedy(StructuredOutput(regex="[0-9]{4}")))
        assert len(answer.text) == 4 and answer.text.isdigit()


# --- a constraint's failure is an error, never an answer ---------------------------------------

# Each forces more text at once, after a choice or two, than the parser's lexer fuel lets it
# walk: the matcher ends in its error state mid-answer.
PAST_THE_LIMITS = [
    StructuredOutput(regex="[a-z]{2}x{70000}"),
    StructuredOutput(regex="[a-z]{2}x{70000}", fast_forward=False),
    StructuredOutput(json_schema={"type": "object", "required": ["n", "tail"], "properties": {
        "n": {"type": "integer"}, "tail": {"const": "yz" * 50_000}}}),
    StructuredOutput(json_schema={"type": "array", "items": {"const": 3}, "minItems": 40_000}),
    StructuredOutput(grammar='start: ("a" | "b") TAIL\nTAIL: /(cd){45000}/'),
    StructuredOutput(grammar='start: ("a" | "b") "' + "q" * 90_000 + '"'),
]


@pytest.mark.parametrize("structured", PAST_THE_LIMITS, ids=range(len(PAST_THE_LIMITS)))
async def test_a_constraint_past_the_parser_limits_is_an_invalid_request(
    structured: StructuredOutput,
) -> None:
    async with Engine.open(TINY, backend="cpu") as engine:
        with pytest.raises(InvalidRequest, match="parser limits") as error:
            await drained(engine.generate("Answer:", greedy(structured, max_tokens=200)))
        assert error.value.field == f"structured.{structured.kind}"
        assert "step failed" not in str(error.value)
        await _waiting_for(lambda: engine._admission.live == 0)


# --- a costly constraint holds back only its own sequence ---------------------------------------


async def test_a_sequence_waiting_for_its_constraint_does_not_hold_back_the_others(
    monkeypatch,
) -> None:
    advance_now = Constraint.advance
    go = threading.Event()

    def held(constraint: Constraint, token: int) -> Any:
        go.wait()
        return advance_now(constraint, token)

    async with Engine.open(TINY, backend="cpu") as engine:
        solo = await engine.complete("Once upon a time", greedy(max_tokens=32))
        monkeypatch.setattr(Constraint, "advance", held)
        constrained: list[str] = []

        async def ask() -> None:
            constrained.append((await engine.complete("Date:", greedy(StructuredOutput(
                regex="[0-9]{4}-[0-9]{2}")))).text)

        async with anyio.create_task_group() as requests:
            requests.start_soon(ask)
            # Its first token is chosen, and its constraint held: the plain request runs
            # every one of its steps meanwhile.
            beside = await engine.complete("Once upon a time", greedy(max_tokens=32))
            assert not constrained
            go.set()
        assert beside.token_ids == solo.token_ids
        assert len(constrained) == 1 and constrained[0][4] == "-"


COSTLY = [
    StructuredOutput(regex=r"(\w+ ){1,60}\w+\.", fast_forward=False),
    StructuredOutput(regex="x{40000}", fast_forward=False),
    StructuredOutput(regex="(a|b)*a(a|b){16}c"),
    StructuredOutput(json_schema={"type": "string", "maxLength": 20_000}),
]


async def test_plain_requests_beside_costly_constraints_get_their_solo_tokens() -> None:
    prompts = ["Once upon a time", "The sea", "In 1850,"]
    async with Engine.open(TINY, backend="cpu") as engine:
        solo = [(await engine.complete(p, greedy(max_tokens=32))).token_ids for p in prompts]
        beside: dict[str, tuple[int, ...]] = {}
        outcomes: list[str] = []

        async def plain(prompt: str) -> None:
            beside[prompt] = (await engine.complete(prompt, greedy(max_tokens=32))).token_ids

        async def costly(structured: StructuredOutput) -> None:
            try:
                outcomes.append((await engine.complete("Go:", greedy(structured))).finish_reason)
            except InvalidRequest as exc:
                outcomes.append(type(exc).__name__)

        async with anyio.create_task_group() as requests:
            for structured in COSTLY * 2:
                requests.start_soon(costly, structured)
            for prompt in prompts:
                requests.start_soon(plain, prompt)
        assert [beside[p] for p in prompts] == solo
        assert len(outcomes) == 2 * len(COSTLY)
        await _waiting_for(lambda: engine._admission.live == 0)



def _tool_grammar(tools: int, arguments: int) -> str:
    """A call to one of `tools` functions of `arguments` string arguments, as the server's
    tool-call grammars are written: a Lark rule of a `%json` schema each."""
    def schema(index: int) -> dict[str, Any]:
        return {"type": "object", "additionalProperties": False, "required": ["name"],
                "x-guidance": JSON_LAYOUT,
                "properties": {"name": {"const": f"tool_{index}"}, "arguments": {
                    "type": "object", "properties": {f"argument_{a}": {"type": "string"}
                                                     for a in range(arguments)}}}}

    rules = [f"fn{index}: %json {json.dumps(schema(index))}" for index in range(tools)]
    return "\n".join(["start: " + " | ".join(f"fn{index}" for index in range(tools)), *rules])


async def test_a_grammar_of_many_json_schemas_is_measured_schema_by_schema() -> None:
    # Its text holds ~20,000 colons and braces (JSON keys and objects): counted as Lark
    # rules and groups they would pass the bound; as schemas, each is a few levels deep.
    grammar = _tool_grammar(tools=128, arguments=30)
    async with Engine.open(TINY, backend="cpu") as engine:
        call = await engine.complete("Call:", greedy(StructuredOutput(grammar=grammar),
                                                      max_tokens=64))
        assert call.text.startswith('{"name": "tool_')
        nested = 'start: %json ' + "[" * 150 + "]" * 150
        with pytest.raises(InvalidRequest, match="nests more than") as error:
            await engine.complete("Call:", greedy(StructuredOutput(grammar=nested)))
        assert error.value.field == "structured.grammar"
