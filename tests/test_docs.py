"""The documentation cannot rot: the site builds in MkDocs' strict mode, every Python block of
the README and of docs/ runs, and every `q4k` command they show parses.

Python blocks run in this process on the tiny Llama model, which stands in for the default
model (`Engine.open()` with no path); a block that talks to `q4k serve` at
http://127.0.0.1:8000 runs against a real `q4k serve` of that model. A block preceded by
`<!-- not run: REASON -->` is skipped with that reason, so `-ra` lists it. Commands are only
parsed, by the `q4k` command's own argument parser, never run.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from actors.cli import build_parser
from tests.conftest import TINY_MODELS

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FENCE = re.compile(r"^```(\S*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>.+?)\s*-->$")
SHELL_LANGUAGES = frozenset({"bash", "sh", "shell", "console"})
SERVER_URL = "http://127.0.0.1:8000"
# Shell words that separate one command from the next on a line.
COMMAND_SEPARATORS = frozenset({"&&", "||", "|", ";", "&"})
TINY_MODEL = TINY_MODELS["llama-q4k-tiny"]


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page: where it starts, its language, its text, and the
    reason it is not run when a `not run` comment precedes it."""

    page: Path
    line: int
    language: str
    text: str
    not_run: str | None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    opened: tuple[int, str] | None = None
    body: list[str] = []
    previous = ""
    for number, line in enumerate(lines, start=1):
        fence = FENCE.match(line)
        if opened is None:
            if fence:
                opened, body = (number, fence.group(1)), []
                marker = NOT_RUN.match(previous.strip())
                not_run = marker.group("reason") if marker else None
            elif line.strip():
                previous = line
            continue
        if line.rstrip() == "```":
            start, language = opened
            blocks.append(Block(page, start, language, "\n".join(body) + "\n", not_run))
            opened, previous = None, ""
        else:
            body.append(line)
    assert opened is None, f"{page.name}: the block at line {opened[0]} is never closed"
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in code_blocks(page)]
PYTHON_BLOCKS = [block for block in ALL_BLOCKS if block.language == "python"]


def shell_commands(block: Block) -> Iterator[list[str]]:
    """Each command of a shell or console block as its words: continuation lines joined, a
    console block's `$ ` lines only (the rest is output), split at `&&`, `|`, `;`."""
    text = block.text.replace("\\\n", " ")
    for line in text.splitlines():
        if block.language == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command: list[str] = []
        for word in lexer:
            if word in COMMAND_SEPARATORS:
                if command:
                    yield command
                command = []
            else:
                command.append(word)
        if command:
            yield command


Q4K_COMMANDS = [
    pytest.param(command, id=f"{block.name}:{' '.join(command[:2])}")
    for block in ALL_BLOCKS if block.language in SHELL_LANGUAGES
    for command in shell_commands(block)
    if Path(command[0]).name == "q4k"
]


def test_the_pages_show_commands_and_code() -> None:
    """The collectors find what the pages hold (an empty list would make the tests below
    pass on nothing)."""
    verbs = {command.values[0][1] for command in Q4K_COMMANDS if len(command.values[0]) > 1}
    assert {"generate", "chat", "serve", "bench", "logs"} <= verbs
    assert any(block.page.name == "README.md" for block in PYTHON_BLOCKS)
    assert any(block.page.parent.name == "docs" for block in PYTHON_BLOCKS)


@pytest.mark.parametrize("command", Q4K_COMMANDS)
def test_q4k_command_parses(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        build_parser().parse_args(command[1:])
    except SystemExit as exc:  # --help and --version end the parse with status 0
        assert exc.code == 0, capsys.readouterr().err


def test_every_not_run_comment_names_a_reason_and_a_block() -> None:
    """A `not run` comment stands right before a code block, so no block is skipped by a
    comment meant for another."""
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if NOT_RUN.match(line.strip()):
                following = next((text for text in lines[number + 1:] if text.strip()), "")
                assert FENCE.match(following), f"{page.name}:{number + 1}: no block follows"


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`q4k serve` of the tiny model, for the blocks that call a server: the repository's
    ChatML template gives it a chat format, and answers are capped short so the blocks'
    defaults stay quick."""
    from tests.test_server import _start, _stop

    server = _start(TINY_MODEL, tmp_path_factory.mktemp("docs-serve") / "serve.log",
                    "--template", str(ROOT / "examples/chat_templates/chatml_tools.jinja"),
                    "--max-tokens-limit", "64")
    yield server.url
    _stop(server)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[block.name for block in PYTHON_BLOCKS])
def test_python_block_runs(block: Block, request: pytest.FixtureRequest,
                           monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if block.not_run:
        pytest.skip(f"{block.name} not run: {block.not_run}")
    source = block.text
    if SERVER_URL in source:
        source = source.replace(SERVER_URL, request.getfixturevalue("docs_server"))
    monkeypatch.setattr("actors.model.default_model.default_model_path", lambda: TINY_MODEL)
    monkeypatch.chdir(tmp_path)
    exec(compile(source, block.name, "exec"), {"__name__": "__main__"})


YAML_BLOCKS = [block for block in ALL_BLOCKS if block.language == "yaml"]


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[block.name for block in YAML_BLOCKS])
def test_serve_config_block_names_replica_settings(block: Block) -> None:
    """A `serve run` config shown parses, and what it passes to `actors.serve.ray:application`
    converts to `ReplicaSettings`, each key one of its fields."""
    import msgspec
    import yaml

    from actors.serve.ray import ReplicaSettings

    config = yaml.safe_load(block.text)
    for app in config["applications"]:
        assert app["import_path"] == "actors.serve.ray:application"
        fields = {field.name for field in msgspec.structs.fields(ReplicaSettings)}
        assert set(app["args"]) <= fields
        msgspec.convert(app["args"], ReplicaSettings, strict=False)


def test_readme_links_reach_files() -> None:
    """The README's relative links name files of the repository (MkDocs checks the site's)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\((?!https?://)([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing


def test_site_builds_strict(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    pages = {path.parent.name for path in (tmp_path / "site").glob("*/index.html")}
    assert pages >= {page.stem for page in PAGES if page.parent.name == "docs"} - {"index"}
