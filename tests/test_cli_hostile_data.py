"""`q4k inspect` and `q4k logs` on data that is hostile to a terminal table:
rich markup in model names, paths and logged values is shown as it is; huge fields
are cut in tables; devices, FIFOs without writers and endless stdin are refused at once; the
summary streams a log of any length in flat memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from actors.cli.logs import CELL_CHARS, MAX_LINE_BYTES, _streamed_summary
from actors.logreader import parse_log, summarize
from test_cli_logs import assert_one_line_error, run_q4k
from tests.conftest import TINY_MODELS
from tests.fuzz import gguf_structure

# Each would be read as markup: a style, a closing tag with nothing open, a link, an escape.
MARKUP = ["[bold red]styled[/bold red]", "[/]closed", "[link=http://x]l[/link]", "\\[esc]"]


def stamp(second: int) -> str:
    return f"2026-12-01T00:00:{second:02d}.000000Z"


def event(name: str, second: int, **fields: object) -> str:
    return json.dumps({"event": name, "timestamp": stamp(second), "level": "info", **fields})


def markup_log(path: Path) -> Path:
    lines = [event("model_loaded", 0, path=MARKUP[0], arch=MARKUP[1], backend="cpu")]
    for index, text in enumerate(MARKUP):
        request_id = f"{text}-{index}"
        lines += [
            event("request_admitted", index + 1, request_id=request_id, prompt_tokens=3),
            event("request_failed", index + 2, request_id=request_id, error=f"boom {text}"),
            event("request_finished", index + 2, request_id=f"ok-{index}", finish_reason=text,
                  completion_tokens=2, total_ms=5.0),
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_markup_in_logged_values_is_shown_as_it_is(tmp_path: Path) -> None:
    log = markup_log(tmp_path / "markup.log")
    for view in (["summary"], ["requests"], ["request", f"{MARKUP[1]}-1"], ["tail", "-n", "50"]):
        result = run_q4k("logs", *view, str(log))
        assert result.returncode == 0 and "Traceback" not in result.stderr, (view, result.stderr)
        expected = MARKUP if view[0] != "request" else [MARKUP[1]]
        for text in expected:
            assert text in result.stdout, (view, text, result.stdout)


def test_markup_in_a_path_and_a_model_name_is_shown_as_it_is(tmp_path: Path) -> None:
    name = "[bold]tiny[/] [/]model [link=x]"
    parts = gguf_structure.apply(
        gguf_structure.seed_parts("llama-q4k-tiny"),
        gguf_structure.Mutation(
            "set", "general.name", gguf_structure.Value(gguf_structure.T.STRING, name)
        ),
    )
    path = tmp_path / "[red]weights[bold].gguf"
    gguf_structure.write_gguf(parts, path)
    result = run_q4k("inspect", str(path))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert name in result.stdout and str(path) in result.stdout
    (tmp_path / "[").mkdir()
    renamed = tmp_path / "[" / "]plain.gguf"  # the path holds "[/]": a closing tag
    shutil.copy(TINY_MODELS["llama-q4k-tiny"], renamed)
    assert str(renamed) in run_q4k("inspect", str(renamed)).stdout


def test_huge_fields_are_cut_in_tables_and_lines(tmp_path: Path) -> None:
    huge = "x" * 1_000_000
    lines = [event("request_admitted", 1, request_id=huge, prompt_tokens=3)]
    lines += [event("request_failed", 2 + i, request_id=f"r{i}", error=huge) for i in range(20)]
    lines.append(event("request_failed", 30, request_id="long", error="y" * (MAX_LINE_BYTES + 10)))
    log = tmp_path / "huge.log"
    log.write_text("\n".join(lines) + "\n")
    requests = run_q4k("logs", "requests", str(log))
    assert requests.returncode == 0
    # 21 rows, each cell cut to CELL_CHARS: kilobytes, not the 20 MB the fields hold.
    assert len(requests.stdout) < 22 * 4 * CELL_CHARS
    summary = run_q4k("logs", "summary", str(log))
    assert summary.returncode == 0 and len(summary.stdout) < 20_000
    assert "longer than" in summary.stdout  # the line past MAX_LINE_BYTES: malformed
    tail = run_q4k("logs", "tail", "-n", "3", str(log))
    assert tail.returncode == 0 and len(tail.stdout) < 4_000
    assert "longer than" in tail.stdout


@pytest.mark.parametrize("view", [["summary"], ["requests"], ["tail"], ["summary", "--plot",
                                                                          "out.png"]])
def test_devices_and_fifos_without_writers_are_refused_at_once(tmp_path: Path,
                                                               view: list[str]) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for name, phrase in (("/dev/zero", "device"), (str(fifo), "FIFO"),
                         (str(tmp_path), "directory")):
        result = run_q4k("logs", *view, name, timeout=30)
        assert_one_line_error(result, name, phrase)


def test_stdin_from_a_device_is_refused_a_pipe_is_read(tmp_path: Path) -> None:
    with open("/dev/zero", "rb") as zero:
        result = subprocess.run([sys.executable, "-m", "actors.cli", "logs", "summary", "-"],
                                stdin=zero, capture_output=True, text=True, timeout=30)
    assert_one_line_error(result, "<stdin>", "device")
    piped = run_q4k("logs", "summary", "--json", "-", stdin=event("step", 1, items=2) + "\n")
    assert json.loads(piped.stdout)["steps"] == 1


def _log_of(path: Path, requests: int) -> Path:
    with path.open("w") as out:
        for index in range(requests):
            out.write(event("request_admitted", index % 60, request_id=f"{index:x}") + "\n")
            out.write(event("step", index % 60, items=index % 7) + "\n")
            out.write(event("request_finished", index % 60, request_id=f"{index:x}",
                            finish_reason="stop", completion_tokens=4, ttft_ms=3.0,
                            decode_tokens_per_s=50.0, total_ms=20.0) + "\n")
    return path


def test_the_summary_streams_in_flat_memory_and_agrees_with_the_whole_parse(
    tmp_path: Path,
) -> None:
    small, big = _log_of(tmp_path / "small.log", 2_000), _log_of(tmp_path / "big.log", 20_000)
    _streamed_summary([str(small)])  # first use: imports and caches, not the log's memory
    peaks = []
    for log in (small, big):
        tracemalloc.start()
        try:
            streamed = _streamed_summary([str(log)])
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    # Ten times the events (60,000 lines, 11 MB): a few numbers more per request (its id's
    # hash, latencies, busy interval: about 100 bytes), not its three events (a KB each).
    assert (peaks[1] - peaks[0]) / 18_000 < 250, peaks
    whole = summarize(parse_log([(str(big), big.read_text().split("\n"))]))
    assert streamed == whole
    assert streamed.requests_seen == 20_000 and streamed.steps == 20_000


def test_a_summary_keeps_a_bounded_number_of_distinct_texts() -> None:
    lines = [event("request_failed", 1, request_id=str(i), error=f"e{i}" * 300)
             for i in range(1500)]
    summary = summarize(parse_log([("log", lines)]))
    assert len(summary.errors) == 1001  # 1,000 kept, the rest counted together
    assert sum(summary.errors.values()) == 1500
    assert max(map(len, summary.errors)) <= 500
