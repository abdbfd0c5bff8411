"""Reading GGUF files: header, metadata, tensor table, and lazy memory-mapped tensor bytes.

The `gguf` package (llama.cpp's own) gives us the format's constants: value types, tensor
types and block sizes. Its `GGUFReader` is not used for parsing because it takes ~10 s on a
262k-token vocabulary (it builds a numpy view per array element) and its failures on bad
files are raw `struct`/`numpy` errors. This parser checks every header claim against the file
size before it allocates anything, so a bad file gives a `ModelFormatError` naming the problem:
bad magic or version, truncation anywhere, absurd counts or lengths, unknown value or tensor
types, rows that are not whole blocks, tensor data past the end or overlapping, non-UTF-8
strings. A valid file we cannot read (big-endian) gives `UnsupportedModelError`. Tensor data
is mapped, never read here: opening a 5 GB file costs what its header costs.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from actors.errors import ModelFormatError, UnsupportedModelError
from actors.model.gguf.string_array import StringArray

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_NESTING = 4
# What one file may hold, whatever its size: every entry costs Python objects and microseconds,
# so a small file of millions of tiny entries would cost minutes and gigabytes. Each bound is
# far above real models (tens of metadata keys; ~1,100 tensors for a 405B model; a 262k-token
# vocabulary, or 200k tokens and 450k merges) and is checked against a count as soon as it is
# read, before the entries are: past one, the file is refused in milliseconds.
MAX_METADATA_KEYS = 1 << 16
MAX_TENSORS = 1 << 16
# Strings inside arrays, all arrays together (about 0.4 us and 60 bytes each: ~2 s at most).
MAX_ARRAY_STRINGS = 1 << 22
# Arrays, nested ones included (each is a numpy array: no real file nests them at all).
MAX_ARRAYS = 1 << 16
_U64 = struct.Struct("<Q")

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SCALAR_DTYPES: dict[GGUFValueType, np.dtype] = {
    kind: np.dtype(fmt) for kind, fmt in _SCALAR_FORMATS.items()
}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table.

    `shape` is in numpy order (rows last, i.e. GGUF's `ne` reversed): a matrix stored with
    `ne = [n_in, n_out]` has `shape == (n_out, n_in)`, one row per output.
    """

    name: str
    type_name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def row_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        return self.shape[-1] // block_size * type_size


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buffer: mmap.mmap | bytes, path: Path) -> None:
        self.buffer = buffer
        self.size = len(buffer)
        self.pos = 0
        self.path = path
        # What is left of the file's allowance of array strings and arrays.
        self.strings_left = MAX_ARRAY_STRINGS
        self.arrays_left = MAX_ARRAYS

    def need(self, n_bytes: int, what: str) -> None:
        if n_bytes < 0 or self.pos + n_bytes > self.size:
            raise ModelFormatError(
                f"{self.path}: {what} needs {n_bytes} bytes at offset {self.pos}, but the "
                f"file has {self.size} bytes (truncated or corrupt file)"
            )

    def scalar(self, kind: GGUFValueType, what: str) -> Any:
        fmt = _SCALAR_FORMATS[kind]
        n_bytes = struct.calcsize(fmt)
        self.need(n_bytes, what)
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += n_bytes
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT32, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT64, what))

    def string(self, what: str) -> str:
        return self.utf8_strings(1, what, indexed=False)[0].decode("utf-8")

    def utf8_strings(self, count: int, what: str, *, indexed: bool = True) -> list[bytes]:
        """`count` length-prefixed strings, each checked to be UTF-8, as their bytes; errors
        name `what[index]` (`what` if not `indexed`).

        Each string's position depends on the previous length, so this loop is inherent; it
        keeps to local names and slicing (3x faster than a cursor call per item on a
        262k-token vocabulary).
        """

        def label(index: int) -> str:
            return f"{what}[{index}]" if indexed else what

        buffer, size, pos = self.buffer, self.size, self.pos
        items: list[bytes] = [b""] * count
        for index in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"length of {label(index)}")
            (length,) = _U64.unpack_from(buffer, pos)
            pos += 8
            if pos + length > size:
                self.pos = pos
                self.need(length, label(index))
            raw = buffer[pos : pos + length]
            pos += length
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                # The GGUF spec makes every string UTF-8. llama.cpp passes raw bytes through,
                # but the tokenizers we run (SPM, GPT-2 byte-level BPE) only store UTF-8 texts,
                # so a bad string means a corrupt file or a tokenizer we do not support.
                raise ModelFormatError(
                    f"{self.path}: {label(index)} is not valid UTF-8 (byte "
                    f"{exc.start} of {length} is 0x{raw[exc.start]:02x}); GGUF strings must "
                    "be UTF-8"
                ) from None
            items[index] = raw
        self.pos = pos
        return items

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.u32(f"value type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ModelFormatError(f"{self.path}: {what} has unknown value type {raw}") from None

    def value(self, kind: GGUFValueType, what: str, depth: int = 0) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string(what)
        if kind == GGUFValueType.ARRAY:
            return self.array(what, depth)
        return self.scalar(kind, what)

    def array(self, what: str, depth: int) -> Any:
        if depth >= MAX_NESTING:
            raise ModelFormatError(f"{self.path}: {what} nests arrays deeper than {MAX_NESTING}")
        self.arrays_left = self._spend(self.arrays_left, 1, MAX_ARRAYS, "arrays", what)
        item_kind = self.value_type(f"items of {what}")
        count = self.u64(f"item count of {what}")
        if item_kind in _SCALAR_DTYPES:
            dtype = _SCALAR_DTYPES[item_kind]
            self.need(count * dtype.itemsize, f"{count} items of {what}")
            values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return values
        # Every string or nested array takes at least 8 bytes (its length or count): check the
        # claim against the file before looping over it.
        self.need(count * 8, f"{count} items of {what}")
        if item_kind == GGUFValueType.STRING:
            self.strings_left = self._spend(
                self.strings_left, count, MAX_ARRAY_STRINGS, "strings in arrays", what
            )
            return StringArray.of_utf8(self.utf8_strings(count, what))
        if item_kind == GGUFValueType.ARRAY:  # each item spends one array as it is read
            self._spend(self.arrays_left, count, MAX_ARRAYS, "arrays", what)
        return [self.value(item_kind, f"{what}[{i}]", depth + 1) for i in range(count)]

    def _spend(self, left: int, count: int, allowed: int, kind: str, what: str) -> int:
        """What is left of an allowance after `count` more; the file is refused past it."""
        if count > left:
            raise ModelFormatError(
                f"{self.path}: {what} would take the file past {allowed:,} {kind} (a corrupt "
                "or hostile file: no real model holds that many)"
            )
        return left - count


class GGUFFile:
    """An open GGUF file: metadata and tensor table parsed, tensor bytes mapped, not read."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file = self._open_regular_file()
        try:
            self._map = self._map_file()
            self._parse()
        except BaseException:
            self.close()
            raise

    def _open_regular_file(self) -> BinaryIO:
        # stat first: opening a FIFO would block until a writer comes, and a device has no size.
        try:
            mode = os.stat(self.path).st_mode
            if stat.S_ISDIR(mode):
                raise ModelFormatError(f"{self.path}: is a directory, not a GGUF file")
            if not stat.S_ISREG(mode):
                raise ModelFormatError(f"{self.path}: is not a regular file")
            return open(self.path, "rb")
        except (FileNotFoundError, NotADirectoryError):
            raise ModelFormatError(f"{self.path}: no such model file") from None
        except OSError as exc:
            raise ModelFormatError(f"{self.path}: cannot open: {exc.strerror}") from None
        except ValueError as exc:  # e.g. a NUL byte in the path
            raise ModelFormatError(f"{str(self.path)!r}: invalid path: {exc}") from None

    def _map_file(self) -> mmap.mmap:
        self.file_size = os.fstat(self._file.fileno()).st_size
        if self.file_size < len(GGUF_MAGIC):
            raise ModelFormatError(
                f"{self.path}: file of {self.file_size} bytes is too short to be GGUF"
            )
        try:
            return mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ModelFormatError(f"{self.path}: cannot map the file: {exc.strerror}") from None

    def _parse(self) -> None:
        cursor = _Cursor(self._map, self.path)
        magic = bytes(self._map[:4])
        if magic != GGUF_MAGIC:
            raise ModelFormatError(
                f"{self.path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})"
            )
        cursor.pos = 4
        self.version = cursor.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            if int.from_bytes(self.version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
                raise UnsupportedModelError(
                    f"{self.path}: big-endian GGUF files are not supported; convert it to "
                    "little-endian (gguf's gguf-convert-endian)"
                )
            raise ModelFormatError(
                f"{self.path}: unsupported GGUF version {self.version} "
                f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})"
            )
        tensor_count = cursor.u64("tensor count")
        kv_count = cursor.u64("metadata count")
        # Each metadata entry takes >= 13 bytes (key length, value type, smallest value) and
        # each tensor entry >= 28: absurd counts are refused before anything is allocated.
        remaining = cursor.size - cursor.pos
        if kv_count * 13 > remaining or tensor_count * 28 > remaining:
            raise ModelFormatError(
                f"{self.path}: header claims {kv_count} metadata entries and {tensor_count} "
                f"tensors, more than a {cursor.size}-byte file can hold (truncated or corrupt)"
            )
        if kv_count > MAX_METADATA_KEYS or tensor_count > MAX_TENSORS:
            raise ModelFormatError(
                f"{self.path}: header claims {kv_count:,} metadata entries and {tensor_count:,} "
                f"tensors (at most {MAX_METADATA_KEYS:,} and {MAX_TENSORS:,}: no real model "
                "holds that many)"
            )
        self.metadata = self._read_metadata(cursor, kv_count)
        infos = self._read_tensor_table(cursor, tensor_count)
        self.alignment = self._alignment()
        self.data_offset = -(-cursor.pos // self.alignment) * self.alignment
        self.tensors = self._place_tensors(infos, cursor.size)
        self._check_no_overlap()

    def _read_metadata(self, cursor: _Cursor, kv_count: int) -> dict[str, Any]:
        """Parse the metadata; also record each key's GGUF value type (and item type for
        arrays) in `metadata_types`, so a writer can copy entries exactly."""
        metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        for index in range(kv_count):
            key = cursor.string(f"metadata key #{index}")
            kind = cursor.value_type(f"metadata {key!r}")
            if key in metadata:
                raise ModelFormatError(f"{self.path}: metadata key {key!r} appears twice")
            value_at = cursor.pos
            metadata[key] = cursor.value(kind, f"metadata {key!r}")
            # An array's item type is the u32 its value starts with (already bounds-checked).
            item_kind = (
                GGUFValueType(struct.unpack_from("<I", cursor.buffer, value_at)[0])
                if kind == GGUFValueType.ARRAY
                else None
            )
            self.metadata_types[key] = (kind, item_kind)
        return metadata

    def _read_tensor_table(
        self, cursor: _Cursor, tensor_count: int
    ) -> list[tuple[str, int, tuple[int, ...], int]]:
        infos = []
        seen: set[str] = set()
        for index in range(tensor_count):
            name = cursor.string(f"name of tensor #{index}")
            if name in seen:
                raise ModelFormatError(f"{self.path}: tensor {name!r} appears twice")
            seen.add(name)
            n_dims = cursor.u32(f"dimension count of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelFormatError(
                    f"{self.path}: tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)"
                )
            ne = tuple(cursor.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims))
            ggml_type = cursor.u32(f"type of tensor {name!r}")
            offset = cursor.u64(f"offset of tensor {name!r}")
            infos.append((name, ggml_type, ne, offset))
        return infos

    def _alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            isinstance(alignment, bool)
            or not isinstance(alignment, int)
            or alignment <= 0
            or alignment & (alignment - 1)
        ):
            raise ModelFormatError(
                f"{self.path}: general.alignment {alignment!r} is not a positive power of two"
            )
        return alignment

    def _place_tensors(
        self, infos: list[tuple[str, int, tuple[int, ...], int]], file_size: int
    ) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for name, ggml_type, ne, offset in infos:
            try:
                quant_type = GGMLQuantizationType(ggml_type)
            except ValueError:
                raise ModelFormatError(
                    f"{self.path}: tensor {name!r} has unknown type id {ggml_type}"
                ) from None
            if quant_type not in GGML_QUANT_SIZES:
                raise ModelFormatError(
                    f"{self.path}: tensor {name!r} has type {quant_type.name}, "
                    "which has no block layout"
                )
            block_size, type_size = GGML_QUANT_SIZES[quant_type]
            if any(d <= 0 for d in ne):
                raise ModelFormatError(
                    f"{self.path}: tensor {name!r} has a zero dimension: shape "
                    f"{tuple(reversed(ne))}"
                )
            if ne[0] % block_size:
                raise ModelFormatError(
                    f"{self.path}: tensor {name!r} of type {quant_type.name} has rows of "
                    f"{ne[0]} elements, not a multiple of its block size {block_size}"
                )
            n_bytes = math.prod(ne) // block_size * type_size
            start = self.data_offset + offset
            if offset % self.alignment:
                raise ModelFormatError(
                    f"{self.path}: tensor {name!r} offset {offset} is not aligned to "
                    f"{self.alignment} bytes"
                )
            if start + n_bytes > file_size:
                raise ModelFormatError(
                    f"{self.path}: tensor {name!r} ({quant_type.name}, shape "
                    f"{tuple(reversed(ne))}) needs bytes {start}..{start + n_bytes}, past the "
                    f"end of the {file_size}-byte file (truncated?)"
                )
            tensors[name] = TensorInfo(
                name=name,
                type_name=quant_type.name,
                ggml_type=int(quant_type),
                shape=tuple(reversed(ne)),
                offset=start,
                n_bytes=n_bytes,
            )
        return tensors

    def _check_no_overlap(self) -> None:
        if len(self.tensors) < 2:
            return
        infos = list(self.tensors.values())
        # Every span already lies inside the file, so int64 holds these offsets.
        starts = np.array([info.offset for info in infos], dtype=np.int64)
        ends = starts + np.array([info.n_bytes for info in infos], dtype=np.int64)
        order = np.argsort(starts, kind="stable")
        clashes = np.flatnonzero(starts[order[1:]] < ends[order[:-1]])
        if clashes.size:
            first, second = infos[order[clashes[0]]], infos[order[clashes[0] + 1]]
            raise ModelFormatError(
                f"{self.path}: tensors {first.name!r} (bytes {first.offset}.."
                f"{first.offset + first.n_bytes}) and {second.name!r} (from byte "
                f"{second.offset}) overlap; a shape or offset in the tensor table is wrong"
            )

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file, shape
        `(*shape[:-1], row_bytes)`; nothing is read until the view is used."""
        return self.raw_of(self.tensor(name))

    def raw_of(self, info: TensorInfo) -> np.ndarray:
        """`raw` of a span of this file described by `info` (one of its tensors, or a range of
        a tensor's rows)."""
        flat = np.frombuffer(self._map, dtype=np.uint8, count=info.n_bytes, offset=info.offset)
        return flat.reshape(*info.shape[:-1], info.row_bytes)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.path}: missing tensor {name!r}") from None

    def require(self, key: str) -> Any:
        """A metadata value the caller cannot do without."""
        try:
            return self.metadata[key]
        except KeyError:
            raise ModelFormatError(f"{self.path}: missing metadata key {key!r}") from None

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def close(self) -> None:
        mapping = getattr(self, "_map", None)
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                # numpy views still point into the map; it closes when they are collected.
                pass
        self._file.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open a GGUF file by path, memory-mapped and lazy."""
    return GGUFFile(path)
