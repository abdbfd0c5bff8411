"""The worst event-loop stall while the engine handles hostile inputs, one at a time, with a
normal stream running beside them: runaway and huge chat templates, prompts of megabytes,
self-inconsistent model files opened by a second engine. A ticker task records the longest
gap in the loop during each input (actors.loop_stall); the goal is under 100 ms. The same
is measured with no hostile input first, as the baseline the engine's own work sets.

    python benchmarks/hostile_stall.py                    # gemma-3-270m
    python benchmarks/hostile_stall.py --model smollm2.gguf
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors import Engine, SamplingParams  # noqa: E402
from actors.errors import Q4KError  # noqa: E402
from actors.loop_stall import watch_loop  # noqa: E402
from actors.messages import Chunk  # noqa: E402
from tests.fuzz import gguf_structure  # noqa: E402

MESSAGES = [{"role": "user", "content": "Hello"}]
TEMPLATES = {
    "template: 10^9 empty loop turns":
        "{% for i in range(30000) %}{% for j in range(30000) %}{% endfor %}{% endfor %}",
    "template: macro recursing twice a level":
        "{% macro f(n) %}{{ f(n + 1) }}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "template: 'a' * 10**9": "{{ 'a' * 10**9 }}",
    "template: output of 10^10 characters":
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "template: 25 nested for": "{% for a in x %}" * 25 + "{% endfor %}" * 25,
}  # fmt: skip
BAD_FILES = {
    "model file: 512 embedding rows, 1,024 tokens":
        gguf_structure.Mutation("tensor_rows", "token_embd.weight", size=512),
    "model file: 3,000-character special token":
        gguf_structure.Mutation("token", index=5, text="<" + "x" * 3000 + ">", token_type=3),
}  # fmt: skip


async def outcome_of(action: Callable[[], Awaitable[object]]) -> str:
    try:
        await action()
    except Q4KError as exc:
        return type(exc).__name__
    return "ok"


async def drain(chunks: AsyncIterator[Chunk]) -> None:
    async with aclosing(chunks):
        async for _ in chunks:
            pass


def hostile_inputs(engine: Engine, folder: Path) -> dict[str, Callable[[], Awaitable[object]]]:
    inputs: dict[str, Callable[[], Awaitable[object]]] = {
        name: (lambda source=source: drain(engine.chat(MESSAGES, SamplingParams(max_tokens=2), source)))
        for name, source in TEMPLATES.items()
    }
    for megabytes in (1, 10):
        text = "The quick brown fox. " * (megabytes * 2**20 // 21)
        inputs[f"prompt: {megabytes} MB of text"] = lambda text=text: drain(
            engine.generate(text, SamplingParams(max_tokens=2))
        )
    for name, mutation in BAD_FILES.items():
        path = folder / f"{len(inputs)}.gguf"
        tiny = gguf_structure.seed_parts("llama-q4k-tiny")
        gguf_structure.write_gguf(gguf_structure.apply(tiny, mutation), path)
        inputs[name] = lambda path=path: _open_and_use(path)
    return inputs


async def _open_and_use(path: Path) -> None:
    async with Engine.open(path) as other:
        await other.complete("hello", SamplingParams(max_tokens=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: gemma-3-270m)")
    args = parser.parse_args()

    async def run() -> None:
        async with Engine.open(args.model, log_level="critical") as engine:
            tokens = [0]

            async def bystander() -> None:
                params = SamplingParams(max_tokens=100_000, temperature=0.8, seed=1, ignore_eos=True)
                async with aclosing(engine.generate("Once upon a time", params)) as chunks:
                    async for _ in chunks:
                        tokens[0] += 1

            with tempfile.TemporaryDirectory() as folder:
                inputs = hostile_inputs(engine, Path(folder))
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(bystander)
                    await anyio.sleep(2.0)  # past the prefill: a steady decode
                    async with watch_loop() as watch:
                        await anyio.sleep(3.0)
                    print(f"{'baseline: a decoding stream alone (3 s)':<48} {'-':<22} "
                          f"{watch.worst_stall_ms:8.1f} ms")
                    worst = 0.0
                    for name, action in inputs.items():
                        before, started = tokens[0], time.perf_counter()
                        async with watch_loop() as watch:
                            result = await outcome_of(action)
                        worst = max(worst, watch.worst_stall_ms)
                        print(f"{name:<48} {result:<22} {watch.worst_stall_ms:8.1f} ms  "
                              f"({time.perf_counter() - started:5.2f} s, the stream got "
                              f"{tokens[0] - before} tokens meanwhile)")
                    print(f"worst loop stall over the hostile inputs: {worst:.1f} ms")
                    tasks.cancel_scope.cancel()

    anyio.run(run)


if __name__ == "__main__":
    main()
