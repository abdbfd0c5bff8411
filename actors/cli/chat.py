"""`q4k chat`: an interactive multi-turn conversation with a chat model.

The engine runs in an event loop on a helper thread (an anyio blocking portal) while the REPL
owns the main thread: `input()` keeps its line editing, and Ctrl-C arrives as KeyboardInterrupt
here, where it cancels the answer being streamed (the request's sequence is dropped and its KV
blocks freed) and leaves the conversation intact. The whole history is sent each turn; the
engine's prefix cache recognises the tokens it already holds and prefills only the new turn.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from anyio.from_thread import BlockingPortal, start_blocking_portal
from rich.console import Console
from rich.text import Text

from actors.cli.common import (
    add_backend_flag,
    add_logging_flags,
    add_model_flag,
    add_sampling_flags,
    configure_logging_from,
    console,
    has_chat_template,
    model_path_from,
    naming_the_flag,
    open_engine,
    read_template,
    sampling_params_from,
)
from actors.errors import InvalidRequest, Q4KError, TemplateError
from actors.model.packaged import CHAT_MODEL

if TYPE_CHECKING:
    from actors.engine import Engine
    from actors.messages import Chunk
    from actors.params import SamplingParams

PROMPT = ">>> "
# How often a turn checks whether Ctrl-C asked to stop the answer.
STOP_POLL_S = 0.05
HELP = "/reset starts over, /system TEXT sets the system prompt (and starts over), /quit leaves; " \
       "Ctrl-C stops an answer, Ctrl-D leaves"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="talk with a chat model (interactive)",
        description=f"An interactive conversation using the model's chat template. {HELP}.",
    )
    parser.add_argument("--system", metavar="TEXT", default=None, help="a system prompt")
    parser.add_argument("--template", metavar="FILE", default=None,
                        help="a Jinja chat template to use instead of the model's own")
    parser.add_argument("--chat-template-kwargs", metavar="JSON", action="append", default=[],
                        help="more variables for the chat template, a JSON object, e.g. "
                             "'{\"enable_thinking\": false}' for Qwen3 (repeatable; a later "
                             "one's keys win)")
    # The default model, gemma-3-270m, is a base model without a chat template.
    add_model_flag(parser, default=CHAT_MODEL)
    add_backend_flag(parser)
    add_sampling_flags(parser, max_tokens=512)
    add_logging_flags(parser)
    parser.set_defaults(handler=_chat)


def _chat(args: argparse.Namespace) -> int:
    configure_logging_from(args)
    params = sampling_params_from(args)
    template = read_template(args.template)
    chat_template_kwargs = _chat_template_kwargs(args.chat_template_kwargs)
    model = model_path_from(args)
    if not has_chat_template(model, template):
        raise TemplateError(
            f"{model.name} has no chat template (base models usually have none): "
            "pass one with --template FILE, or use `q4k generate` for plain text"
        )
    # From here Ctrl-C only sets this flag (the prompt excepted): an interrupt raised inside the
    # portal's machinery, e.g. while the model loads, would leave the engine half started.
    stop_requested = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: stop_requested.set())
    try:
        with (
            start_blocking_portal() as portal,
            portal.wrap_async_context_manager(open_engine(args)) as engine,
        ):
            if stop_requested.is_set():  # pressed while loading: leave now it is safe
                print("q4k chat: interrupted", file=sys.stderr)
                return 130
            session = ChatSession(portal, engine, params, template, chat_template_kwargs,
                                  args.system, console(), stop_requested)
            return session.run()
    finally:
        signal.signal(signal.SIGINT, previous)


def _chat_template_kwargs(objects: list[str]) -> dict[str, Any]:
    """The --chat-template-kwargs JSON objects, checked, merged in order."""
    from actors.model.text.chat import TEMPLATE_KWARGS_FIELD, check_template_kwargs

    merged: dict[str, Any] = {}
    try:
        for text in objects:
            try:
                value = json.loads(text)
            except (ValueError, RecursionError) as exc:
                raise InvalidRequest(f"{text[:80]!r} is not JSON: {exc}",
                                     field=TEMPLATE_KWARGS_FIELD) from None
            merged.update(check_template_kwargs(value))
        return check_template_kwargs(merged)  # together, they may still be too large
    except InvalidRequest as exc:
        raise naming_the_flag(exc) from None


class ChatSession:
    """The REPL: reads turns, streams answers, keeps the history."""

    def __init__(self, portal: BlockingPortal, engine: Engine, params: SamplingParams,
                 template: str | None, chat_template_kwargs: dict[str, Any], system: str | None,
                 out: Console, stop_requested: threading.Event) -> None:
        self.portal = portal
        self.engine = engine
        self.params = params
        self.template = template
        self.chat_template_kwargs = chat_template_kwargs
        self.system = system
        self.out = out
        self.history: list[dict[str, str]] = []
        self.stop_requested = stop_requested  # set by Ctrl-C (the caller's SIGINT handler)

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def run(self) -> int:
        """The loop. Ctrl-C sets `stop_requested`, which a turn acts on at a safe point; only
        at the prompt does it interrupt, dropping the typed line."""
        if sys.stdin.isatty():
            import readline  # noqa: F401  (importing it gives input() line editing and history)
        self.out.print(Text(f"chatting ({HELP})", style="dim"))
        while True:
            try:
                line = _read_line()
            except EOFError:
                self.out.print()
                return 0
            except KeyboardInterrupt:
                self.out.print(Text("\n(no answer to stop; /quit or Ctrl-D leaves)", style="dim"))
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return 0
            elif line.strip():
                self.turn(line)

    def command(self, line: str) -> bool:
        """Run a /command; False when it ends the session."""
        name, _, rest = line.partition(" ")
        if name in ("/quit", "/exit"):
            return False
        if name == "/reset":
            self.history.clear()
            self.out.print(Text("(conversation cleared)", style="dim"))
        elif name == "/system":
            self.system = rest.strip() or None
            self.history.clear()
            state = f"system prompt set: {self.system}" if self.system else "system prompt removed"
            self.out.print(Text(f"({state}; conversation cleared)", style="dim"))
        else:
            self.out.print(Text(f"unknown command {name}: {HELP}", style="yellow"))
        return True

    def turn(self, question: str) -> None:
        """Ask, stream the answer, and keep the exchange in the history; a stopped answer is
        kept as far as it got, so roles still alternate and the next turn reuses its KV."""
        self.history.append({"role": "user", "content": question})
        self.stop_requested.clear()
        answer = _Answer()
        future = self.portal.start_task_soon(answer.stream, self.engine, self.messages(),
                                             self.params, self.template,
                                             self.chat_template_kwargs, self.out)
        while not answer.finished.wait(STOP_POLL_S):
            if self.stop_requested.is_set():
                future.cancel()  # cancels the task's scope; its stream closes, freeing the KV
        if future.cancelled():
            self.out.print()  # the answer stopped mid-line
            self.out.print(Text("[stopped]", style="dim"))
        elif isinstance(future.exception(), Q4KError):
            self.out.print(Text(f"error: {future.exception()}", style="red"))
        else:
            future.result()  # anything else is a bug: let it propagate
        text = "".join(answer.parts)
        if text:
            self.history.append({"role": "assistant", "content": text})
        else:
            self.history.pop()


def _read_line() -> str:
    """input() with Ctrl-C raising KeyboardInterrupt, as at any prompt."""
    flag_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return input(PROMPT)
    finally:
        signal.signal(signal.SIGINT, flag_handler)


class _Answer:
    """One streamed answer: its text so far (a thinking model's reasoning is shown, dim, but
    kept out of it and so out of the conversation), and an event set once its task has
    ended."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.finished = threading.Event()

    async def stream(self, engine: Engine, messages: list[dict[str, str]],
                     params: SamplingParams, template: str | None,
                     chat_template_kwargs: dict[str, Any], out: Console) -> None:
        """Runs in the engine's event loop; closing the stream on cancel frees the sequence."""
        from actors.cli.generate import finish_line

        try:
            last: Chunk | None = None
            async with aclosing(engine.chat(messages, params, template,
                                            chat_template_kwargs=chat_template_kwargs)) as chunks:
                thinking = False
                async for chunk in chunks:
                    if chunk.reasoning:  # a thinking model's reasoning: shown dim, not kept
                        out.print(Text(chunk.reasoning, style="dim"), end="")
                        thinking = True
                    if chunk.text and thinking:
                        out.print()
                        thinking = False
                    out.file.write(chunk.text)
                    out.file.flush()
                    self.parts.append(chunk.text)
                    last = chunk
            out.print()
            if last is not None:
                out.print(Text(finish_line(last), style="dim"))
        finally:
            self.finished.set()
