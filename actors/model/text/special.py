"""Cutting special-token texts out of raw text, as llama.cpp's `tokenizer_st_partition` does.

llama.cpp takes the special tokens longest first and, for each, cuts every leftmost
non-overlapping occurrence out of the text fragments that are still raw. Control and unknown
tokens take part only when the caller asks to parse special tokens; user-defined ones always.

Trying thousands of special tokens (Gemma has 6k `<unusedN>`) against every text would be slow,
so one trie regex finds the longest special token starting at each position, and only the
tokens that can occur in the text run llama.cpp's loop. That loop keeps the raw fragments as
spans of the original text, so no character is ever reserved as a placeholder: a special token
may hold any code point. Building the regex is linear in the special tokens' total length,
which the vocabulary bounds (vocab.MAX_SPECIAL_CHARS), and long tokens' own tails
are cut short in it.
"""

from __future__ import annotations

import gc
import re
from bisect import bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property

import numpy as np

from actors.model.text.vocab import (
    ATTR_CONTROL,
    ATTR_RSTRIP,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    Vocab,
)

Fragment = str | int  # raw text, or the id of a special token cut out of it

# What C's isspace() takes for whitespace (llama.cpp strips these bytes around a token).
_C_SPACES = re.compile(r"[ \t\n\v\f\r]*")


class SpecialTokenSplitter:
    """`split(text, parse_special)` -> raw-text fragments and special token ids, in order."""

    def __init__(self, vocab: Vocab) -> None:
        special = np.flatnonzero(vocab.attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN))
        ids = sorted(special.tolist(), key=lambda token: -len(vocab.tokens[token]))
        always = [token for token in ids if not vocab.attrs[token] & (ATTR_CONTROL | ATTR_UNKNOWN)]
        rstrip = frozenset(np.flatnonzero(vocab.attrs & ATTR_RSTRIP).tolist())
        self._matchers = {
            False: _Matcher({vocab.tokens[token]: token for token in always}, rstrip),
            True: _Matcher({vocab.tokens[token]: token for token in ids}, rstrip),
        }

    def prepare(self) -> None:
        """Build both modes' patterns now (e.g. in a loading thread), not on the first split."""
        for matcher in self._matchers.values():
            matcher.prepare()

    def split(self, text: str, parse_special: bool) -> list[Fragment]:
        if not text:
            return []
        return self._matchers[parse_special].split(text)


class _Matcher:
    """The special tokens of one mode, longest first (llama.cpp's order); those in `rstrip`
    take the whitespace after them out of the text."""

    def __init__(self, text_to_id: dict[str, int], rstrip: frozenset[int]) -> None:
        self.text_to_id = text_to_id
        self.rank = {text: rank for rank, text in enumerate(text_to_id)}
        self.rstrip = rstrip

    def prepare(self) -> None:
        self._finder  # noqa: B018 - the cached properties build and keep them
        self._longest_prefix_token  # noqa: B018

    @cached_property
    def _finder(self) -> tuple[re.Pattern[str], dict[str, str]] | None:
        """A regex matching (empty) at every position where a special token starts, its
        group the longest one starting there or the cut-short start of a long one; and the
        cut-short starts -> the token each stands for."""
        if not self.text_to_id:
            return None
        trie, cut_short = _trie_pattern(list(self.text_to_id))
        with _no_collections():
            return re.compile("(?=(" + trie + "))"), cut_short

    @cached_property
    def _longest_prefix_token(self) -> dict[str, str]:
        """Each special token -> the longest other special token that is a prefix of it (if
        any): chains of these give every token starting where a longer one starts."""
        parent: dict[str, str] = {}
        chain: list[str] = []  # in sorted order, a token's prefixes come just before it
        for text in sorted(self.text_to_id):
            while chain and not text.startswith(chain[-1]):
                chain.pop()
            if chain:
                parent[text] = chain[-1]
            chain.append(text)
        return parent

    def _occurring(self, text: str) -> list[str]:
        """The special tokens that may occur in `text`, in llama.cpp's processing order: the
        longest one starting at each position (or the long one whose cut-short start is
        there), and the special tokens that are its prefixes. A token that turns out absent
        costs `split` one search."""
        if self._finder is None:
            return []
        finder, cut_short = self._finder
        # finditer, not findall: a long text of token starts would be a list as long.
        starts = (match.group(1) for match in finder.finditer(text))
        found = {cut_short.get(start, start) for start in starts}
        parent = self._longest_prefix_token
        for token_text in list(found):
            while (token_text := parent.get(token_text)) is not None and token_text not in found:
                found.add(token_text)
        return sorted(found, key=self.rank.__getitem__)

    def split(self, text: str) -> list[Fragment]:
        occurring = self._occurring(text)
        if not occurring:
            return [text]
        # The still-raw fragments as sorted, disjoint spans [starts[k], ends[k]) of `text`.
        starts, ends = [0], [len(text)]
        cuts: list[tuple[int, int, int]] = []  # (start, end, token id)
        for token_text in occurring:
            token, size = self.text_to_id[token_text], len(token_text)
            at = text.find(token_text)
            while at >= 0:
                span = bisect_right(starts, at) - 1
                if span >= 0 and at + size <= ends[span]:
                    # Inside a raw fragment: cut it there, look again after the cut.
                    end = at + size
                    if token in self.rstrip:
                        end = _C_SPACES.match(text, end, ends[span]).end()
                    cuts.append((at, end, token))
                    _cut_span(starts, ends, span, at, end)
                    at = text.find(token_text, end)
                elif span + 1 < len(starts):
                    # Starts in a cut, or runs past its fragment's end (as would any later
                    # start in that fragment): go on at the next raw fragment.
                    at = text.find(token_text, starts[span + 1])
                else:
                    break
        return _fragments(text, cuts)


