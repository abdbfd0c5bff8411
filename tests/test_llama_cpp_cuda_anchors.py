"""benchmarks/llama_cpp_cuda_anchors.py: llama.cpp's CUDA figures read from its tools' output and
set beside bench_cuda's, checked with stand-in tools that print what llama-bench and
llama-batched-bench print (no GPU, no llama.cpp build needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

# llama-bench -o json: one object a test (fields cut to those read, plus a few beside them).
LLAMA_BENCH_JSON = [
    {"model_type": "llama 8B Q4_K - Medium", "n_gpu_layers": 99, "n_prompt": 512, "n_gen": 0,
     "n_depth": 0, "avg_ns": 40123456, "avg_ts": 12760.5, "stddev_ts": 35.1},
    {"model_type": "llama 8B Q4_K - Medium", "n_gpu_layers": 99, "n_prompt": 0, "n_gen": 64,
     "n_depth": 0, "avg_ns": 450000000, "avg_ts": 142.25, "stddev_ts": 0.4},
]
# llama-batched-bench --output-format jsonl: log lines, then a JSON line a stream count.
BATCHED_LINES = ["main: n_kv_max = 6144, n_batch = 2048, n_ubatch = 512, flash_attn = -1"] + [
    json.dumps({"n_kv_max": 6144, "pp": 32, "tg": 64, "pl": pl, "n_kv": pl * 96, "t_pp": 0.01,
                "speed_pp": 3200.0 * pl, "t_tg": 64 * pl / speed, "speed_tg": speed,
                "t": 1.0, "speed": speed})
    for pl, speed in ((1, 140.0), (32, 2900.0), (64, 4100.0))]


@pytest.fixture
def anchors(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module (it imports bench_cuda from its own folder, as when run)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import llama_cpp_cuda_anchors

    return llama_cpp_cuda_anchors


def fake_tools(bin_dir: Path, bench_output: str, batched_output: str,
               fail: str | None = None) -> Path:
    """llama-bench and llama-batched-bench stand-ins in `bin_dir` that record their arguments
    (args-<tool>.json) and print the given output; the one named by `fail` exits 1."""
    bin_dir.mkdir(exist_ok=True)
    for tool, output in (("llama-bench", bench_output), ("llama-batched-bench", batched_output)):
        script = bin_dir / tool
        script.write_text(
            f"#!{sys.executable}\nimport json, sys\n"
            f"open({str(bin_dir / f'args-{tool}.json')!r}, 'a')"
            ".write(json.dumps(sys.argv[1:]) + '\\n')\n"
            + ("sys.stderr.write('CUDA error: out of memory\\n'); sys.exit(1)\n" if tool == fail
               else f"sys.stdout.write({output!r})\n"))
        script.chmod(0o755)
    return bin_dir


def tool_args(bin_dir: Path, tool: str) -> list[list[str]]:
    return [json.loads(line) for line in (bin_dir / f"args-{tool}.json").read_text().splitlines()]


def test_llama_cpp_figures_are_named_as_bench_cuda_names_its_anchors(
        anchors: ModuleType, tmp_path: Path) -> None:
    bin_dir = fake_tools(tmp_path / "bin", json.dumps(LLAMA_BENCH_JSON), "\n".join(BATCHED_LINES))
    figures = anchors.llama_cpp_figures(bin_dir, "llama3_8b", tmp_path / "8b.gguf",
                                        (1, 32, 64), 512)
    assert figures == {
        "llama_bench": {"llama3_8b_decode_1_stream_tok_s": 142.25,
                        "llama3_8b_prefill_512_tok_s": 12760.5},
        "batched_bench": {"llama3_8b_decode_1_stream_tok_s": 140.0,
                          "llama3_8b_decode_32_streams_tok_s": 2900.0,
                          "llama3_8b_decode_64_streams_tok_s": 4100.0}}
    for name in figures["llama_bench"]:  # every name is one bench_cuda's anchors use
        assert name in anchors.ANCHORS
    # The same shapes as bench_cuda's decode: its prompt and step counts, every layer on the GPU
    [bench] = tool_args(bin_dir, "llama-bench")
    assert bench[bench.index("-p") + 1] == "512" and bench[bench.index("-ngl") + 1] == "99"
    assert bench[bench.index("-n") + 1] == str(anchors.DECODE_STEPS)
    [batched] = tool_args(bin_dir, "llama-batched-bench")
    assert batched[batched.index("-npp") + 1] == str(anchors.DECODE_PROMPT)
    assert batched[batched.index("-ntg") + 1] == str(anchors.DECODE_STEPS)
    assert batched[batched.index("-npl") + 1] == "1,32,64"
    held = 64 * (anchors.DECODE_PROMPT + anchors.DECODE_STEPS)
    assert int(batched[batched.index("-c") + 1]) >= held


def test_a_missing_figure_is_named(anchors: ModuleType, tmp_path: Path) -> None:
    bin_dir = fake_tools(tmp_path / "bin", json.dumps(LLAMA_BENCH_JSON[1:]),
                         "\n".join(BATCHED_LINES))
    with pytest.raises(RuntimeError, match="llama-bench printed no prefill_512 figure"):
        anchors.llama_cpp_figures(bin_dir, "llama3_8b", tmp_path / "8b.gguf", (1, 32), 512)


def test_one_stream_needs_no_batched_bench(anchors: ModuleType, tmp_path: Path) -> None:
    bin_dir = fake_tools(tmp_path / "bin", json.dumps(LLAMA_BENCH_JSON[1:]), "",
                         fail="llama-batched-bench")
    figures = anchors.llama_cpp_figures(bin_dir, "gemma3_270m", tmp_path / "g.gguf", (1,), None)
    assert figures == {"llama_bench": {"gemma3_270m_decode_1_stream_tok_s": 142.25},
                       "batched_bench": {}}
    bench = tool_args(bin_dir, "llama-bench")[0]
    assert bench[bench.index("-p") + 1] == "0"


def bench_cuda_report() -> dict[str, Any]:
    """The parts of a bench_cuda JSON the comparison reads: the 8B, its Engine figures, gemma-3
    and its failed Engine section."""
    return {
        "llama3_8b": {"decode": [{"streams": 1, "tok_s": 300.0}, {"streams": 32, "tok_s": 3000.0}],
                      "prefill": {"tokens": 512, "tok_s": 9000.0}},
        "llama3_8b_engine": [{"streams": 1, "decode_tok_s": 280.0},
                             {"streams": 32, "decode_tok_s": 1900.0}],
        "gemma3_270m": {"decode": [{"streams": 1, "tok_s": 700.0}]},
        "gemma3_270m_engine": {"error": "TimeoutError"},
    }


def test_ours_beside_theirs_gives_each_figures_ratio(anchors: ModuleType) -> None:
    llama_cpp = {"llama_bench": {"llama3_8b_decode_1_stream_tok_s": 150.0,
                                 "llama3_8b_prefill_512_tok_s": 12000.0,
                                 "gemma3_270m_decode_1_stream_tok_s": 350.0},
                 "batched_bench": {"llama3_8b_decode_1_stream_tok_s": 140.0,
                                   "llama3_8b_decode_32_streams_tok_s": 2500.0}}
    rows = anchors.comparison(llama_cpp, anchors.our_figures(bench_cuda_report()))
    one = rows["llama3_8b_decode_1_stream_tok_s"]
    # batched-bench's figure has bench_cuda's shapes; the anchor is the absolute target
    assert (one["llama_cpp"], one["anchor"]) == (140.0, 450)
    assert one["bare"] == {"tok_s": 300.0, "section": "llama3_8b", "ratio": 300.0 / 140.0}
    assert one["engine"] == {"tok_s": 280.0, "section": "llama3_8b_engine", "ratio": 2.0}
    many = rows["llama3_8b_decode_32_streams_tok_s"]
    assert many["bare"] == {"tok_s": 3000.0, "section": "llama3_8b", "ratio": 1.2}
    assert rows["llama3_8b_prefill_512_tok_s"]["bare"]["ratio"] == 0.75
    assert rows["gemma3_270m_decode_1_stream_tok_s"]["bare"]["ratio"] == 2.0
    assert "engine" not in rows["gemma3_270m_decode_1_stream_tok_s"]


def test_a_failing_tool_is_recorded_and_the_other_model_still_runs(
        anchors: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    bin_dir = fake_tools(tmp_path / "bin", json.dumps(LLAMA_BENCH_JSON), "",
                         fail="llama-batched-bench")
    ours, out = tmp_path / "bench_cuda.json", tmp_path / "anchors.json"
    ours.write_text(json.dumps(bench_cuda_report()))
    monkeypatch.setattr(sys, "argv", ["llama_cpp_cuda_anchors.py", str(bin_dir),
                                      "--model-8b", str(tmp_path / "8b.gguf"),
                                      "--gemma3", str(tmp_path / "g.gguf"),
                                      "--ours", str(ours), "--json", str(out)])
    anchors.main()
    report = json.loads(out.read_text())
    assert "llama-batched-bench exited 1" in report["llama3_8b_error"]
    assert "out of memory" in report["llama3_8b_error"]  # the end of the tool's own log
    assert report["llama_cpp"]["llama_bench"] == {"gemma3_270m_decode_1_stream_tok_s": 142.25}
    assert report["comparison"]["gemma3_270m_decode_1_stream_tok_s"]["bare"]["ratio"] == \
        pytest.approx(700.0 / 142.25)
    assert report["shapes"] == {"decode_prompt": anchors.DECODE_PROMPT,
                                "decode_steps": anchors.DECODE_STEPS,
                                "prefill_tokens": anchors.PREFILL_TOKENS}
    capsys.readouterr()


def test_an_earlier_runs_figures_beside_ours_run_no_tool(
        anchors: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    theirs, ours, out = tmp_path / "theirs.json", tmp_path / "ours.json", tmp_path / "out.json"
    theirs.write_text(json.dumps({
        "shapes": {}, "gemma3_270m_error": "TimeoutExpired",
        "llama_cpp": {"llama_bench": {"llama3_8b_decode_1_stream_tok_s": 150.0},
                      "batched_bench": {}}}))
    ours.write_text(json.dumps(bench_cuda_report()))
    monkeypatch.setattr(sys, "argv", ["llama_cpp_cuda_anchors.py", "--theirs", str(theirs),
                                      "--ours", str(ours), "--json", str(out)])
    anchors.main()
    report = json.loads(out.read_text())
    assert report["gemma3_270m_error"] == "TimeoutExpired"  # the earlier run's record stays
    assert report["comparison"]["llama3_8b_decode_1_stream_tok_s"]["bare"]["ratio"] == 2.0
    assert report["comparison"]["llama3_8b_decode_32_streams_tok_s"]["llama_cpp"] is None
    monkeypatch.setattr(sys, "argv", ["llama_cpp_cuda_anchors.py", "--ours", str(ours)])
    with pytest.raises(SystemExit):  # neither the tools nor an earlier run
        anchors.main()
    assert "give bin_dir" in capsys.readouterr().err
