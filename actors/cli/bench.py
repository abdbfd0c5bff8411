"""`q4k bench`: prefill and decode throughput, time to first token and memory at chosen
concurrency levels, measured through the engine exactly as an application uses it."""

from __future__ import annotations

import argparse
import itertools
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec
import numpy as np
from rich.table import Table

from actors.cli.common import (
    add_backend_flag,
    add_logging_flags,
    add_model_flag,
    at_least,
    configure_logging_from,
    console,
    model_path_from,
    open_engine,
)
from actors.progress import Progress

if TYPE_CHECKING:
    from actors.engine import Engine
    from actors.params import SamplingParams

# Filler for synthetic prompts: common words, about one token each in SPM and BPE vocabularies.
FILLER = ("the quick brown fox jumps over a lazy dog while seven small birds sing in the old "
          "green tree near our quiet house").split()


class RequestTiming(msgspec.Struct, frozen=True):
    """One benchmark request, times in seconds on the monotonic clock."""

    submitted: float
    first_token: float
    finished: float
    prompt_tokens: int
    completion_tokens: int


class LevelResult(msgspec.Struct, frozen=True):
    concurrency: int
    requests: int
    mean_prompt_tokens: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    aggregate_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    rss_mib: float
    peak_rss_mib: float


_positive = at_least(1)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure throughput, time to first token and memory",
        description="Run CONCURRENCY clients at a time, each sending ROUNDS requests one after "
        "another (a synthetic prompt of about --prompt-tokens tokens, greedy, exactly "
        "--max-tokens generated). Per level: prefill tokens/s (prompt tokens over the time some "
        "prompt was waiting for its first token), decode tokens/s (tokens after the first over "
        "the time some request was decoding), aggregate generated tokens/s over the level's "
        "wall time, time to first token p50/p95, and the process's peak resident memory.",
    )
    parser.add_argument("--concurrency", type=_levels, default=(1, 4, 16), metavar="N,N,...",
                        help="concurrency levels (default 1,4,16)")
    parser.add_argument("--prompt-tokens", type=_positive, default=128, metavar="N",
                        help="approximate prompt length (default 128)")
    parser.add_argument("--max-tokens", type=_positive, default=64, metavar="N",
                        help="tokens generated per request (default 64)")
    parser.add_argument("--rounds", type=_positive, default=1, metavar="R",
                        help="requests each client sends, one after another (default 1)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_model_flag(parser)
    add_backend_flag(parser)
    add_logging_flags(parser)
    parser.set_defaults(handler=_bench)


def _levels(text: str) -> tuple[int, ...]:
    return tuple(_positive(part.strip()) for part in text.split(","))


def _bench(args: argparse.Namespace) -> int:
    configure_logging_from(args)
    backend, results = anyio.run(_run_levels, args)
    if args.json:
        report = {"model": str(model_path_from(args)), "backend": backend, "levels": results}
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(report)).decode() + "\n")
        return 0
    table = Table(title=f"q4k bench ({backend}): prompt ~{args.prompt_tokens} tokens, "
                        f"{args.max_tokens} generated, {args.rounds} round(s)",
                  title_justify="left")
    for column in ("clients", "requests", "prompt tok", "prefill tok/s", "decode tok/s",
                   "aggregate tok/s", "TTFT p50 ms", "TTFT p95 ms", "RSS MiB", "peak RSS MiB"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r.concurrency), str(r.requests), f"{r.mean_prompt_tokens:.0f}",
                      f"{r.prefill_tokens_per_s:,.1f}", f"{r.decode_tokens_per_s:,.1f}",
                      f"{r.aggregate_tokens_per_s:,.1f}", f"{r.ttft_p50_ms:,.0f}",
                      f"{r.ttft_p95_ms:,.0f}", f"{r.rss_mib:,.0f}", f"{r.peak_rss_mib:,.0f}")
    console().print(table)
    return 0


