"""llama.cpp's vocabulary-only files and the synthetic models' vocabularies against llama.cpp's
own ids and text (tests/reference/vocab-*/ and <model>/tokenizer.jsonl), and `load_tokenizer`."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest

import actors
from actors.errors import ModelFormatError, UnsupportedModelError
from actors.model.gguf.reader import open_gguf
from actors.model.text.tokenizer import Tokenizer, load_tokenizer
from tests.conftest import REFERENCE_DIR, TINY_MODELS

VOCAB_NAMES = ("llama-bpe", "qwen2", "qwen35", "phi-3", "gemma-4")
SYNTHETIC_MODELS = ("qwen3-q4k-tiny", "llama3-q4k-tiny", "gemma3-scaled-q4k-tiny", "phi3-q4k-tiny")
# Reference folder -> the GGUF whose tokenizer it holds.
GGUF_OF = {
    **{f"vocab-{name}": REFERENCE_DIR / f"vocab-{name}" / f"ggml-vocab-{name}.gguf"
       for name in VOCAB_NAMES},
    **{name: TINY_MODELS[name] for name in SYNTHETIC_MODELS},
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_of() -> Callable[[str], Tokenizer]:
    """Each folder's tokenizer, built once for the module (Gemma 4's 262k tokens take ~1 s)."""
    built: dict[str, Tokenizer] = {}

    def get(folder: str) -> Tokenizer:
        if folder not in built:
            built[folder] = load_tokenizer(GGUF_OF[folder])
        return built[folder]

    return get


def _reference_lines(folder: str) -> list[dict]:
    text = (REFERENCE_DIR / folder / "tokenizer.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize("folder", GGUF_OF)
def test_every_reference_line_matches_llama_cpp(
    folder: str, tokenizer_of: Callable[[str], Tokenizer]
) -> None:
    tokenizer = tokenizer_of(folder)
    lines = _reference_lines(folder)
    assert len(lines) >= 72
    for line in lines:
        text, ids = line["text"], line["ids"]
        assert tokenizer.encode(text) == ids, text
        assert tokenizer.encode(text, parse_special=True) == line["ids_parse_special"], text
        # `decoded` is llama.cpp's text of the ids after the BOS, control tokens hidden.
        without_bos = ids[1:] if tokenizer.vocab.add_bos else ids
        assert ids[: len(ids) - len(without_bos)] in ([], [tokenizer.bos_id]), text
        assert tokenizer.decode(without_bos) == line["decoded"], text


def _gemma4_metadata(tokens: list[str], merges: list[str]) -> dict[str, object]:
    """A small Gemma 4 vocabulary: <pad> <eos> <bos>, the 256 byte tokens, then `tokens`."""
    texts = ["<pad>", "<eos>", "<bos>", *(f"<0x{byte:02X}>" for byte in range(256)), *tokens]
    return {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": texts,
        "tokenizer.ggml.token_type": np.array([3, 3, 3] + [6] * 256 + [1] * len(tokens)),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": False,
    }


def test_gemma4_cuts_lines_and_takes_a_run_of_newlines_whole() -> None:
    tokens = ["a", "b", "ab", "▁", "▁ab", "\n", "\n\n\n"]
    tokenizer = Tokenizer.from_gguf(
        SimpleNamespace(metadata=_gemma4_metadata(tokens, ["a b", "▁ ab"]))
    )
    vocab = tokenizer.vocab
    assert vocab.model == "gemma4" and not vocab.byte_level
    assert vocab.add_bos  # llama.cpp adds Gemma 4's BOS even where the file says not to
    ids = tokenizer.encode(" ab\n\n\nab\n\né", add_bos=False)
    # No merge makes '\n\n\n', yet a run of newlines that is a token is taken whole; a run
    # that is none is merged as any word; 'é' has no token: its bytes stand for it.
    assert [vocab.tokens[token] for token in ids] == [
        "▁ab", "\n\n\n", "ab", "\n", "\n", "<0xC3>", "<0xA9>"
    ]  # fmt: skip
    assert tokenizer.decode(ids) == " ab\n\n\nab\n\né"


def test_phi3_special_tokens_drop_the_whitespace_after_them(
    tokenizer_of: Callable[[str], Tokenizer],
) -> None:
    phi3 = tokenizer_of("phi3-q4k-tiny")
    tight = phi3.encode("<|user|>Hi<|end|>", parse_special=True)
    assert phi3.encode("<|user|> \n\tHi<|end|>\n", parse_special=True) == tight
    # <s> keeps the space after it, and only a model named Phi-3 strips at all.
    assert phi3.encode("<s> Hi", parse_special=True) != phi3.encode("<s>Hi", parse_special=True)
    metadata = dict(open_gguf(GGUF_OF["phi3-q4k-tiny"]).metadata)
    metadata["general.name"] = "some-llama"
    renamed = Tokenizer.from_gguf(SimpleNamespace(metadata=metadata))
    assert renamed.encode("<|user|> \n\tHi<|end|>", parse_special=True) != tight


def test_load_tokenizer_reads_a_vocabulary_only_file() -> None:
    path = GGUF_OF["vocab-qwen35"]
    with open_gguf(path) as gguf_file:
        assert gguf_file.tensors == {} and list(gguf_file) == []
    tokenizer = actors.load_tokenizer(path)
    assert actors.load_tokenizer is load_tokenizer and "load_tokenizer" in actors.__all__
    assert tokenizer.vocab.pre is not None and tokenizer.vocab.size == 151936
    assert tokenizer.decode(tokenizer.encode("Hello, world")) == "Hello, world"


def _write_vocab_only(path: Path, model: str, tokens: list[str] | None) -> Path:
    """A GGUF of tokenizer metadata and no tensors, as llama.cpp's vocabulary files are."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    if tokens is not None:
        writer.add_token_list(tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_load_tokenizer_names_the_file_it_refuses(tmp_path: Path) -> None:
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("not a model at all")
    with pytest.raises(ModelFormatError, match=re.escape(f"{not_gguf}: not a GGUF file")):
        load_tokenizer(not_gguf)
    bert = _write_vocab_only(tmp_path / "bert.gguf", "bert", ["[CLS]", "a", "b"])
    with pytest.raises(
        UnsupportedModelError, match=re.escape(f"{bert}: unsupported tokenizer model 'bert'")
    ):
        load_tokenizer(bert)
    no_tokens = _write_vocab_only(tmp_path / "empty.gguf", "llama", None)
    missing_tokens = re.escape(f"{no_tokens}: metadata 'tokenizer.ggml.tokens' is missing")
    with pytest.raises(ModelFormatError, match=missing_tokens):
        load_tokenizer(no_tokens)
    with pytest.raises(ModelFormatError, match="no such model file"):
        load_tokenizer(tmp_path / "missing.gguf")
