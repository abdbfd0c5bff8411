"""Structure-aware GGUF mutation: a real tiny model is read into its parts (metadata with
their GGUF types, tensors with their shapes and types), one to three mutations change
those parts the way a broken converter would (a value of the wrong type, an array of the
wrong length or kind, a malformed token, a tensor of the wrong shape), and the file is
written back byte-exact to the format. The check loads it as the engine does and uses it:
either a project error, or a model that encodes, decodes and computes logits."""

from __future__ import annotations

import struct
import tempfile
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import gguf
from hypothesis import strategies as st

from actors.model.loaded import load_model
from tests.conftest import TINY_MODELS
from tests.fuzz.target import Target, only_project_errors

T = gguf.GGUFValueType
ALIGNMENT = 32
SAMPLE_TEXT = "Hello world <|im_start|>user\n héllo 漢字 😀 <0x41> \x16 <|endoftext|>"


@dataclass(frozen=True)
class Value:
    """One metadata value with its GGUF type (and item type, for arrays)."""

    kind: T
    data: Any
    item: T | None = None


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest dimension first
    type_id: int
    data: bytes


@dataclass(frozen=True)
class ModelParts:
    metadata: dict[str, Value]
    tensors: tuple[Tensor, ...]


@cache
def seed_parts(name: str) -> ModelParts:
    """A tiny model's parts, read with the `gguf` package (independent of our reader)."""
    reader = gguf.GGUFReader(TINY_MODELS[name])
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        kind = T(field.types[0])
        item = T(field.types[1]) if kind == T.ARRAY else None
        metadata[key] = Value(kind, field.contents(), item)
    tensors = tuple(
        Tensor(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), bytes(t.data.tobytes()))
        for t in reader.tensors
    )
    return ModelParts(metadata, tensors)


# --- writing ----------------------------------------------------------------------------------

_SCALAR_FORMAT = {
    T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i",
    T.FLOAT32: "<f", T.BOOL: "<?", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d",
}  # fmt: skip


def _string(text: str) -> bytes:
    raw = text.encode("utf-8", errors="surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: T, data: Any, item: T | None) -> bytes:
    if kind == T.STRING:
        return _string(data)
    if kind == T.ARRAY:
        assert item is not None
        items = list(data)
        # A nested array's items are (item kind, items) pairs.
        body = b"".join(
            _value(T.ARRAY, sub[1], sub[0]) if item == T.ARRAY else _value(item, sub, None)
            for sub in items
        )
        return struct.pack("<IQ", int(item), len(items)) + body
    return struct.pack(_SCALAR_FORMAT[kind], data)


def write_gguf(parts: ModelParts, path: Path) -> None:
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(parts.tensors), len(parts.metadata)))
    for key, value in parts.metadata.items():
        out += _string(key) + struct.pack("<I", int(value.kind))
        out += _value(value.kind, value.data, value.item)
    offset = 0
    for tensor in parts.tensors:
        out += _string(tensor.name) + struct.pack("<I", len(tensor.shape))
        out += b"".join(struct.pack("<Q", d) for d in tensor.shape)
        out += struct.pack("<IQ", tensor.type_id, offset)
        offset += -(-len(tensor.data) // ALIGNMENT) * ALIGNMENT
    out += bytes(-len(out) % ALIGNMENT)
    for tensor in parts.tensors:  # in table order, each padded to the alignment
        out += tensor.data + bytes(-len(tensor.data) % ALIGNMENT)
    path.write_bytes(bytes(out))


# --- mutations --------------------------------------------------------------------------------

KNOWN_KEYS = (
    "{arch}.context_length", "{arch}.embedding_length", "{arch}.block_count",
    "{arch}.feed_forward_length", "{arch}.attention.head_count", "{arch}.attention.head_count_kv",
    "{arch}.attention.key_length", "{arch}.attention.value_length", "{arch}.rope.dimension_count",
    "{arch}.rope.freq_base", "{arch}.attention.layer_norm_rms_epsilon", "{arch}.vocab_size",
    "{arch}.rope.scaling.type", "{arch}.rope.scaling.factor", "general.alignment",
    "general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
)  # fmt: skip
ARRAY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
              "tokenizer.ggml.merges")  # fmt: skip

_ints = st.sampled_from([0, 1, 2, 3, 7, 63, 64, 65, 127, 128, 255, 256, 1023, 1024, 2048, 2**31 - 1])
scalar_values = st.one_of(
    st.builds(Value, st.just(T.UINT32), _ints),
    st.builds(Value, st.just(T.INT32), st.integers(-(2**31), 2**31 - 1)),
    st.builds(Value, st.just(T.UINT64), st.sampled_from([0, 1, 2**32, 2**63, 2**64 - 1])),
    st.builds(Value, st.just(T.FLOAT32), st.floats(width=32)),
    st.builds(Value, st.just(T.FLOAT64), st.floats()),
    st.builds(Value, st.just(T.BOOL), st.booleans()),
    st.builds(Value, st.just(T.STRING), st.text(max_size=40)),
    st.builds(
        Value, st.just(T.STRING),
        st.sampled_from(["llama", "gpt2", "qwen2", "gemma3", "smollm", "none", "linear"]),
    ),
)
array_values = st.one_of(
    st.builds(Value, st.just(T.ARRAY), st.lists(st.booleans(), max_size=6), st.just(T.BOOL)),
    st.builds(Value, st.just(T.ARRAY), st.lists(st.integers(0, 2**31 - 1), max_size=6), st.just(T.UINT32)),
    st.builds(Value, st.just(T.ARRAY), st.lists(st.floats(width=32), max_size=6), st.just(T.FLOAT32)),
    st.builds(Value, st.just(T.ARRAY), st.lists(st.text(max_size=10), max_size=6), st.just(T.STRING)),
    st.builds(  # ragged nested arrays, as a broken converter writes a list of lists
        Value, st.just(T.ARRAY),
        st.lists(st.tuples(st.just(T.FLOAT32), st.lists(st.floats(width=32), max_size=3)), max_size=4),
        st.just(T.ARRAY),
    ),
)  # fmt: skip
token_texts = st.one_of(
    st.sampled_from(["<0xZZ>", "<0x4>", "<0x041>", "0x41", "<0x41", "", "<|im_start|>", "Ġ", "▁"]),
    st.sampled_from([40, 300, 500, 1000, 3000]).map(lambda n: "<" + "x" * n + ">"),  # long special tokens
    st.text(min_size=1, max_size=12),
)


