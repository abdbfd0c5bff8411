"""GGUF files of many tiny entries: metadata keys, one-element tensors, nested arrays, strings
spread over arrays, at counts around the reader's bounds and far past them, written honestly
or with a header that claims more (or fewer) than the file holds. The check opens each with the
reader `open_model` and `q4k inspect` use: it opens, or a project error comes, and either way
within seconds (an unbounded reader spent 5-17 s and over 400 MB on a million entries)."""

from __future__ import annotations

import struct
import tempfile
import time
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

from actors.model.gguf.reader import MAX_ARRAYS, MAX_METADATA_KEYS, MAX_TENSORS, open_gguf
from tests.fuzz.target import Escape, Target, hang_guard, only_project_errors

ARRAY, STRING, FLOAT32 = 9, 8, 0
# Entries actually written at most: the header may claim any count.
MAX_WRITTEN = 300_000
# A case taking longer than this is an escape: the bounds keep every one far below it.
SLOW_S = 5.0


def header(tensors: int, keys: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, keys)


def numbered(prefix: str, count: int) -> np.ndarray:
    """`count` distinct 8-byte names (`prefix`, one character, and 7 digits)."""
    names = np.empty((count, 8), np.uint8)
    names[:, 0] = ord(prefix)
    numbers = np.arange(count)
    for place in range(7):  # decimal digits, last first
        names[:, 7 - place] = ord("0") + numbers // 10**place % 10
    return names.view("S8").ravel()


def many_keys(count: int, claimed: int | None = None) -> bytes:
    """`count` metadata keys, each an empty uint8 array (32 bytes an entry); the header
    claims `claimed` (default: `count`)."""
    entry = np.dtype([("length", "<u8"), ("key", "S8"), ("kind", "<u4"), ("item", "<u4"),
                      ("count", "<u8")])  # fmt: skip
    entries = np.zeros(count, entry)
    entries["length"], entries["key"], entries["kind"] = 8, numbered("k", count), ARRAY
    return header(0, count if claimed is None else claimed) + entries.tobytes()


def many_tensors(count: int, claimed: int | None = None) -> bytes:
    """`count` one-element float32 tensors, 4-byte aligned, data included."""
    alignment = b"\x11\0\0\0\0\0\0\0general.alignment" + struct.pack("<II", 4, 4)
    entry = np.dtype([("length", "<u8"), ("name", "S8"), ("dims", "<u4"), ("ne", "<u8"),
                      ("type", "<u4"), ("offset", "<u8")])  # fmt: skip
    entries = np.zeros(count, entry)
    entries["length"], entries["name"], entries["dims"] = 8, numbered("t", count), 1
    entries["ne"], entries["type"], entries["offset"] = 1, FLOAT32, np.arange(count) * 4
    table = header(count if claimed is None else claimed, 1) + alignment + entries.tobytes()
    return table + bytes(-len(table) % 4) + bytes(4 * count)


def nested_arrays(count: int, claimed: int | None = None) -> bytes:
    """One key holding `count` empty arrays (12 bytes each)."""
    items = np.zeros(count, np.dtype([("item", "<u4"), ("count", "<u8")]))
    claim = count if claimed is None else claimed
    key = struct.pack("<Q", 4) + b"many" + struct.pack("<IIQ", ARRAY, ARRAY, claim)
    return header(0, 1) + key + items.tobytes()


def string_arrays(keys: int, strings: int, claimed: int | None = None) -> bytes:
    """`keys` keys, each an array of `strings` one-character strings (the last claims
    `claimed`)."""
    one_string = struct.pack("<Q", 1) + b"x"
    entries = [
        struct.pack("<Q", 8) + f"s{index:07d}".encode()
        + struct.pack("<IIQ", ARRAY, STRING, strings if index < keys - 1 or claimed is None
                      else claimed)
        + one_string * strings
        for index in range(keys)
    ]  # fmt: skip
    return header(0, keys) + b"".join(entries)


_bounds = {MAX_METADATA_KEYS, MAX_TENSORS, MAX_ARRAYS}
_near = st.sampled_from(
    sorted({0, 1, 2, 7, MAX_WRITTEN} | {b + d for b in _bounds for d in (-1, 0, 1)})
)
_claims = st.one_of(st.none(), _near, st.sampled_from([2**31, 2**63, 2**64 - 1]))
cases = st.one_of(
    st.tuples(st.just("keys"), _near, _claims),
    st.tuples(st.just("tensors"), _near, _claims),
    st.tuples(st.just("nested"), _near, _claims),
    st.tuples(st.just("strings"), st.tuples(st.integers(1, 64), st.sampled_from([0, 1, 5000])),
              _claims),
)  # fmt: skip


def build(case: tuple[str, object, int | None]) -> bytes:
    kind, count, claimed = case
    if kind == "strings":
        keys, strings = count  # type: ignore[misc]
        return string_arrays(keys, strings, claimed)
    make = {"keys": many_keys, "tensors": many_tensors, "nested": nested_arrays}[kind]
    return make(count, claimed)  # type: ignore[arg-type]


def check(case: tuple[str, object, int | None]) -> str:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "counts.gguf"
        path.write_bytes(build(case))
        started = time.perf_counter()
        with hang_guard(case), only_project_errors(case) as outcome:
            open_gguf(path).close()
        seconds = time.perf_counter() - started
    if seconds > SLOW_S:
        raise Escape(f"took {seconds:.1f} s (more than {SLOW_S} s) <- {case!r:.200}")
    return outcome[0]


TARGET = Target("GGUF metadata counts", cases, check)
