"""Bounded fuzz of the GGUF reader and `spec_from_gguf`: whatever the bytes, only the project's
own errors come out, each naming the file, and every case ends (a hang guard stops it if not).

Two kinds: a seeded mutation loop over the real headers (metadata and tensor table) of the tiny
and real models, and hypothesis properties on hand-made files.
"""

from __future__ import annotations

import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.errors import Q4KError
from actors.model.arch import spec_from_gguf
from actors.model.gguf.reader import open_gguf
from actors.model.loaded import load_model
from actors.model.text.vocab import MAX_TOKEN_CHARS
from tests.conftest import TINY_MODELS, gemma3_path, smollm2_path
from tests.fuzz import FUZZ_EXAMPLES, gguf_structure
from tests.fuzz.target import hang_guard

# Mutated cases per model: many on the tiny files (a few ms each), fewer on the real headers
# (6.5 MB for gemma3, mostly its 262k-token vocabulary).
CASES = {"llama-q4k-tiny": 500, "qwen2-q4k-tiny": 500, "smollm2-135m": 150, "gemma3-270m": 100}
# Little-endian u64 windows below this are likely lengths, counts, dims or offsets.
FIELD_LIKE_BELOW = 1 << 32
INTERESTING_U64 = (0, 1, 7, 255, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 60, 1 << 63, (1 << 64) - 1)
INTERESTING_U32 = (0, 1, 8, 9, 12, 13, 31, 39, 40, 1 << 31, (1 << 32) - 1)


@dataclass(frozen=True)
class Seed:
    """The header of one model (everything before its tensor data), its true file size, where
    its tensor table starts, and the offsets of u64 windows that look like fields."""

    name: str
    header: bytes
    file_size: int
    table_start: int
    field_offsets: np.ndarray

    @classmethod
    def load(cls, name: str, path: Path) -> Seed:
        with open_gguf(path) as model:
            data_offset = model.data_offset
            first_tensor = next(iter(model.tensors)).encode()
        with open(path, "rb") as file:
            header = file.read(data_offset)
        table_start = header.index(struct.pack("<Q", len(first_tensor)) + first_tensor)
        raw = np.frombuffer(header, dtype=np.uint8)
        # The u64 starting at every byte offset, one aligned view per phase.
        values = np.zeros(max(len(raw) - 7, 0), dtype=np.uint64)
        for phase in range(8):
            count = (len(raw) - phase) // 8
            values[phase::8][:count] = raw[phase : phase + 8 * count].view("<u8")
        field_offsets = np.flatnonzero(values < FIELD_LIKE_BELOW)
        return cls(name, header, path.stat().st_size, table_start, field_offsets)

    def region(self, rng: np.random.Generator) -> tuple[int, int]:
        """Where to mutate: the whole header, or (as often) the tensor table or the first
        KiB (header counts and scalar metadata), which the vocabulary would otherwise drown."""
        return [(0, len(self.header)), (self.table_start, len(self.header)), (0, 1024)][
            int(rng.integers(3))
        ]


def model_paths() -> dict[str, Path]:
    return {**TINY_MODELS, "smollm2-135m": smollm2_path(), "gemma3-270m": gemma3_path()}


@pytest.fixture(scope="session")
def seeds() -> dict[str, Seed]:
    return {name: Seed.load(name, path) for name, path in model_paths().items()}


def mutate(seed: Seed, rng: np.random.Generator) -> tuple[str, bytearray, int]:
    """One mutated copy of the header: (what was done, bytes, size to extend the file to)."""
    data = bytearray(seed.header)
    size = seed.file_size

    low, high = seed.region(rng)

    def field_offset() -> int:
        first, last = np.searchsorted(seed.field_offsets, [low, high - 8])
        return int(seed.field_offsets[rng.integers(first, max(last, first + 1))])

    kind = rng.integers(6)
    if kind == 0:
        offsets = [int(rng.integers(low, high)) for _ in range(rng.integers(1, 5))]
        for at in offsets:
            data[at] ^= 1 << int(rng.integers(8))
        return f"bit flips at {offsets}", data, size
    if kind == 1:
        at = field_offset()
        data[at + int(rng.integers(8))] ^= 1 << int(rng.integers(8))
        return f"bit flip in the field at {at}", data, size
    if kind == 2:
        at = field_offset()
        (old,) = struct.unpack_from("<Q", data, at)
        choices = (*INTERESTING_U64, old + 1, old - 1 if old else 1, old * 2, size)
        value = int(rng.choice(choices)) if rng.random() < 0.8 else int(rng.integers(1 << 63))
        struct.pack_into("<Q", data, at, value % (1 << 64))
        return f"u64 {old} -> {value} at {at}", data, size
    if kind == 3:
        # Scalar values (u32 hyperparameters, type ids) are followed by the next key's length,
        # so their windows do not look field-like: pick any offset half the time.
        at = field_offset() if rng.random() < 0.5 else int(rng.integers(low, high - 4))
        value = int(rng.choice(INTERESTING_U32)) if rng.random() < 0.5 else int(rng.integers(41))
        struct.pack_into("<I", data, at, value)
        return f"u32 -> {value} at {at}", data, size
    if kind == 4:
        cut = int(rng.integers(low, high + 1))
        return f"truncated at {cut}", data[:cut], cut
    at, span = int(rng.integers(low, high)), int(rng.integers(1, 17))
    del data[at : at + span]
    return f"deleted {span} bytes at {at}", data, size


