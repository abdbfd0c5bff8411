"""Reasoning kept apart: what a thinking model writes between its reasoning markers (`<think>`
... `</think>`; Magistral's `[THINK]` ... `[/THINK]`) is a chat answer's `reasoning`, never its
text.

The markers are decided once per chat request, from the template that renders it and the
model's vocabulary (`reasoning_markers`): the first pair of `KNOWN_MARKERS` whose end marker
the template names and whose start and end are each one token of the vocabulary (a special
token, or an ordinary one: as the template's own text tokenizes). Otherwise nothing is
separated. Where the answer begins follows from the rendered prompt (`opening_phase`):

- the prompt's last marker is a start marker (the template opened the reasoning, as
  DeepSeek-R1 distills' and newer Qwen3 templates end their generation prompt with
  `<think>\\n`): the answer begins inside its reasoning;
- the prompt ends with an end marker and whitespace (the template closed it: Qwen3 with
  `enable_thinking: false` writes an empty `<think>\\n\\n</think>\\n\\n`): the answer is all
  content;
- otherwise the answer may open its reasoning with a start marker as its first token.

Reasoning text is trimmed of the whitespace around it, and the content that follows it of its
leading whitespace; the markers belong to neither.

A `ReasoningGate` is the sequence's constraint (in place of, and around, its structured-output
`Constraint`) when an answer that may reason has a constraint or a reasoning budget: while it
reasons, tokens are free (but for the turn's end, when a constrained answer must follow),
and once `budget` reasoning tokens are spent the end marker is forced; the constraint applies
from the end marker on.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import msgspec
import numpy as np

from actors.model.candidates import mask_words
from actors.structured import Advanced, Constraint

# (start, end) reasoning markers, in the order they are looked for.
KNOWN_MARKERS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))

# Where an answer is: before any text (it may still open reasoning), inside its reasoning, or
# in the answer proper.
OPTIONAL = "optional"
REASONING = "reasoning"
ANSWER = "answer"

# What one token of an answer is.
MARKER = "marker"
CONTENT = "content"


class ReasoningMarkers(msgspec.Struct, frozen=True):
    """The token ids of a model's reasoning markers."""

    start: int
    end: int


def reasoning_markers(template_source: str,
                      tokenize: Callable[[str], list[int]]) -> ReasoningMarkers | None:
    """The reasoning markers of a chat template and vocabulary (see the module docstring);
    `tokenize` reads special tokens as the template's text does. None: it has none."""
    for start, end in KNOWN_MARKERS:
        if end not in template_source:
            continue
        start_ids, end_ids = tokenize(start), tokenize(end)
        if len(start_ids) == 1 and len(end_ids) == 1:
            return ReasoningMarkers(start=start_ids[0], end=end_ids[0])
    return None


def opening_phase(markers: ReasoningMarkers, prompt_ids: Sequence[int],
                  decode: Callable[[Sequence[int]], str]) -> str:
    """Where the answer to a rendered prompt begins: REASONING, ANSWER or OPTIONAL (see the
    module docstring)."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    hits = np.flatnonzero((ids == markers.start) | (ids == markers.end))
    if not hits.size:
        return OPTIONAL
    last = int(hits[-1])
    if ids[last] == markers.start:
        return REASONING
    return ANSWER if not decode(list(prompt_ids[last + 1:])).strip() else OPTIONAL


class ChatReasoning(msgspec.Struct, frozen=True):
    """A chat request's reasoning, decided once its prompt is rendered: its markers, where its
    answer begins (`opening_phase`), and its budget of reasoning tokens (None: none)."""

    markers: ReasoningMarkers
    phase: str
    budget: int | None = None

    def text(self, tokenizer: Any) -> ReasoningText:
        return ReasoningText(self.markers, self.phase, tokenizer)

    def gate(self, answer: Constraint | None, stop_ids: Collection[int],
             vocab_size: int) -> ReasoningGate:
        return ReasoningGate(self.markers, self.phase, answer, self.budget, stop_ids, vocab_size)


class ReasoningPhase:
    """An answer's phase, followed token by token: `take` says what each token is."""

    def __init__(self, markers: ReasoningMarkers, phase: str) -> None:
        self.markers = markers
        self.phase = phase

    def take(self, token: int) -> str:
        """MARKER (it opens or closes the reasoning), REASONING or CONTENT."""
        if self.phase == REASONING:
            if token == self.markers.end:
                self.phase = ANSWER
                return MARKER
            return REASONING
        if self.phase == OPTIONAL:
            if token == self.markers.start:
                self.phase = REASONING
                return MARKER
            self.phase = ANSWER
        return CONTENT


