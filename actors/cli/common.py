"""Flags and helpers the `q4k` verbs share: model, logging, sampling, error lines, consoles."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from actors.compute.backends import BACKEND_NAMES, nvidia_gpu_present
from actors.errors import BackendUnavailable, InvalidRequest
from actors.logs import LEVELS, configure_logging
from actors.model.packaged import DEFAULT_MODEL, resolve_model

if TYPE_CHECKING:
    from actors.engine import Engine
    from actors.params import SamplingParams, StructuredOutput

# Width of tables written to a pipe or file, where there is no terminal to measure.
PIPE_WIDTH = 160
# The flag that sets each field of StructuredOutput, to name it in errors.
STRUCTURED_FLAGS = {
    "json_schema": "--json-schema",
    "regex": "--regex",
    "choice": "--choice",
    "grammar": "--grammar",
    "fast_forward": "--no-fast-forward",
}


class ExamplesHelpFormatter(argparse.HelpFormatter):
    """argparse's help, wrapped to the terminal as usual, except that lines of the description
    or epilog indented by two spaces (example command lines) stay whole, to copy and run."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        fill = super()._fill_text
        return "\n".join(indent + line if line.startswith("  ") else fill(line, width, indent)
                         for line in text.splitlines())


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= `minimum`."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    return whole_number


def add_model_flag(parser: argparse.ArgumentParser, default: str = DEFAULT_MODEL,
                   default_help: str | None = None) -> None:
    """--model: a GGUF file's path or a packaged model's name; without it, the packaged model
    `default` (`model_source`). `default_help` says so where the verb picks it otherwise."""
    parser.add_argument(
        "--model", metavar="MODEL", default=None,
        help="a GGUF model file, or a packaged model's name (`q4k models` lists them; default: "
        f"{default_help or default})")
    parser.set_defaults(default_model=default)


def add_logging_flags(
    parser: argparse.ArgumentParser,
    without_file: str = "without one, logs go to stderr only when a level is given",
) -> None:
    """--log-file and --log-level; `without_file` says where logs go without a --log-file."""
    parser.add_argument(
        "--log-file",
        metavar="PATH",
        default=None,
        help="append JSON-lines logs to PATH (read them back with `q4k logs`)",
    )
    parser.add_argument(
        "--log-level",
        choices=tuple(LEVELS),
        default=None,
        help=f"lowest level logged (default: info to --log-file; {without_file})",
    )


def configure_logging_from(args: argparse.Namespace, default_level: str | None = None) -> None:
    """Logs go to --log-file as JSON lines, else to stderr only when --log-level (or the verb's
    `default_level`) asks: a verb reports its own errors as one line, which log lines on stderr
    would only repeat."""
    level = args.log_level or default_level or ("info" if args.log_file else "critical")
    if args.log_file is not None and not Path(args.log_file).parent.exists():
        raise InvalidRequest(
            f"--log-file {args.log_file}: the folder {Path(args.log_file).parent} does not exist; "
            "create it or pick another path",
            field="log_file",
        )
    try:
        configure_logging(level, args.log_file)
    except OSError as exc:
        raise InvalidRequest(
            f"--log-file {args.log_file}: cannot write there ({exc.strerror}); pick another path",
            field="log_file",
        ) from None


def add_sampling_flags(parser: argparse.ArgumentParser, *, max_tokens: int = 256) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                       help=f"most tokens to generate (default {max_tokens})")
    group.add_argument("--temperature", type=float, default=0.8, metavar="T",
                       help="0 = greedy (default 0.8)")
    group.add_argument("--top-k", type=int, default=40, metavar="K", help="0 = off (default 40)")
    group.add_argument("--top-p", type=float, default=0.95, metavar="P", help="default 0.95")
    group.add_argument("--min-p", type=float, default=0.05, metavar="P", help="default 0.05")
    group.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                       help="1 = off (default 1)")
    group.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop when TEXT is generated (repeatable)")
    group.add_argument("--ignore-eos", action="store_true",
                       help="keep generating past end-of-sequence tokens")
    _add_structured_flags(parser)


def _add_structured_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "structured output", "the answer must match one of these, enforced token by token")
    one_of = group.add_mutually_exclusive_group()
    one_of.add_argument("--json-schema", metavar="FILE", default=None,
                        help="a JSON Schema file: the answer is JSON valid against it")
    one_of.add_argument("--regex", metavar="R", default=None,
                        help="the answer matches the regular expression R in full")
    one_of.add_argument("--choice", action="append", default=None, metavar="TEXT",
                        help="the answer is one of these texts (repeat the flag for each)")
    one_of.add_argument("--grammar", metavar="FILE", default=None,
                        help="a grammar file (llguidance's Lark syntax, or llama.cpp's GBNF)")
    group.add_argument("--no-fast-forward", action="store_true",
                       help="decode the tokens the constraint forces one step each instead of "
                       "feeding them as one chunk")