def read_everything(path: Path) -> None:
    """What a loader does first: the table, the spec, a view of every tensor."""
    with open_gguf(path) as model:
        for info in model:
            model.raw(info.name)
        spec_from_gguf(model)


def outcome(path: Path, what: str) -> str:
    """'ok', or the project error's class; anything else fails the test with `what`."""
    try:
        with hang_guard(what):
            read_everything(path)
    except Q4KError as exc:
        assert str(path) in str(exc), f"{what}: the error does not name the file: {exc}"
        return type(exc).__name__
    except Exception as exc:
        pytest.fail(f"{what}: raw {type(exc).__name__}: {exc}")
    return "ok"


@pytest.mark.parametrize("name", list(CASES))
def test_mutated_headers(seeds: dict[str, Seed], tmp_path: Path, name: str) -> None:
    seed = seeds[name]
    rng = np.random.default_rng(sum(name.encode()))
    path = tmp_path / "fuzzed.gguf"
    outcomes: dict[str, int] = {}
    for case in range(CASES[name]):
        what, data, size = mutate(seed, rng)
        with open(path, "wb") as out:
            out.write(data)
            out.truncate(max(size, len(data)))  # sparse: the reader must not touch the data
        result = outcome(path, f"{name} case {case}: {what}")
        outcomes[result] = outcomes.get(result, 0) + 1
    # The loop must reach both sides: files still read and files refused.
    assert outcomes.get("ok", 0) and outcomes.get("ModelFormatError", 0), outcomes


# --- hypothesis: hand-made files ---------------------------------------------------------------

FUZZ_SETTINGS = settings(
    max_examples=150,
    deadline=None,  # no timing threshold; the hang guard covers hangs
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@FUZZ_SETTINGS
@given(body=st.binary(max_size=400), version=st.sampled_from([2, 3]))
def test_random_bytes_after_the_header(tmp_path: Path, body: bytes, version: int) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", version) + body)
    outcome(path, f"random body {body!r}")


@FUZZ_SETTINGS
@given(
    counts=st.tuples(st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1)),
    lengths=st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=6),
)
def test_random_counts_and_lengths(
    tmp_path: Path, counts: tuple[int, int], lengths: list[int]
) -> None:
    """A header followed by u64 fields in the places lengths and counts go."""
    body = struct.pack("<QQ", *counts) + b"".join(
        struct.pack("<Q", n) + b"key" + struct.pack("<I", 9) for n in lengths
    )
    path = tmp_path / "counts.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + body)
    outcome(path, f"counts {counts}, lengths {lengths}")


metadata_values = st.one_of(
    st.integers(-(1 << 31), (1 << 31) - 1),
    st.floats(width=32, allow_nan=False),
    st.booleans(),
    st.text(max_size=20),
    st.lists(st.text(max_size=8), min_size=1, max_size=5),
    st.lists(st.integers(0, 1000), min_size=1, max_size=5),
)


metadata_keys = st.from_regex(r"[a-z]{1,8}\.[a-z_]{1,12}", fullmatch=True)


@FUZZ_SETTINGS
@given(metadata=st.dictionaries(metadata_keys, metadata_values, max_size=8))
def test_written_metadata_reads_back(tmp_path: Path, metadata: dict[str, object]) -> None:
    path = tmp_path / "meta.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in metadata.items():
        writer.add_key_value(key, value, gguf_type_of(value))
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open_gguf(path) as model:
        for key, value in metadata.items():
            read = model.metadata[key]
            expected = np.float32(value) if isinstance(value, float) else value
            assert np.array_equal(np.asarray(read), np.asarray(expected)), (key, read, value)
        weights = model.raw("w").view(np.float32)
        assert np.array_equal(weights, np.arange(64, dtype=np.float32).reshape(2, 32))


