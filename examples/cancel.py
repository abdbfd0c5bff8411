"""Cancelling requests: a deadline with anyio.move_on_after, and an early break.

Cancelling the task (or closing the stream) ends the request at once: no later forward step
carries it, and its KV blocks go back to the pool.

    python examples/cancel.py
"""

from __future__ import annotations

from contextlib import aclosing

import anyio

from actors import Engine, SamplingParams


async def main() -> None:
    params = SamplingParams(max_tokens=200, temperature=0.0)
    async with Engine.open() as engine:
        # 1. A deadline: whatever arrived within 5 seconds, then the request is cancelled.
        text = []
        with anyio.move_on_after(5.0) as deadline:
            async for chunk in engine.generate("The history of the printing press", params):
                text.append(chunk.text)
        print(f"deadline hit: {deadline.cancelled_caught}; got {''.join(text)!r}")

        # 2. An early break: stop as soon as the answer has a full stop. `aclosing` ends the
        # request right here instead of when the stream is garbage-collected.
        stream = engine.generate("Name three colours.", params)
        async with aclosing(stream):
            text = []
            async for chunk in stream:
                text.append(chunk.text)
                if "." in chunk.text:
                    break
        print(f"stopped early: {''.join(text)!r}")
        await anyio.sleep(0.1)  # the scheduler frees the blocks on its next turn
        print(engine.stats())


if __name__ == "__main__":
    anyio.run(main)
