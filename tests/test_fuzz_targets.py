"""The fuzz targets of tests/fuzz, bounded for CI (Q4K_FUZZ_EXAMPLES each, default 150):
SamplingParams over every field, Engine.open over every option, hostile chat templates, chat
template operations sized before C builds them, hostile log files, special-token texts and
GGUF metadata counts. An input that makes the project raise anything but its own errors fails.
The GGUF structure target runs in tests/test_gguf_fuzz.py; `benchmarks/fuzz.py` runs all of
them longer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz import (
    FUZZ_EXAMPLES,
    engine_options,
    gguf_counts,
    logs,
    params,
    special_tokens,
    template_operations,
    templates,
)
from tests.fuzz.target import Target

FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,  # no timing threshold; the targets' hang guards cover hangs
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _fuzz_test(target: Target):
    @FUZZ_SETTINGS
    @given(case=target.cases)
    def run(case: object) -> None:
        target.check(case)

    return run


@pytest.mark.parametrize(
    "target",
    [
        params.TARGET,
        engine_options.TARGET,
        templates.TARGET,
        template_operations.TARGET,
        logs.TARGET,
        special_tokens.TARGET,
        gguf_counts.TARGET,
    ],
    ids=lambda target: target.name,
)
def test_no_input_escapes_the_project_errors(target: Target) -> None:
    _fuzz_test(target)()