def _cut_span(starts: list[int], ends: list[int], span: int, cut_start: int, cut_end: int) -> None:
    """Take [cut_start, cut_end) out of raw span `span`, keeping the pieces left of it and
    right of it that are not empty."""
    start, end = starts[span], ends[span]
    if start < cut_start and cut_end < end:
        ends[span] = cut_start
        starts.insert(span + 1, cut_end)
        ends.insert(span + 1, end)
    elif start < cut_start:
        ends[span] = cut_start
    elif cut_end < end:
        starts[span] = cut_end
    else:
        del starts[span], ends[span]


def _fragments(text: str, cuts: list[tuple[int, int, int]]) -> list[Fragment]:
    """The raw text between the cuts, and the cut tokens, in text order."""
    fragments: list[Fragment] = []
    previous = 0
    for start, end, token in sorted(cuts):
        if start > previous:
            fragments.append(text[previous:start])
        fragments.append(token)
        previous = end
    if previous < len(text):
        fragments.append(text[previous:])
    return fragments


@contextmanager
def _no_collections() -> Iterator[None]:
    """The garbage collector off for a block that allocates many objects that all live until
    it ends: a regex compile makes a tuple per pattern character, and each full collection
    these trigger would walk the whole process's heap holding the GIL (about 150 ms in a
    process serving gemma-3), so the event loop would stall while a model loads. Collection
    is left off if it was off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# Characters of a text's own tail kept in the trie regex (a match of the rest is left to the
# search for the token): far longer than any real special token's tail.
_TAIL_CHARS = 64
# Deeper nesting of groups than this makes Python's regex compiler recurse past its limit (a
# vocabulary whose special tokens are prefixes of each other, "<a", "<aa", "<aaa", ...).
_MAX_TRIE_GROUPS = 100


def _trie_pattern(texts: list[str]) -> tuple[str, dict[str, str]]:
    """A regex matching the longest of `texts` that starts at a position: a prefix trie whose
    single-child chains are one literal each, or, where the trie would nest too deep, the
    texts as alternatives, longest first (the same longest matches, slower).

    A text's own tail (past the last character it shares with another text) is cut to
    _TAIL_CHARS, so long tokens cost the regex little: a match of a cut-short text only says
    the token may start there. Returned beside the pattern: cut-short start -> its text.

    Built in one pass over the sorted texts, each trie node's pattern written once into a list
    of pieces (a node's texts are a contiguous run of the sorted list): linear in the texts'
    total length, where joining each node's pattern from its children's was quadratic in a
    long token's length."""
    ordered = sorted(set(texts))
    cut_short: dict[str, str] = {}
    pieces: list[str] = []
    deepest = 0
    # A str is written as is; (lo, hi, depth, groups) is the node whose texts are
    # ordered[lo:hi], sharing their first `depth` characters, under `groups` open groups.
    stack: list[str | tuple[int, int, int, int]] = [(0, len(ordered), 0, 0)]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            pieces.append(item)
            continue
        lo, hi, depth, groups = item
        terminal = len(ordered[lo]) == depth  # a text ending here sorts first
        first = lo + terminal
        # Per child: its literal, and its node (lo, hi, depth), None where a tail was cut.
        branches: list[tuple[str, tuple[int, int, int] | None]] = []
        while first < hi:
            char = ordered[first][depth]
            last = bisect_right(ordered, char, first, hi, key=lambda text: text[depth])
            shared = _common_prefix_length(ordered[first], ordered[last - 1], depth + 1)
            child: tuple[int, int, int] | None = (first, last, shared)
            if last - first == 1 and shared > depth + _TAIL_CHARS:  # one text's own tail
                shared, child = depth + _TAIL_CHARS, None
                cut_short[ordered[first][:shared]] = ordered[first]
            branches.append((re.escape(ordered[first][depth:shared]), child))
            first = last
        grouped = len(branches) > 1 or (bool(branches) and terminal)
        inner = groups + grouped
        deepest = max(deepest, inner)
        sequence: list[str | tuple[int, int, int, int]] = ["(?:"] if grouped else []
        for index, (literal, child) in enumerate(branches):
            sequence += ["|"] * (index > 0) + [literal]
            if child is not None:
                sequence.append((*child, inner))
        if grouped:
            sequence.append(")?" if terminal else ")")
        stack.extend(reversed(sequence))
    if deepest > _MAX_TRIE_GROUPS:
        return "|".join(map(re.escape, sorted(ordered, key=len, reverse=True))), {}
    return "".join(pieces), cut_short


def _common_prefix_length(first: str, second: str, known: int) -> int:
    """Length of the longest common prefix of two texts known to share `known` characters:
    a binary search of slice comparisons (C loops), not a Python loop per character."""
    low, high = known, min(len(first), len(second))
    while low < high:
        middle = (low + high + 1) // 2
        if first[:middle] == second[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
