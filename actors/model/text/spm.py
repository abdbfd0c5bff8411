"""SentencePiece (`tokenizer.ggml.model = llama`) encoding as a Hugging Face BPE model.

llama.cpp's llm_tokenizer_spm starts from single characters and keeps merging the adjacent
pair whose concatenation is the vocabulary token with the highest score (leftmost on ties);
characters that never become a token fall back to `<0xXX>` byte tokens. That is exactly a BPE
whose merge list holds every way to cut a token into two symbols, ranked by the score of the
token they make, with byte fallback. `tokenizers` runs that BPE in Rust; here we only derive
the merge list, vectorized: a 262k-token vocabulary has ~1.6M cut points.

A symbol is a token or a single character, and a character need not be a token to merge:
a vocabulary cut short (the first 1024 tokens of a real one) has '▁the' but not '▁'. Such
characters get ids past the vocabulary in the BPE model, and become their byte tokens when
one is left unmerged.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, models

from actors.model.text.vocab import Vocab

# Odd bases for the polynomial string hash; the next is tried if two tokens collide.
_SLOTS = 1 << 22
_SLOT_MASK = np.uint64(_SLOTS - 1)
_HASH_BASES = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9)


class SpmEncoder:
    """Cuts text fragments (spaces already '▁') into token ids like llama.cpp."""

    def __init__(self, vocab: Vocab) -> None:
        texts = vocab.tokens.texts()
        loose_chars = _chars_without_token(texts)
        symbols = texts + loose_chars
        merged, left, right = merge_pairs(symbols)
        # Best score first (token id on ties); among cuts of one token, transformers' order.
        token_rank = np.empty(vocab.size, dtype=np.int64)
        token_rank[np.argsort(-vocab.scores.astype(np.float64), kind="stable")] = np.arange(
            vocab.size
        )
        order = np.lexsort((right, left, token_rank[merged]))
        text = symbols.__getitem__
        merges = list(zip(map(text, left[order].tolist()), map(text, right[order].tolist())))
        loose_ids = {char: vocab.size + index for index, char in enumerate(loose_chars)}
        model = models.BPE(vocab={**vocab.token_to_id.as_dict(), **loose_ids}, merges=merges,
                           byte_fallback=True)
        self._tokenizer = Tokenizer(model)
        self._n_tokens = vocab.size
        # The byte tokens of each loose character, by its id past the vocabulary (a byte
        # without a token is dropped).
        self._loose_char_bytes = [
            [vocab.token_to_id[name] for name in _byte_token_names(char)
             if name in vocab.token_to_id]
            for char in loose_chars
        ]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [self._byte_fallback(encoding.ids) for encoding in encodings]

    def _byte_fallback(self, ids: list[int]) -> list[int]:
        """`ids` with each loose character left unmerged replaced by its byte tokens."""
        if not self._loose_char_bytes or max(ids, default=0) < self._n_tokens:
            return ids
        tokens: list[int] = []
        for token in ids:
            if token < self._n_tokens:
                tokens.append(token)
            else:
                tokens += self._loose_char_bytes[token - self._n_tokens]
        return tokens


def _byte_token_names(char: str) -> list[str]:
    return [f"<0x{byte:02X}>" for byte in char.encode("utf-8")]


def _code_points(tokens: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The code points of all tokens end to end, and each token's length."""
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    return np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32), lengths


def _chars_without_token(tokens: list[str]) -> list[str]:
    """The characters that occur in tokens but are no token themselves."""
    codes, lengths = _code_points(tokens)
    single = codes[(np.cumsum(lengths) - lengths)[lengths == 1]]
    return [chr(code) for code in np.setdiff1d(codes, single).tolist()]


