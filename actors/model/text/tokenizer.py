"""Text <-> token ids exactly as llama.cpp does it, from a GGUF's `tokenizer.*` metadata.

`Tokenizer.encode` follows `llama_vocab::impl::tokenize`: special-token texts are cut out first
(`special`), each raw fragment goes through the SPM or BPE encoder (Hugging Face
`tokenizers` models built in `spm` / `bpe`), BOS/EOS as the model asks.
`decode` and the streaming `IncrementalDecoder` join `token_to_piece` pieces, as llama.cpp's
server and llama-cpp-python do for generated text (not `llama_detokenize`, whose space
cleaning and first-space stripping they do not use).
`load_tokenizer` opens a GGUF file (a vocabulary-only one too) and builds its tokenizer.
"""

from __future__ import annotations

import codecs
import os
from array import array
from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from actors.errors import InvalidRequest, ModelFormatError, UnsupportedModelError
from actors.heap import release_free_memory
from actors.model.gguf.reader import GGUFFile, open_gguf
from actors.model.gguf.string_array import joined
from actors.model.packaged import resolve_model
from actors.model.text.bpe import (
    BYTE_LEVEL_CHARS,
    ByteLevelBpeEncoder,
    Utf8BpeEncoder,
    byte_level_bytes,
)
from actors.model.text.special import Fragment, SpecialTokenSplitter
from actors.model.text.spm import SpmEncoder
from actors.model.text.vocab import (
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_NORMAL,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    SPM_SPACE,
    Vocab,
    read_vocab,
)


