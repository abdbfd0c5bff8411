"""tests/gpu without a device: its groups (tests/gpu/conftest.py), which device_check.sh runs a
process each so that a kernel's fault costs only its group, checked on the collected test ids;
the figures its tests record, printed at the end of a run; and the device tests themselves run
over the emulated device, which rehearses their own code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.gpu.conftest import GPU_TEST_GROUPS, device_group

ROOT = Path(__file__).resolve().parent.parent


def test_every_device_test_has_a_group_and_every_group_tests() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/gpu"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    ids = [line for line in listed.splitlines() if line.startswith("tests/gpu/")]
    groups = {node_id: device_group(SimpleNamespace(nodeid=node_id,
                                                    path=ROOT / node_id.split("::")[0]))
              for node_id in ids}
    assert set(groups.values()) == set(GPU_TEST_GROUPS)
    # Each product's own kernels go with it, the backend end to end apart
    for node_id, group in groups.items():
        if "test_cuda_backend.py" in node_id:
            assert group == "backend", node_id
        elif "matvec_mma" in node_id:
            assert group == "mma_matvec", node_id
        elif "batched" in node_id:
            assert group == "batched", node_id
        else:
            assert group == "kernels", node_id


def test_the_device_check_runs_every_group_in_order() -> None:
    script = (ROOT / "tests" / "gpu" / "device_check.sh").read_text()
    loop = re.search(r"^for group in (.+); do$", script, re.MULTILINE)
    assert loop is not None and tuple(loop.group(1).split()) == GPU_TEST_GROUPS


def test_the_figures_tests_record_end_the_log() -> None:
    from tests.gpu.conftest import pytest_terminal_summary

    class Reporter:
        def __init__(self) -> None:
            self.lines: list[str] = []
            self.stats = {
                "passed": [SimpleNamespace(nodeid="t.py::b", when="call",
                                           user_properties=[("worst", "0.01"), ("top1", "1.0")]),
                           SimpleNamespace(nodeid="t.py::c", when="call", user_properties=[])],
                "failed": [SimpleNamespace(nodeid="t.py::a", when="call",
                                           user_properties=[("worst", "0.3")])],
                "": [SimpleNamespace(nodeid="t.py::d", when="setup",
                                     user_properties=[("x", "1")])],
                "warnings": [SimpleNamespace(message="deprecated")]}

        def section(self, title: str) -> None:
            self.lines.append(f"== {title}")

        def write_line(self, line: str) -> None:
            self.lines.append(line)

    reporter = Reporter()
    pytest_terminal_summary(reporter)
    # a failed check's figure too (how far it was off), sorted; nothing of other phases
    assert reporter.lines == ["== figures recorded by the device tests", "t.py::a: worst=0.3",
                              "t.py::b: worst=0.01, top1=1.0"]


@pytest.mark.slow
@pytest.mark.parametrize("group", GPU_TEST_GROUPS)
def test_the_device_tests_pass_over_the_emulated_device(group: str) -> None:
    """tests/gpu over the emulated device (GPU_TESTS_EMULATED=1: each kernel its numpy twin,
    each launch checked against the compiled kernel's parameters), a group a test as
    device_check.sh runs them (so a busy machine's time limit is one group's, not all of
    them): the device tests' own code (arguments, shapes, fixtures) is right before a device's
    few minutes are spent on it. The full-size SmolLM2 and gemma-3 are left out here (the tiny
    models take the same code), and so are the tiny models that test_cuda_backend_emulated.py
    already runs."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-k", "not smollm2 and not gemma3 and not qwen3 and not llama3 and not phi3",
         "tests/gpu"],
        cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "GPU_TESTS_EMULATED": "1", "GPU_TEST_GROUP": group})
    assert done.returncode == 0, done.stdout[-4000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
