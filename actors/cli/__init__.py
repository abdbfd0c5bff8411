"""The `q4k` command: one module per verb, each exposing `register(subparsers)`.

A verb's `register` adds its subparser and sets `handler` (args -> exit status). Errors of the
project become one readable line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence

from actors.errors import Q4KError

# Verb modules, in the order `q4k --help` lists them.
VERB_MODULES = ("models", "inspect", "generate", "chat", "serve", "bench", "logs", "quantize")


class _OneLineErrorParser(argparse.ArgumentParser):
    """Usage mistakes are one line naming the problem and where help is (subparsers made
    by `add_subparsers` inherit this class)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        prog="q4k", description="Serve and inspect Q4_K-family GGUF language models."
    )
    parser.add_argument("--version", action="version", version=f"q4k {_version()}")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name in VERB_MODULES:
        importlib.import_module(f"actors.cli.{name}").register(subparsers)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("q4k-actors")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed; run from a source tree)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except Q4KError as exc:
        print(f"q4k {args.verb}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"q4k {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