class Tokenizer:
    """A model's tokenizer: `load_tokenizer(path)`, or `Tokenizer.from_gguf(gguf_file)` for
    a file already open."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self._splitter = SpecialTokenSplitter(vocab)
        # Every token's piece (special tokens rendered) end to end, token t at
        # [_piece_starts[t], _piece_starts[t + 1]) (an int64 array.array: one Python int at a
        # time quickly): 4 MB for a 262k-token vocabulary, where a bytes object each took
        # 15 MB. `_hidden`, a byte a token: 1 where the piece renders as nothing unless
        # special tokens are asked for.
        self._piece_bytes, self._piece_starts = _token_pieces(vocab)
        self._hidden = (vocab.attrs & (ATTR_CONTROL | ATTR_UNKNOWN) != 0).astype(np.uint8).tobytes()

    @classmethod
    def from_gguf(cls, gguf_file: Any) -> Tokenizer:
        """From an open GGUF file (anything with a `.metadata` mapping)."""
        return cls(read_vocab(gguf_file.metadata))

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    @property
    def bos_id(self) -> int | None:
        return self.vocab.special.get("bos")

    @property
    def eos_id(self) -> int | None:
        return self.vocab.special.get("eos")

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end generation: llama.cpp's end-of-generation set (EOS, end of turn...)."""
        return self.vocab.eog_ids

    @cached_property
    def _encoder(self) -> SpmEncoder | ByteLevelBpeEncoder | Utf8BpeEncoder:
        # Built on first use: ~1 s for a 262k-token vocabulary, not needed to decode.
        if self.vocab.model == "llama":
            return SpmEncoder(self.vocab)
        if self.vocab.byte_level:
            return ByteLevelBpeEncoder(self.vocab)
        return Utf8BpeEncoder(self.vocab)

    @cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token can stand for (special-token texts included)."""
        return max(1, int(np.diff(np.frombuffer(self._piece_starts, np.int64)).max(initial=1)))

    @cached_property
    def _bytes_that_count(self) -> np.ndarray:
        """bool[256]: text bytes that cannot vanish in encoding. A byte-level BPE drops each
        byte whose character is missing from its vocabulary (as llama.cpp does); another
        vocabulary without all 256 byte tokens may drop whole characters, so then only the
        ASCII bytes with a byte token count (a character with no token falls back to its
        byte tokens; every byte of a non-ASCII character is >= 0x80)."""
        if self.vocab.byte_level:
            return np.array([char in self.vocab.token_to_id for char in BYTE_LEVEL_CHARS])
        present = np.array([f"<0x{byte:02X}>" in self.vocab.token_to_id for byte in range(256)])
        return present if present.all() else present & (np.arange(256) < 0x80)

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))` from the bytes alone, in linear time: so a
        prompt that cannot fit a context is refused without tokenizing it."""
        data = text.encode("utf-8", errors="surrogatepass")
        counting = self._bytes_that_count
        if counting.all():
            kept = len(data)
        else:
            kept = int(np.count_nonzero(counting[np.frombuffer(data, np.uint8)]))
        return -(-kept // self.max_token_bytes)

    def prepare_encoder(self) -> None:
        """Build the encoder and the special-token patterns now (e.g. in a loading thread)
        instead of on the first encode, which may run on the event loop; then give the
        build's freed temporaries back to the system (about 95 MB for gemma-3's vocabulary,
        which the C heap would otherwise keep resident)."""
        self._encoder  # noqa: B018 - the cached properties build and keep them
        self._bytes_that_count  # noqa: B018 - 256 token lookups, not on a request's loop
        self._splitter.prepare()
        release_free_memory()

    def encode(
        self, text: str, *, add_bos: bool | None = None, parse_special: bool = False
    ) -> list[int]:
        """Token ids of `text`.

        add_bos: None does what llama.cpp does with `add_special`: BOS if the model's
        `add_bos_token` says so (and EOS if `add_eos_token` does); True/False force a BOS or none.
        parse_special: also match control tokens such as `<|im_start|>` in the text; user-defined
        tokens are always matched.
        """
        if not isinstance(text, str):
            raise InvalidRequest(f"text must be a str, not {type(text).__name__}", field="text")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InvalidRequest(
                f"text is not valid Unicode: {error.reason} at index {error.start}", field="text"
            ) from None
        add_eos = add_bos is None and self.vocab.add_eos
        if add_bos is None:
            add_bos = self.vocab.add_bos
        ids: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise InvalidRequest("this model has no BOS token", field="add_bos")
            ids.append(self.bos_id)
        ids += self._encode_fragments(self._splitter.split(text, parse_special))
        if add_eos:
            ids.append(self.vocab.special["eos"])
        return ids

    def _encode_fragments(self, fragments: list[Fragment]) -> list[int]:
        if self.vocab.model == "llama":
            raw = _spm_texts(fragments, self.vocab.add_space_prefix)
        else:
            raw = [fragment for fragment in fragments if isinstance(fragment, str)]
        if not raw:
            return [fragment for fragment in fragments if isinstance(fragment, int)]
        encoded = iter(self._encoder.encode_batch(raw))
        ids: list[int] = []
        for fragment in fragments:
            if isinstance(fragment, str):
                ids += next(encoded)
            else:
                ids.append(fragment)
        return ids

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        """Text of `ids`: the pieces of the tokens, joined (llama.cpp's `token_to_piece`);
        `special` also renders control tokens. As llama.cpp gives generated text, spaces are
        kept as the tokens have them: the space a SentencePiece token starts with too.

        Bytes that are not valid UTF-8 (a sequence cut inside a character) become U+FFFD.
        """
        ids = self._checked_ids(ids)
        piece_starts = np.frombuffer(self._piece_starts, dtype=np.int64)
        starts = piece_starts[ids]
        ends = piece_starts[ids + 1]
        if not special:
            ends = np.where(np.frombuffer(self._hidden, dtype=np.uint8)[ids], starts, ends)
        lengths = ends - starts
        # The byte positions of every piece, end to end.
        positions = np.arange(int(lengths.sum())) + np.repeat(
            starts - (np.cumsum(lengths) - lengths), lengths)
        data = np.frombuffer(self._piece_bytes, dtype=np.uint8)[positions].tobytes()
        return data.decode("utf-8", errors="replace")

    def incremental_decoder(self, *, special: bool = False) -> IncrementalDecoder:
        """A streaming decoder whose pushes + flush concatenate to `decode(ids, special=...)`."""
        return IncrementalDecoder(self, special=special)

    def piece(self, token_id: int, *, special: bool = False) -> bytes:
        """The bytes one token stands for (control tokens render their text only if `special`)."""
        # A plain int in range skips the array check: streaming calls this once a token.
        if type(token_id) is not int or not 0 <= token_id < self.vocab.size:
            token_id = int(self._checked_ids((token_id,))[0])
        if not special and self._hidden[token_id]:
            return b""
        starts = self._piece_starts
        return self._piece_bytes[starts[token_id] : starts[token_id + 1]]

    def _checked_ids(self, ids: Iterable[int]) -> np.ndarray:
        """`ids` as an int64 array, each checked to be a token of the vocabulary."""
        try:
            array = np.asarray(ids if isinstance(ids, Sequence | np.ndarray) else list(ids))
        except (TypeError, ValueError):
            raise InvalidRequest("token ids must be a sequence of integers", field="ids") from None
        if array.size == 0:
            return np.zeros(0, dtype=np.int64)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise InvalidRequest("token ids must be a flat sequence of integers", field="ids")
        bad = np.flatnonzero((array < 0) | (array >= self.vocab.size))
        if len(bad):
            raise InvalidRequest(
                f"token id {int(array[bad[0]])} is out of range: the vocabulary has "
                f"{self.vocab.size} tokens (0..{self.vocab.size - 1})",
                field="ids",
            )
        return array.astype(np.int64, copy=False)


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of the GGUF file at `path` (or of the packaged model it names, such as
    "gemma-3-270m"): a whole model, or a vocabulary-only file (no tensors). ModelFormatError
    for a file that is no valid GGUF or holds a broken vocabulary (or a packaged model not
    installed), UnsupportedModelError for a tokenizer this engine lacks; both name the file."""
    with open_gguf(resolve_model(path)) as gguf_file:
        return tokenizer_of_file(gguf_file)


def tokenizer_of_file(gguf_file: GGUFFile) -> Tokenizer:
    """The tokenizer of an open GGUF file (what `load_tokenizer` and an opened model use);
    its errors name the file."""
    try:
        return Tokenizer.from_gguf(gguf_file)
    except (ModelFormatError, UnsupportedModelError) as error:
        raise type(error)(f"{gguf_file.path}: {error}") from None


class IncrementalDecoder:
    """Turns a stream of token ids into text chunks for streaming.

    A chunk never holds broken UTF-8 (an emoji split over byte tokens waits for its last byte),
    so chunks are final: the concatenation of every `push` and the `flush` equals
    `Tokenizer.decode` of the same ids.
    """

    def __init__(self, tokenizer: Tokenizer, *, special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        piece = self._tokenizer.piece(token_id, special=self._special)
        # ASCII with no partial character held decodes as is: most tokens, once a token,
        # without the codec's Python-level buffering.
        if piece.isascii() and not self._utf8.getstate()[0]:
            return piece.decode("ascii")
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """The text still held back (a character cut short at the end of the stream)."""
        return self._utf8.decode(b"", final=True)


def _token_pieces(vocab: Vocab) -> tuple[bytes, array]:
    """What each token renders as when special tokens are shown (llama.cpp's piece cache):
    the pieces end to end, and where each starts (int64, one more for the end of the last)."""
    attrs = vocab.attrs.tolist()
    byte_level = vocab.byte_level
    pieces = []
    for text, attr in zip(vocab.tokens, attrs):
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            pieces.append(text.encode())
        elif attr & ATTR_NORMAL:
            pieces.append(
                byte_level_bytes(text) if byte_level else text.replace(SPM_SPACE, " ").encode()
            )
        elif attr & ATTR_BYTE:
            pieces.append(bytes([int(text[3:5], 16)]))
        else:  # unused and undefined tokens render as nothing
            pieces.append(b"")
    return joined(pieces)


def _spm_texts(fragments: list[Fragment], add_space_prefix: bool) -> list[str]:
    """Raw fragments as SentencePiece sees them: '▁' for spaces, and (with add_space_prefix)
    one more first when a special token or the start of the text precedes them."""
    texts = []
    after_special = True  # llama.cpp prefixes the first fragment as if a special token preceded
    for fragment in fragments:
        if isinstance(fragment, str):
            prefix = " " if add_space_prefix and after_special else ""
            texts.append((prefix + fragment).replace(" ", SPM_SPACE))
        after_special = isinstance(fragment, int)
    return texts
