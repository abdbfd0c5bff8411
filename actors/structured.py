"""Structured output: a request's `StructuredOutput` enforced token by token with llguidance.

llguidance (the constraint engine llama.cpp and vLLM use) turns a JSON schema, a regex, a list
of choices or a Lark grammar into a matcher that, after each token, says which tokens may come
next, as a bitmask over the vocabulary (bit t % 32 of int32 word t // 32: token t allowed), and
which tokens the grammar forces outright (a JSON key, a closing brace).

- `GrammarCompiler` (one per engine) builds llguidance's tokenizer from the GGUF vocabulary
  itself, once, on first use (`Engine.open` asks for it before serving: 0.7 s for a 49k
  vocabulary, 1.3 s for 262k, holding the GIL), and compiles each request's constraint into
  a `Constraint`. Both block: run them on `CompileThreads`, which gives each compile a thread
  whose stack fits the deepest grammar the bounds below admit, and at most `COMPILE_THREADS`
  at once.
- A `Constraint` lives in its sequence's sampling state. Its `allowed` mask travels to the
  backend in `RowInputs`, which masks the row before penalties and candidates. Once the
  step's token is chosen, `Constraint.advance` (in a constraint worker's thread, off the
  shared step: actors.sampling.constraints) feeds it to the matcher, takes the tokens the
  grammar then forces (fast-forward) and computes the next mask; when the request ends, a
  worker also `release`s the matcher (freeing a large one takes tens of milliseconds).

What a constraint may cost is bounded before and while it runs:

- llguidance compiles by recursion, one level per nested schema object, `$ref` followed,
  grammar rule or group: `_schema_depth` and `_grammar_depth` bound that from the source
  alone (counts never below the real depth), `MAX_COMPILE_DEPTH` bounds those, and the
  compile thread's stack fits the bound (measured: at most 5.7 KiB a level;
  `_STACK_PER_LEVEL` is twice that).
- `PARSER_LIMITS` bound the lexer's work and memory per mask (its fuel and states): a matcher
  that reaches them is in an error state, which ends the request with `InvalidRequest`.
- Forced text is taken a bounded piece at a time (`MAX_FORCED_BYTES` a step, never more
  tokens than the answer has left), so a constraint that forces a megabyte never tokenizes it
  on one call; the masks (and the forced-byte walk inside them) run without the GIL.
"""

from __future__ import annotations

import _thread
import asyncio
import copy
import json
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import msgspec
import numpy as np

from actors.errors import EngineClosed, EngineOverloaded, InvalidRequest
from actors.heap import release_free_memory
from actors.logs import get_logger
from actors.model.candidates import mask_words
from actors.model.text.vocab import ATTR_CONTROL, ATTR_USER_DEFINED
from actors.params import StructuredOutput

T = TypeVar("T")

# llguidance marks a special token by a 0xff byte before its text, which no UTF-8 text holds:
# a grammar's text can then never produce it by accident.
_SPECIAL_MARK = b"\xff"

# --- bounds ---------------------------------------------------------------------------------

