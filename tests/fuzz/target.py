"""What a fuzz target is, and the check shared by all of them."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from actors.errors import Q4KError


# A hang guard, not a speed requirement: a case normally takes milliseconds.
HANG_GUARD_S = 60


class Escape(AssertionError):
    """An input made the project raise something other than its own errors."""


@dataclass(frozen=True)
class Target:
    """A family of hostile inputs (`cases`) and the check each must pass (`check`)."""

    name: str
    cases: st.SearchStrategy[Any]
    check: Callable[[Any], str]


@contextmanager
def only_project_errors(what: object) -> Iterator[list[str]]:
    """Yields a list that gets the outcome ('ok' or the project error's class name); any other
    exception becomes an `Escape` naming `what`."""
    outcome = ["ok"]
    try:
        yield outcome
    except Q4KError as exc:
        outcome[0] = type(exc).__name__
    except Escape:
        raise
    except Exception as exc:
        raise Escape(f"{type(exc).__name__}: {exc!s:.300} <- {what!r:.300}") from exc


@contextmanager
def hang_guard(what: object) -> Iterator[None]:
    """Raise `TimeoutError` in the main thread if the block runs past `HANG_GUARD_S`."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"{what!r:.300} ran past {HANG_GUARD_S} s: a hang")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(HANG_GUARD_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
