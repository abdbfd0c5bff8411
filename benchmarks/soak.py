"""Soak and overload the engine: hundreds of requests with random lengths, cancellations and
deadlines against small limits; prints completed / rejected / cancelled / failed, latency
p50 / p99, peak memory and growth per 1,000 requests, what is still held (must be nothing)
and whether a reference greedy request still gives its exact tokens. Exit status 1 if
anything leaked, failed or changed.

    python benchmarks/soak.py                                   # gemma-3-270m, 400 requests
    python benchmarks/soak.py --model smollm2.gguf --requests 1000 --max-sequences 8

A script rather than a `q4k` verb: it is a check for whoever changes the engine, not a tool
a user of the engine runs, and it keeps the CLI's surface to what users need.
"""

from __future__ import annotations

import argparse
import sys

import anyio
import msgspec

from actors import Engine
from actors.soak import SoakPlan, soak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: gemma-3-270m)")
    parser.add_argument("--requests", type=int, default=SoakPlan.requests)
    parser.add_argument("--waves", type=int, default=SoakPlan.waves)
    parser.add_argument("--arrival-s", type=float, default=SoakPlan.arrival_s)
    parser.add_argument("--max-new-tokens", type=int, default=SoakPlan.max_new_tokens)
    parser.add_argument("--max-sequences", type=int, default=4)
    parser.add_argument("--max-queued", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=64, help="a small pool: preemption")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    plan = SoakPlan(requests=args.requests, waves=args.waves, arrival_s=args.arrival_s,
                    max_new_tokens=args.max_new_tokens, seed=args.seed)

    async def run() -> dict:
        async with Engine.open(args.model, max_sequences=args.max_sequences,
                               max_queued=args.max_queued, kv_blocks=args.kv_blocks,
                               log_level="error") as engine:  # rejections are expected here
            return vars(await soak(engine, plan))

    report = anyio.run(run)
    if args.json:
        print(msgspec.json.encode(report).decode())
    else:
        print(f"soak: {report['requests']} requests in {report['seconds']:.1f} s "
              f"(max_sequences {args.max_sequences}, max_queued {args.max_queued}, "
              f"kv_blocks {args.kv_blocks})")
        print(f"  completed {report['completed']}  rejected {report['rejected']}  "
              f"cancelled {report['cancelled']}  failed {report['failed']} {report['failures']}")
        print(f"  latency of completed: p50 {report['latency_p50_ms']:.0f} ms, "
              f"p99 {report['latency_p99_ms']:.0f} ms")
        print(f"  peak RSS {report['peak_rss_mib']:.0f} MiB, growth "
              f"{report['rss_growth_mib_per_1000']:+.1f} MiB per 1,000 requests")
        print(f"  held afterwards: {report['leaked']}; reference tokens exact: "
              f"{report['reference_exact']}; worst loop stall {report['worst_loop_stall_ms']} ms")
    healthy = report["reference_exact"] and not report["failed"] and not any(report["leaked"].values())
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
