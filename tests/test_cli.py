"""The `q4k` command as a whole: --version, and the README's command lines agree with the
parser (every flag and argument it shows exists, and every one the parser takes is shown)."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
from pathlib import Path

import pytest

from actors.cli import build_parser
from test_cli_logs import run_q4k

README = Path(__file__).parent.parent / "README.md"
OPTION = re.compile(r"\[(-{1,2}[\w-]+)")
OPTION_GROUP = re.compile(r"\[-[^\]]*\]")


def readme_command_lines() -> dict[str, str]:
    """The README's `q4k ...` lines (after "## The command line"), keyed by their verb (and view,
    for `logs`), with `[SAMPLING]` expanded."""
    section = README.read_text().split("## The command line", 1)[1]
    block = section.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    sampling = next(line for line in block if line.startswith("SAMPLING = ")).split(" = ", 1)[1]
    lines = {}
    for line in block:
        words = line.split()
        if words[0] == "q4k" and words[1] != "--version":
            key = " ".join(words[1:3]) if words[1] == "logs" else words[1]
            lines[key] = line.replace("[SAMPLING]", sampling)
    return lines


def subparsers_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def parsers_by_key() -> dict[str, argparse.ArgumentParser]:
    verbs = subparsers_of(build_parser())
    found = {verb: parser for verb, parser in verbs.items() if verb != "logs"}
    found |= {f"logs {view}": parser for view, parser in subparsers_of(verbs["logs"]).items()}
    return found


def shown_positionals(line: str, key: str) -> list[str]:
    return OPTION_GROUP.sub("", line).split()[1 + len(key.split()):]


def parser_positionals(parser: argparse.ArgumentParser) -> list[str]:
    shown = []
    for action in parser._actions:
        if action.option_strings:
            continue
        name = action.metavar or action.dest.upper()
        shown.append({"?": f"[{name}]", "+": f"{name}..."}.get(action.nargs, name))
    return shown


@pytest.mark.parametrize("key", sorted(parsers_by_key()))
def test_the_readme_shows_each_command_as_it_parses(key: str) -> None:
    parser = parsers_by_key()[key]
    line = readme_command_lines()[key]
    shown = set(OPTION.findall(line))
    taken = [a.option_strings for a in parser._actions
             if a.option_strings and "--help" not in a.option_strings]
    assert all(shown & set(options) for options in taken), (key, taken, shown)
    assert shown <= {option for options in taken for option in options}, (key, shown)
    assert shown_positionals(line, key) == parser_positionals(parser)


def test_the_readme_lists_every_command() -> None:
    assert set(readme_command_lines()) == set(parsers_by_key())


def test_version() -> None:
    result = run_q4k("--version")
    assert result.returncode == 0
    assert result.stdout == f"q4k {importlib.metadata.version('q4k-actors')}\n"
