"""Cutting special-token texts out of raw text, as llama.cpp's `tokenizer_st_partition` does.

llama.cpp takes the special tokens longest first and, for each, cuts every leftmost
non-overlapping occurrence out of the text fragments that are still raw. Control and unknown
tokens take part only when the caller asks to parse special tokens; user-defined ones always.

Trying thousands of special tokens (Gemma has 6k `<unusedN>`) against every text would be slow,
so one trie regex finds where special tokens start, and only the tokens that can occur in the
text run llama.cpp's loop.
"""

from __future__ import annotations

import re
from collections import defaultdict
from functools import cached_property

import numpy as np

from actors.model.tokenizer_vocab import (
    ATTR_CONTROL,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    Vocab,
)

# Stands in for text already cut out; must not occur in any special token.
_MASK_CANDIDATES = ("\x00", "\uffff", "\U0010fffe")

Fragment = str | int  # raw text, or the id of a special token cut out of it


class SpecialTokenSplitter:
    """`split(text, parse_special)` -> raw-text fragments and special token ids, in order."""

    def __init__(self, vocab: Vocab) -> None:
        special = np.flatnonzero(vocab.attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN))
        ids = sorted(special.tolist(), key=lambda token: -len(vocab.tokens[token]))
        always = [token for token in ids if not vocab.attrs[token] & (ATTR_CONTROL | ATTR_UNKNOWN)]
        self._matchers = {
            False: _Matcher({vocab.tokens[token]: token for token in always}),
            True: _Matcher({vocab.tokens[token]: token for token in ids}),
        }

    def split(self, text: str, parse_special: bool) -> list[Fragment]:
        if not text:
            return []
        return self._matchers[parse_special].split(text)


class _Matcher:
    """The special tokens of one mode, longest first (llama.cpp's order)."""

    def __init__(self, text_to_id: dict[str, int]) -> None:
        self.text_to_id = text_to_id
        self.rank = {text: rank for rank, text in enumerate(text_to_id)}

    @cached_property
    def _finder(self) -> re.Pattern[str] | None:
        return re.compile(_trie_pattern(list(self.text_to_id))) if self.text_to_id else None

    @cached_property
    def _lengths(self) -> list[int]:
        return sorted({len(text) for text in self.text_to_id})

    @cached_property
    def _by_prefix(self) -> dict[str, list[str]]:
        index: dict[str, list[str]] = defaultdict(list)
        for text in self.text_to_id:
            for end in range(1, len(text)):
                index[text[:end]].append(text)
        return dict(index)

    @cached_property
    def _mask(self) -> str:
        return next(
            char
            for char in _MASK_CANDIDATES
            if not any(char in text for text in self.text_to_id)
        )

    def _occurring(self, text: str) -> list[str]:
        """The special tokens that occur in `text`, in llama.cpp's processing order.

        Every occurrence either starts a leftmost-longest match of the trie, lies inside one,
        or starts inside one and runs past its end (its prefix is a suffix of the match).
        """
        if self._finder is None:
            return []
        matched = set(self._finder.findall(text))
        found: set[str] = set()
        straddling: set[str] = set()
        lengths = self._lengths
        for token_text in matched:
            size = len(token_text)
            for start in range(size):
                # Only pieces as long as some special token can be one (not every end: a
                # special token of thousands of characters made that quadratic per encode).
                found.update(
                    piece
                    for length in lengths
                    if start + length <= size
                    and (piece := token_text[start : start + length]) in self.text_to_id
                )
                if start:
                    straddling.update(self._by_prefix.get(token_text[start:], ()))
        found.update(candidate for candidate in straddling - found if candidate in text)
        return sorted(found, key=self.rank.__getitem__)

    def split(self, text: str) -> list[Fragment]:
        occurring = self._occurring(text)
        if not occurring:
            return [text]
        mask = self._mask
        cuts: list[tuple[int, int, int]] = []
        masked = text
        for token_text in occurring:
            # Leftmost non-overlapping occurrences within still-raw text: masked spans can't
            # be part of a match because the mask character is in no token.
            spans = [match.span() for match in re.finditer(re.escape(token_text), masked)]
            if not spans:
                continue
            token = self.text_to_id[token_text]
            cuts.extend((start, end, token) for start, end in spans)
            pieces, previous = [], 0
            for start, end in spans:
                pieces += (masked[previous:start], mask * (end - start))
                previous = end
            pieces.append(masked[previous:])
            masked = "".join(pieces)
        cuts.sort()
        fragments: list[Fragment] = []
        previous = 0
        for start, end, token in cuts:
            if start > previous:
                fragments.append(text[previous:start])
            fragments.append(token)
            previous = end
        if previous < len(text):
            fragments.append(text[previous:])
        return fragments


# Deeper nesting of groups than this makes Python's regex compiler recurse past its limit (a
# vocabulary whose special tokens are prefixes of each other, "<a", "<aa", "<aaa", ...).
_MAX_TRIE_GROUPS = 100


def _trie_pattern(texts: list[str]) -> str:
    """A regex matching the longest of `texts` that starts at a position: a prefix trie, or,
    where the trie would nest too deep, the texts as alternatives, longest first (the same
    leftmost-longest matches, slower). Built without recursion: a special token can be
    thousands of characters long."""
    trie: dict[str, dict] = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}
    pattern: dict[int, str] = {}
    groups: dict[int, int] = {}
    stack: list[tuple[dict[str, dict], bool]] = [(trie, False)]
    while stack:  # post-order: a node's pattern from its children's
        node, children_done = stack.pop()
        children = [(char, child) for char, child in node.items() if char]
        if not children_done:
            stack.append((node, True))
            stack.extend((child, False) for _, child in children)
            continue
        branches = [re.escape(char) + pattern.pop(id(child)) for char, child in children]
        depth = max((groups.pop(id(child)) for _, child in children), default=0)
        grouped = len(branches) > 1 or (bool(branches) and "" in node)
        body = "(?:" + "|".join(branches) + ")" if grouped else "".join(branches)
        pattern[id(node)] = body + "?" if branches and "" in node else body
        groups[id(node)] = depth + grouped
    if groups[id(trie)] > _MAX_TRIE_GROUPS:
        return "|".join(map(re.escape, sorted(texts, key=len, reverse=True)))
    return pattern[id(trie)]