# Containers a JSON schema may nest (llguidance's JSON reader stops at 124 under its wrapper).
MAX_SCHEMA_NESTING = 100
# Levels of llguidance's compile recursion a constraint may need (as `_schema_depth` and
# `_grammar_depth` count them): far above real schemas and grammars (a 1,000-property schema:
# about 1,000; a tool-call grammar of 128 functions: under 1,000). It bounds the compile's
# memory too: the costliest shape measured (references to objects nested 45 deep) took
# 11 KiB a level, 90 MB at the bound.
MAX_COMPILE_DEPTH = 8_192
# Stack per level, twice the most measured (5.7 KiB: a `$ref` chain whose targets each nest
# 60 objects), plus room for the first mask and Python's own frames: 160 MiB of address space,
# of which only what a compile touches is ever memory.
_STACK_PER_LEVEL = 12 << 10
COMPILE_STACK_BYTES = MAX_COMPILE_DEPTH * _STACK_PER_LEVEL + (64 << 20)
# A GBNF grammar is converted to Lark by llguidance's Python converter, whose work grows with
# rules x characters (6,000 rules of 118 KB took 21 s; it holds the GIL as Python does, which
# the event loop then waits for): this product bounds it to about 0.1 s. (llama.cpp's JSON
# grammar is 30 rules of 1.5 KB: 45k.)
MAX_GBNF_WORK = 1 << 22
# Compiles running at once: each holds a core, and parts of each hold the GIL (reading the
# grammar: ~20 ms a 300 KB schema), so half the cores, leaving the rest to the steps and
# the event loop. And how long a request waits for its own compile.
COMPILE_THREADS = max(1, (os.cpu_count() or 2) // 2)
COMPILE_SECONDS = 20.0
# llguidance's parser limits, below its defaults where those let one request take seconds of
# CPU or hundreds of MB. Lexer fuel (about 4 a forced byte, ~120 bytes of memory each) bounds
# the compile's lexer and the first mask (whose walk of the forced text its default, 1M, let
# reach 250 KB: 1.2 s and 120 MB), then each later mask (the default 200k: 50 KB); a
# constraint that forces more text at once than its fuel allows fails with InvalidRequest.
# These still serve 1,000-property schemas and the wide Unicode regexes measured on gemma-3's
# vocabulary. Lexer states cost 1-2 KB each (the default 250k: up to 500 MB a request).
# Errors leave out the parser's state and the grammar (the request's error says what failed).
PARSER_LIMITS = {
    "initial_lexer_fuel": 200_000,
    "step_lexer_fuel": 50_000,
    "max_lexer_states": 50_000,
    "verbose_errors": False,
}
# llguidance's token "slices": for each, the vocabulary's tokens that match the regex, as a
# trie of their own, so a mask whose lexer allows that whole regex takes the slice at once
# instead of walking every token. Each costs about 17 MB for a 262k-token vocabulary. Kept:
# the text of a JSON string of any length, what a schema's "string" property lets a model
# write (a mask inside one: 0.02 ms instead of 3 ms on gemma-3). Left out of llguidance's
# defaults: whitespace runs (JSON here is written without free whitespace) and strings of at
# most 10 or 30 characters (a `maxLength` string's masks walk the vocabulary: 3 ms).
GRAMMAR_SLICES = (r'[^"\\\x00-\x1F\x7F]+',)
# Forced text taken per step: a larger run is tokenized this much at a time.
MAX_FORCED_BYTES = 4096
# Characters of llguidance's error kept in the request's error.
MAX_ERROR_CHARS = 600


class Advanced(msgspec.Struct, frozen=True):
    """What a constrained row's token did: the tokens the grammar forces after it (already
    consumed), whether the grammar is complete, or why the constraint failed."""

    forced: tuple[int, ...] = ()
    done: bool = False
    error: str | None = None


class Constraint:
    """One sequence's llguidance matcher, the bitmask of the tokens allowed next, and how many
    tokens the answer has left (forced tokens past it would never be used). `start()` it,
    then `advance()` it token by token, then `release()` it, all off the event loop."""

    def __init__(self, matcher: Any, grammar_tokenizer: Any, vocab_size: int,
                 fast_forward: bool, budget: int) -> None:
        self._matcher = matcher
        self._grammar_tokenizer = grammar_tokenizer
        self._words = mask_words(vocab_size)
        self.fast_forward = fast_forward
        self._left = budget
        self.allowed = np.zeros(self._words, dtype=np.int32)
        self.done = False
        self.leading: tuple[int, ...] = ()

    def start(self) -> Advanced:
        """The first mask, after what the grammar forces before any choice (a schema's
        `{"first_key": `): `leading`, which joins the prompt's prefill, leaving room for the
        model's first token. In the compiling thread: the step after the prompt needs both."""
        first = self._settle(self._matcher, spare=1)
        self.leading = first.forced
        return first

    def advance(self, token: int) -> Advanced:
        """Consume the chosen `token`, then the tokens forced after it (fast-forward), and
        compute the next mask. Blocks (the masks run without the GIL): a worker thread."""
        matcher = self._matcher
        if matcher is None:
            return Advanced(error="the structured output constraint was released")
        if not matcher.consume_token(token):
            return Advanced(error=_failure(matcher, f"refused token {token}"))
        self._left -= 1
        return self._settle(matcher, spare=0)

    def copy(self) -> Constraint:
        """A second constraint in this one's state, for another answer to the same prompt:
        its matcher copied (llguidance's `deep_copy`), not compiled again. Off the event loop,
        as a compile."""
        twin = copy.copy(self)
        twin._matcher = self._matcher.deep_copy()
        twin.allowed = self.allowed.copy()
        return twin

    def release(self) -> None:
        """Let go of the matcher in this thread: freeing a large grammar's takes long enough
        (tens of milliseconds, with the GIL) that it must not happen on the event loop."""
        self._matcher = None

    def _settle(self, matcher: Any, spare: int) -> Advanced:
        """After the last consumed token: the forced tokens (consumed, at most the answer's
        room less `spare`) and the next mask (a complete grammar's allows only the end)."""
        forced: tuple[int, ...] = ()
        mask = None
        if self.fast_forward and not matcher.is_stopped() and not matcher.is_error():
            # The mask also walks the bytes the grammar forces (without the GIL), so taking
            # them afterwards costs no more than their tokenization.
            mask = self._mask(matcher)
            forced = self._forced(matcher, self._left - spare)
            if forced and not matcher.consume_tokens(list(forced)):
                return Advanced(error=_failure(matcher, "refused its own forced tokens"))
            self._left -= len(forced)
        if forced or mask is None:
            mask = self._mask(matcher)
        if matcher.is_error():
            return Advanced(error=_failure(matcher, "failed"))
        # A fresh array each time: the step that used the old mask may still hold it.
        self.allowed = mask
        self.done = matcher.is_stopped()
        return Advanced(forced=forced, done=self.done)

    def _mask(self, matcher: Any) -> np.ndarray:
        mask = np.zeros(self._words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return mask

    def _forced(self, matcher: Any, room: int) -> tuple[int, ...]:
        """The forced tokens to take now: at most `room`, from at most `MAX_FORCED_BYTES` of
        the forced text."""
        if room <= 0:
            return ()
        forced_bytes = matcher.compute_ff_bytes()
        if not forced_bytes:
            return ()
        if len(forced_bytes) <= MAX_FORCED_BYTES:
            tokens = matcher.compute_ff_tokens()
        else:
            # The tokens of a prefix that later bytes cannot change; the rest is forced again.
            tokens, _ = self._grammar_tokenizer.tokenize_partial(forced_bytes[:MAX_FORCED_BYTES])
        return tuple(tokens[:room])


def _failure(matcher: Any, what: str) -> str:
    """Why `matcher` (in its error state, or refusing `what`) failed, on one line."""
    error = _one_line(matcher.get_error())
    limits = matcher.stop_reason() in _LIMIT_REASONS or "too many" in error.lower()
    hint = (" (it reached the engine's parser limits, actors.structured.PARSER_LIMITS: it "
            "forces more text at once, or needs more lexer work, than they allow; simplify "
            "it)" if limits else "")
    return f"the structured output constraint {what}{hint}: {error}"


# llguidance's stop reasons for a matcher that ran into its limits (running out of lexer fuel
# or Earley items is an error whose message says "too many expressions constructed", "too
# many items").
_LIMIT_REASONS = ("LexerTooComplex", "ParserTooComplex", "MaxTokensTotal", "MaxTokensParser")


class GrammarCompiler:
    """Compiles requests' constraints for one model's tokenizer (thread-safe, blocking)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._built: Any = None

    @property
    def ready(self) -> bool:
        """Whether llguidance's tokenizer is built (until then a compile first builds it)."""
        return self._built is not None

    def constraint(self, structured: StructuredOutput, budget: int) -> Constraint:
        """A ready `Constraint` for an answer of at most `budget` tokens (first mask computed,
        the forced start taken); `InvalidRequest` naming the field if the schema, regex or
        grammar is past the bounds or does not compile. Needs a `CompileThreads` thread."""
        import llguidance

        field = f"structured.{structured.kind}"
        if structured.kind == "json_schema":  # checked before llguidance reads it
            _check_compile_depth(structured.kind, _schema_depth(structured.json_schema))
        grammar = _grammar_text(structured)
        if structured.kind == "grammar":  # a GBNF grammar is measured once converted
            _check_compile_depth(structured.kind, _grammar_depth(grammar))
        matcher = llguidance.LLMatcher(self.grammar_tokenizer(), grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(**PARSER_LIMITS))
        # No matcher may outlive a failure here: an exception's frames would keep it alive
        # until the event loop frees the exception, and freeing a large one takes a while.
        if matcher.is_error():
            error = f"{structured.kind} does not compile: {_one_line(matcher.get_error())}"
            del matcher
            raise InvalidRequest(error, field=field)
        constraint = Constraint(matcher, self.grammar_tokenizer(), self._tokenizer.vocab_size,
                                structured.fast_forward, budget)
        del matcher
        first = constraint.start()
        if first.error is not None:
            constraint.release()
            raise InvalidRequest(first.error, field=field)
        return constraint

    def grammar_tokenizer(self) -> Any:
        """llguidance's tokenizer over this model's vocabulary, built on first use."""
        with self._lock:
            if self._built is None:
                started = time.perf_counter()
                self._built = _build_grammar_tokenizer(self._tokenizer)
                get_logger("actors.structured").info(
                    "grammar_tokenizer_built", vocab_size=self._tokenizer.vocab_size,
                    ms=round((time.perf_counter() - started) * 1000.0, 1),
                )
            return self._built


# --- the compile recursion's depth ----------------------------------------------------------


def _check_compile_depth(kind: str, depth: int) -> None:
    """`InvalidRequest` when llguidance's compile recursion may go `depth` levels deep, past
    what the compile thread's stack is sized for. (A regex, a list of choices or any JSON
    object compiles flat: a regex's parser refuses groups nested past 250.)"""
    if depth > MAX_COMPILE_DEPTH:
        raise InvalidRequest(
            f"{kind} may need {depth:,} levels of nesting to compile (nested objects, $ref "
            f"chains, rules and groups); at most {MAX_COMPILE_DEPTH:,} are allowed",
            field=f"structured.{kind}")


def _schema_depth(schema: Any, kind: str = "json_schema") -> int:
    """An upper bound on a JSON schema's compile recursion, which goes through nested schema
    objects and into each `$ref`'s target, compiling a target once: a path holds every object
    at most once, plus once more per distinct reference (N + R), and it is at most R + 1
    stretches of nesting no deeper than the document's ((R + 1) x D). `InvalidRequest` for a
    schema nested past `MAX_SCHEMA_NESTING` (naming `kind`, the field that holds it). Linear
    in the schema, and it keeps nothing of it
    (a copy of a large schema would set off the garbage collector's full passes, which hold
    the GIL); the built-in types' own methods read it, whatever a subclass overrides."""
    objects = 0
    deepest_object = 0
    refs: set[str] = set()
    stack = [(schema, 1, 1)]
    while stack:
        value, depth, object_depth = stack.pop()
        if depth > MAX_SCHEMA_NESTING:
            raise _nested_too_deep(kind)
        if isinstance(value, dict):
            objects += 1
            deepest_object = max(deepest_object, object_depth)
            ref = dict.get(value, "$ref")
            if isinstance(ref, str):
                refs.add(ref)
            children = dict.values(value)
            object_depth += 1
        elif isinstance(value, list | tuple):
            children = value
        else:
            continue
        for child in children:
            if isinstance(child, dict | list | tuple):
                stack.append((child, depth + 1, object_depth))
    return min(objects + len(refs), (len(refs) + 1) * deepest_object)


def _nested_too_deep(kind: str) -> InvalidRequest:
    what = "json_schema" if kind == "json_schema" else f"a %json schema in the {kind}"
    return InvalidRequest(
        f"{what} nests more than {MAX_SCHEMA_NESTING} levels of objects and arrays",
        field=f"structured.{kind}")


def _grammar_depth(grammar: str) -> int:
    """An upper bound on a Lark grammar's compile recursion, which recurses into each rule and
    terminal it references (each compiled once: every definition has a colon) and through
    each group (`(`, `[`; a `{` counts twice); each `%json` schema inside is measured as a
    schema (`_schema_depth`), its own objects and references added."""
    depth = 1
    lark_end = 0
    for block in _JSON_BLOCK.finditer(grammar):
        if block.start() < lark_end:
            continue  # inside the schema just measured
        try:
            schema, schema_end = _JSON.raw_decode(grammar, block.end())
        except RecursionError:
            raise _nested_too_deep("grammar") from None
        except ValueError:
            continue  # not JSON: counted as Lark text, which counts more
        depth += _lark_depth(grammar[lark_end:block.start()]) + _schema_depth(schema, "grammar")
        lark_end = schema_end
    return depth + _lark_depth(grammar[lark_end:])


def _lark_depth(text: str) -> int:
    return text.count(":") + text.count("(") + text.count("[") + 2 * text.count("{")


_JSON_BLOCK = re.compile(r"%json\s*")
_JSON = json.JSONDecoder()


# --- compile threads ------------------------------------------------------------------------


class CompileThreads:
    """Runs compiles on the event loop's behalf, each in a new thread whose stack is
    `COMPILE_STACK_BYTES`, at most `limit` at once; the others wait their turn in order.

    A caller that stops waiting (cancelled, past its deadline, or `close()`d) leaves its
    compile running alone: llguidance cannot be interrupted, so it is bounded by the parser
    limits instead, and it holds its place in `limit` until it ends. A compile still waiting
    for its turn never starts."""

    def __init__(self, limit: int = COMPILE_THREADS) -> None:
        self._limit = limit
        self._running = 0
        self._turns: deque[asyncio.Future[None]] = deque()
        self._results: set[asyncio.Future[Any]] = set()
        self._closed = False
        self._idle: asyncio.Future[None] | None = None

    async def run(self, work: Callable[[], T], timeout_s: float | None = None) -> T:
        """`work()`'s result or exception; `TimeoutError` once `timeout_s` passed since it
        started, `EngineClosed` once closed, `EngineOverloaded` if no thread can start."""
        self._check_open()
        await self._turn()
        loop = asyncio.get_running_loop()
        result: asyncio.Future[T] = loop.create_future()
        try:
            _start_deep_thread(self._work, work, result, loop)
        except RuntimeError as exc:  # no thread can start: the machine is out of them
            self._finished()
            raise EngineOverloaded(f"no thread could start for a compile: {exc}") from None
        self._results.add(result)
        try:
            with anyio.fail_after(timeout_s):
                return await result
        finally:
            self._results.discard(result)

    def close(self) -> None:
        """Every caller waiting (for a turn or a result) raises EngineClosed now; running
        compiles end on their own."""
        self._closed = True
        for future in (*self._turns, *self._results):
            if not future.done():
                future.set_exception(
                    EngineClosed("the engine closed while this request's constraint compiled"))
        self._turns.clear()

    async def wait_idle(self) -> None:
        """Until no compile runs (after `close()`, none starts again)."""
        while self._running:
            self._idle = asyncio.get_running_loop().create_future()
            await self._idle

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("this engine is closed; open a new one")

    async def _turn(self) -> None:
        if self._running < self._limit and not self._turns:
            self._running += 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._turns.append(turn)
        try:
            await turn  # `_finished` counts the turn it gives as running
        except BaseException:
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self._finished()  # given a turn, then cancelled: pass it on
            elif turn in self._turns:
                self._turns.remove(turn)
            raise

    def _work(self, work: Callable[[], T], result: asyncio.Future[T],
              loop: asyncio.AbstractEventLoop) -> None:
        """In the compile thread: run `work` and hand its outcome to the loop (or drop it
        here if its caller stopped waiting: freeing a matcher is not the loop's work)."""
        try:
            outcome: tuple[bool, Any] = (True, work())
        except BaseException as exc:  # raised on the loop, for the caller
            outcome = (False, exc)
        if result.done():
            outcome = (False, None)
        try:
            loop.call_soon_threadsafe(self._deliver, result, outcome)
        except RuntimeError:
            pass  # the event loop is gone: nobody waits for this compile

    def _deliver(self, result: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
        self._finished()
        if result.done():  # its caller stopped waiting
            return
        ok, value = outcome
        if ok:
            result.set_result(value)
        else:
            result.set_exception(value)

    def _finished(self) -> None:
        """A running compile ended: give its turn to the next caller still waiting."""
        while self._turns:
            turn = self._turns.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._running -= 1
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)


_stack_size_lock = threading.Lock()


def _start_deep_thread(target: Callable[..., None], *args: Any) -> None:
    """Run `target(*args)` in a new thread with a `COMPILE_STACK_BYTES` stack (the size is
    process-wide while a thread starts, so it is set and restored under a lock). A bare
    thread: `threading.Thread.start` would wait, on the event loop, until the new thread
    gets the GIL, which busy threads can hold for a while."""
    with _stack_size_lock:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            _thread.start_new_thread(target, args)
        finally:
            threading.stack_size(previous)


# --- grammar text ---------------------------------------------------------------------------

# JSON written as `json.dumps` writes it, `{"a": 1, "b": [2, 3]}`: models write it so, and
# no whitespace elsewhere, or a model can fill its budget with blank lines between tokens. A
# schema's own "x-guidance" options override these.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# What llguidance's converter takes for Lark rather than GBNF: a line that starts (after
# blanks) with `%llguidance` or a `start` rule. Blanks exclude the newline, so each line
# start is tried once (`^\s*` also matched newlines: quadratic on a text of blank lines).
_LARK_SYNTAX = re.compile(r"(?m)^[^\S\n]*(?:%llguidance\b|start\s*:)")


# Where llguidance's error gives way to its parser state (or says it leaves it out).
_ERROR_TAIL = re.compile(r"<state>|<non-verbose/>")


def _one_line(error: str) -> str:
    """llguidance's error on one line, without the parser state and grammar it appends and
    the caret lines of its source excerpts, cut to `MAX_ERROR_CHARS` (it may quote a whole
    regex or grammar: a megabyte to log and send back)."""
    head = _ERROR_TAIL.split(error[: 4 * MAX_ERROR_CHARS], maxsplit=1)[0]
    lines = (line.strip() for line in head.splitlines())
    text = " ".join(line for line in lines if line.strip("^ "))
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar of a constraint (compiled against the tokenizer later)."""
    import llguidance

    kind = structured.kind
    try:
        if kind in ("json_schema", "json_object"):
            schema = structured.json_schema if kind == "json_schema" else {"type": "object"}
            return _json_schema_grammar(schema)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(structured.choice or ()))
        if kind == "regex":
            return llguidance.grammar_from("regex", structured.regex or "")
        return llguidance.LLMatcher.grammar_from_lark(_lark(structured.grammar or ""))
    except ValueError as error:
        raise InvalidRequest(f"{kind} is not valid: {error}", field=f"structured.{kind}") from None


def _json_schema_grammar(schema: dict[str, Any]) -> str:
    """llguidance's grammar of a JSON schema, as `LLMatcher.grammar_from_json_schema` writes
    it with `JSON_LAYOUT` as defaults under the schema's own "x-guidance" options, written
    here in one pass (that function parses and writes the schema again holding the GIL: 30 ms
    a megabyte the event loop waits through)."""
    options = dict.get(schema, "x-guidance", {})
    if not isinstance(options, dict):
        raise ValueError("x-guidance must be an object of JSON compile options")
    grammar = {"name": "json_schema", "json_schema": {**schema, "x-guidance": {
        **JSON_LAYOUT, **options}}, "lark_grammar": None}
    return msgspec.json.encode({"grammars": [grammar], "max_tokens": None}).decode()


def _lark(grammar: str) -> str:
    """A grammar in Lark syntax: as it is, or converted from llama.cpp's GBNF (`::=` rules)
    once its size is known to bound the conversion's work."""
    if _LARK_SYNTAX.search(grammar):
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    rules = grammar.count("::=")
    if (rules + 1) * len(grammar) > MAX_GBNF_WORK:
        raise InvalidRequest(
            f"a GBNF grammar of {rules:,} rules in {len(grammar):,} characters is too large to "
            f"convert (rules x characters must stay under {MAX_GBNF_WORK:,}); write it in "
            "Lark syntax (a `start:` rule), which is compiled without conversion",
            field="structured.grammar")
    try:
        return gbnf_to_lark(grammar)
    except Exception as error:  # the converter raises plain exceptions, RecursionError too
        raise ValueError(f"Failed to convert the grammar from GBNF to Lark: {error}") from None


class _VocabularyView:
    """What llguidance's `TokenizerWrapper` reads from a tokenizer: each token's bytes, the
    special tokens, and an encoder of text (the project's own, identical to llama.cpp's)."""

    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.vocab
        attrs = vocab.attrs.tolist()
        self.tokens = [_token_bytes(tokenizer.piece(token, special=True), attr)
                       for token, attr in enumerate(attrs)]
        self.special_token_ids = [t for t, piece in enumerate(self.tokens)
                                  if piece.startswith(_SPECIAL_MARK)]
        self.bos_token_id = tokenizer.bos_id
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(
            tokenizer.stop_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("the encoder takes text")  # llguidance then hands it str
        return self._tokenizer.encode(text, add_bos=False)


def _token_bytes(piece: bytes, attr: int) -> bytes:
    """A token's bytes as llguidance reads them: control tokens, and user-defined ones that
    look like them (`<...>`), carry the special mark, as llama.cpp's own binding does."""
    looks_special = piece.startswith(b"<") and piece.endswith(b">")
    if attr & ATTR_CONTROL or (attr & ATTR_USER_DEFINED and looks_special):
        return _SPECIAL_MARK + piece
    return piece


def _build_grammar_tokenizer(tokenizer: Any) -> Any:
    import llguidance

    view = _VocabularyView(tokenizer)
    wrapper = llguidance.TokenizerWrapper(view)
    built = llguidance.LLTokenizer(
        wrapper,
        n_vocab=tokenizer.vocab_size,
        # Every end-of-generation token ends a grammar that is complete.
        eos_token=sorted(tokenizer.stop_ids) or [view.eos_token_id],
        slices=list(GRAMMAR_SLICES),
    )
    # llguidance copied the token list; the wrapper it keeps (to call the encoder) need not
    # hold it too.
    view.tokens = wrapper.tokens = []
    del view, wrapper
    release_free_memory()
    return built


__all__ = [
    "COMPILE_SECONDS",
    "JSON_LAYOUT",
    "MAX_COMPILE_DEPTH",
    "PARSER_LIMITS",
    "Advanced",
    "CompileThreads",
    "Constraint",
    "GrammarCompiler",
    "StructuredOutput",
    "mask_words",
]