def merge_pairs(tokens: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (token, left, right) with text[token] == text[left] + text[right], as id arrays."""
    codes, lengths = _code_points(tokens)
    ends = np.cumsum(lengths)
    starts = ends - lengths

    # Every cut point: token `owner`, cut at absolute code position `cut`.
    n_cuts = np.maximum(lengths - 1, 0)
    owner = np.repeat(np.arange(len(tokens)), n_cuts)
    cut = np.arange(int(n_cuts.sum())) - np.repeat(np.cumsum(n_cuts) - n_cuts, n_cuts)
    cut += np.repeat(starts + 1, n_cuts)

    lookup = _TokenTable(codes, starts, ends)
    left = lookup.find(starts[owner], cut)
    found = np.flatnonzero(left >= 0)
    owner, cut, left = owner[found], cut[found], left[found]
    right = lookup.find(cut, ends[owner])
    found = right >= 0
    merged, left, right = owner[found], left[found], right[found]
    exact = _same_text(codes, starts, lengths, merged, left, right)
    return merged[exact], left[exact], right[exact]


class _TokenTable:
    """Token id by text slice: a direct-address table on hash bits, binary search on clashes."""

    def __init__(self, codes: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        for base in _HASH_BASES:
            self.hasher = _SubstringHasher(codes, base)
            self.keys = self.hasher.key(starts, ends)
            self.order = np.argsort(self.keys)
            self.sorted_keys = self.keys[self.order]
            if np.all(self.sorted_keys[1:] != self.sorted_keys[:-1]):
                break
        else:  # pragma: no cover - three independent 64-bit hashes colliding
            raise RuntimeError("token hash collision under every base")
        slots = (self.keys & _SLOT_MASK).astype(np.int64)
        self.slot_token = np.full(_SLOTS, -1, dtype=np.int32)
        self.slot_token[slots] = np.arange(len(slots), dtype=np.int32)
        self.slot_shared = np.bincount(slots, minlength=_SLOTS) > 1

    def find(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Id of the token whose text is codes[lo:hi] (up to hash equality), else -1."""
        wanted = self.hasher.key(lo, hi)
        slots = (wanted & _SLOT_MASK).astype(np.int64)
        result = self.slot_token[slots]
        result = np.where((result >= 0) & (self.keys[result] == wanted), result, -1)
        clash = np.flatnonzero(self.slot_shared[slots] & (result < 0))
        index = np.minimum(np.searchsorted(self.sorted_keys, wanted[clash]), len(self.keys) - 1)
        hit = self.sorted_keys[index] == wanted[clash]
        result[clash[hit]] = self.order[index[hit]]
        return result


class _SubstringHasher:
    """Position-independent polynomial hash (mod 2^64) of any slice of the code array."""

    def __init__(self, codes: np.ndarray, base: int) -> None:
        n = len(codes)
        inverse = pow(base, -1, 1 << 64)
        with np.errstate(over="ignore"):
            self.powers = np.cumprod(np.full(n + 1, base, dtype=np.uint64)) * np.uint64(inverse)
            inverse_powers = np.cumprod(np.full(n, inverse, dtype=np.uint64))
            weighted = (codes.astype(np.uint64) + np.uint64(1)) * inverse_powers
            self.prefix = np.concatenate(([np.uint64(0)], np.cumsum(weighted, dtype=np.uint64)))
        self.base = base

    def key(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Hash of codes[lo:hi] for each pair, mixed with the length."""
        with np.errstate(over="ignore"):
            # sum_j c_j B^(hi-1-j) = B^(hi) * sum_j c_j B^-(j+1); powers[i] = B^i.
            value = self.powers[hi] * (self.prefix[hi] - self.prefix[lo])
            return value ^ ((hi - lo).astype(np.uint64) * np.uint64(0xFF51AFD7ED558CCD))


def _same_text(
    codes: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    merged: np.ndarray,
    left: np.ndarray,
    right: np.ndarray,
) -> np.ndarray:
    """Exact check of hash hits: text[merged] == text[left] + text[right], per candidate."""
    size = lengths[merged]
    offset = np.arange(int(size.sum())) - np.repeat(np.cumsum(size) - size, size)
    left_size = np.repeat(lengths[left], size)
    in_left = offset < left_size
    source = np.where(
        in_left,
        np.repeat(starts[left], size) + offset,
        np.repeat(starts[right], size) + offset - left_size,
    )
    equal = codes[np.repeat(starts[merged], size) + offset] == codes[source]
    mismatches = np.add.reduceat(~equal, np.cumsum(size) - size) if len(size) else size
    return mismatches == 0