def gguf_type_of(value: object) -> gguf.GGUFValueType:
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.INT32
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.ARRAY


def test_seeds_cover_the_structure(seeds: dict[str, Seed]) -> None:
    """The field-like offsets the mutations favour include the header's own counts."""
    for seed in seeds.values():
        assert {8, 16} <= set(seed.field_offsets.tolist()), seed.name
        assert os.path.getsize(model_paths()[seed.name]) == seed.file_size


# --- structure-aware mutation: tests/fuzz/gguf_structure.py ------------------------------------


@settings(FUZZ_SETTINGS, max_examples=FUZZ_EXAMPLES)
@given(case=gguf_structure.cases)
def test_structure_aware_mutations_load_or_fail_with_a_project_error(case) -> None:
    gguf_structure.check(case)


def _mutated(*changes: gguf_structure.Mutation) -> str:
    return gguf_structure.check(("llama-q4k-tiny", list(changes)))


# Examples of self-inconsistent files, each refused with a ModelFormatError.
SELF_INCONSISTENT = {
    "embedding rows below the vocabulary": [
        gguf_structure.Mutation("tensor_rows", "token_embd.weight", size=512)
    ],
    "a bool array where a bool goes": [
        gguf_structure.Mutation(
            "set",
            "tokenizer.ggml.add_bos_token",
            gguf_structure.Value(gguf.GGUFValueType.ARRAY, [True, False], gguf.GGUFValueType.BOOL),
        )
    ],
    "ragged scores": [
        gguf_structure.Mutation(
            "set",
            "tokenizer.ggml.scores",
            gguf_structure.Value(
                gguf.GGUFValueType.ARRAY,
                [(gguf.GGUFValueType.FLOAT32, [1.0]), (gguf.GGUFValueType.FLOAT32, [1.0, 2.0])],
                gguf.GGUFValueType.ARRAY,
            ),
        )
    ],
    "a BYTE token not <0xHH>": [gguf_structure.Mutation("token", index=300, text="<0xZZ>", token_type=6)],
    "an odd rope dimension": [
        gguf_structure.Mutation(
            "set", "{arch}.rope.dimension_count", gguf_structure.Value(gguf.GGUFValueType.UINT32, 63)
        )
    ],
    "a key length not the head size": [
        gguf_structure.Mutation(
            "set", "{arch}.attention.key_length", gguf_structure.Value(gguf.GGUFValueType.UINT32, 32)
        )
    ],
    "a RoPE scaling type that is an array (found by benchmarks/fuzz.py)": [
        gguf_structure.Mutation(
            "set",
            "{arch}.rope.scaling.type",
            gguf_structure.Value(gguf.GGUFValueType.ARRAY, [], gguf.GGUFValueType.BOOL),
        )
    ],
    "a pre-tokenizer name that is an array": [
        gguf_structure.Mutation(
            "set",
            "tokenizer.ggml.pre",
            gguf_structure.Value(gguf.GGUFValueType.ARRAY, ["a", "b"], gguf.GGUFValueType.STRING),
        )
    ],
}


@pytest.mark.parametrize("what", list(SELF_INCONSISTENT))
def test_self_inconsistent_files_are_model_format_errors(what: str) -> None:
    assert _mutated(*SELF_INCONSISTENT[what]) == "ModelFormatError"


@pytest.mark.parametrize("length", [500, MAX_TOKEN_CHARS - 2])
@pytest.mark.parametrize("token_type", [3, 4])  # control, user-defined
def test_a_long_special_token_loads_and_is_matched(length: int, token_type: int) -> None:
    """~500 characters made the special-token pattern recurse past Python's limit; up to the
    load bound (MAX_TOKEN_CHARS with its brackets) a token loads, past it the file is refused."""
    text = "<" + "x" * length + ">"
    assert _mutated(gguf_structure.Mutation("token", index=5, text=text, token_type=token_type)) == "ok"
    parts = gguf_structure.apply(
        gguf_structure.seed_parts("llama-q4k-tiny"),
        gguf_structure.Mutation("token", index=5, text=text, token_type=token_type),
    )
    path = Path(tempfile.mkdtemp()) / "long-special.gguf"
    gguf_structure.write_gguf(parts, path)
    tokenizer = load_model(path).tokenizer
    assert tokenizer.encode("a" + text + "b", add_bos=False, parse_special=True).count(5) == 1
    longer = "<" + "x" * (length + MAX_TOKEN_CHARS) + ">"
    mutation = gguf_structure.Mutation("token", index=5, text=longer, token_type=token_type)
    assert _mutated(mutation) == "ModelFormatError"
