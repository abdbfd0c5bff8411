"""A GGUF's `tokenizer.*` metadata read the way llama.cpp's `llama_vocab::load` reads it.

Everything here decides *what* the tokenizer is (token attributes, special ids, flags, the
pre-tokenizer of a BPE vocabulary); the encoders in `spm` / `bpe` and the
`Tokenizer` in `tokenizer` decide *how* text is cut. llama.cpp's quirks are kept on purpose,
because every one of them changes the ids the model sees (e.g. `</s>` in Gemma's vocabulary is
user-defined in the file but treated as a control token, so plain text never matches it).
"""

from __future__ import annotations

import re
import zlib
from array import array
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from actors.errors import ModelFormatError, UnsupportedModelError
from actors.model.gguf.string_array import StringArray

# llama_token_attr bits (llama.h).
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_RSTRIP = 1 << 8  # whitespace right after this special token is dropped

SPM_SPACE = "\u2581"  # '▁', how SentencePiece-style vocabularies write a space

# GGUF token types (llama_token_type) -> attribute bits; anything else is "undefined" (0).
_TYPE_TO_ATTR = np.zeros(8, dtype=np.int32)
_TYPE_TO_ATTR[1] = ATTR_NORMAL
_TYPE_TO_ATTR[2] = ATTR_UNKNOWN
_TYPE_TO_ATTR[3] = ATTR_CONTROL
_TYPE_TO_ATTR[4] = ATTR_USER_DEFINED
_TYPE_TO_ATTR[5] = ATTR_UNUSED
_TYPE_TO_ATTR[6] = ATTR_BYTE

