"""GGUF reading: the real and tiny models parse as gguf's own reader sees them, and every kind
of bad file gives ModelFormatError (or UnsupportedModelError) naming the problem."""

from __future__ import annotations

import os
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from actors import load_model
from actors.errors import ModelFormatError, UnsupportedModelError
from actors.model.arch import spec_from_gguf
from actors.model.gguf.reader import open_gguf
from tests.conftest import TINY_MODELS

TINY = TINY_MODELS["llama-q4k-tiny"]
HEADER_BYTES = 24  # magic, version, tensor count, metadata count


# --- building and mutating files ---------------------------------------------------------------


def write_llama(
    path: Path,
    *,
    arch: str = "llama",
    skip_key: str | None = None,
    skip_tensor: str | None = None,
    tokens: list[str] | None = None,
) -> Path:
    """A small, valid GGUF with the metadata and embedding `spec_from_gguf` reads."""
    writer = gguf.GGUFWriter(path, arch)
    keys: dict[str, Callable[[], None]] = {
        f"{arch}.block_count": lambda: writer.add_block_count(2),
        f"{arch}.embedding_length": lambda: writer.add_embedding_length(64),
        f"{arch}.attention.head_count": lambda: writer.add_head_count(4),
        f"{arch}.feed_forward_length": lambda: writer.add_feed_forward_length(128),
        f"{arch}.context_length": lambda: writer.add_context_length(256),
    }
    for key, add in keys.items():
        if key != skip_key:
            add()
    writer.add_token_list(tokens or [f"t{i}" for i in range(32)])
    tensors = {
        "token_embd.weight": np.ones((32, 64), np.float32),
        "output_norm.weight": np.ones(64, np.float32),
    }
    for name, array in tensors.items():
        if name != skip_tensor:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def copy_of(source: Path, tmp_path: Path, name: str = "copy.gguf") -> tuple[Path, bytearray]:
    target = tmp_path / name
    shutil.copyfile(source, target)
    return target, bytearray(target.read_bytes())


