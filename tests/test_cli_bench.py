"""`q4k bench` as a subprocess on the tiny llama model, its figures checked against the log the
run wrote; the interval arithmetic behind the figures checked directly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from actors.cli.bench import RequestTiming, covered_seconds, level_result
from test_cli_logs import run_q4k

ARGS = ("--backend", "cpu", "--prompt-tokens", "24", "--max-tokens", "6", "--rounds", "2")


@pytest.fixture(scope="module")
def bench_run(tiny_model_paths: dict[str, Path],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    log = tmp_path_factory.mktemp("bench") / "bench.log"
    result = run_q4k("bench", "--model", str(tiny_model_paths["llama-q4k-tiny"]), *ARGS,
                     "--concurrency", "1,3", "--json", "--log-file", str(log),
                     "--log-level", "debug")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), log


def test_bench_json_reports_every_level(bench_run: tuple[dict, Path]) -> None:
    report, _ = bench_run
    assert report["model"].endswith("llama-q4k-tiny.gguf") and report["backend"] == "cpu"
    levels = report["levels"]
    assert [level["concurrency"] for level in levels] == [1, 3]
    assert [level["requests"] for level in levels] == [2, 6]
    for level in levels:
        assert level["mean_prompt_tokens"] > 10
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "aggregate_tokens_per_s",
                    "ttft_p50_ms", "rss_mib"):
            assert level[key] > 0
        assert level["ttft_p95_ms"] >= level["ttft_p50_ms"]
        assert level["peak_rss_mib"] >= level["rss_mib"]


def test_bench_log_agrees(bench_run: tuple[dict, Path]) -> None:
    _, log = bench_run
    summary = json.loads(run_q4k("logs", "summary", "--json", str(log)).stdout)
    # The warm-up request, then 2 + 6 measured ones, each exactly --max-tokens long.
    assert summary["finish_reasons"] == {"length": 9}
    assert summary["completion_tokens"] == 2 + 8 * 6
    assert summary["malformed"] == 0 and summary["failed"] == 0
    # Three clients at once must share steps.
    assert max(int(size) for size in summary["batch_sizes"]) >= 2


def test_bench_table_and_bad_levels(tiny_model_paths: dict[str, Path]) -> None:
    model = str(tiny_model_paths["llama-q4k-tiny"])
    table = run_q4k("bench", "--model", model, *ARGS, "--concurrency", "2")
    assert table.returncode == 0, table.stderr
    assert "prefill tok/s" in table.stdout and "TTFT p95 ms" in table.stdout
    bad = run_q4k("bench", "--model", model, "--concurrency", "1,zero")
    assert bad.returncode == 2 and "'zero' is not a whole number" in bad.stderr


def test_covered_seconds_is_the_union_of_intervals() -> None:
    starts = np.array([5.0, 0.0, 1.0, 10.0])
    ends = np.array([6.0, 2.0, 3.0, 10.5])
    assert covered_seconds(starts, ends) == pytest.approx(3.0 + 1.0 + 0.5)
    assert covered_seconds(np.array([]), np.array([])) == 0.0


def test_level_result_figures() -> None:
    timings = [RequestTiming(0.0, 0.5, 2.5, 100, 11), RequestTiming(0.0, 1.0, 3.0, 50, 21)]
    result = level_result(2, timings)
    assert result.prefill_tokens_per_s == pytest.approx(150 / 1.0)
    assert result.decode_tokens_per_s == pytest.approx(30 / 2.5)
    assert result.aggregate_tokens_per_s == pytest.approx(32 / 3.0)
    assert result.ttft_p50_ms == pytest.approx(750.0)
