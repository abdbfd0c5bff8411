"""llama.cpp's CUDA figures on the same GPU and model files as benchmarks/bench_cuda.py's, and
ours as ratios to them: the speed targets read on the machine that measured them.

    python benchmarks/llama_cpp_cuda_anchors.py BIN_DIR --model-8b 8B.gguf [--gemma3 G.gguf]
        [--ours bench_cuda.json] [--json OUT.json]

BIN_DIR holds llama-bench and llama-batched-bench (benchmarks/llama_cpp_cuda.sh), run with
every layer on the GPU and llama.cpp's defaults otherwise. The shapes follow bench_cuda's:

- one stream's decode and a 512-token prefill: llama-bench (`-p 512 -n DECODE_STEPS`);
- decode at 1 / 8 / 32 / 64 streams: llama-batched-bench, each stream holding DECODE_PROMPT
  tokens before DECODE_STEPS decode steps of one token a stream, as bench_cuda's decode does
  (its S_TG: the streams' tokens over the decode steps' time).

Where `--ours` names bench_cuda's JSON, each figure is given beside ours: on the bare
backend and through the whole Engine, and the ratio of each to llama.cpp's. `--theirs` takes llama.cpp's figures from an earlier run's JSON instead of
running the tools (ours and theirs measured in two device calls, set side by side here).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any

from bench_cuda import ANCHORS, DECODE_PROMPT, DECODE_STEPS, DECODE_STREAMS, PREFILL_TOKENS

TOOL_TIMEOUT_S = 240
# bench_cuda's section of each model: the bare backend's (`<model>_engine`: the Engine's).
MODEL_SECTIONS = ("llama3_8b", "gemma3_270m")


def figure_name(model: str, streams: int) -> str:
    """The name of a decode figure, as bench_cuda's ANCHORS spell them."""
    return f"{model}_decode_{streams}_stream{'s' if streams > 1 else ''}_tok_s"


def run_tool(argv: list[str]) -> str:
    """A llama.cpp tool's standard output; its failure raised with the end of its log."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} exited {done.returncode}: "
                           f"{(done.stderr or done.stdout)[-2000:]}")
    return done.stdout


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects among a tool's output lines (its log lines are mixed in)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def llama_bench(bin_dir: Path, model: Path, prefill: int | None) -> dict[str, float]:
    """One stream's decode (DECODE_STEPS tokens) and, where `prefill` is given, a prompt of
    that many tokens in tokens a second, as llama-bench measures them (5 repeats)."""
    output = run_tool([str(bin_dir / "llama-bench"), "-m", str(model), "-ngl", "99",
                       "-p", str(prefill or 0), "-n", str(DECODE_STEPS), "-r", "5", "-o", "json"])
    figures = {}
    for test in json.loads(output):
        if test["n_gen"]:
            figures["decode_1_stream"] = test["avg_ts"]
        elif test["n_prompt"]:
            figures[f"prefill_{test['n_prompt']}"] = test["avg_ts"]
    return figures


def batched_bench(bin_dir: Path, model: Path, streams: tuple[int, ...]) -> dict[int, float]:
    """Decode tokens a second at each stream count: every stream prefilled with DECODE_PROMPT
    tokens, then DECODE_STEPS steps of one token a stream."""
    # Twice what the streams hold: room whether llama.cpp pools the cells or splits them per
    # sequence (and pads each share).
    context = 2 * max(streams) * (DECODE_PROMPT + DECODE_STEPS)
    output = run_tool([str(bin_dir / "llama-batched-bench"), "-m", str(model), "-ngl", "99",
                       "-c", str(context), "-npp", str(DECODE_PROMPT), "-ntg", str(DECODE_STEPS),
                       "-npl", ",".join(map(str, streams)), "--output-format", "jsonl"])
    return {row["pl"]: row["speed_tg"] for row in json_lines(output)}


def llama_cpp_figures(bin_dir: Path, model: str, path: Path, streams: tuple[int, ...],
                      prefill: int | None) -> dict[str, dict[str, float]]:
    """llama.cpp's figures of one model file, named as bench_cuda's ANCHORS name them, by the
    tool that measured them."""
    single = llama_bench(bin_dir, path, prefill)
    wanted = ["decode_1_stream"] + ([f"prefill_{prefill}"] if prefill else [])
    if missing := [name for name in wanted if name not in single]:
        raise RuntimeError(f"llama-bench printed no {', '.join(missing)} figure: {single}")
    figures = {"llama_bench": {figure_name(model, 1): single["decode_1_stream"]},
               "batched_bench": {}}
    if prefill:
        figures["llama_bench"][f"{model}_prefill_{prefill}_tok_s"] = single[f"prefill_{prefill}"]
    if len(streams) > 1:
        figures["batched_bench"] = {figure_name(model, n): tok_s
                                    for n, tok_s in batched_bench(bin_dir, path, streams).items()}
    return figures


def our_figures(report: dict[str, Any]) -> dict[str, dict[str, tuple[float, str]]]:
    """bench_cuda's figures under the anchors' names, each with its section, on the bare
    backend ("bare") and through the Engine ("engine")."""
    ours: dict[str, dict[str, tuple[float, str]]] = {"bare": {}, "engine": {}}
    for model in MODEL_SECTIONS:
        bare = report.get(model, {})  # a model's figures, or {"error": ...}
        for row in bare.get("decode", []):
            ours["bare"][figure_name(model, row["streams"])] = (row["tok_s"], model)
        prefill = bare.get("prefill")
        if prefill:
            ours["bare"][f"{model}_prefill_{prefill['tokens']}_tok_s"] = (prefill["tok_s"], model)
        engine = report.get(f"{model}_engine")
        for row in engine if isinstance(engine, list) else []:
            ours["engine"][figure_name(model, row["streams"])] = (row["decode_tok_s"],
                                                                  f"{model}_engine")
    return ours


def comparison(llama_cpp: dict[str, dict[str, float]],
               ours: dict[str, dict[str, tuple[float, str]]]) -> dict[str, dict[str, Any]]:
    """Each of our figures beside llama.cpp's and the absolute anchor. A decode figure
    compares with llama-batched-bench's where there is one (the same prompt and step counts as
    ours), else with llama-bench's."""
    rows: dict[str, dict[str, Any]] = {}
    for name in sorted({name for kind in ours.values() for name in kind}):
        theirs = llama_cpp["batched_bench"].get(name, llama_cpp["llama_bench"].get(name))
        row: dict[str, Any] = {"llama_cpp": theirs, "anchor": ANCHORS.get(name)}
        for kind, figures in ours.items():
            if name in figures:
                tok_s, section = figures[name]
                row[kind] = {"tok_s": tok_s, "section": section,
                             "ratio": tok_s / theirs if theirs else None}
        rows[name] = row
    return rows


