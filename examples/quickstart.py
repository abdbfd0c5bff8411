"""Stream one completion from the default model (gemma-3-270m) to the terminal.

    python examples/quickstart.py "Once upon a time"
"""

from __future__ import annotations

import sys

import anyio

from actors import Engine, SamplingParams


async def main(prompt: str) -> None:
    async with Engine.open() as engine:
        params = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.95, seed=1)
        async for chunk in engine.generate(prompt, params):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason is not None:
                print(f"\n[{chunk.finish_reason}: {chunk.usage.completion_tokens} tokens, "
                      f"{chunk.timings.decode_tokens_per_s:.1f} tok/s]")


if __name__ == "__main__":
    anyio.run(main, " ".join(sys.argv[1:]) or "Once upon a time")
