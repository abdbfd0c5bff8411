"""`q4k generate` as a subprocess on the tiny llama model: streaming text, --json Completion,
errors as one line, the real log it writes read back by `q4k logs`, and answers constrained by
the structured-output flags (--json-schema, --regex, --choice, --grammar)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from actors.compute.backends import BACKENDS
from test_cli_chat import CHATML
from test_cli_logs import CALL_TIMEOUT_S, assert_one_line_error, run_q4k
from test_logreader import recount

GREEDY = ("--temperature", "0", "--max-tokens", "12", "--ignore-eos")


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_paths: dict[str, Path]) -> str:
    return str(tiny_model_paths["llama-q4k-tiny"])


@pytest.fixture(scope="module")
def greedy_json(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One --json run that also writes a log file, shared by the tests below."""
    log = tmp_path_factory.mktemp("generate") / "run.log"
    result = run_q4k("generate", "Hello there", "--model", tiny_llama, "--backend", "cpu",
                     *GREEDY, "--json", "--log-file", str(log))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), log


def test_json_prints_the_completion(greedy_json: tuple[dict, Path]) -> None:
    completion, _ = greedy_json
    assert completion["finish_reason"] == "length"
    assert len(completion["token_ids"]) == 12
    assert completion["usage"]["completion_tokens"] == 12
    assert completion["usage"]["prompt_tokens"] > 0
    assert completion["timings"]["ttft_ms"] > 0


def test_streamed_text_matches_the_completion(tiny_llama: str,
                                              greedy_json: tuple[dict, Path]) -> None:
    completion, _ = greedy_json
    result = run_q4k("generate", "Hello there", "--model", tiny_llama, "--backend", "cpu",
                     *GREEDY)
    assert result.returncode == 0, result.stderr
    assert result.stdout == completion["text"] + "\n"
    assert "[length · " in result.stderr and "12 generated" in result.stderr
    # What the engine holds, said once at the start.
    assert re.search(r"^q4k generate: memory: [\d,]+ MB resident after loading; KV pool of "
                     r"[\d,]+ positions$", result.stderr, re.MULTILINE)


def test_prompt_from_stdin(tiny_llama: str, greedy_json: tuple[dict, Path]) -> None:
    completion, _ = greedy_json
    result = run_q4k("generate", "-", "--model", tiny_llama, "--backend", "cpu", *GREEDY,
                     "--json", stdin="Hello there")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == completion["token_ids"]


def test_the_real_log_reads_back(greedy_json: tuple[dict, Path]) -> None:
    completion, log = greedy_json
    lines = log.read_text().splitlines()
    events = [json.loads(line)["event"] for line in lines]
    assert {"model_loaded", "engine_started", "request_admitted", "request_finished"} <= set(events)
    summary = json.loads(run_q4k("logs", "summary", "--json", str(log)).stdout)
    assert summary["malformed"] == 0
    assert summary["finish_reasons"] == {"length": 1}
    assert summary["completion_tokens"] == 12
    expected = recount(lines)
    assert summary["ttft_ms"]["p50"] == pytest.approx(expected["ttft"][0])
    assert summary["tokens_per_s"] == pytest.approx(expected["tokens_per_s"], rel=1e-6)
    (row,) = json.loads(run_q4k("logs", "requests", "--json", str(log)).stdout)
    assert row["status"] == "finished" and row["completion_tokens"] == 12


def test_errors_are_one_line(tiny_llama: str, tmp_path: Path) -> None:
    assert_one_line_error(run_q4k("generate", "hi", "--model", str(tmp_path / "absent.gguf")),
                          "absent.gguf", "no such model file")
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("just some text, not a model\n")
    assert_one_line_error(run_q4k("generate", "hi", "--model", str(not_gguf)), "notes.gguf")
    assert_one_line_error(run_q4k("generate", "hi", "--model", tiny_llama, "--top-p", "1.5"),
                          "--top-p: ", "top_p")
    assert_one_line_error(run_q4k("generate", "", "--model", tiny_llama, "--backend", "cpu"),
                          "empty")
    assert_one_line_error(run_q4k("generate", "hi", "--model", tiny_llama, "--log-file",
                                  str(not_gguf / "run.log")), "--log-file", "cannot write there")


def test_an_empty_prompt_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    # The model does not exist: only a check made before loading can name the prompt.
    absent = str(tmp_path / "absent.gguf")
    assert_one_line_error(run_q4k("generate", "", "--model", absent), "prompt is empty")
    assert_one_line_error(run_q4k("generate", "-", "--model", absent, stdin=""),
                          "prompt is empty")


def test_a_log_file_in_a_missing_folder_is_refused(tiny_llama: str, tmp_path: Path) -> None:
    log = tmp_path / "no-such-folder" / "run.log"
    assert_one_line_error(run_q4k("generate", "hi", "--model", tiny_llama, "--log-file", str(log)),
                          "--log-file", "does not exist")
    assert not log.parent.exists()


@pytest.mark.skipif(BACKENDS["cuda"].unavailable_reason() is None,
                    reason="CUDA can run on this machine")
def test_a_backend_that_cannot_run_offers_the_flag_that_can(tiny_llama: str) -> None:
    result = run_q4k("generate", "hi", "--model", tiny_llama, "--backend", "cuda")
    assert_one_line_error(result, "--backend cuda cannot run here", "--backend auto")
    assert "backend='auto'" not in result.stderr


