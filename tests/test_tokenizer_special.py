"""Special-token texts of any code points and any length: cut out
exactly as llama.cpp does, with no character reserved as a placeholder; the trie pattern built
in linear time; tokens past the load bounds refused with ModelFormatError; the patterns built
in the loading thread, not on the first encode."""

from __future__ import annotations

import time

import anyio
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from actors import Engine, SamplingParams
from actors.errors import ModelFormatError
from actors.loop_stall import watch_loop
from actors.model.text import special as tokenizer_special
from actors.model.text.special import _trie_pattern
from actors.model.text.vocab import MAX_SPECIAL_CHARS, MAX_TOKEN_CHARS
from tests.fuzz import gguf_structure
from tests.fuzz.special_tokens import (
    CONTROL,
    FREE_IDS,
    USER_DEFINED,
    odd_texts,
    tiny_metadata,
    tokenizer_with,
)
from tests.test_tokenizer_props import llama_cpp_encode

special_sets = st.lists(
    st.tuples(
        odd_texts.filter(lambda text: text not in tiny_metadata()["tokenizer.ggml.tokens"]),
        st.sampled_from([CONTROL, USER_DEFINED]),
    ),
    min_size=1,
    max_size=len(FREE_IDS),
    unique_by=lambda pair: pair[0],
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specials=special_sets,
    pieces=st.lists(st.one_of(odd_texts, st.text("ab <>\n", max_size=4)), max_size=16),
    parse_special=st.booleans(),
)
@example(  # every old placeholder is itself a special token's text
    specials=[("\x00", USER_DEFINED), ("\uffff", USER_DEFINED), ("\U0010fffe", CONTROL)],
    pieces=["a\x00b", "\uffff\U0010fffe", "\x00\x00"],
    parse_special=True,
)
def test_special_texts_of_any_code_points_split_as_llama_cpp_does(
    specials: list[tuple[str, int]], pieces: list[str], parse_special: bool
) -> None:
    tokenizer = tokenizer_with(dict(zip(FREE_IDS, specials)))
    # The texts hold the special texts themselves too, overlapping and adjacent.
    text = "".join(p + specials[i % len(specials)][0] for i, p in enumerate(pieces))
    assert tokenizer.encode(text, parse_special=parse_special) == llama_cpp_encode(
        tokenizer, text, parse_special
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specials=special_sets,
    pieces=st.lists(st.one_of(odd_texts, st.text("ab <>\n", max_size=4)), max_size=16),
)
def test_long_tokens_cut_short_in_the_regex_still_split_as_llama_cpp_does(
    specials: list[tuple[str, int]], pieces: list[str]
) -> None:
    """The same property with every special token's own tail past one character cut short in
    the trie regex (as tails past 64 characters are), so the check of the rest runs."""
    original = tokenizer_special._TAIL_CHARS
    tokenizer_special._TAIL_CHARS = 1
    try:
        test_special_texts_of_any_code_points_split_as_llama_cpp_does.hypothesis.inner_test(
            specials, pieces, parse_special=True
        )
    finally:
        tokenizer_special._TAIL_CHARS = original


@pytest.mark.parametrize("size", [256 * 1024, 1024 * 1024])
def test_a_huge_user_defined_token_is_refused_at_load_in_milliseconds(size: int) -> None:
    started = time.perf_counter()
    with pytest.raises(ModelFormatError, match=f"{size + 2:,} characters long"):
        tokenizer_with({5: ("<" + "x" * size + ">", USER_DEFINED)})
    assert time.perf_counter() - started < 0.5


def test_special_texts_past_their_total_are_refused() -> None:
    per_token = MAX_TOKEN_CHARS
    count = MAX_SPECIAL_CHARS // per_token + 1
    assert count <= 1024 - 17  # the tiny vocabulary has the room (its normal tokens)
    # Normal tokens made special (refused before their merges are looked at).
    specials = {17 + i: (f"<{i:05d}" + "y" * (per_token - 6), USER_DEFINED) for i in range(count)}
    with pytest.raises(ModelFormatError, match="special tokens .* characters"):
        tokenizer_with(specials)


@pytest.mark.parametrize("size", [256 * 1024, 1024 * 1024])
def test_the_trie_pattern_is_linear_in_a_long_token(size: int) -> None:
    """Below the load bound too: the pattern of a 1 MiB token took about 40 s when each trie
    node's pattern was rebuilt from its children's."""
    long_token = "<x" + "y" * size + ">"
    started = time.perf_counter()
    pattern, cut_short = _trie_pattern([long_token, "<xa>", "<z>"])
    assert time.perf_counter() - started < 0.5
    # The long token's own tail is cut short in the regex, and checked where it matches.
    assert pattern.startswith("<(?:x(?:") and len(pattern) < 100
    assert list(cut_short.values()) == [long_token]


def test_tokens_at_the_bounds_build_and_encode_in_milliseconds() -> None:
    longest = "<" + "z" * (MAX_TOKEN_CHARS - 2) + ">"
    tokenizer = tokenizer_with({5: (longest, USER_DEFINED), 6: ("<" + "z" * 50 + ">", CONTROL)})
    started = time.perf_counter()
    tokenizer.prepare_encoder()
    ids = tokenizer.encode("a" + longest + "b" + longest[:-1] + longest, parse_special=True)
    assert time.perf_counter() - started < 1.0
    assert ids.count(5) == 2  # not where only its start is there


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_first_generate_builds_nothing_on_the_event_loop(tmp_path) -> None:
    """Many long special tokens: their patterns are built while the model loads, so the first
    request finds them ready and the loop keeps ticking."""
    parts = gguf_structure.seed_parts("llama-q4k-tiny")
    no_merges = gguf_structure.Value(gguf_structure.T.ARRAY, [], gguf_structure.T.STRING)
    # Without merges, normal tokens can take any text (no merge refers to them).
    parts = gguf_structure.apply(
        parts, gguf_structure.Mutation("set", "tokenizer.ggml.merges", no_merges)
    )
    for index in range(600, 1000):  # merged tokens: unused without merges
        text = f"<{index:04d}" + "q" * 1000 + ">"
        parts = gguf_structure.apply(
            parts, gguf_structure.Mutation("token", index=index, text=text, token_type=USER_DEFINED)
        )
    path = tmp_path / "long_specials.gguf"
    gguf_structure.write_gguf(parts, path)
    async with Engine.open(path, backend="cpu") as engine:
        matchers = engine._tokenizer._splitter._matchers.values()
        assert all("_finder" in vars(matcher) for matcher in matchers)
        async with watch_loop() as watch:
            await engine.complete("hello <0600", SamplingParams(max_tokens=2, temperature=0))
            await anyio.sleep(0.05)
    assert watch.ticks > 0 and watch.worst_stall_ms < 500
