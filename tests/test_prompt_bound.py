"""`Tokenizer.min_tokens` is a sound lower bound: for any text, encoding gives at least that
many tokens, so the engine may refuse a prompt by its bytes alone without ever refusing one
that would fit. Checked on a byte-level BPE that lacks some byte characters (SmolLM2), the
tiny models, and a SentencePiece vocabulary with every byte token (gemma-3-270m)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors import load_model
from actors.model.text.tokenizer import Tokenizer
from tests.conftest import TINY_MODELS, gemma3_path, smollm2_path

MODELS = {**TINY_MODELS, "smollm2-135m": smollm2_path, "gemma3-270m": gemma3_path}

texts = st.one_of(
    st.text(max_size=400),
    st.text(alphabet="ab \n\x00\x16é漢😀", max_size=400),
    st.lists(st.sampled_from(["<|im_start|>", "<start_of_turn>", "<eos>", "Hello", " ", "\t"]),
             max_size=40).map("".join),
)


@pytest.fixture(scope="module", params=list(MODELS))
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    where = MODELS[request.param]
    tokenizer = load_model(where() if callable(where) else where).tokenizer
    tokenizer.prepare_encoder()
    return tokenizer


@settings(max_examples=80, deadline=None)
@given(text=texts, parse_special=st.booleans())
def test_no_text_encodes_to_fewer_tokens_than_its_bound(
    tokenizer: Tokenizer, text: str, parse_special: bool
) -> None:
    tokens = tokenizer.encode(text, add_bos=False, parse_special=parse_special)
    assert tokenizer.min_tokens(text) <= len(tokens)
