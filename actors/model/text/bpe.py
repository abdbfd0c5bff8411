"""Byte-level BPE (`tokenizer.ggml.model = gpt2`) as a Hugging Face `tokenizers` model.

llama.cpp's llm_tokenizer_bpe splits text with the pre-tokenizer regexes of
`tokenizer.ggml.pre` (each regex splits the pieces of the previous one, keeping the text
between matches), maps bytes to GPT-2's printable characters, then merges by rank. A
`tokenizers` pipeline of `Split(regex, "isolated")` steps, `ByteLevel` without its own regex
and a BPE model over the GGUF's vocabulary and merges does the same in Rust.

A character whose byte-level form is not in the vocabulary splits its piece in llama.cpp (it
stays a symbol that no merge joins, and is dropped at the end), where a `tokenizers` BPE without
an unknown token would drop it first and merge its neighbours. So the model gets an unknown
token outside the vocabulary, `unknown_char_id(vocab)`, which the caller drops.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from actors.errors import UnsupportedModelError
from actors.model.text.vocab import Vocab


# Text of the unknown token; NUL-led, so no GGUF vocabulary holds it.
_UNKNOWN_CHAR = "\x00q4k-unknown-char"


def unknown_char_id(vocab: Vocab) -> int:
    """The id the BPE model gives a character missing from `vocab`: past its last token."""
    return vocab.size


def build_bpe_model(vocab: Vocab) -> Tokenizer:
    """A `tokenizers.Tokenizer` that cuts one raw text fragment like llama.cpp, except that it
    yields `unknown_char_id(vocab)` for a character missing from the vocabulary."""
    assert vocab.pre is not None
    token_to_id = vocab.token_to_id
    merges = []
    for rank, merge in enumerate(vocab.merges):
        cut = merge.find(" ", 1)  # llama.cpp: the first space after the first character
        left, right = (merge[:cut], merge[cut + 1 :]) if cut > 0 else ("", "")
        if left not in token_to_id or right not in token_to_id or left + right not in token_to_id:
            raise UnsupportedModelError(
                f"BPE merge #{rank} {merge!r} joins or makes text that is not in the vocabulary"
            )
        merges.append((left, right))
    model = models.BPE(
        vocab={**token_to_id, _UNKNOWN_CHAR: unknown_char_id(vocab)},
        merges=merges,
        unk_token=_UNKNOWN_CHAR,
        ignore_merges=vocab.ignore_merges,
    )
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in vocab.pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return tokenizer


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
