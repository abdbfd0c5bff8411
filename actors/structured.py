"""Structured output: a request's `StructuredOutput` enforced token by token with llguidance.

llguidance (the constraint engine llama.cpp and vLLM use) turns a JSON schema, a regex, a list
of choices or a Lark grammar into a matcher that, after each token, says which tokens may come
next, as a bitmask over the vocabulary (bit t % 32 of int32 word t // 32: token t allowed), and
which tokens the grammar forces outright (a JSON key, a closing brace).

- `GrammarCompiler` (one per engine) builds llguidance's tokenizer from the GGUF vocabulary
  itself, once, on the first constrained request (0.7 s for a 49k vocabulary, seconds for
  262k), and compiles each request's constraint into a `Constraint`. Both block: call them in
  a worker thread.
- A `Constraint` lives in its sequence's sampling state. Its `allowed` mask travels to the
  backend in `RowInputs`, which masks the row before penalties and candidates. Once the
  step's token is chosen, `advance_constraints` (in the sampler's thread) feeds it to every
  constrained row of the step, takes the tokens the grammar then forces (fast-forward) and
  computes the next masks of the whole batch at once, in llguidance's own threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from actors.errors import InvalidRequest
from actors.logs import get_logger
from actors.model.candidates import mask_words
from actors.model.text.vocab import ATTR_CONTROL, ATTR_USER_DEFINED
from actors.params import StructuredOutput

# llguidance marks a special token by a 0xff byte before its text, which no UTF-8 text holds:
# a grammar's text can then never produce it by accident.
_SPECIAL_MARK = b"\xff"


class Advanced(msgspec.Struct, frozen=True):
    """What a constrained row's token did: the tokens the grammar forces after it (already
    consumed), whether the grammar is complete, or why the constraint failed."""

    forced: tuple[int, ...] = ()
    done: bool = False
    error: str | None = None


class Constraint:
    """One sequence's llguidance matcher and the bitmask of the tokens allowed next."""

    def __init__(
        self, matcher: Any, vocab_size: int, fast_forward: bool, max_leading: int
    ) -> None:
        self._matcher = matcher
        self.fast_forward = fast_forward
        self.allowed = np.zeros(mask_words(vocab_size), dtype=np.int32)
        # The first mask is computed here, in the compiling thread: the step after the prompt
        # needs it at once.
        # What the grammar forces before any choice (a schema's `{"first_key": `) joins the
        # prompt's prefill, up to `max_leading` tokens (room must stay in the context and the
        # budget for the model's first token); the first mask comes after it.
        self.leading: tuple[int, ...] = ()
        if fast_forward:
            self.leading = tuple(matcher.compute_ff_tokens()[: max(max_leading, 0)])
            if self.leading and not matcher.consume_tokens(list(self.leading)):
                raise InvalidRequest("the structured output constraint refused its own forced "
                                     f"start: {_one_line(matcher.get_error())}",
                                     field="structured")
        matcher.unsafe_compute_mask_ptr(self.allowed.ctypes.data, self.allowed.nbytes)
        self.done = matcher.is_stopped()

    def advance(self, token: int) -> Advanced:
        """Consume the chosen `token` and, with fast-forward on, the tokens forced after it."""
        matcher = self._matcher
        if not matcher.consume_token(token):
            return Advanced(error=f"the structured output constraint refused token {token}: "
                                  f"{_one_line(matcher.get_error())}")
        forced: list[int] = []
        if self.fast_forward and not matcher.is_stopped():
            forced = matcher.compute_ff_tokens()
            if forced and not matcher.consume_tokens(forced):
                return Advanced(error=f"the structured output constraint refused its own "
                                      f"forced tokens: {_one_line(matcher.get_error())}")
        self.done = matcher.is_stopped()
        return Advanced(forced=tuple(forced), done=self.done)


def advance_constraints(
    constraints: Sequence[Constraint], tokens: Sequence[int]
) -> list[Advanced]:
    """Advance each constraint by its row's chosen token, then compute the next masks of all
    that go on in one parallel call (llguidance's threads, without the GIL)."""
    advanced = [c.advance(t) for c, t in zip(constraints, tokens)]
    going_on = [c for c, a in zip(constraints, advanced) if a.error is None and not a.done]
    if going_on:
        masks = np.zeros((len(going_on), going_on[0].allowed.size), dtype=np.int32)
        _executor().unsafe_compute_mask_ptr(
            [(c._matcher, row) for row, c in enumerate(going_on)],
            masks.ctypes.data, masks.shape[1] * 4, masks.shape[0],
        )
        # A fresh array per step: the step that used the old masks may still hold them.
        for row, constraint in enumerate(going_on):
            constraint.allowed = masks[row]
    return advanced


class GrammarCompiler:
    """Compiles requests' constraints for one model's tokenizer (thread-safe, blocking)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._built: Any = None

    def constraint(self, structured: StructuredOutput, max_leading: int) -> Constraint:
        """A ready `Constraint` (first mask computed; at most `max_leading` forced tokens
        before the model's first choice); `InvalidRequest` naming the field if the schema,
        regex or grammar does not compile."""
        import llguidance

        field = f"structured.{structured.kind}"
        matcher = llguidance.LLMatcher(self.grammar_tokenizer(), _grammar_text(structured),
                                       log_level=0)
        if matcher.is_error():
            raise InvalidRequest(
                f"{structured.kind} does not compile: {_one_line(matcher.get_error())}",
                field=field,
            )
        return Constraint(matcher, self._tokenizer.vocab_size, structured.fast_forward,
                          max_leading)

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


# JSON written as `json.dumps` writes it, `{"a": 1, "b": [2, 3]}`: models write it so, and
# no whitespace elsewhere, or a model can fill its budget with blank lines between tokens. A
# schema's own "x-guidance" options override these.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _one_line(error: str) -> str:
    """llguidance's error on one line, without the parser state and grammar it appends and
    the caret lines of its source excerpts."""
    lines = (line.strip() for line in error.split("<state>", 1)[0].splitlines())
    return " ".join(line for line in lines if line.strip("^ "))


def _grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar of a constraint (compiled against the tokenizer later)."""
    import llguidance

    kind = structured.kind
    try:
        if kind in ("json_schema", "json_object"):
            schema = structured.json_schema if kind == "json_schema" else {"type": "object"}
            return llguidance.LLMatcher.grammar_from_json_schema(
                msgspec.json.encode(schema).decode(), defaults=JSON_LAYOUT
            )
        if kind == "choice":
            return llguidance.grammar_from("choice", list(structured.choice or ()))
        if kind == "regex":
            return llguidance.grammar_from("regex", structured.regex or "")
        # Lark as it is; GBNF (llama.cpp's `::=` rules) is converted.
        return llguidance.grammar_from("grammar", structured.grammar or "")
    except ValueError as error:
        raise InvalidRequest(f"{kind} is not valid: {error}", field=f"structured.{kind}") from None


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
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(view),
        n_vocab=tokenizer.vocab_size,
        # Every end-of-generation token ends a grammar that is complete.
        eos_token=sorted(tokenizer.stop_ids) or [view.eos_token_id],
    )


_executor_lock = threading.Lock()
_shared_executor: Any = None


def _executor() -> Any:
    """llguidance's thread pool for batched masks, one per process."""
    global _shared_executor
    with _executor_lock:
        if _shared_executor is None:
            import llguidance

            _shared_executor = llguidance.LLExecutor()
        return _shared_executor


__all__ = [
    "JSON_LAYOUT",
    "Advanced",
    "Constraint",
    "GrammarCompiler",
    "StructuredOutput",
    "advance_constraints",
    "mask_words",
]
