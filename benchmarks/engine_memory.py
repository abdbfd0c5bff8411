"""Resident memory of the engine on gemma-3-270m (or --model), broken down by mapping.

    python benchmarks/engine_memory.py [--model PATH] [--tokens 64] [--pieces]

Opens `Engine.open(path)` with its default options (the default KV pool), serves one request
of --tokens tokens, then one structured (JSON schema) request, and prints the process's
resident memory (VmRSS) after each stage, split by what holds the pages (/proc/self/smaps):

- anonymous: the heap and anonymous mappings (Python objects, the tokenizers' tables, the
  KV pool's written pages, the step's buffers, numba's compiled code);
- model file: the GGUF's pages read so far (shared page cache, counted in RSS once mapped);
- other files: shared libraries and other mapped files (numpy, LLVM, ...).

`--pieces` instead builds what `Engine.open` builds one piece at a time, in the order it
does, and prints what each adds: the file's metadata, the tokenizer's tables, its encoder and
special-token patterns, the weights, llguidance's grammar tokenizer, the first step.
Figures are MiB. The goal for gemma-3-270m (`RSS_GOAL_MIB`) is after one request with the
default pool. Linux only.
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass

import actors  # noqa: F401  # first: it picks OpenBLAS's kernels before numpy loads them
import anyio

from actors import Engine, SamplingParams
from actors.model.packaged import resolve_model
from actors.params import StructuredOutput

RSS_GOAL_MIB = 600.0
PROMPT = "Write a short story about a robot who learns to paint."
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@dataclass(frozen=True)
class Resident:
    """Resident MiB of the process (VmRSS) and of its mappings by kind."""

    total: float
    anonymous: float
    model_file: float
    other_files: float

    def minus(self, before: Resident) -> Resident:
        return Resident(self.total - before.total, self.anonymous - before.anonymous,
                        self.model_file - before.model_file,
                        self.other_files - before.other_files)

    def row(self, signed: bool = False) -> str:
        form = "{:+8,.0f}" if signed else "{:8,.0f}"
        return "  ".join(form.format(value) for value in
                         (self.total, self.anonymous, self.model_file, self.other_files))


HEADER = f"{'':44s}{'RSS MiB':>8s}  {'anon':>8s}  {'model':>8s}  {'files':>8s}"


def resident(model_path: str) -> Resident:
    """This process's resident memory now, by mapping kind (MiB)."""
    kb = {"anonymous": 0, "model_file": 0, "other_files": 0}
    kind = "anonymous"
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split(maxsplit=5)
            if fields[0] == "Rss:":
                kb[kind] += int(fields[1])
            elif not fields[0].endswith(":"):  # a mapping's header: address range, ..., path
                path = fields[5].rstrip("\n") if len(fields) > 5 else ""
                kind = ("model_file" if path == model_path else
                        "other_files" if path.startswith("/") else "anonymous")
    with open("/proc/self/status") as status:
        total = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return Resident(total / 1024, *(value / 1024 for value in kb.values()))


class Report:
    """Prints each stage's memory and what it added to the one before."""

    def __init__(self, model_path: str) -> None:
        self._model_path = model_path
        self._last = resident(model_path)
        print(HEADER)
        print(f"{'python, numpy, numba and the engine imported':44s}{self._last.row()}")

    def stage(self, what: str) -> Resident:
        now = resident(self._model_path)
        print(f"{what:44s}{now.row()}   added {now.minus(self._last).row(signed=True)}",
              flush=True)
        self._last = now
        return now


async def engine_stages(path: str, tokens: int) -> Resident:
    """The engine with its default options: opened, after a request, after a structured one."""
    report = Report(path)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    async with Engine.open(path) as engine:
        positions = engine.info.num_blocks * engine.info.block_size
        report.stage(f"Engine.open (KV pool of {positions:,} positions)")
        await engine.complete(PROMPT, params)
        after_request = report.stage(f"after one request of {tokens} tokens")
        structured = SamplingParams(max_tokens=tokens, temperature=0.0,
                                    structured=StructuredOutput(json_schema=SCHEMA))
        await engine.complete(PROMPT, structured)
        report.stage("after one structured request")
    return after_request


def piece_stages(path: str) -> Resident:
    """What `Engine.open` and a first step build, one piece at a time."""
    from actors.model.loaded import load_quantized, open_model
    from actors.model.step import StepItem
    from actors.structured import GrammarCompiler

    report = Report(path)
    opened = open_model(path)
    report.stage("the file opened, its metadata read")
    tokenizer = opened.tokenizer
    report.stage("the tokenizer's tables")
    tokenizer.prepare_encoder()
    report.stage("its encoder and special-token patterns")
    model = load_quantized(opened)
    report.stage("the weights (mapped, none read yet)")
    GrammarCompiler(tokenizer).grammar_tokenizer()
    report.stage("llguidance's grammar tokenizer")
    steps: list[tuple[str, Callable[[], object]]] = []
    kv = model.new_kv_pool(8)
    ids = tuple(tokenizer.encode(PROMPT))
    steps.append(("the first step (weights read, kernels loaded)",
                  lambda: model.step([StepItem(ids, 0, tuple(range(8)))], kv)))
    steps.append(("a second step", lambda: model.step([StepItem((ids[-1],), len(ids),
                                                                tuple(range(8)))], kv)))
    for what, step in steps:
        step()
        last = report.stage(what)
    gc.collect()
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: gemma-3-270m)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--pieces", action="store_true",
                        help="build the engine's pieces one at a time instead")
    args = parser.parse_args()
    path = os.path.realpath(resolve_model(args.model))
    print(f"model {path}")
    if args.pieces:
        piece_stages(path)
        return
    measured = anyio.run(engine_stages, path, args.tokens)
    goal = RSS_GOAL_MIB if args.model is None else None
    verdict = "" if goal is None else (
        f" (goal for gemma-3-270m: under {goal:.0f} MiB: "
        f"{'met' if measured.total < goal else 'not met'})")
    print(f"resident after one request of {args.tokens} tokens: {measured.total:,.0f} MiB"
          f"{verdict}")


if __name__ == "__main__":
    main()