def measure(bin_dir: Path, model_8b: Path | None, gemma3: Path | None,
            report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """llama.cpp's figures of the files given, by tool; a model whose tools fail is recorded
    in `report` as `<model>_error` and the other still runs."""
    llama_cpp: dict[str, dict[str, float]] = {"llama_bench": {}, "batched_bench": {}}
    for model, path, streams, prefill in [("llama3_8b", model_8b, DECODE_STREAMS, PREFILL_TOKENS),
                                          ("gemma3_270m", gemma3, (1,), None)]:
        if not path:
            continue
        started = time.perf_counter()
        try:
            for tool, figures in llama_cpp_figures(bin_dir, model, path, streams, prefill).items():
                llama_cpp[tool].update(figures)
        except Exception as exc:  # noqa: BLE001  (recorded; the other model still runs)
            report[f"{model}_error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        print(f"llama_cpp_cuda_anchors: {model} in {time.perf_counter() - started:.1f} s",
              flush=True)
    return llama_cpp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bin_dir", type=Path, nargs="?",
                        help="llama-bench and llama-batched-bench's folder")
    parser.add_argument("--model-8b", type=Path, help="the Llama-3-8B-shaped file bench_cuda ran")
    parser.add_argument("--gemma3", type=Path, help="the gemma-3-270m file bench_cuda ran")
    parser.add_argument("--ours", type=Path, help="bench_cuda's JSON, for the ratios")
    parser.add_argument("--theirs", type=Path, help="an earlier run's JSON: its llama.cpp "
                        "figures beside --ours, no tool run (no bin_dir)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if (args.bin_dir is None) == (args.theirs is None):
        parser.error("give bin_dir (to run llama.cpp's tools) or --theirs (an earlier run's JSON)")

    report: dict[str, Any] = {"shapes": {"decode_prompt": DECODE_PROMPT,
                                         "decode_steps": DECODE_STEPS,
                                         "prefill_tokens": PREFILL_TOKENS}}
    if args.theirs:
        earlier = json.loads(args.theirs.read_text())
        report.update({key: value for key, value in earlier.items() if key != "comparison"})
    else:
        report["llama_cpp"] = measure(args.bin_dir, args.model_8b, args.gemma3, report)
    if args.ours and args.ours.exists():
        report["comparison"] = comparison(report["llama_cpp"],
                                          our_figures(json.loads(args.ours.read_text())))
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
