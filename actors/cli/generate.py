"""`q4k generate PROMPT`: complete a prompt, streaming the text as it is generated."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

import anyio
import msgspec

from actors.cli.common import (
    add_backend_flag,
    add_logging_flags,
    add_model_flag,
    add_sampling_flags,
    configure_logging_from,
    memory_line,
    naming_the_flag,
    open_engine,
    sampling_params_from,
)
from actors.errors import InvalidRequest

if TYPE_CHECKING:
    from actors.messages import Chunk
    from actors.params import SamplingParams


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="complete a prompt, streaming the text",
        description="Complete PROMPT (plain text, no chat template) and stream the text to "
        "stdout; a line with the engine's resident memory and, at the end, one with the "
        "finish reason and speed go to stderr.",
    )
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt, or '-' to read it from stdin")
    parser.add_argument("--json", action="store_true",
                        help="print the whole Completion as one JSON object instead of streaming")
    add_model_flag(parser)
    add_backend_flag(parser)
    add_sampling_flags(parser)
    add_logging_flags(parser)
    parser.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    configure_logging_from(args)
    params = sampling_params_from(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:  # checked here, before the model spends seconds loading
        raise InvalidRequest("the prompt is empty: give some text, or '-' to read it from stdin",
                             field="prompt")
    streamed: list[str] = []
    try:
        return anyio.run(_run, args, prompt, params, streamed)
    except InvalidRequest as exc:
        # A constraint compiles against the model's vocabulary, so only once the model loads.
        if exc.field is not None and exc.field.startswith("structured."):
            raise naming_the_flag(exc) from None
        raise
    except KeyboardInterrupt:
        if streamed and not streamed[-1].endswith("\n"):  # "interrupted" starts its own line
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise


async def _run(args: argparse.Namespace, prompt: str, params: SamplingParams,
               streamed: list[str]) -> int:
    """Generate; each text written to stdout is also appended to `streamed`."""
    async with open_engine(args) as engine:
        if args.json:
            completion = await engine.complete(prompt, params)
            print(f"q4k generate: {memory_line(engine)}", file=sys.stderr)
            sys.stdout.write(msgspec.json.encode(completion).decode() + "\n")
            return 0
        last: Chunk | None = None
        async for chunk in engine.generate(prompt, params):
            if last is None:  # the request started: said here, so a refused one has one line
                print(f"q4k generate: {memory_line(engine)}", file=sys.stderr, flush=True)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            if chunk.text:
                streamed.append(chunk.text)
            last = chunk
        sys.stdout.write("\n")
        if last is not None:
            print(finish_line(last), file=sys.stderr)
    return 0


def finish_line(chunk: Chunk) -> str:
    """`[stop · 7 prompt tokens (3 cached) · 32 generated · ttft 85 ms · 24.1 tok/s]` from the
    last chunk of a stream."""
    parts = [chunk.finish_reason or "?"]
    if chunk.usage is not None:
        usage = chunk.usage
        parts.append(f"{usage.prompt_tokens} prompt tokens ({usage.cached_tokens} cached)")
        parts.append(f"{usage.completion_tokens} generated")
    if chunk.timings is not None:
        parts.append(f"ttft {chunk.timings.ttft_ms:.0f} ms")
        parts.append(f"{chunk.timings.decode_tokens_per_s:.1f} tok/s")
    return "[" + " · ".join(parts) + "]"