# The pre-tokenizer regexes of llama.cpp's llm_tokenizer_bpe, applied one after another.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen 3.5: as Qwen 2, but runs of letters also take combining marks (\p{M}).
QWEN35_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """One `tokenizer.ggml.pre` family: its regexes and the flags llama.cpp sets with it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    always_bos: bool = False  # a BOS even where the file's add_bos_token says none
    # False for SentencePiece-style BPE (Gemma 4): token texts are UTF-8 with '▁' for a
    # space and <0xXX> byte tokens instead of GPT-2's byte-level alphabet, and the text is
    # cut into lines and runs of newlines instead of by regexes (see `bpe`).
    byte_level: bool = True


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2 = PreTokenizer((GPT2_REGEX,))
_STARCODER = PreTokenizer((r"\p{N}", GPT2_REGEX))
_LLAMA3 = PreTokenizer((LLAMA3_REGEX,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((QWEN2_REGEX,))
_GEMMA4 = PreTokenizer((), always_bos=True, byte_level=False)

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "exaone4", "mellum"), _GPT2),
    **dict.fromkeys(
        ("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "smollm", "command-r"),
        _STARCODER,
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0"), _LLAMA3
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((LLAMA3_REGEX,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _QWEN2),
    "qwen35": PreTokenizer((QWEN35_REGEX,)),
    "gemma4": _GEMMA4,
}

# Texts llama.cpp recognises as end-of-turn / end-of-generation tokens (llama-vocab.cpp),
# forcing them to control type when the file says otherwise.
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)  # fmt: skip
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# Characters of one token's text: real vocabularies stay under ~100 (gemma-3: 31, SmolLM2: 81).
# A special token is matched by a regex trie whose cost per text position grows with the
# longest one, and every token's length bounds what one token can stand for.
MAX_TOKEN_CHARS = 1024
# Characters of all special-token texts together (gemma-3's 6.4k: 76k): the trie regexes built
# from them cost up to about 1 us and 120 bytes a character to compile.
MAX_SPECIAL_CHARS = 1 << 19

# Metadata keys of the special ids, in llama.cpp's order (later deprecated keys win).
_SPECIAL_ID_KEYS = (
    ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
    ("eom", "eom_token_id"), ("unk", "unknown_token_id"), ("sep", "seperator_token_id"),
    ("pad", "padding_token_id"), ("mask", "mask_token_id"), ("fim_pre", "fim_pre_token_id"),
    ("fim_suf", "fim_suf_token_id"), ("fim_mid", "fim_mid_token_id"),
    ("fim_pad", "fim_pad_token_id"), ("fim_rep", "fim_rep_token_id"),
    ("fim_sep", "fim_sep_token_id"), ("fim_pre", "prefix_token_id"),
    ("fim_suf", "suffix_token_id"), ("fim_mid", "middle_token_id"),
)  # fmt: skip


class TokenIds(Mapping[str, int]):
    """Token text -> id over the vocabulary's texts: the ids ordered by a CRC-32 of their
    text, found by bisection and checked against the text (2 MB for a 262k-token vocabulary,
    where a dict took 15 MB; a lookup takes a few microseconds). `as_dict()` for code that
    builds from every token."""

    def __init__(self, texts: StringArray) -> None:
        self._texts = texts
        checksums = texts.checksums()
        order = np.argsort(checksums, kind="stable")
        # array.arrays: bisection reads one Python int at a time from them quickly.
        self._order = array("i", order.astype(np.int32).tobytes())
        self._sorted = array("I", checksums[order].tobytes())

    def __getitem__(self, text: str) -> int:
        if isinstance(text, str):
            key = zlib.crc32(text.encode("utf-8", "surrogatepass"))
            keys, order = self._sorted, self._order
            at = bisect_left(keys, key)
            while at < len(keys) and keys[at] == key:
                if self._texts[order[at]] == text:
                    return order[at]
                at += 1
        raise KeyError(text)

    def __iter__(self) -> Iterator[str]:
        return iter(self._texts)

    def __len__(self) -> int:
        return len(self._texts)

    def as_dict(self) -> dict[str, int]:
        """Every text -> its id, as a dict (built now: ~30 ms for 262k tokens)."""
        return {text: token for token, text in enumerate(self._texts.texts())}


@dataclass(frozen=True)
class Vocab:
    """The tokenizer as llama.cpp sees it after loading: texts, scores, attributes, flags."""

    model: str  # "llama" (SPM), "gpt2" (byte-level BPE) or "gemma4" (SentencePiece-style BPE)
    tokens: StringArray
    token_to_id: TokenIds
    scores: np.ndarray  # float32, one per token
    attrs: np.ndarray  # int32 ATTR_* bits, one per token
    merges: Sequence[str]  # BPE only: "left right", rank = position
    pre: PreTokenizer | None  # BPE only
    special: dict[str, int]  # bos, eos, unk, eot, ... -> id, only those that are set
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    ignore_merges: bool

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def byte_level(self) -> bool:
        """Token texts spell bytes in GPT-2's byte-level alphabet; otherwise (SentencePiece,
        Gemma 4) they are UTF-8 with '▁' for a space, and <0xXX> tokens stand for bytes."""
        return self.pre is not None and self.pre.byte_level


def read_vocab(metadata: Mapping[str, Any]) -> Vocab:
    """Read `tokenizer.*` metadata; UnsupportedModelError for tokenizers this engine lacks."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise ModelFormatError("the model has no tokenizer (metadata 'tokenizer.ggml.model')")
    _check_text(metadata, "tokenizer.ggml.model")
    texts = _strings(metadata, "tokenizer.ggml.tokens")
    if not texts:
        raise ModelFormatError("metadata 'tokenizer.ggml.tokens' is empty: the vocabulary has no tokens")
    # Every text as a str while the vocabulary is checked and marked; kept as a StringArray.
    tokens = texts.texts() if isinstance(texts, StringArray) else list(texts)
    n_tokens = len(tokens)
    if model == "llama":
        pre = None
        merges: Sequence[str] = []
        special = {"bos": 1, "eos": 2, "unk": 0}
        add_bos, add_space_prefix = True, True
    elif model in ("gpt2", "gemma4"):
        # llama.cpp gives tokenizer model gemma4 its own pre-tokenizer, whatever the file names.
        pre = _GEMMA4 if model == "gemma4" else _named_pre_tokenizer(metadata)
        merges = _strings(metadata, "tokenizer.ggml.merges")
        special = {"bos": 11, "eos": 11} if model == "gpt2" else {}
        add_bos, add_space_prefix = pre.add_bos, False
    else:
        raise UnsupportedModelError(
            f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); supported: "
            "'llama' (SentencePiece BPE), 'gpt2' (byte-level BPE) and 'gemma4' "
            "(SentencePiece-style BPE)"
        )
    add_space_prefix = _flag(metadata, "tokenizer.ggml.add_space_prefix", add_space_prefix)

    if "" in tokens:  # llama.cpp names empty tokens so they stay distinct
        tokens = [text or f"[EMPTY_{index}]" for index, text in enumerate(tokens)]
        texts = tokens
    token_to_id = {text: index for index, text in enumerate(tokens)}
    if len(token_to_id) != n_tokens:
        raise ModelFormatError("tokenizer.ggml.tokens holds the same token text twice")
    scores = _numeric_array(metadata, "tokenizer.ggml.scores", n_tokens, np.float32)
    types = _numeric_array(metadata, "tokenizer.ggml.token_type", n_tokens, np.int32, fill=1)
    attrs = _TYPE_TO_ATTR[np.clip(types, 0, 7)].copy()
    _check_byte_tokens(tokens, attrs)

    special = {name: token for name, token in special.items() if token < n_tokens}
    for name, key in _SPECIAL_ID_KEYS:
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is None:
            continue
        if not isinstance(value, int | np.integer):
            raise ModelFormatError(f"metadata 'tokenizer.ggml.{key}' is not an integer: {value!r}")
        if 0 <= value < n_tokens:  # llama.cpp ignores an id outside the vocabulary
            special[name] = int(value)
    add_bos = _flag(metadata, "tokenizer.ggml.add_bos_token", add_bos) or (
        pre is not None and pre.always_bos
    )
    add_eos = _flag(metadata, "tokenizer.ggml.add_eos_token", False)
    for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and name not in special:
            raise ModelFormatError(
                f"tokenizer.ggml.add_{name}_token is set but the model has no {name} token"
            )
    eog_ids = _mark_special_tokens(token_to_id, attrs, special)
    _mark_rstrip_tokens(metadata.get("general.name"), token_to_id, attrs)
    _check_token_lengths(tokens, attrs)
    kept = StringArray.of(texts)  # the metadata's own array where no token was renamed
    return Vocab(
        model=model,
        tokens=kept,
        token_to_id=TokenIds(kept),
        scores=scores,
        attrs=attrs,
        merges=merges,
        pre=pre,
        special=special,
        eog_ids=eog_ids,
        add_bos=add_bos,
        add_eos=add_eos,
        add_space_prefix=add_space_prefix,
        ignore_merges=pre is not None and pre.ignore_merges,
    )


