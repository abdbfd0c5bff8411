"""The compact token tables: GGUF string arrays (`StringArray`) and token lookup by text
(`TokenIds`), against the plain list and dict they stand for."""

from __future__ import annotations

import pickle
import zlib

import numpy as np
import pytest

from actors.model.gguf.reader import open_gguf
from actors.model.gguf.string_array import StringArray
from actors.model.text.vocab import TokenIds, read_vocab
from tests.conftest import smollm2_path

TEXTS = ["", "a", "héllo", "▁the", "😀", "<0x0A>", "\n\n", "a b c"]


def test_a_string_array_reads_as_the_list_it_holds() -> None:
    array = StringArray.of(TEXTS)
    assert len(array) == len(TEXTS)
    assert list(array) == array.texts() == TEXTS
    assert [array[index] for index in range(-len(TEXTS), len(TEXTS))] == TEXTS + TEXTS
    assert array[2:5] == TEXTS[2:5]
    assert array == TEXTS and array != TEXTS[:-1] and array == StringArray.of(TEXTS)
    assert "▁the" in array and "absent" not in array
    with pytest.raises(IndexError):
        array[len(TEXTS)]
    assert pickle.loads(pickle.dumps(array)) == TEXTS


def test_a_lone_surrogate_survives_the_round_trip() -> None:
    assert StringArray.of(["a\ud800b"])[0] == "a\ud800b"


def test_gguf_string_arrays_hold_the_files_strings() -> None:
    with open_gguf(smollm2_path()) as gguf_file:
        tokens = gguf_file.metadata["tokenizer.ggml.tokens"]
        merges = gguf_file.metadata["tokenizer.ggml.merges"]
        assert isinstance(tokens, StringArray) and isinstance(merges, StringArray)
        assert len(tokens) == 49152 and tokens[0] == "<|endoftext|>"
        assert all(isinstance(text, str) for text in tokens)


def test_token_ids_find_every_token_as_a_dict_would() -> None:
    with open_gguf(smollm2_path()) as gguf_file:
        vocab = read_vocab(gguf_file.metadata)
    texts = vocab.tokens.texts()
    expected = {text: token for token, text in enumerate(texts)}
    assert [vocab.token_to_id[text] for text in texts] == list(range(len(texts)))
    assert vocab.token_to_id.as_dict() == expected
    assert list(vocab.token_to_id) == texts and len(vocab.token_to_id) == len(texts)
    for absent in ("no such token text", "", 7, None, b"<|im_end|>"):
        assert absent not in vocab.token_to_id
        assert vocab.token_to_id.get(absent) is None
    with pytest.raises(KeyError):
        vocab.token_to_id["no such token text"]
    again = pickle.loads(pickle.dumps(vocab.token_to_id))
    assert again["<|im_end|>"] == expected["<|im_end|>"]


def test_token_ids_tell_apart_texts_with_the_same_checksum() -> None:
    first, second = _crc32_collision()
    ids = TokenIds(StringArray.of(["x", first, "y", second]))
    assert ids[first] == 1 and ids[second] == 3 and ids["x"] == 0
    assert first + "!" not in ids


def _crc32_collision() -> tuple[str, str]:
    """Two different short texts with the same CRC-32 (a birthday search: 2^18 texts hold
    several pairs)."""
    letters = np.random.default_rng(3).integers(97, 123, size=(1 << 18, 10), dtype=np.uint8)
    texts = [row.tobytes().decode() for row in letters]
    checksums = np.array([zlib.crc32(text.encode()) for text in texts], dtype=np.uint32)
    order = np.argsort(checksums, kind="stable")
    same = np.flatnonzero(checksums[order][1:] == checksums[order][:-1])
    assert len(same), "no CRC-32 collision among 2^18 texts"
    return texts[order[same[0]]], texts[order[same[0] + 1]]
