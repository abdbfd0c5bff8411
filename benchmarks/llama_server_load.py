"""Aggregate decode throughput of a running llama-server at several client counts.

    python benchmarks/llama_server_load.py [--url http://127.0.0.1:8089] [--clients 1 4 16 64]

Each client asks for 64 tokens (greedy, EOS ignored, no prompt cache), all clients of a round
at once, as the reference anchors were measured; prints tokens/s over each round's wall time.
Started by `benchmarks/llama_cpp_anchors.sh`, which builds and runs the server.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

TOKENS_PER_CLIENT = 64


def ask(url: str, client: int) -> int:
    """One completion request; returns the tokens the server generated."""
    body = json.dumps({
        "prompt": f"Write a short story about a robot number {client} who learns to paint.",
        "n_predict": TOKENS_PER_CLIENT, "temperature": 0, "ignore_eos": True,
        "cache_prompt": False,
    }).encode()
    request = urllib.request.Request(f"{url}/completion", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        return int(json.load(response)["tokens_predicted"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8089")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    args = parser.parse_args()
    ask(args.url, 0)  # warm-up
    for n_clients in args.clients:
        started = time.perf_counter()
        with ThreadPoolExecutor(n_clients) as pool:
            tokens = sum(pool.map(lambda c: ask(args.url, c), range(n_clients)))
        elapsed = time.perf_counter() - started
        print(f"llama-server {n_clients:3d} clients: {tokens / elapsed:7.1f} tok/s aggregate "
              f"({tokens} tokens in {elapsed:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
