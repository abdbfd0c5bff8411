"""Special-token texts a hostile or careless converter could write: control, noncharacter and
private-use code points (what a placeholder scheme would borrow), prefixes and repeats of each
other, lengths around the load bound, as control, user-defined or unknown tokens of the tiny
model. The check builds the tokenizer: a ModelFormatError at load, or encodings that match a
plain port of llama.cpp's (tests/test_tokenizer_props.py) in both special-token modes."""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
from hypothesis import strategies as st

from actors.model.gguf.reader import open_gguf
from actors.model.text.tokenizer import Tokenizer
from actors.model.text.vocab import MAX_TOKEN_CHARS, read_vocab
from tests.conftest import TINY_MODELS
from tests.fuzz.target import Escape, Target, hang_guard, only_project_errors
from tests.test_tokenizer_props import llama_cpp_encode

# Ids of the tiny model's special tokens that no merge uses: free to take any text.
FREE_IDS = range(3, 17)
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # GGUF token types
ODD_CHARS = (
    "\x00", "\uffff", "\U0010fffe", "\x01", "\x1f", "\x7f", "\ufdd0", "\ufffe", "\U0001fffe",
    "\U0010ffff", "\ue000", "\uf8ff", "\U000f0000", "\U00100000",
)  # fmt: skip


@cache
def tiny_metadata() -> dict[str, Any]:
    return dict(open_gguf(TINY_MODELS["llama-q4k-tiny"]).metadata)


def tokenizer_with(specials: dict[int, tuple[str, int]]) -> Tokenizer:
    """The tiny model's tokenizer with token id -> (text, GGUF token type) replaced."""
    metadata = dict(tiny_metadata())
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = np.array(metadata["tokenizer.ggml.token_type"])
    for token, (text, kind) in specials.items():
        tokens[token], types[token] = text, kind
    metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"] = tokens, types
    return Tokenizer(read_vocab(metadata))


odd_texts = st.text(st.sampled_from(ODD_CHARS + ("<", ">", "a")), min_size=1, max_size=4)
long_texts = st.builds(
    lambda char, size: char * size,
    st.sampled_from(ODD_CHARS + ("a",)),
    st.sampled_from([50, MAX_TOKEN_CHARS - 1, MAX_TOKEN_CHARS, MAX_TOKEN_CHARS + 1, 5000]),
)
special_texts = st.one_of(odd_texts, odd_texts, odd_texts, long_texts)
special_sets = st.lists(
    st.tuples(
        special_texts.filter(lambda text: text not in tiny_metadata()["tokenizer.ggml.tokens"]),
        st.sampled_from([UNKNOWN, CONTROL, USER_DEFINED]),
    ),
    min_size=1,
    max_size=len(FREE_IDS),
    unique_by=lambda pair: pair[0],
)
cases = st.tuples(
    special_sets, st.lists(st.one_of(odd_texts, st.text("ab <>\n", max_size=4)), max_size=12)
)


def check(case: tuple[list[tuple[str, int]], list[str]]) -> str:
    specials, pieces = case
    # The text holds the special texts themselves, overlapping and adjacent, with the pieces.
    text = "".join(piece + specials[i % len(specials)][0] for i, piece in enumerate(pieces))
    with hang_guard(case), only_project_errors(case) as outcome:
        tokenizer = tokenizer_with(dict(zip(FREE_IDS, specials)))
        for parse_special in (False, True):
            ids = tokenizer.encode(text, parse_special=parse_special)
            expected = llama_cpp_encode(tokenizer, text, parse_special)
            if ids != expected:
                raise Escape(f"ids {ids[:20]} != llama.cpp's {expected[:20]} <- {case!r:.300}")
            tokenizer.decode(ids, special=True)
    return outcome[0]


TARGET = Target("special-token texts", cases, check)