async def _run_levels(args: argparse.Namespace) -> tuple[str, list[LevelResult]]:
    """(the backend the engine chose, one result per concurrency level)."""
    from actors.params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warmup = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    results = []
    async with open_engine(args, max_sequences=max(args.concurrency)) as engine:
        backend = "cuda" if engine.info.on_gpu else "cpu"
        await engine.complete(synthetic_prompt(-1, args.prompt_tokens), warmup)
        for level in args.concurrency:
            timings: list[RequestTiming] = []
            with Progress(f"bench: {level} clients", level * args.rounds) as progress:
                async with anyio.create_task_group() as group:
                    for index in range(level):
                        group.start_soon(_client, engine, index * args.rounds, args, params,
                                         timings, progress)
            results.append(level_result(level, timings))
    return backend, results


async def _client(engine: Engine, first_index: int, args: argparse.Namespace,
                  params: SamplingParams, timings: list[RequestTiming], progress: Progress) -> None:
    """One client: its requests one after another, each with its own prompt."""
    for index in range(first_index, first_index + args.rounds):
        prompt = synthetic_prompt(index, args.prompt_tokens)
        timings.append(await _timed_request(engine, prompt, params))
        progress.advance()


def synthetic_prompt(index: int, words: int) -> str:
    """About `words` tokens of filler, starting with a number unique to the request so that no
    two requests share a cached prefix."""
    return f"{index + 1}. " + " ".join(itertools.islice(itertools.cycle(FILLER), words - 2))


async def _timed_request(engine: Engine, prompt: str, params: SamplingParams) -> RequestTiming:
    submitted = time.monotonic()
    first_token = None
    last = None
    async for chunk in engine.generate(prompt, params):
        if first_token is None:
            first_token = time.monotonic()
        last = chunk
    finished = time.monotonic()
    usage = last.usage
    return RequestTiming(submitted, first_token or finished, finished, usage.prompt_tokens,
                         usage.completion_tokens)


def covered_seconds(starts: np.ndarray, ends: np.ndarray) -> float:
    """Length of the union of the intervals [starts[i], ends[i]]."""
    if starts.size == 0:
        return 0.0
    order = np.argsort(starts)
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    before = np.concatenate(([-np.inf], reach[:-1]))
    return float(np.clip(reach - np.maximum(starts, before), 0.0, None).sum())


def level_result(concurrency: int, timings: list[RequestTiming]) -> LevelResult:
    """The figures of one concurrency level from its requests' timings."""
    t = np.array([[r.submitted, r.first_token, r.finished, r.prompt_tokens, r.completion_tokens]
                  for r in timings], dtype=np.float64)
    submitted, first, finished, prompt, completion = t.T
    ttft_ms = (first - submitted) * 1000.0
    prefill_s = covered_seconds(submitted, first)
    decode_s = covered_seconds(first, finished)
    wall_s = finished.max() - submitted.min()
    rss = _rss_mib()
    return LevelResult(
        concurrency=concurrency,
        requests=len(timings),
        mean_prompt_tokens=float(prompt.mean()),
        prefill_tokens_per_s=float(prompt.sum() / prefill_s) if prefill_s > 0 else 0.0,
        decode_tokens_per_s=float((completion - 1).clip(0).sum() / decode_s) if decode_s > 0
        else 0.0,
        aggregate_tokens_per_s=float(completion.sum() / wall_s) if wall_s > 0 else 0.0,
        ttft_p50_ms=float(np.percentile(ttft_ms, 50)),
        ttft_p95_ms=float(np.percentile(ttft_ms, 95)),
        rss_mib=rss,
        peak_rss_mib=max(rss, _peak_rss_mib()),  # the kernel updates the peak lazily
    )


def _rss_mib() -> float:
    """The process's resident memory now (Linux /proc; the peak where that is missing)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return _peak_rss_mib()
    return resident_pages * resource.getpagesize() / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
