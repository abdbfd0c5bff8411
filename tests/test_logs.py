"""The library's logs: silent until the application chooses, then JSON lines to a stream or
records of the standard `logging` module."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import actors.logs
from actors.logs import configure_logging, enabled_for, get_logger, log_to_stdlib

REJECTED_REQUEST = """
import anyio
from actors import Engine, InvalidRequest

async def main():
    async with Engine.open({model!r}, backend="cpu") as engine:
        try:
            engine.generate("")
        except InvalidRequest:
            print("refused")

anyio.run(main)
"""


@pytest.fixture(autouse=True)
def restore_destination(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each test changes where the package logs; put it back afterwards.
    monkeypatch.setattr(actors.logs, "_destination", actors.logs._destination)


def test_an_embedded_engine_is_silent_until_logging_is_configured(
        tiny_model_paths: dict[str, Path]) -> None:
    script = REJECTED_REQUEST.format(model=str(tiny_model_paths["llama-q4k-tiny"]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "refused\n"
    assert result.stderr == ""


def test_configured_logging_writes_json_lines() -> None:
    stream = io.StringIO()
    configure_logging("info", stream)
    log = get_logger("actors.engine", request_id="r1")
    log.debug("step", items=1)
    log.warning("request_rejected", reason="overloaded")
    (line,) = stream.getvalue().splitlines()
    event = json.loads(line)
    assert event["event"] == "request_rejected" and event["request_id"] == "r1"
    assert event["level"] == "warning"


def test_routing_into_the_standard_logging_module(caplog: pytest.LogCaptureFixture) -> None:
    log_to_stdlib()
    caplog.set_level(logging.INFO, logger="actors")
    log = get_logger("actors.session", request_id="r2")
    log.debug("prefill_started")  # below the stdlib logger's level: never rendered
    log.info("request_finished", completion_tokens=5)
    (record,) = caplog.records
    assert record.name == "actors.session" and record.levelno == logging.INFO
    assert json.loads(record.getMessage())["completion_tokens"] == 5
    assert record.event_dict["request_id"] == "r2"


def test_enabled_for_says_whether_an_event_would_be_written(
        caplog: pytest.LogCaptureFixture) -> None:
    """What the scheduler checks before building its per-step debug event."""
    assert not enabled_for("actors.scheduler", "critical")  # silent until configured
    configure_logging("info", io.StringIO())
    assert not enabled_for("actors.scheduler", "debug")
    assert enabled_for("actors.scheduler", "info")
    log_to_stdlib()
    caplog.set_level(logging.INFO, logger="actors")
    assert not enabled_for("actors.scheduler", "debug")
    caplog.set_level(logging.DEBUG, logger="actors")
    assert enabled_for("actors.scheduler", "debug")


def test_configure_logging_after_stdlib_routing_takes_over(
        caplog: pytest.LogCaptureFixture) -> None:
    log_to_stdlib()
    stream = io.StringIO()
    configure_logging("info", stream)
    with caplog.at_level(logging.DEBUG, logger="actors"):
        get_logger("actors.engine").info("engine_started")
    assert caplog.records == []
    assert json.loads(stream.getvalue())["event"] == "engine_started"
