"""Structured-output constraints, hostile in shape and in content: JSON schemas ($ref chains
through every keyword that takes a schema, nesting, long consts and enums, huge counts),
regexes (long literals, counted repetitions, nested groups), Lark grammars (rule, terminal
and group chains, `%json` blocks), GBNF grammars and choices, around and past the engine's
bounds, and random text in each field.

Each runs through one engine (the tiny llama, opened once on a loop of its own) beside a
plain greedy request. It must end in the project's own error or in an answer its
constraint accepts (a finish of "stop" is re-checked by a fresh matcher), and the plain
request must get exactly its solo tokens. The loop's worst stall while a case runs is kept
in `WORST_STALL` (benchmarks/fuzz.py reports it; a crash ends the process, so CI runs this
target in a subprocess). The shape builders serve tests/test_constraints_hostile.py too.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from functools import partial
from typing import Any, TypeVar

import anyio
from hypothesis import strategies as st

from actors import Engine, SamplingParams, StructuredOutput
from actors.errors import Q4KError
from actors.loop_stall import watch_loop
from actors.messages import Completion
from tests.conftest import TINY_MODELS
from tests.fuzz.target import Escape, Target, only_project_errors

T = TypeVar("T")

# --- shapes ---------------------------------------------------------------------------------

# Keywords whose value is a schema (or holds one), each wrapping a reference to the next link.
REF_LINKS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "properties": lambda ref: {"type": "object", "properties": {"next": ref}},
    "required-property": lambda ref: {"type": "object", "properties": {"next": ref},
                                      "required": ["next"]},
    "items": lambda ref: {"type": "array", "items": ref},
    "prefixItems": lambda ref: {"type": "array", "prefixItems": [ref]},
    "additionalProperties": lambda ref: {"type": "object", "additionalProperties": ref},
    "patternProperties": lambda ref: {"type": "object", "patternProperties": {"^n": ref}},
    "anyOf": lambda ref: {"anyOf": [ref, {"type": "null"}]},
    "allOf": lambda ref: {"allOf": [ref]},
    "bare": lambda ref: ref,
    "sibling": lambda ref: {"type": "object", **ref},
}


def ref_chain(length: int, link: str, defs_key: str = "$defs",
              nesting: int = 0) -> dict[str, Any]:
    """A schema whose `length` definitions each refer to the next through `link`, each
    reference `nesting` objects deep inside its definition."""
    def body(index: int) -> dict[str, Any]:
        inner: dict[str, Any] = {"$ref": f"#/{defs_key}/n{index + 1}"}
        for _ in range(nesting):
            inner = {"type": "object", "properties": {"in": inner}, "required": ["in"]}
        return REF_LINKS[link](inner)

    defs = {f"n{index}": body(index) for index in range(length)}
    defs[f"n{length}"] = {"type": "integer"}
    return {"$ref": f"#/{defs_key}/n0", defs_key: defs}


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "boolean"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


def lark_rule_chain(length: int, groups: int = 0, terminals: bool = False) -> str:
    """`length` rules (or terminals), each referring to the next inside `groups` parentheses."""
    name = "T" if terminals else "r"
    lines = [f"start: {name}0"]
    for index in range(length):
        lines.append(f'{name}{index}: ' + "(" * groups + f'"a" {name}{index + 1}' + ")" * groups)
    lines.append(f'{name}{length}: "z"')
    return "\n".join(lines)


def gbnf_rule_chain(length: int) -> str:
    lines = ["root ::= r0"] + [f'r{index} ::= "a" r{index + 1}' for index in range(length)]
    return "\n".join([*lines, f'r{length} ::= "z"'])


def lark_json_block(schema: dict[str, Any]) -> str:
    return "start: %json " + json.dumps(schema)


# --- cases ----------------------------------------------------------------------------------

# Chain lengths around the old crash points (about 900 references, 2,700 rules on an 8 MiB
# stack) and the bound (16,384 levels).
_lengths = st.one_of(st.integers(1, 60), st.sampled_from([800, 1_200, 2_500, 5_000, 9_000]))
_counts = st.one_of(st.integers(0, 50), st.sampled_from([1_000, 20_000, 100_000, 10**6]))
_letters = st.sampled_from("abxyz09 {}()[]\\\":|*")
_long_text = st.builds(lambda char, count: char * count, _letters,
                       st.sampled_from([1, 100, 5_000, 60_000, 200_000]))
_words = st.text(max_size=12)

_schema_leaf = st.one_of(
    st.just({}),
    st.builds(lambda kind: {"type": kind},
              st.sampled_from(["string", "integer", "number", "boolean", "null", "object",
                               "array", "nope"])),
    st.builds(lambda text: {"const": text}, st.one_of(_long_text, _words)),
    st.builds(lambda texts: {"enum": texts}, st.lists(st.one_of(_long_text, _words),
                                                       min_size=1, max_size=3)),
    st.builds(lambda key, count: {"type": "string", key: count},
              st.sampled_from(["minLength", "maxLength"]), _counts),
    st.builds(lambda pattern: {"type": "string", "pattern": pattern}, st.text(max_size=20)),
    st.builds(lambda count: {"type": "array", "items": {"const": 1}, "minItems": count}, _counts),
)
schemas = st.one_of(
    st.recursive(_schema_leaf, lambda inner: st.one_of(
        st.builds(lambda props: {"type": "object", "properties": props,
                                 "required": list(props)},
                  st.dictionaries(_words, inner, max_size=3)),
        st.builds(lambda item: {"type": "array", "items": item}, inner),
        st.builds(lambda options: {"anyOf": options}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda options: {"allOf": options}, st.lists(inner, min_size=1, max_size=2)),
    ), max_leaves=8),
    st.builds(ref_chain, _lengths, st.sampled_from(sorted(REF_LINKS)),
              st.sampled_from(["$defs", "definitions"]), st.sampled_from([0, 1, 20, 60])),
    st.builds(nested_schema, st.sampled_from([1, 40, 99, 101, 130])),
)
_literals = st.builds(lambda char, count: char * count, st.sampled_from("abxyz09 "),
                      st.sampled_from([1, 100, 5_000, 60_000, 200_000]))
_regex_atoms = st.one_of(
    _literals, st.sampled_from(["[a-z]", "\\w", "\\d", ".", "(a|b)", "\\p{L}", "\\{"]),
)
regexes = st.one_of(
    st.recursive(_regex_atoms, lambda inner: st.one_of(
        st.builds(lambda a, b: a + b, inner, inner),
        st.builds(lambda a, b: f"({a}|{b})", inner, inner),
        st.builds(lambda a, count: f"({a}){{{count}}}", inner, _counts),
        st.builds(lambda a, low, high: f"({a}){{{low},{low + high}}}", inner, _counts, _counts),
        st.builds(lambda a, depth: "(" * depth + a + ")" * depth, inner,
                  st.sampled_from([1, 100, 249, 300])),
    ), max_leaves=4),
    st.text(max_size=30),
)
grammars = st.one_of(
    st.builds(lark_rule_chain, _lengths, st.sampled_from([0, 1, 29, 31]), st.booleans()),
    st.builds(gbnf_rule_chain, _lengths),
    st.builds(lark_json_block, schemas),
    st.builds(lambda regex: f"start: /{regex}/", regexes),
    st.builds(lambda text: 'start: "' + text.replace('"', "") + '"', _long_text),
    st.builds(lambda count: "\n" * count + "x", st.sampled_from([1, 1_000, 200_000])),
    st.text(max_size=40),
)
choices = st.lists(st.one_of(_long_text, _words), min_size=1, max_size=5)

cases = st.one_of(
    st.builds(lambda schema: {"json_schema": schema}, schemas),
    st.builds(lambda regex: {"regex": regex}, regexes),
    st.builds(lambda grammar: {"grammar": grammar}, grammars),
    st.builds(lambda options: {"choice": options}, choices),
    st.just({"json_object": True}),
).flatmap(lambda fields: st.builds(lambda fast: {**fields, "fast_forward": fast},
                                   st.booleans()))

# --- the check ------------------------------------------------------------------------------

PROMPT = "Answer:"
BYSTANDER_PROMPT = "Once upon a time"
MAX_TOKENS = 40
WORST_STALL = {"ms": 0.0, "case": ""}


def check(fields: dict[str, Any]) -> str:
    with only_project_errors(_shown(fields)) as outcome:
        structured = StructuredOutput(**fields)
        outcome[0] = _ENGINE.run(partial(_run_case, structured, _shown(fields)))
    return outcome[0]


async def _run_case(structured: StructuredOutput, shown: str, engine: Engine,
                    solo: tuple[int, ...]) -> str:
    bystander: list[tuple[int, ...]] = []

    async def plain() -> None:
        answer = await engine.complete(BYSTANDER_PROMPT, _greedy(None))
        bystander.append(answer.token_ids)

    answer: Completion | Q4KError
    async with watch_loop() as watch:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(plain)
            try:
                answer = await engine.complete(PROMPT, _greedy(structured))
            except Q4KError as exc:
                answer = exc
    if isinstance(answer, Q4KError):
        if "step failed" in str(answer):
            raise Escape(f"a constraint's failure reported as a step's: {answer} <- {shown}")
        outcome = type(answer).__name__
    else:
        outcome = f"ok ({answer.finish_reason})"
        if answer.finish_reason == "stop" and not await engine._compiles.run(
                partial(_accepts, engine, structured, answer.token_ids)):
            raise Escape(f"finish 'stop' with text its constraint refuses: "
                         f"{answer.text!r:.200} <- {shown}")
    if bystander != [solo]:
        raise Escape(f"the plain request beside it got {bystander}, alone {solo} <- {shown}")
    if watch.worst_stall_ms > WORST_STALL["ms"]:
        WORST_STALL.update(ms=watch.worst_stall_ms, case=shown)
    return outcome


def _accepts(engine: Engine, structured: StructuredOutput, tokens: tuple[int, ...]) -> bool:
    """Whether a fresh matcher (llguidance's default limits) takes `tokens` as a complete
    answer. In a compile thread: its compile recurses as deep as the engine's did."""
    import llguidance

    from actors.structured import _grammar_text

    grammars = engine._grammars
    matcher = llguidance.LLMatcher(grammars.grammar_tokenizer(), _grammar_text(structured),
                                   log_level=0)
    return matcher.consume_tokens(list(tokens)) and (matcher.is_accepting()
                                                     or matcher.is_stopped())


def _greedy(structured: StructuredOutput | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured=structured)


def _shown(fields: dict[str, Any]) -> str:
    """A case in a few hundred characters (its values can be megabytes)."""
    return repr({name: (f"<{type(value).__name__} of {len(value):,}>"
                        if isinstance(value, str | list | dict) and len(repr(value)) > 200
                        else value) for name, value in fields.items()})


class _SharedEngine:
    """One engine for every case, serving on an event loop in a daemon thread of its own
    (opening one per case would cost more than the cases)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: Engine | None = None
        self._solo: tuple[int, ...] = ()

    def run(self, case: Callable[[Engine, tuple[int, ...]], Awaitable[T]]) -> T:
        with self._lock:
            if self._loop is None:
                self._start()
        assert self._loop is not None and self._engine is not None
        return asyncio.run_coroutine_threadsafe(case(self._engine, self._solo),
                                                self._loop).result()

    def _start(self) -> None:
        ready: Future[None] = Future()

        async def serve() -> None:
            try:
                async with Engine.open(TINY_MODELS["llama-q4k-tiny"], backend="cpu") as engine:
                    self._solo = (await engine.complete(BYSTANDER_PROMPT,
                                                        _greedy(None))).token_ids
                    self._engine, self._loop = engine, asyncio.get_running_loop()
                    ready.set_result(None)
                    await anyio.sleep_forever()
            except Exception as exc:  # the case that started it raises it
                if not ready.done():
                    ready.set_exception(exc)

        threading.Thread(target=anyio.run, args=(serve,), name="fuzz-engine",
                         daemon=True).start()
        ready.result()


_ENGINE = _SharedEngine()

TARGET = Target("structured-output constraints (schemas, regexes, grammars)", cases, check)
