"""What a fuzz target is, and the check shared by all of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from actors.errors import Q4KError


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
    except Exception as exc:
        raise Escape(f"{type(exc).__name__}: {exc!s:.300} <- {what!r:.300}") from exc
