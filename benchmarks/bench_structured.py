"""What structured output costs: JSON-schema answers against the same answers unconstrained.

For each concurrency N (default 1, 16, 64) on gemma-3-270m (CPU backend), N distinct short
prompts are sent at once, greedy, three ways:

- `json_ff`: every request constrained by a 5-key JSON schema (fast-forward on, the default);
- `json_noff`: the same with fast-forward off, so every token is a decode step and the figure
  is the masks' whole cost;
- `plain`: unconstrained, EOS ignored, each request's `max_tokens` set to the token count of
  the constrained answer to the same prompt, so both runs deliver exactly as many tokens per
  request (and requests end at the same points). A plain run is made per distinct vector of
  counts (`json_ff` and `json_noff` answers usually tokenize alike, then one serves both).

tok/s = tokens delivered / wall seconds from the first request sent to the last answered; each
figure is the best of --repeats runs, the variants interleaved (the machine may be shared).
Prompts stay shorter than a KV block with the schema's forced start, so no run reuses another's
prefill through the prefix cache (checked: every request must report 0 cached tokens).

Then, one request at a time: decode steps per answer with and without fast-forward
(`engine.stats().steps` deltas); the mask time per token (the `json_noff` answers of the largest
N replayed through fresh constraints: `Constraint.advance` per token, one row, and per step
with all rows in lockstep on the constraint workers' threads as the engine runs them (off
the shared step: each row's sequence waits only for its own), plus the CPU backend's
`apply_token_masks` of that step); and the time to build llguidance's tokenizer for each model
(gemma-3-270m, SmolLM2-135M, the tiny llama of the tests).

`ms/step` is a run's seconds over the engine steps it took: with fast-forward a step carries
more tokens (a forced run is a prefill chunk), so it is longer and there are fewer of them.

    python benchmarks/bench_structured.py [--concurrency 1 16 64] [--repeats 2]
                                          [--max-tokens 64] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import numpy as np

from actors import Engine, SamplingParams, StructuredOutput, load_model
from actors.compute.contract import RowInputs, apply_token_masks
from actors.messages import Completion
from actors.model.default_model import default_model_path
from actors.model.loaded import open_model
from actors.model.packaged import CHAT_MODEL, resolve_model
from actors.sampling.constraints import CONSTRAINT_THREADS
from actors.structured import GrammarCompiler

ROOT = Path(__file__).resolve().parent.parent
TINY_LLAMA = ROOT / "tests" / "reference" / "models" / "llama-q4k-tiny.gguf"
BLOCK_SIZE = 16
MAX_SEQUENCES = 64
PREFILL_CHUNK = 512
# Answers of ~40 tokens on gemma-3-270m, 17 of them forced by the schema (keys, punctuation).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
        "job": {"type": "string", "maxLength": 16},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12},
                    "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "city", "job", "hobbies"],
    "additionalProperties": False,
}
NAMES = ("Ana", "Bo", "Chen", "Dev", "Eva", "Femi", "Gus", "Hana",
         "Ivo", "Jun", "Kai", "Lea", "Mo", "Nia", "Oto", "Pia")


class Run(NamedTuple):
    seconds: float
    steps: int  # engine steps taken meanwhile
    tokens: tuple[int, ...]  # completion tokens of each request, in prompt order
    answers: tuple[Completion, ...]


def prompts_for(count: int) -> list[str]:
    return [f"{NAMES[i % len(NAMES)]}, {20 + i}. JSON:" for i in range(count)]


def constrained(max_tokens: int, fast_forward: bool) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          structured=StructuredOutput(json_schema=SCHEMA,
                                                      fast_forward=fast_forward))


def plain(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def run_all(engine: Engine, prompts: list[str], params: Sequence[SamplingParams]) -> Run:
    """Every prompt at once, prompt i with params[i]."""
    answers: list[Completion | None] = [None] * len(prompts)

    async def one(index: int) -> None:
        answers[index] = await engine.complete(prompts[index], params[index])

    steps_before = engine.stats().steps
    started = time.perf_counter()
    async with anyio.create_task_group() as tasks:
        for index in range(len(prompts)):
            tasks.start_soon(one, index)
    seconds = time.perf_counter() - started
    steps = engine.stats().steps - steps_before
    done = tuple(a for a in answers if a is not None)
    cached = sum(a.usage.cached_tokens for a in done)
    if cached:
        raise RuntimeError(f"{cached} prompt tokens came from the prefix cache: shorten the "
                           "prompts so no run reuses another's prefill")
    return Run(seconds, steps, tuple(a.usage.completion_tokens for a in done), done)


async def throughput(engine: Engine, count: int, repeats: int, max_tokens: int
                     ) -> tuple[dict[str, Any], Run]:
    """The row of one concurrency, and the best `json_noff` run (its answers are replayed)."""
    prompts = prompts_for(count)
    best: dict[str, Run] = {}

    def keep(name: str, run: Run) -> None:
        if name not in best or run.seconds < best[name].seconds:
            best[name] = run

    for _ in range(repeats):
        plain_runs: dict[tuple[int, ...], Run] = {}
        for fast_forward in (True, False):
            run = await run_all(engine, prompts, [constrained(max_tokens, fast_forward)] * count)
            name = "json_ff" if fast_forward else "json_noff"
            keep(name, run)
            if run.tokens not in plain_runs:
                plain_runs[run.tokens] = await run_all(engine, prompts,
                                                       [plain(n) for n in run.tokens])
            keep(f"plain_for_{name}", plain_runs[run.tokens])
    row: dict[str, Any] = {"concurrency": count}
    for name in ("json_ff", "json_noff"):
        constrained_run, plain_run = best[name], best[f"plain_for_{name}"]
        tokens = sum(constrained_run.tokens)
        row[f"{name}_tok_s"] = round(tokens / constrained_run.seconds, 1)
        row[f"plain_for_{name}_tok_s"] = round(tokens / plain_run.seconds, 1)
        row[f"{name}_vs_plain"] = round(plain_run.seconds / constrained_run.seconds, 3)
        row[f"{name}_ms_per_step"] = round(constrained_run.seconds / constrained_run.steps * 1e3, 1)
        row[f"plain_for_{name}_ms_per_step"] = round(plain_run.seconds / plain_run.steps * 1e3, 1)
    row["tokens_per_answer"] = round(float(np.mean(best["json_ff"].tokens)), 1)
    row["answers_stopped"] = sum(a.finish_reason == "stop" for a in best["json_ff"].answers)
    return row, best["json_noff"]


async def steps_per_answer(engine: Engine, count: int, max_tokens: int) -> dict[str, Any]:
    """Decode steps an answer takes alone, with and without fast-forward."""
    row: dict[str, Any] = {"answers": count}
    for fast_forward in (True, False):
        steps, tokens = [], []
        for prompt in prompts_for(count):
            before = engine.stats().steps
            answer = await engine.complete(prompt, constrained(max_tokens, fast_forward))
            steps.append(engine.stats().steps - before)
            tokens.append(answer.usage.completion_tokens)
        name = "ff" if fast_forward else "noff"
        row[f"{name}_steps"] = round(float(np.mean(steps)), 1)
        row[f"{name}_tokens"] = round(float(np.mean(tokens)), 1)
    return row


def mask_times(compiler: GrammarCompiler, answers: Sequence[Completion],
               vocab_size: int) -> dict[str, Any]:
    """Replay each answer's tokens through fresh constraints, timing `Constraint.advance`:
    per token for one row alone, and per step for all the rows together (on
    `CONSTRAINT_THREADS` threads, as the engine's constraint workers run them); with the rows
    together, also the backend's share: `apply_token_masks` on the step's logits (the CPU
    backend's masking of the rows, before penalties and candidates)."""
    structured = StructuredOutput(json_schema=SCHEMA, fast_forward=False)
    budget = max(len(answer.token_ids) for answer in answers) + 1
    alone: list[float] = []
    for answer in answers:
        constraint = compiler.constraint(structured, budget)
        for token in answer.token_ids:
            started = time.perf_counter()
            advanced = constraint.advance(token)
            alone.append(time.perf_counter() - started)
            if advanced.error is not None:
                raise RuntimeError(advanced.error)
            if advanced.done:
                break
    rows = [(compiler.constraint(structured, budget), list(answer.token_ids))
            for answer in answers]
    together: list[float] = []
    masking: list[float] = []
    logits = np.random.default_rng(0).standard_normal((len(rows), vocab_size), np.float32)
    with ThreadPoolExecutor(CONSTRAINT_THREADS) as workers:
        for position in range(max(len(tokens) for _, tokens in rows)):
            going = [(c, tokens[position]) for c, tokens in rows
                     if position < len(tokens) and not c.done]
            if not going:
                break
            started = time.perf_counter()
            list(workers.map(lambda row: row[0].advance(row[1]), going))
            together.append(time.perf_counter() - started)
            masked = [RowInputs(allowed=c.allowed) for c, _ in going if not c.done]
            started = time.perf_counter()
            apply_token_masks(logits[:len(masked)], masked)
            masking.append(time.perf_counter() - started)
    alone_us, together_ms = np.array(alone) * 1e6, np.array(together) * 1e3
    masking_ms = np.array(masking) * 1e3
    return {
        "tokens": len(alone),
        "one_row_us_p50": round(float(np.percentile(alone_us, 50)), 1),
        "one_row_us_p99": round(float(np.percentile(alone_us, 99)), 1),
        "rows_per_step": len(rows),
        "step_ms_p50": round(float(np.percentile(together_ms, 50)), 3),
        "step_ms_p99": round(float(np.percentile(together_ms, 99)), 3),
        "apply_ms_p50": round(float(np.percentile(masking_ms, 50)), 3),
        "apply_ms_p99": round(float(np.percentile(masking_ms, 99)), 3),
    }


def tokenizer_build(path: Path) -> tuple[dict[str, Any], GrammarCompiler]:
    """Seconds to build llguidance's tokenizer from the model's vocabulary (with the vocabulary
    size), and the compiler that holds it."""
    tokenizer = open_model(path).tokenizer
    compiler = GrammarCompiler(tokenizer)
    started = time.perf_counter()
    compiler.grammar_tokenizer()
    seconds = time.perf_counter() - started
    return {"vocab": tokenizer.vocab_size, "seconds": round(seconds, 2)}, compiler


def model_paths() -> dict[str, Path]:
    return {"gemma-3-270m": default_model_path(), "smollm2-135m": resolve_model(CHAT_MODEL),
            "llama-q4k-tiny": TINY_LLAMA}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    paths = model_paths()
    builds: dict[str, dict[str, Any]] = {}
    compilers: dict[str, GrammarCompiler] = {}
    for name, path in paths.items():
        builds[name], compilers[name] = tokenizer_build(path)
        print(json.dumps({"tokenizer_build": name, **builds[name]}), flush=True)
    model = load_model(paths["gemma-3-270m"])
    results: dict[str, Any] = {"tokenizer_build": builds}
    async with Engine.open(model, backend="cpu", max_sequences=MAX_SEQUENCES,
                           prefill_chunk=PREFILL_CHUNK) as engine:
        # Builds the engine's own grammar tokenizer and starts the threads, untimed.
        await engine.complete(prompts_for(1)[0], constrained(args.max_tokens, True))
        rows, replayed = [], None
        for count in args.concurrency:
            row, replayed = await throughput(engine, count, args.repeats, args.max_tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
        results["throughput"] = rows
        results["steps_per_answer"] = await steps_per_answer(engine, 8, args.max_tokens)
        print(json.dumps({"steps_per_answer": results["steps_per_answer"]}), flush=True)
    if replayed is not None:
        results["mask"] = mask_times(compilers["gemma-3-270m"], replayed.answers,
                                     model.spec.vocab_size)
        print(json.dumps({"mask": results["mask"]}), flush=True)
    return results


def print_table(results: dict[str, Any]) -> None:
    print("\nratio = constrained tok/s / plain tok/s on the same token counts (goal at 64: "
          ">= 0.90)")
    print(f"{'N':>3} {'variant':<10} {'tok/s':>8} {'plain':>8} {'ratio':>6} "
          f"{'ms/step':>8} {'plain':>8}")
    for row in results["throughput"]:
        for name in ("json_ff", "json_noff"):
            print(f"{row['concurrency']:>3} {name:<10} {row[f'{name}_tok_s']:>8} "
                  f"{row[f'plain_for_{name}_tok_s']:>8} {row[f'{name}_vs_plain']:>6.3f} "
                  f"{row[f'{name}_ms_per_step']:>8} {row[f'plain_for_{name}_ms_per_step']:>8}")
    steps = results["steps_per_answer"]
    print(f"steps per answer (alone): fast-forward {steps['ff_steps']} for "
          f"{steps['ff_tokens']} tokens; without {steps['noff_steps']} for "
          f"{steps['noff_tokens']} tokens")
    if "mask" in results:
        mask = results["mask"]
        print(f"mask per token, one row: p50 {mask['one_row_us_p50']} us, p99 "
              f"{mask['one_row_us_p99']} us ({mask['tokens']} tokens); a step of "
              f"{mask['rows_per_step']} rows: p50 {mask['step_ms_p50']} ms, p99 "
              f"{mask['step_ms_p99']} ms; applying its masks to the logits (CPU backend): "
              f"p50 {mask['apply_ms_p50']} ms, p99 {mask['apply_ms_p99']} ms")
    print("grammar tokenizer build: " + ", ".join(
        f"{name} ({build['vocab']} tokens) {build['seconds']} s"
        for name, build in results["tokenizer_build"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=2, help="best of this many, interleaved")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="budget of a constrained answer (answers take ~40)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    results = anyio.run(measure, args)
    print_table(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
