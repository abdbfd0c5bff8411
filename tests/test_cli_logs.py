"""`q4k logs` driven as a subprocess over synthetic logs: outputs, exit codes, malformed lines,
stdin, several files, tail -f on a file being appended, --plot with and without matplotlib."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from test_logreader import GARBAGE, recount, write_synthetic_log

# Generous bound for one CLI call on a loaded 2-core machine; not a timing assertion.
CALL_TIMEOUT_S = 120


def run_q4k(*args: str, stdin: str | None = None, env: dict[str, str] | None = None,
            timeout: float = CALL_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run `python -m actors.cli ARGS` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "actors.cli", *args],
        input=stdin, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *phrases: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for phrase in phrases:
        assert phrase in lines[0]


@pytest.fixture(scope="module")
def garbage_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    path = tmp_path_factory.mktemp("logs") / "run.log"
    return path, write_synthetic_log(path, requests=50, seed=11, garbage=True)


def test_summary_json_agrees_with_a_recount(garbage_log: tuple[Path, list[str]]) -> None:
    path, lines = garbage_log
    result = run_q4k("logs", "summary", "--json", str(path))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    expected = recount(lines)
    assert summary["malformed"] == expected["malformed"] == len(GARBAGE) + 1
    assert len(summary["malformed_examples"]) == 5
    assert summary["finish_reasons"] == expected["finish_reasons"]
    assert (summary["cancelled"], summary["failed"], summary["rejected"]) == (
        expected["cancelled"], expected["failed"], expected["rejected"])
    ttft = summary["ttft_ms"]
    np.testing.assert_allclose([ttft["p50"], ttft["p95"], ttft["p99"]], expected["ttft"])
    per_token = summary["per_token_latency_ms"]
    np.testing.assert_allclose([per_token["p50"], per_token["p95"], per_token["p99"]],
                               expected["per_token"])
    assert summary["tokens_per_s"] == pytest.approx(expected["tokens_per_s"], rel=1e-6)
    assert {int(k): v for k, v in summary["batch_sizes"].items()} == expected["batch_sizes"]


def test_summary_table_names_the_figures(garbage_log: tuple[Path, list[str]]) -> None:
    path, lines = garbage_log
    result = run_q4k("logs", "summary", str(path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    expected = recount(lines)
    for heading in ("requests", "latency (ms)", "time to first token", "per token",
                    "tokens/s while busy", "tokens/s over the whole span", "batch sizes",
                    "malformed lines", "not JSON"):
        assert heading in out
    assert f"{expected['events']} events, {expected['malformed']} malformed" in out
    assert f"{expected['tokens_per_s']:,.1f}" in out
    assert f"{expected['busy_tokens_per_s']:,.1f}" in out
    assert f"{np.round(expected['ttft'][0], 1):.1f}" in out


def test_summary_attributes_a_logged_notice_to_the_run_that_logged_it(tmp_path: Path) -> None:
    """A notice about the machine that ran the engine (here: its GPU passed over) is shown as
    the log's, not as a notice about the machine reading the log."""
    path = tmp_path / "run.log"
    message = "backend auto: cuda not used (no NVIDIA driver); running on the CPU"
    path.write_text(json.dumps({"event": "notice", "timestamp": "2026-01-02T03:04:05Z",
                                "level": "info", "logger": "actors.loader",
                                "message": message}) + "\n")
    result = run_q4k("logs", "summary", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    (title,) = [i for i, line in enumerate(lines) if line.startswith("notices the log holds")]
    assert "from the run that wrote it" in lines[title]
    assert message in "\n".join(lines[title + 1:])
    assert not any(line.startswith("notice") and message in line for line in lines)
    assert message not in result.stderr


def test_stdin_and_several_files(tmp_path: Path) -> None:
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    lines_a = write_synthetic_log(first, requests=10, seed=1)
    lines_b = write_synthetic_log(second, requests=12, seed=2)
    both = json.loads(run_q4k("logs", "summary", "--json", str(first), str(second)).stdout)
    assert both["sources"] == [str(first), str(second)]
    assert both["events"] == len(lines_a) + len(lines_b)
    piped = run_q4k("logs", "summary", "--json", "-", stdin=first.read_text())
    assert json.loads(piped.stdout)["events"] == len(lines_a)
    assert json.loads(piped.stdout)["sources"] == ["<stdin>"]


def test_requests_and_one_request(garbage_log: tuple[Path, list[str]]) -> None:
    path, lines = garbage_log
    rows = json.loads(run_q4k("logs", "requests", "--json", str(path)).stdout)
    ids = {json.loads(t)["request_id"] for t in lines
           if t.startswith("{") and t.endswith("}") and '"request_id"' in t}
    assert {r["request_id"] for r in rows} == ids
    table = run_q4k("logs", "requests", str(path))
    assert table.returncode == 0 and f"{len(rows)} requests" in table.stdout

    finished = next(r for r in rows if r["status"] == "finished")
    timeline = run_q4k("logs", "request", finished["request_id"], str(path))
    assert timeline.returncode == 0, timeline.stderr
    assert "request_admitted" in timeline.stdout and "request_finished" in timeline.stdout
    as_json = json.loads(run_q4k("logs", "request", "--json", finished["request_id"],
                                 str(path)).stdout)
    assert as_json["events"][-1]["details"]["finish_reason"] == finished["finish_reason"]

    assert_one_line_error(run_q4k("logs", "request", "no-such-id", str(path)),
                          "matches no request")


def test_missing_or_unreadable_input_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(run_q4k("logs", "summary", str(tmp_path / "absent.log")),
                          "absent.log", "no such log file")
    assert_one_line_error(run_q4k("logs", "summary", str(tmp_path)), "is a directory")
    assert_one_line_error(run_q4k("logs", "tail", str(tmp_path / "absent.log")),
                          "no such log file")


def test_tail_prints_the_last_lines_readably(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    lines = write_synthetic_log(path, requests=5, seed=4)
    result = run_q4k("logs", "tail", "-n", "3", str(path))
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip().splitlines()
    assert len(out) == 3
    last = json.loads(lines[-1])
    assert last["event"] in out[-1] and not out[-1].startswith("{")
    piped = run_q4k("logs", "tail", "-", stdin="\n".join([*lines, "not json"]) + "\n")
    assert piped.returncode == 0, piped.stderr
    shown = piped.stdout.strip().splitlines()
    assert len(shown) == len(lines) + 1 and shown[-1].startswith(f"malformed line {len(lines) + 1}")


def test_tail_refuses_a_negative_count(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    write_synthetic_log(path, requests=2, seed=4)
    assert_one_line_error(run_q4k("logs", "tail", "-n", "-3", str(path)), "-n", "at least 0")


def _read_until(process: subprocess.Popen[str], wanted: str, deadline: float) -> str:
    """Lines from the process's stdout up to one containing `wanted` (bounded in time by the
    caller's deadline, enforced with a watchdog kill)."""
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if wanted in line:
            return "".join(seen)
    raise AssertionError(f"{wanted!r} never appeared; got {''.join(seen)!r}")


def test_tail_follow_prints_appended_lines(tmp_path: Path) -> None:
    path = tmp_path / "live.log"
    path.write_text(json.dumps({"event": "engine_started", "timestamp": "2026-01-02T03:04:05Z",
                                "level": "info", "backend": "cpu"}) + "\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "actors.cli", "logs", "tail", "-f", "-n", "1", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    watchdog = subprocess.Popen(  # never let a stuck follower hang the suite
        ["sh", "-c", f"sleep {CALL_TIMEOUT_S}; kill -9 {process.pid} 2>/dev/null"])
    try:
        deadline = time.monotonic() + CALL_TIMEOUT_S
        _read_until(process, "engine_started", deadline)  # it has read what is there so far
        stamp = "2026-01-02T03:04:09.000001Z"
        finished = json.dumps({"event": "request_finished", "timestamp": stamp, "level": "info",
                               "request_id": "live-1", "finish_reason": "length"})
        with path.open("a") as log:
            log.write(finished[:30])  # a line written in two parts is shown once, whole
            log.flush()
            time.sleep(0.5)
            log.write(finished[30:] + "\n")
            log.write("garbage that is not json\n")
            log.write(json.dumps({"event": "notice", "timestamp": stamp, "level": "warning",
                                  "message": "all done"}) + "\n")
        out = _read_until(process, "all done", deadline)
        assert "[live-1]" in out and "finish_reason=length" in out
        assert "malformed line" in out and "garbage that is not json" in out
        assert out.count("request_finished") == 1

        path.write_text("")  # truncated, as log rotation with copytruncate does
        time.sleep(0.5)
        path.write_text(json.dumps({"event": "notice", "timestamp": stamp, "level": "info",
                                    "message": "after rotation"}) + "\n")
        _read_until(process, "after rotation", deadline)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=CALL_TIMEOUT_S) == 0
        assert "Traceback" not in process.stderr.read()
    finally:
        process.kill()
        watchdog.kill()
        process.wait()


def test_plot_writes_a_png(garbage_log: tuple[Path, list[str]], tmp_path: Path) -> None:
    path, _ = garbage_log
    png = tmp_path / "run.png"
    result = run_q4k("logs", "summary", "--plot", str(png), str(path))
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(
    garbage_log: tuple[Path, list[str]], tmp_path: Path
) -> None:
    blocker = tmp_path / "no_matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    path, _ = garbage_log
    result = run_q4k("logs", "summary", "--plot", str(tmp_path / "x.png"), str(path),
                     env={"PYTHONPATH": os.pathsep.join(
                         [str(blocker.parent), os.environ.get("PYTHONPATH", "")])})
    assert_one_line_error(result, "--plot needs matplotlib", "q4k-actors[plot]")


def test_invalid_utf8_is_one_malformed_line_from_a_file_or_stdin(tmp_path: Path) -> None:
    good = json.dumps({"event": "notice", "timestamp": "2026-01-02T03:04:05Z", "message": "ok"})
    separator = json.dumps({"event": "notice", "timestamp": "2026-01-02T03:04:06Z",
                            "message": "a\u2028b"}, ensure_ascii=False)  # one line, not two
    raw = b"\xff\xfe\x80 not text\n" + f"{good}\n{separator}\n".encode()
    path = tmp_path / "binary.log"
    path.write_bytes(raw)
    from_file = json.loads(run_q4k("logs", "summary", "--json", str(path)).stdout)
    piped = subprocess.run([sys.executable, "-m", "actors.cli", "logs", "summary", "--json", "-"],
                           input=raw, capture_output=True, timeout=CALL_TIMEOUT_S)
    assert piped.returncode == 0, piped.stderr
    for summary in (from_file, json.loads(piped.stdout)):
        assert (summary["events"], summary["malformed"]) == (2, 1)


def test_every_view_survives_hostile_lines(tmp_path: Path) -> None:
    from test_logreader import HOSTILE_LINES

    path = tmp_path / "hostile.log"
    lines = write_synthetic_log(path, requests=5, seed=6)
    with path.open("a") as out:
        out.write("\n".join(HOSTILE_LINES.values()) + "\n")
    request_id = json.loads(next(line for line in lines if "request_id" in line))["request_id"]
    for view in (["summary"], ["summary", "--json"], ["requests"], ["request", request_id],
                 ["tail", "-n", "50"]):
        result = run_q4k("logs", *view, str(path))
        assert result.returncode == 0 and "Traceback" not in result.stderr, (view, result.stderr)
    summary = json.loads(run_q4k("logs", "summary", "--json", str(path)).stdout)
    assert summary["malformed"] == len(HOSTILE_LINES)
