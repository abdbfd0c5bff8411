"""A GGUF array of strings kept as its UTF-8 bytes end to end, each string decoded when asked.

A vocabulary's token texts are the largest thing in a file's metadata: gemma-3's 262,144
texts took 24 MB as Python strings, and 3 MB this way. Strings are decoded per item (about
0.2 us each); `texts()` gives them all as a list for code that builds from every one.
"""

from __future__ import annotations

import operator
import zlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np


def joined(parts: Sequence[bytes]) -> tuple[bytes, array]:
    """`parts` end to end, and where each starts: an int64 array.array with one more entry,
    the end of the last (it gives one Python int at a time quickly)."""
    starts = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)), out=starts[1:])
    return b"".join(parts), array("q", starts.tobytes())


class StringArray(Sequence[str]):
    """Immutable strings: `data[starts[i]:starts[i + 1]]` is string i's UTF-8."""

    __slots__ = ("_data", "_starts")

    def __init__(self, data: bytes, starts: array) -> None:
        self._data = data
        self._starts = starts  # as `joined` gives them

    @classmethod
    def of_utf8(cls, encoded: Sequence[bytes]) -> StringArray:
        """From each string's UTF-8 bytes (already checked to decode)."""
        return cls(*joined(encoded))

    @classmethod
    def of(cls, texts: Iterable[str]) -> StringArray:
        """From strings (a lone surrogate kept as `surrogatepass` writes it)."""
        if isinstance(texts, StringArray):
            return texts
        return cls.of_utf8([text.encode("utf-8", "surrogatepass") for text in texts])

    def __len__(self) -> int:
        return len(self._starts) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[item] for item in range(*index.indices(len(self)))]
        index = operator.index(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"string index {index} out of range ({len(self)} strings)")
        starts = self._starts
        return self._data[starts[index] : starts[index + 1]].decode("utf-8", "surrogatepass")

    def __iter__(self) -> Iterator[str]:
        return iter(self.texts())

    def texts(self) -> list[str]:
        """Every string, as a list (what building from all of them wants)."""
        data = self._data
        bounds = self._starts.tolist()
        return [data[start:end].decode("utf-8", "surrogatepass")
                for start, end in zip(bounds, bounds[1:])]

    def checksums(self) -> np.ndarray:
        """Each string's CRC-32 (of its UTF-8), uint32: a key to find strings by."""
        data = self._data
        bounds = self._starts.tolist()
        return np.fromiter((zlib.crc32(data[start:end]) for start, end in zip(bounds, bounds[1:])),
                           dtype=np.uint32, count=len(self))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return self._data == other._data and self._starts == other._starts
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return self.texts() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return f"StringArray({len(self):,} strings, {len(self._data):,} bytes)"
