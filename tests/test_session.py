"""Stop strings: text that could become a stop string is held back, never emitted then taken
back, and the text from a stop string on is dropped."""

from __future__ import annotations

import pytest

from actors.scheduler import Admission
from actors.session import StopText
from actors.errors import EngineOverloaded


def feed(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    stop_text = StopText(stops)
    emitted = []
    for piece in pieces:
        text, hit = stop_text.push(piece)
        emitted.append(text)
        if hit:
            return emitted, True
    emitted.append(stop_text.flush())
    return emitted, False


def test_a_stop_string_across_pieces_is_cut_and_never_emitted() -> None:
    emitted, hit = feed(["END"], ["the E", "N", "D of it"])
    assert hit and "".join(emitted) == "the "
    assert emitted == ["the ", "", ""]


def test_a_false_start_is_released_once_it_cannot_match() -> None:
    emitted, hit = feed(["END"], ["an E", "Nx", "y"])
    assert not hit
    assert emitted == ["an ", "ENx", "y", ""]


def test_the_earliest_of_several_stops_wins() -> None:
    emitted, hit = feed(["world", "lo w"], ["hello world"])
    assert hit and emitted == ["hel"]


def test_held_text_comes_out_at_the_end() -> None:
    emitted, hit = feed(["###"], ["a#", "#"])
    assert not hit and "".join(emitted) == "a##"


def test_no_stops_holds_nothing() -> None:
    assert feed([], ["a", "b"]) == (["a", "b", ""], False)


def test_admission_counts_live_requests() -> None:
    admission = Admission(2)
    admission.enter()
    admission.enter()
    with pytest.raises(EngineOverloaded):
        admission.enter()
    admission.leave()
    admission.enter()
    assert admission.live == 2
