"""BPE (`tokenizer.ggml.model = gpt2` or `gemma4`) as Hugging Face `tokenizers` models.

llama.cpp's llm_tokenizer_bpe cuts text into words, then merges the symbols of each word by
rank. Two kinds of vocabulary:

- byte-level (gpt2): words come from the pre-tokenizer regexes of `tokenizer.ggml.pre` (each
  regex splits the pieces of the previous one, keeping the text between matches), and bytes
  are mapped to GPT-2's printable characters. A `tokenizers` pipeline of
  `Split(regex, "isolated")` steps, `ByteLevel` without its own regex and a BPE model over the
  GGUF's vocabulary and merges does the same in Rust. A character whose byte-level form is not
  in the vocabulary splits its word in llama.cpp (it stays a symbol that no merge joins, and is
  dropped at the end), where a `tokenizers` BPE without an unknown token would drop it first
  and merge its neighbours; so the model gets an unknown token outside the vocabulary, which
  the encoder drops afterwards.
- UTF-8 (gemma4, SentencePiece-style): spaces become '▁', each line and each run of newlines
  is a word of raw UTF-8 characters, a run of newlines that is a token is taken whole, and a
  character without a token falls back to its `<0xXX>` byte tokens.
"""

from __future__ import annotations

import re
from typing import Any

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from actors.errors import UnsupportedModelError
from actors.model.text.vocab import SPM_SPACE, Vocab

# Text of the unknown token; NUL-led, so no GGUF vocabulary holds it.
_UNKNOWN_CHAR = "\x00q4k-unknown-char"
# llama.cpp's words for Gemma 4: `[^\n]+|[\n]+`.
_LINES_AND_NEWLINES = re.compile(r"[^\n]+|\n+")


class ByteLevelBpeEncoder:
    """Cuts raw text fragments into token ids like llama.cpp, for a byte-level vocabulary."""

    def __init__(self, vocab: Vocab) -> None:
        assert vocab.pre is not None
        self._unknown = vocab.size  # the id of a character missing from the vocabulary
        model = _bpe_model(
            vocab,
            {**vocab.token_to_id.as_dict(), _UNKNOWN_CHAR: self._unknown},
            unk_token=_UNKNOWN_CHAR,
            ignore_merges=vocab.ignore_merges,
        )
        self._tokenizer = Tokenizer(model)
        self._tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in vocab.pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        # llama.cpp drops a character its vocabulary lacks.
        return [
            [token for token in encoding.ids if token != self._unknown]
            if self._unknown in encoding.ids
            else encoding.ids
            for encoding in encodings
        ]


class Utf8BpeEncoder:
    """Cuts raw text fragments into token ids like llama.cpp, for a SentencePiece-style
    vocabulary (Gemma 4)."""

    def __init__(self, vocab: Vocab) -> None:
        self._tokenizer = Tokenizer(_bpe_model(vocab, vocab.token_to_id.as_dict(),
                                               byte_fallback=True))
        self._newline_runs = {
            text: token for token, text in enumerate(vocab.tokens) if text.strip("\n") == ""
        }

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        words = [_LINES_AND_NEWLINES.findall(text.replace(" ", SPM_SPACE)) for text in texts]
        to_merge = [word for fragment in words for word in fragment
                    if word not in self._newline_runs]
        merged = iter(self._tokenizer.encode_batch_fast(to_merge, add_special_tokens=False))
        ids: list[list[int]] = []
        for fragment in words:
            fragment_ids: list[int] = []
            for word in fragment:
                whole = self._newline_runs.get(word)
                fragment_ids += next(merged).ids if whole is None else [whole]
            ids.append(fragment_ids)
        return ids


def _bpe_model(vocab: Vocab, token_ids: dict[str, int], **options: Any) -> models.BPE:
    """A `tokenizers` BPE over `token_ids` and the vocabulary's merges, in rank order."""
    # llama.cpp cuts a merge at the first space after its first character.
    cuts = [merge.find(" ", 1) for merge in vocab.merges]
    pairs = [
        (merge[:cut], merge[cut + 1 :]) if cut > 0 else ("", "")
        for merge, cut in zip(vocab.merges, cuts)
    ]
    try:
        return models.BPE(vocab=token_ids, merges=pairs, **options)
    except Exception as error:  # what `tokenizers` raises for a merge outside the vocabulary
        texts = token_ids.keys()
        for rank, (left, right) in enumerate(pairs):
            if not {left, right, left + right} <= texts:
                raise UnsupportedModelError(
                    f"BPE merge #{rank} {vocab.merges[rank]!r} joins or makes text that is not "
                    "in the vocabulary"
                ) from None
        raise error


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (unicode_byte_to_utf8_map)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {byte: chr(byte) for byte in printable}
    others = (byte for byte in range(256) if byte not in mapping)
    mapping.update({byte: chr(256 + index) for index, byte in enumerate(others)})
    return mapping


# The byte-level character of each byte value, by value.
BYTE_LEVEL_CHARS = tuple(char for _, char in sorted(_byte_to_char().items()))
# Translates byte-level characters to latin-1 characters of the same byte value.
_TO_LATIN1 = {ord(char): byte for byte, char in _byte_to_char().items()}


def byte_level_bytes(token_text: str) -> bytes:
    """The bytes a normal BPE token stands for (llama.cpp's llama_decode_text)."""
    if all(ord(char) in _TO_LATIN1 for char in token_text):
        return token_text.translate(_TO_LATIN1).encode("latin-1")
    # A character outside the byte map: llama.cpp writes a marker with the token text.
    out = bytearray()
    for char in token_text:
        if ord(char) in _TO_LATIN1:
            out.append(_TO_LATIN1[ord(char)])
        else:
            hex_bytes = "".join(f"{byte:02x}" for byte in char.encode("utf-8"))
            out += f"[UNK_BYTE_0x{hex_bytes}{token_text}]".encode()
    return bytes(out)