def sampling_params_from(args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams the sampling flags describe, validated; a bad value is an
    InvalidRequest that names the flag the user typed."""
    from actors.params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
            structured=structured_output_from(args),
        )
        params.validate()
    except InvalidRequest as exc:
        raise naming_the_flag(exc) from None
    return params


def structured_output_from(args: argparse.Namespace) -> StructuredOutput | None:
    """The StructuredOutput the structured-output flags describe (None without one); the
    --json-schema and --grammar files are read here, before any model loads."""
    from actors.params import StructuredOutput

    fast_forward = not args.no_fast_forward
    if args.json_schema is not None:
        schema = _json_schema_file(args.json_schema)
        return StructuredOutput(json_schema=schema, fast_forward=fast_forward)
    if args.regex is not None:
        return StructuredOutput(regex=args.regex, fast_forward=fast_forward)
    if args.choice is not None:
        return StructuredOutput(choice=tuple(args.choice), fast_forward=fast_forward)
    if args.grammar is not None:
        grammar = read_text_file(args.grammar, "the grammar", f"--grammar {args.grammar}",
                                 "structured.grammar")
        return StructuredOutput(grammar=grammar, fast_forward=fast_forward)
    if not fast_forward:
        raise InvalidRequest("--no-fast-forward applies to a constrained answer: give "
                             "--json-schema, --regex, --choice or --grammar too",
                             field="structured.fast_forward")
    return None


def naming_the_flag(exc: InvalidRequest) -> InvalidRequest:
    """`exc` with the flag the user typed in front (--top-p, --regex...); as it is where
    that flag is already named."""
    field = exc.field or ""
    if field.startswith("structured."):
        flag = STRUCTURED_FLAGS.get(field.removeprefix("structured."))
    else:
        flag = f"--{field.replace('_', '-')}" if field else None
    if flag is None or str(exc).startswith(flag):
        return exc
    return InvalidRequest(f"{flag}: {exc}", field=exc.field)


def _json_schema_file(path: str) -> Any:
    text = read_text_file(path, "the schema", f"--json-schema {path}", "structured.json_schema")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"--json-schema {path}: not JSON: {exc}",
                             field="structured.json_schema") from None


def model_source(args: argparse.Namespace) -> str:
    """What --model names (a path or a packaged model's name), else the verb's default model."""
    return args.model if args.model is not None else args.default_model


def model_path_from(args: argparse.Namespace) -> Path:
    """The file of the model `model_source` names (the packaged default assembled on first
    use); `ModelFormatError` when it names no file and no packaged model, or one not
    installed."""
    return resolve_model(model_source(args))


def error_line(verb: str, message: str) -> int:
    """Print one `q4k VERB: error: ...` line on stderr, as the dispatcher does; exit status 1."""
    print(f"q4k {verb}: error: {message}", file=sys.stderr)
    return 1


def console() -> Console:
    """A rich console on stdout: styled on a terminal, plain and wide on a pipe."""
    width = None if sys.stdout.isatty() else PIPE_WIDTH
    return Console(file=sys.stdout, width=width, highlight=False)


def add_backend_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=BACKEND_NAMES, default="auto",
                        help="where the model runs (default auto: the GPU when one is usable)")


@asynccontextmanager
async def open_engine(args: argparse.Namespace, *, report_memory: bool = False,
                      **options: Any) -> AsyncIterator[Engine]:
    """`Engine.open` for the --model (`model_source`) and --backend flags; `options` go to the
    engine. A backend
    that cannot run is told in the command line's words; once open, `backend_notice` says
    (one line on stderr) when --backend auto passed over a GPU this machine has, and with
    `report_memory` one line says what the engine holds (`memory_line`)."""
    from actors.engine import Engine

    try:
        async with Engine.open(model_source(args), backend=args.backend, **options) as engine:
            notice = backend_notice(args.backend, engine)
            if notice is not None:
                print(f"q4k {args.verb}: notice: {notice}", file=sys.stderr, flush=True)
            if report_memory:
                print(f"q4k {args.verb}: {memory_line(engine)}", file=sys.stderr, flush=True)
            yield engine
    except BackendUnavailable as exc:
        if exc.backend is None:
            raise
        raise BackendUnavailable(
            f"--backend {exc.backend} cannot run here: {exc.reason}; use --backend auto to "
            "fall back to what can",
            backend=exc.backend,
            reason=exc.reason,
        ) from None


def memory_line(engine: Engine) -> str:
    """`memory: 287 MB resident after loading; KV pool of 65,536 positions` (the pool's pages
    become resident as they fill)."""
    from actors.compute.cpu import resident_bytes

    resident = resident_bytes()
    held = "resident memory unknown" if resident is None else f"{resident / 1e6:,.0f} MB resident"
    positions = engine.info.num_blocks * engine.info.block_size
    return f"memory: {held} after loading; KV pool of {positions:,} positions"


def backend_notice(requested: str, engine: Engine) -> str | None:
    """Why --backend auto runs on the CPU of a machine that has an NVIDIA GPU (the engine's
    notices), or None where the backend is the one a user expects."""
    if requested != "auto" or engine.info.on_gpu or not engine.notices:
        return None
    return "; ".join(engine.notices) if nvidia_gpu_present() else None


def read_template(path: str | None) -> str | None:
    """The text of the --template FILE (None without one)."""
    if path is None:
        return None
    return read_text_file(path, "the template", path, "template")


def read_text_file(path: str, what: str, shown: str, field: str) -> str:
    """A UTF-8 text file's text; else `InvalidRequest` "SHOWN: cannot read WHAT: why"."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise InvalidRequest(f"{shown}: cannot read {what}: {why}", field=field) from None


def has_chat_template(model: Path, override: str | None) -> bool:
    """Whether `model` can chat: the template to use (`override`, else the model's own) is
    compiled before any weights load, so a bad one fails here (TemplateError). False when the
    model has none (base models usually have none) and no `override` is given."""
    from actors.model.gguf.reader import open_gguf
    from actors.model.text.chat import CHAT_TEMPLATE_KEY, ChatTemplate

    with open_gguf(model) as gguf:
        if override is None and CHAT_TEMPLATE_KEY not in gguf.metadata:
            return False
        ChatTemplate.from_model_metadata(gguf, override)
    return True