def _named_pre_tokenizer(metadata: Mapping[str, Any]) -> PreTokenizer:
    """The pre-tokenizer a `gpt2` BPE file names in `tokenizer.ggml.pre`."""
    pre_name = metadata.get("tokenizer.ggml.pre")
    if pre_name is None:
        raise UnsupportedModelError(
            "BPE tokenizer without 'tokenizer.ggml.pre': the pre-tokenizer is unknown "
            "(llama.cpp would guess 'default' and degrade quality); re-convert the model"
        )
    _check_text(metadata, "tokenizer.ggml.pre")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise UnsupportedModelError(
            f"unsupported BPE pre-tokenizer {pre_name!r} (tokenizer.ggml.pre); supported: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return pre


def _mark_special_tokens(
    token_to_id: dict[str, int], attrs: np.ndarray, special: dict[str, int]
) -> frozenset[int]:
    """llama.cpp's text-based detection of end-of-turn, FIM and end-of-generation tokens.

    Found tokens become control tokens (never matched in plain text, hidden when decoding).
    Where llama.cpp takes the first match of a hash map, we take the lowest id.
    """

    def present(texts: tuple[str, ...]) -> list[int]:
        return sorted(token_to_id[text] for text in texts if text in token_to_id)

    for name, texts in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), *_FIM_TEXTS.items()):
        if name not in special and (found := present(texts)):
            special[name] = found[0]
            attrs[found[0]] |= ATTR_CONTROL

    eog = {special[name] for name in ("fim_pad", "fim_rep", "fim_sep") if name in special}
    for token in present(_EOG_TEXTS):
        eog.add(token)
        attrs[token] |= ATTR_CONTROL
    for token in present(_ALWAYS_USER_DEFINED):
        attrs[token] = ATTR_USER_DEFINED
    eog.update(special[name] for name in ("eos", "eot", "eom") if name in special)

    eog_texts = {text: token for text in _EOG_TEXTS if (token := token_to_id.get(text)) in eog}
    # o200k_harmony / solar-open: "<|end|>" ends a message there, not the generation.
    has_call = "<|call|>" in eog_texts or "<|calls|>" in eog_texts
    if "<|end|>" in eog_texts and has_call and eog_texts.keys() & {"<|return|>", "<|flush|>"}:
        eog.discard(eog_texts["<|end|>"])
        attrs[eog_texts["<|end|>"]] = ATTR_USER_DEFINED
    # gemma4 / paddleocr: "</s>" is an ordinary token there.
    if "<|tool_response>" in eog_texts and "</s>" in eog_texts:
        eog.discard(eog_texts["</s>"])
        attrs[eog_texts["</s>"]] = ATTR_NORMAL
    return frozenset(eog)


