"""Small files of millions of tiny entries: metadata keys, one-element
tensors, nested arrays, strings spread over many arrays. Each is refused with a
ModelFormatError before its entries are read, in milliseconds, by the reader, `open_model`
and `q4k inspect` alike; a file under the bounds still opens."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.errors import ModelFormatError
from actors.model.gguf import reader as gguf_module
from actors.model.gguf.reader import MAX_ARRAYS, MAX_METADATA_KEYS, MAX_TENSORS, open_gguf
from actors.model.loaded import open_model
from tests.fuzz.gguf_counts import many_keys, many_tensors, nested_arrays, string_arrays

MILLION = 1 << 20


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
