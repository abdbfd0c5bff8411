"""The `q4k` command as a whole: --version, the synopsis in docs/cli.md agrees with the
parser (every flag and argument it shows exists, and every one the parser takes is shown), and
what every verb that opens an engine shares: the backend notice."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from actors.cli import build_parser
from actors.compute.backends import BACKENDS, nvidia_gpu_present
from test_cli_chat import CHATML
from actors.serve.guard import API_KEY_ENV
from test_cli_logs import CALL_TIMEOUT_S, assert_one_line_error, run_q4k

CLI_PAGE = Path(__file__).parent.parent / "docs" / "cli.md"
OPTION = re.compile(r"\[(-{1,2}[\w-]+)")
OPTION_GROUP = re.compile(r"\[-[^\]]*\]")


def synopsis_command_lines() -> dict[str, str]:
    """The synopsis' `q4k ...` lines (docs/cli.md, "## Synopsis"), keyed by their verb (and view,
    for `logs`), with `[SAMPLING]` expanded."""
    section = CLI_PAGE.read_text().split("## Synopsis", 1)[1]
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
def test_the_synopsis_shows_each_command_as_it_parses(key: str) -> None:
    parser = parsers_by_key()[key]
    line = synopsis_command_lines()[key]
    shown = set(OPTION.findall(line))
    taken = [a.option_strings for a in parser._actions
             if a.option_strings and "--help" not in a.option_strings]
    assert all(shown & set(options) for options in taken), (key, taken, shown)
    assert shown <= {option for options in taken for option in options}, (key, shown)
    assert shown_positionals(line, key) == parser_positionals(parser)


def test_the_synopsis_lists_every_command() -> None:
    assert set(synopsis_command_lines()) == set(parsers_by_key())


def test_version() -> None:
    result = run_q4k("--version")
    assert result.returncode == 0
    assert result.stdout == f"q4k {importlib.metadata.version('q4k-actors')}\n"


@pytest.mark.parametrize("key", [" ", ""])
def test_serve_refuses_an_api_key_environment_variable_set_empty(
        tiny_model_paths: dict[str, Path], key: str) -> None:
    """Set but empty is a mistake to say, never a server without a key."""
    result = run_q4k("serve", "--model", str(tiny_model_paths["llama-q4k-tiny"]), "--port", "0",
                     env={API_KEY_ENV: key})
    assert_one_line_error(result, API_KEY_ENV, "empty")


@pytest.mark.parametrize("name", ["models.lan:8000", "http://models.lan", "a b", "", "[::1]"])
def test_serve_refuses_an_allowed_host_that_is_not_a_host_name(name: str) -> None:
    result = run_q4k("serve", "--allowed-host", name)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--allowed-host: must be a host name" in result.stderr


def test_serve_refuses_connection_limits_with_replicas(tiny_model_paths: dict[str, Path]) -> None:
    pytest.importorskip("ray", reason="needs the `ray` extra")
    result = run_q4k("serve", "--model", str(tiny_model_paths["llama-q4k-tiny"]),
                     "--replicas", "2", "--port", "8000", "--header-timeout", "5")
    assert_one_line_error(result, "--header-timeout", "Ray Serve's proxy")


def test_serve_help_says_where_logs_go_by_default() -> None:
    (serve,) = [a for a in subparsers_of(build_parser())["serve"]._actions
                if "--log-level" in a.option_strings]
    assert "only when a level is given" not in serve.help
    assert "without one, to stderr" in serve.help


# --- the backend notice ---------------------------------------------------------------------

CUDA_CANNOT_RUN = BACKENDS["cuda"].unavailable_reason()
NOTICE = re.compile(r"^q4k (\w+): notice: backend auto: cuda not used \(.+\); running on the CPU$")


@pytest.fixture
def gpu_that_cannot_be_used(tmp_path: Path) -> dict[str, str]:
    """An environment that shows an NVIDIA GPU (`nvidia-smi` on the PATH) where CUDA cannot run."""
    if CUDA_CANNOT_RUN is None:
        pytest.skip("CUDA can run on this machine: auto takes the GPU")
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (tools / "nvidia-smi").chmod(0o755)
    return {"PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}


def notices_in(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "notice: backend auto" in line]


@pytest.mark.parametrize("verb", ["generate", "chat", "bench"])
def test_auto_passing_over_a_gpu_is_one_line_on_stderr(
        verb: str, gpu_that_cannot_be_used: dict[str, str],
        tiny_model_paths: dict[str, Path], tmp_path: Path) -> None:
    model = ["--model", str(tiny_model_paths["llama-q4k-tiny"])]
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    command = {
        "generate": ["generate", "Hello", *model, "--max-tokens", "2"],
        "chat": ["chat", *model, "--template", str(template)],
        "bench": ["bench", *model, "--concurrency", "1", "--prompt-tokens", "8",
                  "--max-tokens", "2"],
    }[verb]
    result = run_q4k(*command, stdin="", env=gpu_that_cannot_be_used)
    assert result.returncode == 0, result.stderr
    (notice,) = notices_in(result.stderr)
    assert NOTICE.match(notice).group(1) == verb
    assert CUDA_CANNOT_RUN in notice


def test_serve_says_it_too(gpu_that_cannot_be_used: dict[str, str],
                           tiny_model_paths: dict[str, Path], tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "actors.cli", "serve", "--model",
         str(tiny_model_paths["llama-q4k-tiny"]), "--port", "0",
         "--log-file", str(tmp_path / "serve.log")],
        stderr=subprocess.PIPE, text=True, env={**os.environ, **gpu_that_cannot_be_used})
    watchdog = threading.Timer(CALL_TIMEOUT_S, process.kill)  # a missing line fails, not hangs
    watchdog.start()
    try:
        lines = [process.stderr.readline() for _ in range(3)]  # banner, no template, backend
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=CALL_TIMEOUT_S)
    finally:
        watchdog.cancel()
        process.kill()
    assert "has no chat template" in lines[1]
    assert NOTICE.match(lines[2].rstrip("\n")).group(1) == "serve"


@pytest.mark.skipif(nvidia_gpu_present(), reason="this machine shows an NVIDIA GPU")
def test_no_notice_where_the_cpu_is_what_a_user_expects(
        tiny_model_paths: dict[str, Path]) -> None:
    result = run_q4k("generate", "Hello", "--model", str(tiny_model_paths["llama-q4k-tiny"]),
                     "--max-tokens", "2")
    assert result.returncode == 0, result.stderr
    assert notices_in(result.stderr) == []
