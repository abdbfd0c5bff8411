"""Load on `q4k serve` over loopback: N concurrent streaming clients of /v1/completions.

Each client sends one streamed request (a distinct prompt, greedy, EOS ignored, exactly
--tokens generated), all clients of a level at once, as `bench_engine.py` does through the
engine directly; prints aggregate generated tokens/s over the level's wall time, time to first
token p50 / p99 (request sent -> first text event), and errors. Bounded: one round per level,
and each level gives up after --deadline seconds (unfinished requests count as errors).

    python benchmarks/bench_serve.py [--model PATH] [--clients 16 64] [--tokens 64]
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --served-model NAME
    python benchmarks/bench_serve.py --replicas 2 [--model PATH]

Without --url it starts `q4k serve` on a free loopback port (backend auto) and stops it after;
with --replicas N, `q4k serve --replicas N` (N engines on a local Ray instance behind Ray
Serve's proxy, prefix-affine routing), so its figures sit beside one engine's.
With --against-engine, each level also runs the same requests through an engine in this process
(`bench_engine.through_engine`), interleaved with the server's rounds, best of --repeats each,
and prints the ratio: what the HTTP layer costs, with other load on the machine hitting both.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import httpx
import numpy as np

from actors import load_model
from bench_engine import through_engine

PROMPT = "Write a short story about a robot who learns to paint, number {index}."
# The line q4k serve prints as it starts listening (--replicas: once every replica is ready).
BANNER = re.compile(r"q4k serve: .* on (http://127\.0\.0\.1:\d+)/v1 ")
DEFAULT_MODEL = "gemma-3-270m"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def started_server(model: str | None, max_sequences: int,
                   replicas: int | None) -> Iterator[tuple[str, str]]:
    """`q4k serve` (with --replicas N: on Ray Serve, whose proxy needs a fixed port) on a free
    loopback port: (base url, served model name) once it is ready."""
    command = [sys.executable, "-m", "actors.cli", "serve",
               "--max-sequences", str(max_sequences), "--log-level", "warning"]
    command += (["--port", "0"] if replicas is None
                else ["--port", str(free_port()), "--replicas", str(replicas)])
    process = subprocess.Popen(command + ["--model", model or DEFAULT_MODEL],
                               stderr=subprocess.PIPE, text=True)
    try:
        printed = []  # Ray's own start-up lines come before the banner
        for line in process.stderr:
            printed.append(line)
            if found := BANNER.search(line):
                break
        else:
            raise SystemExit(f"q4k serve did not start: {''.join(printed)}")
        # Whatever it prints from now on is read, so it never blocks on a full pipe.
        threading.Thread(target=process.stderr.read, daemon=True).start()
        url = found.group(1)
        with httpx.Client(base_url=url) as client:
            while client.get("/health").status_code != 200:
                time.sleep(0.1)
            served = client.get("/v1/models").json()["data"][0]["id"]  # a name, or a file's stem
        yield url, served
    finally:
        process.send_signal(signal.SIGINT)
        process.wait()


async def one_request(client: httpx.AsyncClient, model: str, index: int, tokens: int,
                      started: float) -> tuple[float, int]:
    """(seconds to the first text event, tokens generated) for one streamed completion."""
    body = {"model": model, "prompt": PROMPT.format(index=index), "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    first: float | None = None
    generated = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.perf_counter() - started
            if event.get("usage"):
                generated = event["usage"]["completion_tokens"]
    if first is None or generated != tokens:
        raise RuntimeError(f"request {index}: {generated} tokens, first text at {first}")
    return first, generated


async def level(url: str, model: str, clients: int, tokens: int, deadline_s: float) -> dict:
    """One round of `clients` concurrent requests."""
    results: list[tuple[float, int]] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=deadline_s) as client:

        async def run(index: int) -> None:
            try:
                results.append(await one_request(client, model, index, tokens, started))
            except (httpx.HTTPError, RuntimeError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

        started = time.perf_counter()
        with anyio.move_on_after(deadline_s):
            async with anyio.create_task_group() as tasks:
                for index in range(clients):
                    tasks.start_soon(run, index)
        wall_s = time.perf_counter() - started
    ttft_ms = np.array([first for first, _ in results]) * 1000.0
    return {
        "clients": clients,
        "completed": len(results),
        "errors": clients - len(results),
        "aggregate_tok_s": round(sum(n for _, n in results) / wall_s, 1),
        "ttft_p50_ms": round(float(np.percentile(ttft_ms, 50)), 1) if results else None,
        "ttft_p99_ms": round(float(np.percentile(ttft_ms, 99)), 1) if results else None,
        "wall_s": round(wall_s, 2),
        "first_errors": errors[:3],
    }


def measure(url: str, model: str, args: argparse.Namespace) -> None:
    anyio.run(level, url, model, 1, 2, args.deadline)  # warm-up: threads, first-call costs
    local = load_model(args.model) if args.against_engine else None
    for clients in args.clients:
        rounds = []
        engine_s = float("inf")
        for _ in range(args.repeats):
            rounds.append(anyio.run(level, url, model, clients, args.tokens, args.deadline))
            if local is not None:
                prompts = [local.tokenizer.encode(PROMPT.format(index=i)) for i in range(clients)]
                run = anyio.run(through_engine, local, prompts, args.tokens)
                engine_s = min(engine_s, run.seconds)
        best = max(rounds, key=lambda row: (-row["errors"], row["aggregate_tok_s"]))
        if local is not None:
            best["engine_tok_s"] = round(clients * args.tokens / engine_s, 1)
            best["serve_over_engine"] = round(best["aggregate_tok_s"] / best["engine_tok_s"], 3)
        print(json.dumps(best), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: gemma-3-270m)")
    parser.add_argument("--url", default=None, help="a running server instead of starting one")
    parser.add_argument("--served-model", default=None, help="model id at --url")
    parser.add_argument("--replicas", type=int, default=None, metavar="N",
                        help="start `q4k serve --replicas N` (Ray Serve) instead of one engine")
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="rounds per level; the best counts")
    parser.add_argument("--against-engine", action="store_true",
                        help="also time the same requests through an in-process engine")
    parser.add_argument("--deadline", type=float, default=300.0,
                        help="seconds one level may take (default 300)")
    args = parser.parse_args()
    if args.url is not None:
        measure(args.url, args.served_model or "", args)
        return
    with started_server(args.model, max(args.clients), args.replicas) as (url, model):
        measure(url, model, args)


if __name__ == "__main__":
    main()