def test_ctrl_c_puts_interrupted_on_its_own_line(tiny_llama: str) -> None:
    # stdout and stderr share one pipe, as they share a terminal.
    process = subprocess.Popen(
        [sys.executable, "-m", "actors.cli", "generate", "Hello", "--model", tiny_llama,
         "--backend", "cpu", "--temperature", "0", "--max-tokens", "2000", "--ignore-eos"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        first = process.stdout.read1()  # the text is streaming
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=CALL_TIMEOUT_S)
    finally:
        process.kill()
    assert first and process.returncode == 130
    lines = (first + rest).decode().splitlines()
    assert lines[-1] == "q4k generate: interrupted"
    assert "[length" not in lines[-2]  # it stopped before the end


# Structured output: the flags shared with `q4k chat` (actors/cli/common.py).
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "digit": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "digit", "tags"],
    "additionalProperties": False,
}


def generate_constrained(tiny_llama: str, *flags: str) -> dict:
    """The --json Completion of a greedy answer under `flags` (later flags win)."""
    result = run_q4k("generate", "Hello there", "--model", tiny_llama, "--backend", "cpu",
                     "--temperature", "0", "--max-tokens", "40", "--json", *flags)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("fast_forward", [(), ("--no-fast-forward",)], ids=["ff", "no-ff"])
def test_json_schema_answers_validate(tiny_llama: str, tmp_path: Path,
                                      fast_forward: tuple[str, ...]) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SMALL_SCHEMA))
    completion = generate_constrained(tiny_llama, "--json-schema", str(schema_file),
                                      *fast_forward)
    assert completion["finish_reason"] == "stop"
    jsonschema.validate(json.loads(completion["text"]), SMALL_SCHEMA)


def test_regex_choice_and_grammar_answers_match(tiny_llama: str, tmp_path: Path) -> None:
    regex = generate_constrained(tiny_llama, "--regex", "[a-c]{3}-[0-9]{2}")
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", regex["text"]) and regex["finish_reason"] == "stop"
    choice = generate_constrained(tiny_llama, "--choice", "red", "--choice", "green")
    assert choice["text"] in ("red", "green") and choice["finish_reason"] == "stop"
    lark = tmp_path / "answer.lark"
    lark.write_text('start: ("yes" | "no") " because " /[a-z]{2,5}/\n')
    grammar = generate_constrained(tiny_llama, "--grammar", str(lark))
    assert re.fullmatch("(yes|no) because [a-z]{2,5}", grammar["text"])


def test_a_grammar_cut_by_max_tokens_ends_with_length(tiny_llama: str) -> None:
    completion = generate_constrained(tiny_llama, "--regex", "[a-z]{200}", "--max-tokens", "5")
    assert completion["finish_reason"] == "length"
    assert completion["usage"]["completion_tokens"] == 5


def test_streamed_constrained_text_ends_with_stop(tiny_llama: str) -> None:
    result = run_q4k("generate", "Hello there", "--model", tiny_llama, "--backend", "cpu",
                     "--temperature", "0", "--choice", "red", "--choice", "green")
    assert result.returncode == 0, result.stderr
    assert result.stdout in ("red\n", "green\n")
    assert result.stderr.splitlines()[-1].startswith("[stop · ")


def test_structured_flag_errors_are_one_line(tiny_llama: str, tmp_path: Path) -> None:
    def fails(*flags: str) -> subprocess.CompletedProcess[str]:
        return run_q4k("generate", "hi", "--model", tiny_llama, "--backend", "cpu", *flags)

    absent = str(tmp_path / "absent.json")
    assert_one_line_error(fails("--json-schema", absent),
                          f"--json-schema {absent}: cannot read the schema")
    not_json = tmp_path / "broken.json"
    not_json.write_text('{"type": ')
    assert_one_line_error(fails("--json-schema", str(not_json)),
                          f"--json-schema {not_json}: not JSON", "line 1 column 10")
    not_object = tmp_path / "list.json"
    not_object.write_text("[1, 2]")
    assert_one_line_error(fails("--json-schema", str(not_object)),
                          "--json-schema: ", "must be a JSON object")
    bad_type = tmp_path / "bad_type.json"
    bad_type.write_text('{"type": "colour"}')
    assert_one_line_error(fails("--json-schema", str(bad_type)), "--json-schema: ", "colour")
    assert_one_line_error(fails("--regex", "("), "--regex: ", "does not compile")
    assert_one_line_error(fails("--grammar", str(tmp_path / "absent.lark")),
                          "--grammar ", "cannot read the grammar")
    assert_one_line_error(fails("--regex", "a", "--choice", "b"), "--choice", "--regex",
                          "not allowed")
    assert_one_line_error(fails("--no-fast-forward"), "--no-fast-forward", "--json-schema")


def test_an_unreadable_schema_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    # The model does not exist: only a check made before loading can name the schema.
    absent = str(tmp_path / "absent.gguf")
    assert_one_line_error(run_q4k("generate", "hi", "--model", absent, "--json-schema",
                                  str(tmp_path / "none.json")), "--json-schema", "cannot read")


def test_chat_takes_the_structured_flags(tiny_llama: str, tmp_path: Path) -> None:
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    result = run_q4k("chat", "--model", tiny_llama, "--backend", "cpu", "--template",
                     str(template), "--temperature", "0", "--choice", "red", "--choice", "green",
                     stdin="pick a colour\n/quit\n")
    assert result.returncode == 0, result.stderr
    answer = result.stdout.splitlines()[1].removeprefix(">>> ")
    assert answer in ("red", "green") and "[stop · " in result.stdout