@dataclass(frozen=True)
class Mutation:
    op: str
    key: str = ""
    value: Value | None = None
    index: int = 0
    size: int = 0
    text: str = ""
    token_type: int = 1


mutations = st.one_of(
    st.builds(Mutation, st.just("set"), st.sampled_from(KNOWN_KEYS), st.one_of(scalar_values, array_values)),
    st.builds(Mutation, st.just("delete"), st.sampled_from(KNOWN_KEYS)),
    st.builds(Mutation, st.just("resize"), st.sampled_from(ARRAY_KEYS), size=st.integers(0, 1100)),
    st.builds(
        Mutation, st.just("token"), index=st.integers(0, 1023), text=token_texts,
        token_type=st.integers(0, 7),
    ),
    st.builds(
        Mutation, st.just("tensor_rows"),
        st.sampled_from(["token_embd.weight", "output.weight", "blk.0.attn_q.weight",
                         "blk.0.attn_k.weight"]),
        size=st.integers(1, 1100),
    ),
    st.builds(
        Mutation, st.just("tensor_drop"),
        st.sampled_from(["token_embd.weight", "output.weight", "output_norm.weight",
                         "blk.1.ffn_up.weight"]),
    ),
)  # fmt: skip


def apply(parts: ModelParts, mutation: Mutation) -> ModelParts:
    metadata = dict(parts.metadata)
    arch = metadata.get("general.architecture", Value(T.STRING, "llama")).data
    key = mutation.key.format(arch=arch if isinstance(arch, str) else "llama")
    if mutation.op == "set":
        metadata[key] = mutation.value
    elif mutation.op == "delete":
        metadata.pop(key, None)
    elif mutation.op == "resize" and key in metadata and metadata[key].kind == T.ARRAY:
        old = metadata[key]
        items = list(old.data)
        grown = (items * (mutation.size // max(len(items), 1) + 1))[: mutation.size]
        metadata[key] = replace(old, data=grown)
    elif mutation.op == "token":
        _set_token(metadata, mutation)
    elif mutation.op == "tensor_rows":
        return ModelParts(metadata, tuple(_with_rows(t, mutation) for t in parts.tensors))
    elif mutation.op == "tensor_drop":
        return ModelParts(metadata, tuple(t for t in parts.tensors if t.name != key))
    return ModelParts(metadata, parts.tensors)


def _set_token(metadata: dict[str, Value], mutation: Mutation) -> None:
    tokens, types = metadata.get("tokenizer.ggml.tokens"), metadata.get("tokenizer.ggml.token_type")
    if tokens is None or tokens.kind != T.ARRAY or tokens.item != T.STRING:
        return
    texts = list(tokens.data)
    if texts:
        texts[mutation.index % len(texts)] = mutation.text
        metadata["tokenizer.ggml.tokens"] = replace(tokens, data=texts)
    if types is not None and types.kind == T.ARRAY and types.item in (T.INT32, T.UINT32):
        kinds = list(types.data)
        if kinds:
            kinds[mutation.index % len(kinds)] = mutation.token_type
            metadata["tokenizer.ggml.token_type"] = replace(types, data=kinds)


def _with_rows(tensor: Tensor, mutation: Mutation) -> Tensor:
    """The tensor with `size` rows (its slowest dimension), its data cut or repeated."""
    if tensor.name != mutation.key or len(tensor.shape) != 2:
        return tensor
    row_bytes = len(tensor.data) // tensor.shape[1]
    rows = mutation.size
    data = (tensor.data * (rows // tensor.shape[1] + 1))[: rows * row_bytes]
    return replace(tensor, shape=(tensor.shape[0], rows), data=data)


cases = st.tuples(st.sampled_from(sorted(TINY_MODELS)), st.lists(mutations, min_size=1, max_size=3))


def check(case: tuple[str, list[Mutation]]) -> str:
    """Write the mutated file, load it as the engine does, and use what loaded."""
    name, changes = case
    parts = seed_parts(name)
    for change in changes:
        parts = apply(parts, change)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mutated.gguf"
        write_gguf(parts, path)
        with only_project_errors(changes) as outcome:
            use(path)
    return outcome[0]


def use(path: Path) -> None:
    model = load_model(path)
    tokenizer = model.tokenizer
    ids = tokenizer.encode(SAMPLE_TEXT, parse_special=True)
    tokenizer.decode(range(tokenizer.vocab_size), special=True)
    # The highest id too: an embedding with fewer rows than the tokenizer has tokens.
    model.logits([*ids[:4], tokenizer.vocab_size - 1])


TARGET = Target("GGUF structure (tiny models)", cases, check)
