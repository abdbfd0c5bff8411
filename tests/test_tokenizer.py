"""Tokenizers against llama.cpp's own ids (tests/reference/*/tokenizer.jsonl) and their edges."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from actors.errors import InvalidRequest, ModelFormatError, UnsupportedModelError
from actors.model.gguf.reader import open_gguf
from actors.model.text.tokenizer import Tokenizer
from tests.conftest import REFERENCE_DIR, TINY_MODELS, gemma3_path, smollm2_path


def _load(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(path))


@pytest.fixture(scope="session")
def gemma3() -> Tokenizer:
    return _load(gemma3_path())


@pytest.fixture(scope="session")
def smollm2() -> Tokenizer:
    return _load(smollm2_path())


@pytest.fixture(scope="session")
def tokenizers(gemma3: Tokenizer, smollm2: Tokenizer) -> dict[str, Tokenizer]:
    return {"gemma3-270m": gemma3, "smollm2-135m": smollm2}


def _reference_lines(model: str) -> list[dict]:
    path = REFERENCE_DIR / model / "tokenizer.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("model", ["gemma3-270m", "smollm2-135m"])
def test_every_reference_line_matches_llama_cpp(
    model: str, tokenizers: dict[str, Tokenizer]
) -> None:
    tokenizer = tokenizers[model]
    lines = _reference_lines(model)
    assert len(lines) > 50
    for line in lines:
        text = line["text"]
        assert tokenizer.encode(text) == line["ids"], text
        assert tokenizer.encode(text, parse_special=True) == line["ids_parse_special"], text
        ids = line["ids"]
        without_bos = ids[1:] if ids[:1] == [tokenizer.bos_id] and tokenizer.vocab.add_bos else ids
        assert tokenizer.decode(without_bos) == line["decoded"], text
        # The BOS is a control token: hidden when decoding, so it changes nothing.
        assert tokenizer.decode(ids) == line["decoded"], text


def test_special_ids_and_flags(gemma3: Tokenizer, smollm2: Tokenizer) -> None:
    assert (gemma3.vocab_size, gemma3.bos_id, gemma3.eos_id) == (262144, 2, 1)
    assert gemma3.vocab.add_bos and not gemma3.vocab.add_eos
    assert (smollm2.vocab_size, smollm2.bos_id, smollm2.eos_id) == (49152, 1, 2)
    assert not smollm2.vocab.add_bos
    assert smollm2.encode("Hi")[0] != smollm2.bos_id
    # llama.cpp's end-of-generation tokens: EOS and the end-of-turn token of each family.
    assert {gemma3.eos_id, gemma3.vocab.token_to_id["<end_of_turn>"]} <= gemma3.stop_ids
    assert {smollm2.vocab.token_to_id[t] for t in ("<|im_end|>", "<|endoftext|>")} <= (
        smollm2.stop_ids
    )


def test_add_bos_overrides_the_model_setting(gemma3: Tokenizer, smollm2: Tokenizer) -> None:
    assert gemma3.encode("Hello", add_bos=False) == gemma3.encode("Hello")[1:]
    assert smollm2.encode("Hello", add_bos=True) == [smollm2.bos_id, *smollm2.encode("Hello")]
    assert gemma3.encode("") == [gemma3.bos_id]
    assert smollm2.encode("") == []


def test_control_tokens_only_when_asked_user_defined_always(gemma3: Tokenizer) -> None:
    start = gemma3.vocab.token_to_id["<start_of_turn>"]
    bold = gemma3.vocab.token_to_id["<b>"]  # user-defined
    assert start not in gemma3.encode("<start_of_turn>user")
    assert gemma3.encode("<start_of_turn>user", parse_special=True)[1] == start
    assert bold in gemma3.encode("<b>x</b>")
    # Control tokens are hidden when decoding unless asked for.
    assert gemma3.decode([start]) == ""
    assert gemma3.decode([start], special=True) == "<start_of_turn>"


def test_chatml_tokens_parse_as_single_ids(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("<|im_start|>user\nHi<|im_end|>\n", parse_special=True)
    to_id = smollm2.vocab.token_to_id
    assert ids[0] == to_id["<|im_start|>"] and to_id["<|im_end|>"] in ids
    assert smollm2.decode(ids, special=True) == "<|im_start|>user\nHi<|im_end|>\n"
    assert smollm2.decode(ids) == "user\nHi\n"


def test_tiny_models_use_a_1024_token_vocabulary() -> None:
    for path in TINY_MODELS.values():
        tokenizer = _load(path)
        assert tokenizer.vocab_size == 1024
        text = "The quick brown fox: 123 ünïcode 😀"
        ids = tokenizer.encode(text)
        assert max(ids) < 1024
        decoded = tokenizer.decode(ids)
        if not tokenizer.vocab.byte_level:
            # Cut to 1024 tokens, a SentencePiece vocabulary has no '▁' alone: a space no merge
            # takes stays its byte tokens, which decode to '▁' (so does llama.cpp: the
            # reference lines check it exactly); the space prefix stays too.
            decoded = decoded.replace("\u2581", " ")
            decoded = decoded.removeprefix(" ") if tokenizer.vocab.add_space_prefix else decoded
        assert decoded == text


def test_emoji_split_over_byte_tokens_waits_for_its_last_byte(gemma3: Tokenizer) -> None:
    byte_ids = [gemma3.vocab.token_to_id[f"<0x{byte:02X}>"] for byte in "😀".encode()]
    decoder = gemma3.incremental_decoder()
    assert [decoder.push(token) for token in byte_ids] == ["", "", "", "😀"]
    assert decoder.flush() == ""
    # A cut-off character decodes as U+FFFD, in one go and when streamed.
    assert gemma3.decode(byte_ids[:2]) == "\ufffd"
    decoder = gemma3.incremental_decoder()
    assert "".join(decoder.push(token) for token in byte_ids[:2]) + decoder.flush() == "\ufffd"


@pytest.mark.parametrize("special", [False, True])
def test_decode_joins_the_pieces_of_its_tokens(
    tokenizers: dict[str, Tokenizer], special: bool
) -> None:
    for tokenizer in tokenizers.values():
        ids = np.random.default_rng(7).integers(0, tokenizer.vocab_size, 5000).tolist()
        ids += sorted(tokenizer.vocab.special.values()) + [0, tokenizer.vocab_size - 1]
        pieces = b"".join(tokenizer.piece(token, special=special) for token in ids)
        assert tokenizer.decode(ids, special=special) == pieces.decode("utf-8", "replace")
        assert tokenizer.decode(np.array(ids, dtype=np.uint32), special=special) == (
            tokenizer.decode(ids, special=special))
        assert tokenizer.decode([], special=special) == ""
        longest = max(len(tokenizer.piece(token, special=True)) for token in range(
            tokenizer.vocab_size))
        assert tokenizer.max_token_bytes == longest


def test_a_tokenizer_pickles_and_encodes_the_same(tokenizers: dict[str, Tokenizer]) -> None:
    text = "Hello <start_of_turn> <|im_end|> wörld 😀 x 12345"
    for tokenizer in tokenizers.values():
        again = pickle.loads(pickle.dumps(tokenizer))
        ids = tokenizer.encode(text, parse_special=True)
        assert again.encode(text, parse_special=True) == ids
        assert again.decode(ids, special=True) == tokenizer.decode(ids, special=True)


def test_bad_input_gives_clear_errors(gemma3: Tokenizer) -> None:
    with pytest.raises(InvalidRequest, match="262144") as caught:
        gemma3.decode([5, 262144])
    assert caught.value.field == "ids"
    with pytest.raises(InvalidRequest, match="-1"):
        gemma3.decode([-1])
    with pytest.raises(InvalidRequest, match="out of range"):
        gemma3.incremental_decoder().push(10**9)
    with pytest.raises(InvalidRequest, match="out of range"):
        gemma3.piece(-1)
    with pytest.raises(InvalidRequest, match="integers"):
        gemma3.piece(True)  # type: ignore[arg-type]  (a bool is not a token id)
    assert gemma3.piece(np.int64(5)) == gemma3.piece(5)
    with pytest.raises(InvalidRequest, match="integers"):
        gemma3.decode(["a"])
    with pytest.raises(InvalidRequest, match="str"):
        gemma3.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="Unicode"):
        gemma3.encode("lone \ud800 surrogate")


def _metadata_with(path: Path, **changes: object) -> SimpleNamespace:
    metadata = dict(open_gguf(path).metadata)
    for key, value in changes.items():
        name = f"tokenizer.ggml.{key}"
        if value is None:
            metadata.pop(name, None)
        else:
            metadata[name] = value
    return SimpleNamespace(metadata=metadata)


def test_unsupported_tokenizers_are_named() -> None:
    tiny = TINY_MODELS["llama-q4k-tiny"]
    with pytest.raises(UnsupportedModelError, match="'wordpiece-ish'"):
        Tokenizer.from_gguf(_metadata_with(tiny, model="wordpiece-ish"))
    with pytest.raises(UnsupportedModelError, match="'made-up-pre'"):
        Tokenizer.from_gguf(_metadata_with(tiny, pre="made-up-pre"))
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.pre"):
        Tokenizer.from_gguf(_metadata_with(tiny, pre=None))
    with pytest.raises(ModelFormatError, match="tokens"):
        Tokenizer.from_gguf(_metadata_with(tiny, tokens=None))


@pytest.mark.parametrize("pre", ["default", "gpt-2", "llama-bpe", "qwen2", "qwen35", "smollm"])
def test_every_supported_pre_tokenizer_round_trips(pre: str) -> None:
    tokenizer = Tokenizer.from_gguf(_metadata_with(smollm2_path(), pre=pre))
    text = "Hello world's 12345 numbers,\n\n  indented\tcode() + ünï 日本 😀"
    ids = tokenizer.encode(text, add_bos=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.vocab.tokens[ids[0]] == "Hello"


def test_smollm_pre_tokenizer_isolates_digits(smollm2: Tokenizer) -> None:
    assert [smollm2.vocab.tokens[t] for t in smollm2.encode("x 12345")] == ["x", "Ġ", *"12345"]


def test_spm_space_prefix_is_added_and_kept_when_decoding(gemma3: Tokenizer) -> None:
    tokenizer = _spm_with_space_prefix(gemma3)
    ids = tokenizer.encode("Hello world", add_bos=False)
    assert tokenizer.vocab.tokens[ids[0]] == "▁Hello"
    # The pieces joined, as llama.cpp gives generated text: the prefix space stays.
    assert tokenizer.decode(ids) == " Hello world"
    # After a special token the next text gets the prefix space again (llama.cpp).
    bold = tokenizer.vocab.token_to_id["<b>"]
    prefixed_x = tokenizer.vocab.token_to_id["▁x"]
    assert tokenizer.encode("<b>x", add_bos=False)[:2] == [bold, prefixed_x]


def _spm_with_space_prefix(gemma3: Tokenizer) -> Tokenizer:
    from dataclasses import replace

    return Tokenizer(replace(gemma3.vocab, add_space_prefix=True))
