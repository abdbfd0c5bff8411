"""The documented longer fuzz run: every target of tests/fuzz with many more inputs than CI
runs, counting inputs, outcomes and escapes (anything but the project's own errors).

    python benchmarks/fuzz.py                      # 2,000 inputs per target
    python benchmarks/fuzz.py --examples 20000 --target templates
    python benchmarks/fuzz.py --markdown           # docs/reliability.md's table rows

Run from the repository root (the targets live in the test tree). An escape is printed with
the input hypothesis shrank it to, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fuzz import (  # noqa: E402
    constraints,
    engine_options,
    gguf_counts,
    gguf_structure,
    logs,
    params,
    special_tokens,
    template_operations,
    templates,
)
from tests.fuzz.target import Escape, Target  # noqa: E402

TARGETS = {
    "gguf": gguf_structure.TARGET,
    "params": params.TARGET,
    "engine": engine_options.TARGET,
    "templates": templates.TARGET,
    "template-operations": template_operations.TARGET,
    "logs": logs.TARGET,
    "special-tokens": special_tokens.TARGET,
    "gguf-counts": gguf_counts.TARGET,
    "constraints": constraints.TARGET,
}


def run_target(target: Target, examples: int) -> tuple[Counter[str], list[str], float]:
    """Outcomes per kind, the escapes found (shrunk), and the seconds it took."""
    outcomes: Counter[str] = Counter()
    escapes: list[str] = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate, Phase.shrink],
    )
    @given(case=target.cases)
    def fuzz(case: object) -> None:
        outcomes[target.check(case)] += 1

    started = time.perf_counter()
    try:
        fuzz()
    except Escape as exc:
        escapes.append(str(exc))
    return outcomes, escapes, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="inputs per target")
    parser.add_argument("--target", choices=sorted(TARGETS), action="append",
                        help="run only these (repeatable; default all)")
    parser.add_argument("--markdown", action="store_true", help="print docs/reliability.md table rows")
    args = parser.parse_args()
    found = 0
    for name in args.target or list(TARGETS):
        target = TARGETS[name]
        outcomes, escapes, seconds = run_target(target, args.examples)
        inputs = sum(outcomes.values()) + len(escapes)
        found += len(escapes)
        kinds = ", ".join(f"{kind} {count:,}" for kind, count in outcomes.most_common())
        if name == "constraints":  # its cases run on an engine's loop, which a ticker watches
            kinds += (f"; worst loop stall {constraints.WORST_STALL['ms']} ms "
                      f"({constraints.WORST_STALL['case']:.120})")
        if args.markdown:
            command = f"`python benchmarks/fuzz.py --target {name} --examples {args.examples}`"
            print(f"| fuzz: {target.name} | {command} | {inputs:,} inputs, "
                  f"**{len(escapes)} escapes** ({kinds}) |")
        else:
            print(f"{target.name:<32} {inputs:>7,} inputs  {len(escapes)} escapes  {seconds:6.1f} s  {kinds}")
        for escape in escapes:
            print(f"  ESCAPE {escape}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