def string_field(data: bytes | bytearray, text: str) -> int:
    """Offset just past the length-prefixed string `text` (a key or a tensor name)."""
    encoded = text.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def tensor_fields(data: bytes | bytearray, name: str) -> dict[str, int]:
    """Byte offsets of the fields of one tensor-table entry."""
    at = string_field(data, name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    return {"dims": at + 4, "type": at + 4 + 8 * n_dims, "offset": at + 8 + 8 * n_dims}


def put_u32(data: bytearray, at: int, value: int) -> None:
    struct.pack_into("<I", data, at, value)


def put_u64(data: bytearray, at: int, value: int) -> None:
    struct.pack_into("<Q", data, at, value)


def refused(path: Path, *needles: str, error: type[Exception] = ModelFormatError) -> str:
    """Open `path`, expect `error`, check that its message names every needle."""
    with pytest.raises(error) as caught:
        open_gguf(path).close()
    message = str(caught.value)
    for needle in needles:
        assert needle in message, message
    return message


# --- good files --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def all_model_paths(real_model_paths: dict[str, Path]) -> list[Path]:
    return [*TINY_MODELS.values(), *real_model_paths.values()]


def test_tables_match_gguf_reader() -> None:
    for path in TINY_MODELS.values():
        reader = gguf.GGUFReader(path)
        with open_gguf(path) as ours:
            assert ours.version == 3
            assert len(ours.tensors) == len(reader.tensors)
            assert set(ours.metadata) == {
                key for key in reader.fields if not key.startswith("GGUF.")
            }
            for theirs in reader.tensors:
                info = ours.tensor(theirs.name)
                assert info.type_name == theirs.tensor_type.name
                assert info.shape == tuple(int(d) for d in reversed(theirs.shape))
                assert info.offset == theirs.data_offset
                assert info.n_bytes == theirs.n_bytes
                assert np.array_equal(
                    ours.raw(theirs.name).reshape(-1), theirs.data.view(np.uint8).reshape(-1)
                )
            tokens = reader.fields["tokenizer.ggml.tokens"].contents()
            assert ours.metadata["tokenizer.ggml.tokens"] == tokens


def test_real_models_open(all_model_paths: list[Path]) -> None:
    for path in all_model_paths:
        with open_gguf(path) as model:
            last = max(model, key=lambda info: info.offset)
            assert last.offset + last.n_bytes <= model.file_size
            assert model.raw(last.name).shape == (*last.shape[:-1], last.row_bytes)
            spec_from_gguf(model)


def test_open_does_not_read_tensor_data(tmp_path: Path) -> None:
    """A 4 GiB tensor in a sparse file: opening maps it without touching its pages."""
    if not sys.platform.startswith("linux"):
        pytest.skip("measures resident memory through /proc")
    path = tmp_path / "big.gguf"
    rows, cols = 1 << 18, 4096
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor_info("big.weight", (rows, cols), np.dtype(np.float32), rows * cols * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    os.truncate(path, 4096 + rows * cols * 4)
    if os.stat(path).st_blocks * 512 > 1 << 26:
        pytest.skip("this filesystem does not keep sparse files sparse")

    def resident_bytes() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident_bytes()
    with open_gguf(path) as model:
        view = model.raw("big.weight")
        grown = resident_bytes() - before
        assert view.shape == (rows, cols * 4)
        assert model.tensor("big.weight").n_bytes == 4 << 30
        del view
    assert grown < 1 << 26, f"opening made {grown} bytes resident"


# --- paths that are not GGUF files -------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    refused(tmp_path / "nope.gguf", "no such model file")


def test_directory(tmp_path: Path) -> None:
    refused(tmp_path, "is a directory")


def test_fifo_does_not_block(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    refused(fifo, "not a regular file")


def test_zero_length_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    refused(empty, "0 bytes", "too short")


def test_path_with_nul_byte(tmp_path: Path) -> None:
    refused(Path(f"{tmp_path}/a\0b.gguf"), "invalid path")


# --- header ------------------------------------------------------------------------------------


def test_wrong_magic(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    data[:4] = b"GGML"
    path.write_bytes(data)
    refused(path, "not a GGUF file", "GGML")


@pytest.mark.parametrize("version", [1, 4, 0xFFFFFFFF])
def test_unsupported_version(tmp_path: Path, version: int) -> None:
    path, data = copy_of(TINY, tmp_path)
    put_u32(data, 4, version)
    path.write_bytes(data)
    refused(path, f"unsupported GGUF version {version}")


def test_big_endian_is_unsupported_not_corrupt(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    data[4:8] = struct.pack(">I", 3)
    path.write_bytes(data)
    refused(path, "big-endian", error=UnsupportedModelError)


@pytest.mark.parametrize("field_at, value", [(8, 1 << 63), (16, 1 << 60), (8, (1 << 64) - 1)])
def test_absurd_header_counts(tmp_path: Path, field_at: int, value: int) -> None:
    path, data = copy_of(TINY, tmp_path)
    put_u64(data, field_at, value)
    path.write_bytes(data)
    refused(path, str(value), "more than a")


# --- truncation at every stage -----------------------------------------------------------------


def truncation_points() -> dict[str, list[int]]:
    data = TINY.read_bytes()
    with open_gguf(TINY) as model:
        data_offset = model.data_offset
        last = max(model, key=lambda info: info.offset)
    tensor_table = string_field(data, "token_embd.weight") - 8 - len("token_embd.weight")
    rng = np.random.default_rng(7)
    return {
        "header": list(range(4, HEADER_BYTES)),
        "metadata": sorted(rng.integers(HEADER_BYTES, tensor_table, 40).tolist()),
        "tensor table": list(range(tensor_table, tensor_table + 64))
        + sorted(rng.integers(tensor_table, data_offset - 1, 40).tolist()),
        "data": [data_offset, last.offset + 1, len(data) - 1],
    }


@pytest.mark.parametrize("stage", ["header", "metadata", "tensor table", "data"])
def test_truncated(tmp_path: Path, stage: str) -> None:
    data = TINY.read_bytes()
    path = tmp_path / "cut.gguf"
    for size in truncation_points()[stage]:
        path.write_bytes(data[:size])
        message = refused(path)
        assert "truncated" in message, (size, message)


# --- tensor table ------------------------------------------------------------------------------


def test_tensor_data_past_the_end(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    put_u64(data, tensor_fields(data, "output_norm.weight")["offset"], len(data))
    path.write_bytes(data)
    refused(path, "'output_norm.weight'", "past the end")


def test_row_not_a_multiple_of_the_block(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    with open_gguf(TINY) as model:
        info = model.tensor("blk.0.attn_q.weight")
    assert info.type_name == "Q4_K"
    put_u64(data, tensor_fields(data, info.name)["dims"], info.shape[-1] - 1)
    path.write_bytes(data)
    refused(path, repr(info.name), "Q4_K", f"{info.shape[-1] - 1} elements", "block size 256")


@pytest.mark.parametrize("type_id", [4, 99, 0xFFFFFFFF])
def test_unknown_tensor_type(tmp_path: Path, type_id: int) -> None:
    path, data = copy_of(TINY, tmp_path)
    put_u32(data, tensor_fields(data, "blk.0.attn_k.weight")["type"], type_id)
    path.write_bytes(data)
    refused(path, "'blk.0.attn_k.weight'", f"unknown type id {type_id}")


def test_overlapping_tensors(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    with open_gguf(TINY) as model:
        first = model.tensor("blk.0.attn_q.weight")
        relative = first.offset - model.data_offset
    put_u64(data, tensor_fields(data, "blk.0.attn_k.weight")["offset"], relative)
    path.write_bytes(data)
    refused(path, "overlap", "'blk.0.attn_q.weight'", "'blk.0.attn_k.weight'")


def test_dimension_product_overflow(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    dims = tensor_fields(data, "blk.0.ffn_down.weight")["dims"]
    put_u64(data, dims, 1 << 40)  # a multiple of every block size
    put_u64(data, dims + 8, 1 << 40)
    path.write_bytes(data)
    refused(path, "'blk.0.ffn_down.weight'", "past the end")


@pytest.mark.parametrize("n_dims", [0, 5, 1 << 31])
def test_bad_dimension_count(tmp_path: Path, n_dims: int) -> None:
    path, data = copy_of(TINY, tmp_path)
    put_u32(data, tensor_fields(data, "output_norm.weight")["dims"] - 4, n_dims)
    path.write_bytes(data)
    refused(path, "'output_norm.weight'", f"{n_dims} dimensions")


def test_zero_dimension(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    put_u64(data, tensor_fields(data, "output_norm.weight")["dims"], 0)
    path.write_bytes(data)
    refused(path, "'output_norm.weight'", "zero dimension")


def test_misaligned_tensor_offset(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    at = tensor_fields(data, "output_norm.weight")["offset"]
    put_u64(data, at, struct.unpack_from("<Q", data, at)[0] + 4)
    path.write_bytes(data)
    refused(path, "'output_norm.weight'", "not aligned")


def test_duplicate_tensor_name(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    name = string_field(data, "blk.0.attn_k.weight") - len("blk.0.attn_k.weight")
    data[name : name + len("blk.0.attn_k.weight")] = b"blk.0.attn_q.weight"
    path.write_bytes(data)
    refused(path, "'blk.0.attn_q.weight' appears twice")


def test_huge_tensor_name_length(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    at = string_field(data, "output_norm.weight") - len("output_norm.weight") - 8
    put_u64(data, at, 1 << 63)
    path.write_bytes(data)
    refused(path, "truncated", "name of tensor")


# --- metadata ----------------------------------------------------------------------------------


def test_huge_string_length(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    at = string_field(data, "general.architecture") + 4  # past the value type
    put_u64(data, at, 1 << 63)
    path.write_bytes(data)
    refused(path, "truncated", "'general.architecture'", str(1 << 63))


def test_huge_array_count(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        patched = bytearray(data)
        put_u64(patched, string_field(patched, key) + 8, 1 << 60)  # past value and item types
        path.write_bytes(patched)
        refused(path, repr(key), str(1 << 60))


def test_unknown_value_type(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    put_u32(data, string_field(data, "llama.block_count"), 77)
    path.write_bytes(data)
    refused(path, "'llama.block_count'", "unknown value type 77")


def test_arrays_nested_too_deep(tmp_path: Path) -> None:
    path = tmp_path / "nested.gguf"
    key = b"deep"
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    entry += (struct.pack("<I", 9) + struct.pack("<Q", 1)) * 8  # arrays of one array, 8 deep
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + entry + b"\0" * 64)
    refused(path, "'deep'", "nests arrays deeper")


def test_duplicate_metadata_key(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    # Both keys have 27 characters, so renaming one leaves the rest of the file in place.
    at = string_field(data, "tokenizer.ggml.eos_token_id") - 27
    data[at : at + 27] = b"tokenizer.ggml.bos_token_id"
    path.write_bytes(data)
    refused(path, "'tokenizer.ggml.bos_token_id' appears twice")


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_bad_alignment(tmp_path: Path, alignment: int) -> None:
    path = tmp_path / "aligned.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("general.alignment", alignment)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    refused(path, "general.alignment", "power of two")


def test_non_utf8_token(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    tokens = string_field(data, "tokenizer.ggml.tokens") + 4 + 4 + 8  # value/item types, count
    first_token = tokens + 8
    data[first_token] = 0xFF
    path.write_bytes(data)
    refused(path, "'tokenizer.ggml.tokens'[0]", "not valid UTF-8", "0xff")


def test_non_utf8_key(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    at = string_field(data, "general.name") - 1
    data[at] = 0xC3
    path.write_bytes(data)
    refused(path, "metadata key #", "not valid UTF-8")


# --- what the architecture needs (through spec_from_gguf) --------------------------------------


def test_small_llama_is_valid(tmp_path: Path) -> None:
    with open_gguf(write_llama(tmp_path / "ok.gguf")) as model:
        spec = spec_from_gguf(model)
    assert (spec.arch, spec.n_layers, spec.d_model, spec.vocab_size) == ("llama", 2, 64, 32)


@pytest.mark.parametrize(
    "key", ["llama.block_count", "llama.embedding_length", "llama.attention.head_count"]
)
def test_missing_architecture_key(tmp_path: Path, key: str) -> None:
    with open_gguf(write_llama(tmp_path / "m.gguf", skip_key=key)) as model:
        with pytest.raises(ModelFormatError, match=f"missing metadata key '{key}'"):
            spec_from_gguf(model)


def test_missing_architecture_name(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    at = string_field(data, "general.architecture") - len("general.architecture")
    data[at : at + len("general.architecture")] = b"general.architectur_"
    path.write_bytes(data)
    with open_gguf(path) as model:
        with pytest.raises(ModelFormatError, match="missing metadata key 'general.architecture'"):
            spec_from_gguf(model)


def test_missing_embedding_tensor(tmp_path: Path) -> None:
    with open_gguf(write_llama(tmp_path / "m.gguf", skip_tensor="token_embd.weight")) as model:
        with pytest.raises(ModelFormatError, match="missing tensor 'token_embd.weight'"):
            spec_from_gguf(model)


def test_unsupported_architecture(tmp_path: Path) -> None:
    with open_gguf(write_llama(tmp_path / "m.gguf", arch="mamba")) as model:
        with pytest.raises(UnsupportedModelError, match="'mamba' is not supported"):
            spec_from_gguf(model)


@pytest.mark.parametrize(
    "key, value",
    [("general.architecture", np.array([1, 2])), ("llama.attention.value_length", np.ones(2))],
)
def test_metadata_of_the_wrong_kind(tmp_path: Path, key: str, value: object) -> None:
    with open_gguf(TINY) as model:
        model.metadata[key] = value
        with pytest.raises(ModelFormatError, match=key):
            spec_from_gguf(model)


def test_missing_layer_tensor_through_the_loader(tmp_path: Path) -> None:
    path, data = copy_of(TINY, tmp_path)
    at = string_field(data, "blk.2.ffn_up.weight")
    data[at - 1] = ord("X")  # renamed, so the table no longer has it
    path.write_bytes(data)
    with pytest.raises(ModelFormatError, match="missing tensor 'blk.2.ffn_up.weight'"):
        load_model(path)


def test_known_but_unsupported_tensor_type(tmp_path: Path) -> None:
    """I32 has F32's size, so the file stays valid: the reader opens it, the loader refuses."""
    path, data = copy_of(TINY, tmp_path)
    put_u32(data, tensor_fields(data, "blk.1.attn_norm.weight")["type"], 26)
    path.write_bytes(data)
    with open_gguf(path) as model:
        assert model.tensor("blk.1.attn_norm.weight").type_name == "I32"
    with pytest.raises(UnsupportedModelError, match="I32"):
        load_model(path)
