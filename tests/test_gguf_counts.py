"""Small files of millions of tiny entries (issue 19, item 3): metadata keys, one-element
tensors, nested arrays, strings spread over many arrays. Each is refused with a
ModelFormatError before its entries are read, in milliseconds, by the reader, `open_model`
and `q4k inspect` alike; a file under the bounds still opens."""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from actors.errors import ModelFormatError
from actors.model import gguf as gguf_module
from actors.model.gguf import MAX_ARRAYS, MAX_METADATA_KEYS, MAX_TENSORS, open_gguf
from actors.model.loaded import open_model

ARRAY, STRING, UINT8, FLOAT32 = 9, 8, 0, 0
MILLION = 1 << 20


def header(tensors: int, keys: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, keys)


def numbered(prefix: str, count: int) -> np.ndarray:
    """`count` distinct 8-byte names, as a fixed-width byte array."""
    width = 8 - len(prefix)
    return np.char.add(prefix, np.char.zfill(np.arange(count).astype(str), width)).astype("S8")


def many_keys(count: int) -> bytes:
    """`count` metadata keys, each an empty uint8 array (32 bytes an entry)."""
    entry = np.dtype([("length", "<u8"), ("key", "S8"), ("kind", "<u4"), ("item", "<u4"),
                      ("count", "<u8")])  # fmt: skip
    entries = np.zeros(count, entry)
    entries["length"], entries["key"], entries["kind"] = 8, numbered("k", count), ARRAY
    return header(0, count) + entries.tobytes()


def many_tensors(count: int) -> bytes:
    """`count` one-element float32 tensors, 4-byte aligned, data included."""
    alignment = b"\x11\0\0\0\0\0\0\0general.alignment" + struct.pack("<II", 4, 4)
    entry = np.dtype([("length", "<u8"), ("name", "S8"), ("dims", "<u4"), ("ne", "<u8"),
                      ("type", "<u4"), ("offset", "<u8")])  # fmt: skip
    entries = np.zeros(count, entry)
    entries["length"], entries["name"], entries["dims"], entries["ne"] = 8, numbered("t", count), 1, 1
    entries["type"], entries["offset"] = FLOAT32, np.arange(count) * 4
    table = header(count, 1) + alignment + entries.tobytes()
    return table + bytes(-len(table) % 4) + bytes(4 * count)


def nested_arrays(count: int) -> bytes:
    """One key holding `count` empty arrays (12 bytes each)."""
    items = np.zeros(count, np.dtype([("item", "<u4"), ("count", "<u8")]))
    key = struct.pack("<Q", 4) + b"many" + struct.pack("<IIQ", ARRAY, ARRAY, count)
    return header(0, 1) + key + items.tobytes()


def string_arrays(keys: int, strings: int) -> bytes:
    """`keys` keys, each an array of `strings` one-character strings."""
    body = b"".join(
        struct.pack("<Q", 8) + f"s{index:07d}".encode() + struct.pack("<IIQ", ARRAY, STRING, strings)
        + (struct.pack("<Q", 1) + b"x") * strings
        for index in range(keys)
    )  # fmt: skip
    return header(0, keys) + body


HOSTILE = {
    "a million metadata keys": (lambda: many_keys(MILLION), f"at most {MAX_METADATA_KEYS:,}"),
    "a million one-element tensors": (lambda: many_tensors(MILLION), f"{MAX_TENSORS:,}"),
    "a million nested arrays": (lambda: nested_arrays(MILLION), f"past {MAX_ARRAYS:,} arrays"),
}


@pytest.fixture(scope="module", params=sorted(HOSTILE))
def hostile_file(request, tmp_path_factory) -> tuple[Path, str]:
    make, needle = HOSTILE[request.param]
    path = tmp_path_factory.mktemp("counts") / "hostile.gguf"
    path.write_bytes(make())
    return path, needle


def test_the_reader_refuses_in_milliseconds(hostile_file: tuple[Path, str]) -> None:
    path, needle = hostile_file
    started = time.perf_counter()
    with pytest.raises(ModelFormatError, match=needle):
        open_gguf(path)
    assert time.perf_counter() - started < 0.25


def test_open_model_refuses(hostile_file: tuple[Path, str]) -> None:
    path, needle = hostile_file
    with pytest.raises(ModelFormatError, match=needle):
        open_model(path)


def test_q4k_inspect_refuses_in_one_line(hostile_file: tuple[Path, str]) -> None:
    path, needle = hostile_file
    done = subprocess.run(
        [sys.executable, "-m", "actors.cli", "inspect", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert needle in done.stderr and "Traceback" not in done.stderr


def test_strings_spread_over_many_arrays_are_refused_past_the_allowance(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(gguf_module, "MAX_ARRAY_STRINGS", 1000)
    path = tmp_path / "strings.gguf"
    path.write_bytes(string_arrays(keys=11, strings=100))
    with pytest.raises(ModelFormatError, match="'s0000010' would take the file past 1,000 strings"):
        open_gguf(path)
    path.write_bytes(string_arrays(keys=10, strings=100))
    assert len(open_gguf(path).metadata) == 10


def test_files_under_the_bounds_open(tmp_path: Path) -> None:
    path = tmp_path / "fine.gguf"
    path.write_bytes(many_tensors(1000))
    assert len(open_gguf(path).tensors) == 1000
    path.write_bytes(nested_arrays(1000))
    assert len(open_gguf(path).metadata["many"]) == 1000