# llama.cpp sets some token attributes by model name, the file having none: in a model named
# Phi-3 every special token drops the whitespace after it in the text, except these.
_PHI3_NAMES = ("phi-3", "phi3")
_PHI3_KEEP_SPACE = ("<unk>", "<s>", "<|endoftext|>")


def _mark_rstrip_tokens(model_name: Any, token_to_id: dict[str, int], attrs: np.ndarray) -> None:
    if not isinstance(model_name, str) or not any(
        name in model_name.lower() for name in _PHI3_NAMES
    ):
        return
    attrs[attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0] |= ATTR_RSTRIP
    for text in _PHI3_KEEP_SPACE:
        if text in token_to_id:
            attrs[token_to_id[text]] &= ~ATTR_RSTRIP


def _strings(metadata: Mapping[str, Any], key: str) -> StringArray | list[str]:
    value = metadata.get(key)
    if not isinstance(value, StringArray | list) or (value and not isinstance(value[0], str)):
        raise ModelFormatError(f"metadata {key!r} is missing or is not an array of strings")
    return value


def _check_text(metadata: Mapping[str, Any], key: str) -> None:
    if not isinstance(metadata[key], str):
        raise ModelFormatError(f"metadata {key!r} must be a string, got {_kind(metadata[key])}")


def _flag(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(key, default)
    if not isinstance(value, bool | np.bool_):
        raise ModelFormatError(f"metadata {key!r} must be a bool, got {_kind(value)}")
    return bool(value)


def _kind(value: Any) -> str:
    if isinstance(value, np.ndarray | list | StringArray):
        return f"an array of {len(value)} items"
    return f"a {type(value).__name__}"


def _check_token_lengths(tokens: list[str], attrs: np.ndarray) -> None:
    """Refuse token texts past MAX_TOKEN_CHARS, and special-token texts past
    MAX_SPECIAL_CHARS in all, before anything is built from them."""
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    longest = int(np.argmax(lengths))
    if lengths[longest] > MAX_TOKEN_CHARS:
        raise ModelFormatError(
            f"token {longest} of tokenizer.ggml.tokens is {lengths[longest]:,} characters long "
            f"(at most {MAX_TOKEN_CHARS:,}): {tokens[longest][:40]!r}..."
        )
    special = attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0
    special_chars = int(lengths[special].sum())
    if special_chars > MAX_SPECIAL_CHARS:
        raise ModelFormatError(
            f"the {int(special.sum()):,} special tokens (control, user-defined, unknown) of "
            f"tokenizer.ggml.tokens hold {special_chars:,} characters (at most "
            f"{MAX_SPECIAL_CHARS:,} in all)"
        )


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _check_byte_tokens(tokens: list[str], attrs: np.ndarray) -> None:
    """A BYTE token stands for the byte its text names, `<0xHH>` (llama.cpp reads it so)."""
    for token in np.flatnonzero(attrs & ATTR_BYTE).tolist():
        if not _BYTE_TOKEN.fullmatch(tokens[token]):
            raise ModelFormatError(
                f"token {token} is a BYTE token (tokenizer.ggml.token_type 6) but its text "
                f"{tokens[token][:40]!r} is not of the form <0xHH>"
            )


def _numeric_array(
    metadata: Mapping[str, Any], key: str, n_tokens: int, dtype: type, fill: float = 0
) -> np.ndarray:
    value = metadata.get(key)
    if value is None:
        return np.full(n_tokens, fill, dtype=dtype)
    try:
        array = np.asarray(value)
    except ValueError:  # nested arrays of different lengths
        array = np.asarray([])
    if array.ndim != 1 or array.dtype.kind not in "iuf" or len(array) < n_tokens:
        raise ModelFormatError(
            f"metadata {key!r} must be a numeric array of at least {n_tokens} entries"
        )
    return array[:n_tokens].astype(dtype)
