"""benchmarks/bench_cuda.py end to end over the emulated device, whose kernel twins check each
launch's arguments as they run: every section a device run makes, so a mistake in the
benchmark's own code (a kernel's arguments, a section's plumbing) shows here rather than in a
device run's few minutes. Its matrices are cut small; the figures are meaningless; what is
checked is that each section ran and reports its fields. benchmarks/bench_compile.py likewise."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_MODELS

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.slow
def test_every_section_runs_and_reports(emulated: tuple[Any, Any], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_cuda

    monkeypatch.setattr(bench_cuda, "COPY_BYTES", 1 << 20)
    monkeypatch.setattr(bench_cuda, "MATVEC_SHAPES", ((96, 512), (64, 1024)))
    for name, value in [("DECODE_STREAMS", (1, 9)), ("DECODE_STEPS", 4), ("ENGINE_TOKENS", 6),
                        ("PREFILL_TOKENS", 64)]:
        monkeypatch.setattr(bench_cuda, name, value)
    out = tmp_path / "bench_cuda.json"
    llama, qwen = TINY_MODELS["llama-q4k-tiny"], TINY_MODELS["qwen2-q4k-tiny"]
    monkeypatch.setattr(sys, "argv", [
        "bench_cuda.py", "--json", str(out), "--repeats", "2", "--model-8b", str(llama),
        "--gemma3", str(qwen), "--model", str(qwen), "--engine-streams", "1", "9"])
    bench_cuda.main()
    capsys.readouterr()
    report = json.loads(out.read_text())

    errors = {name: section["error"] for name, section in report.items()
              if isinstance(section, dict) and "error" in section}
    assert not errors
    assert [(row["kernel"], row["tokens"]) for row in report["matvec_mma"]] == [
        (f"mul_mat_vec_mma_{t}", n) for t in ("q4_K", "q6_K") for _ in bench_cuda.MATVEC_SHAPES
        for n in (1, 8)]
    assert all(row["us"] > 0 for row in report["matvec_mma"])
    assert [row["kernel"] for row in report["batch_prefill"]] == [
        "mul_mat_batch64_f16x2_q4_K", "mul_mat_batch64_f16x2_q6_K_planar"]
    assert all(row["tokens"] == bench_cuda.PREFILL_TOKENS for row in report["batch_prefill"])
    assert [(row["type"], row["tokens"]) for row in report["batch"]] == [
        (t, n) for t in ("Q4_K", "Q6_K") for _ in bench_cuda.MATVEC_SHAPES for n in (16, 32, 64)]
    assert all(row["kernel"].endswith("_planar") == (row["type"] == "Q6_K")
               for row in report["batch"])
    # every product timed from a graph of its launches alone (several), not from Python's
    # launch loop
    timed = [row["kernel"] for name in ("matvec_mma", "batch", "batch_prefill")
             for row in report[name]]
    graphs = [graph for graph in emulated[1].captured if graph and graph[0] in timed]
    graphs = graphs[:len(timed)]
    assert [graph[0] for graph in graphs] == timed
    assert all(len(graph) >= 2 and set(graph) == {graph[0]} for graph in graphs)
    for section, streams in [("llama3_8b", bench_cuda.DECODE_STREAMS),
                             ("gemma3_270m", (1,)), ("qwen2-q4k-tiny", bench_cuda.DECODE_STREAMS)]:
        assert [row["streams"] for row in report[section]["decode"]] == list(streams), section
    assert report["llama3_8b"]["prefill"]["tokens"] == bench_cuda.PREFILL_TOKENS
    for section, streams in [("llama3_8b_engine", [1, 9]), ("gemma3_270m_engine", [1, 9]),
                             ("qwen2-q4k-tiny_engine", [1, 9]),
                             ("llama3_8b_engine_other_run_ahead", [1, 9])]:
        rows = report[section]
        assert [row["streams"] for row in rows] == streams, section
        # each beside the bare backend's step at the same count, where that one was measured
        assert all("decode_tok_s" in row for row in rows), section
    # the run-ahead rule reversed: none at 1 stream, every step at 9 (past the rule's 8)
    assert [row["run_ahead_rows"] for row in report["llama3_8b_engine_other_run_ahead"]] == [0, 9]


def test_the_compile_benchmark_times_every_case(emulated: tuple[Any, Any],
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/bench_compile.py over the emulated compiler: each case timed, and every
    file compiled in each of the four."""
    _, device = emulated
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.delitem(sys.modules, "bench_compile", raising=False)  # over this emulator
    import bench_compile

    monkeypatch.setattr(sys, "argv", ["bench_compile.py"])
    bench_compile.main()
    figures = json.loads(capsys.readouterr().out)
    cases = [f"{way}_{cache}_s" for way in ("one_at_a_time", "side_by_side")
             for cache in ("cold", "cached")]
    assert set(figures) == {"files", *cases}
    assert all(figures[case] >= 0 for case in cases)
    assert len(device.compiled) == 4 * figures["files"]
