"""How long `q4k logs requests` and `q4k logs summary` take on a big log: a synthetic log of
N requests (admitted, prefill, finished or cancelled; steps in between), written once, then
each view run as a user runs it, its output sent to a file: its time and its peak memory.

    python benchmarks/bench_logs.py --requests 100000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

START = datetime(2026, 12, 1, tzinfo=timezone.utc)


def request_lines(index: int) -> list[dict[str, object]]:
    """The events one request logs, 20 ms apart; every fifth is cancelled after its tokens."""
    request_id = f"{index:016x}"
    at = START + timedelta(milliseconds=5 * index)

    def event(name: str, offset_ms: float, **fields: object) -> dict[str, object]:
        stamp = (at + timedelta(milliseconds=offset_ms)).isoformat().replace("+00:00", "Z")
        return {"event": name, "timestamp": stamp, "level": "info", "request_id": request_id, **fields}

    lines = [
        event("request_admitted", 0, prompt_tokens=64, max_tokens=32),
        event("prefill_finished", 40, prompt_tokens=64, cached_tokens=16, ms=40.0),
    ]
    if index % 5 == 4:
        lines.append(event("request_cancelled", 90, completion_tokens=8, ttft_ms=40.0, total_ms=90.0))
    else:
        lines.append(event("request_finished", 200, finish_reason="length", prompt_tokens=64,
                           completion_tokens=32, ttft_ms=40.0, decode_tokens_per_s=193.7,
                           total_ms=200.0))
    return lines


def write_log(path: Path, requests: int) -> int:
    with path.open("w") as out:
        lines = 0
        for index in range(requests):
            for line in request_lines(index):
                out.write(json.dumps(line) + "\n")
                lines += 1
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "big.log"
        lines = write_log(log, args.requests)
        print(f"log: {args.requests:,} requests, {lines:,} lines, {log.stat().st_size / 2**20:.1f} MiB")
        for view in (["requests"], ["requests", "--json"], ["summary"]):
            started = time.perf_counter()
            with open(Path(folder) / "out.txt", "w") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "actors.cli", "logs", *view, str(log)],
                    stdout=out, stderr=subprocess.DEVNULL,
                )
                # This child's own peak resident memory (Linux reports KiB).
                _, status, usage = os.wait4(process.pid, 0)
            seconds = time.perf_counter() - started
            code = os.waitstatus_to_exitcode(status)
            outcome = "ok" if code == 0 else f"exit {code}"
            print(f"q4k logs {' '.join(view):<16} {seconds:6.2f} s  peak RSS "
                  f"{usage.ru_maxrss / 1024:7.1f} MiB  {outcome}")

if __name__ == "__main__":
    main()