class ReasoningText:
    """The reasoning text of an answer's tokens (the session's side): `take` a token, and get
    the reasoning text it releases, or None for a token of the content."""

    def __init__(self, markers: ReasoningMarkers, phase: str, tokenizer: Any) -> None:
        self._phase = ReasoningPhase(markers, phase)
        self._decoder = tokenizer.incremental_decoder()
        self._began = False  # whether any reasoning text came (its leading blanks do not)
        self._blanks = ""  # whitespace held back: it may end the reasoning
        # The tokens of the reasoning, its markers included.
        self.tokens = 0
        self._content_follows = False  # the reasoning just ended: the content's blanks go

    def take(self, token: int) -> str | None:
        kind = self._phase.take(token)
        if kind == CONTENT:
            return None
        self.tokens += 1
        if kind == REASONING:
            return self._trimmed(self._decoder.push(token))
        if self._phase.phase == ANSWER:  # the end marker
            self._content_follows = True
            return self.flush()
        return ""

    def content(self, text: str) -> str:
        """Content text as it follows the reasoning: without the blanks right after it."""
        if self._content_follows:
            text = text.lstrip()
            self._content_follows = not text
        return text

    def flush(self) -> str:
        """The reasoning text still held, once it ends (its trailing whitespace dropped)."""
        text = self._trimmed(self._decoder.flush())
        self._blanks = ""
        return text

    def _trimmed(self, text: str) -> str:
        if not self._began:
            text = text.lstrip()
            self._began = bool(text)
        text = self._blanks + text
        kept = text.rstrip()
        self._blanks = text[len(kept):]
        return kept


class ReasoningGate:
    """The constraint of an answer that may reason (see the module docstring): `answer` (the
    structured-output constraint, or None) from the end marker on; the end marker forced once
    `budget` reasoning tokens are spent (None: no budget). Constraint's interface, as the
    sampler, the scheduler and the constraint workers use it."""

    def __init__(self, markers: ReasoningMarkers, phase: str, answer: Constraint | None,
                 budget: int | None, stop_ids: Collection[int], vocab_size: int) -> None:
        self._phase = ReasoningPhase(markers, phase)
        self._answer = answer
        self._budget = budget
        self._spent = 0
        self._words = mask_words(vocab_size)
        # While reasoning, a constrained answer must still come: the turn may not end.
        self._reasoning_mask = None if answer is None else _mask(self._words, stop_ids, True)
        self.done = False
        self.leading: tuple[int, ...] = ()
        self.allowed: np.ndarray | None = None
        if phase == REASONING and budget == 0:
            self.leading = self._end_forced().forced
        else:
            self.allowed = self._allowed()

    def advance(self, token: int) -> Advanced:
        """Take the chosen `token`: the tokens forced after it, and the next mask."""
        before = self._phase.phase
        kind = self._phase.take(token)
        if before == ANSWER:
            return self._answered(self._answer.advance(token)) if self._answer else Advanced()
        if kind == CONTENT:  # the answer began without reasoning
            return self._answer_began(token)
        if self._phase.phase == ANSWER:  # the model ended its reasoning
            return self._answer_starts(())
        if kind == REASONING:
            self._spent += 1
        if self._budget is not None and self._spent >= self._budget:
            return self._end_forced()
        self.allowed = self._allowed()
        return Advanced()

    def release(self) -> None:
        if self._answer is not None:
            self._answer.release()

    def _end_forced(self) -> Advanced:
        """The budget is spent: the end marker, then the answer's forced start."""
        end = self._phase.markers.end
        self._phase.take(end)
        return self._answer_starts((end,))

    def _answer_starts(self, before: tuple[int, ...]) -> Advanced:
        """The answer proper starts after `before`: with its constraint's forced start."""
        answer = self._answer
        self.allowed = self._allowed()
        if answer is None:
            return Advanced(forced=before)
        self.done = answer.done
        return Advanced(forced=(*before, *answer.leading), done=self.done)

    def _answer_began(self, token: int) -> Advanced:
        """The model began its answer with `token`, without reasoning."""
        answer = self._answer
        self.allowed = self._allowed()
        if answer is None:
            return Advanced()
        if not answer.leading:
            return self._answered(answer.advance(token))
        if token != answer.leading[0]:
            return Advanced(error=f"the structured output constraint refused token {token}")
        self.done = answer.done
        return Advanced(forced=answer.leading[1:], done=self.done)

    def _answered(self, advanced: Advanced) -> Advanced:
        self.allowed = self._answer.allowed
        self.done = advanced.done
        return advanced

    def _allowed(self) -> np.ndarray | None:
        """The mask of the tokens allowed next (None: any)."""
        answer = self._answer
        if answer is None:
            return None
        phase = self._phase.phase
        if phase == ANSWER:
            return answer.allowed
        if phase == REASONING:
            return self._reasoning_mask
        # Open the reasoning, or begin the answer as its constraint allows.
        first = _mask(self._words, answer.leading[:1], False) if answer.leading else answer.allowed
        return first | _mask(self._words, (self._phase.markers.start,), False)


def _mask(words: int, tokens: Collection[int], without: bool) -> np.ndarray:
    """A token mask of just `tokens`, or (`without`) of every token but them."""
    bits = np.zeros(words * 32, dtype=bool)
    bits[np.fromiter(tokens, dtype=np.int64, count=len(tokens))] = True
    if without:
        bits = ~bits
    return np.packbits(bits, bitorder="little").view(np.int32)


__all__ = [
    "ANSWER",
    "ChatReasoning",
    "KNOWN_MARKERS",
    "OPTIONAL",
    "REASONING",
    "ReasoningGate",
    "ReasoningMarkers",
    "ReasoningPhase",
    "ReasoningText",
    "opening_phase",
    "reasoning_markers",
]
