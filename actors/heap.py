"""Giving the C heap's free pages back to the system after a one-time build.

Building a tokenizer for a 262k-token vocabulary allocates and frees about 100 MB of
temporaries (merge lists, hash tables, the copies `tokenizers` and llguidance make of them).
glibc's malloc keeps freed chunks mapped for reuse, so without being told they stay resident
for the engine's whole life; `malloc_trim` hands their pages back.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Return the pages of the C heap's free chunks to the system (every thread's arena).

    Call it after building something large whose temporaries are gone. It takes a few
    milliseconds for a heap of hundreds of MB, without the GIL (a ctypes call releases it)."""
    if _TRIM is not None:
        _TRIM(0)
