"""The soak run, tiny: the tiny model, 60 requests in two bursts against max_sequences=2,
max_queued=3 and a 24-block KV pool, with cancellations and deadlines. Every request is accounted for, none
fails, nothing is held afterwards and the reference greedy answer is unchanged."""

from __future__ import annotations

import pytest

from actors import Engine
from actors.soak import SoakPlan, soak
from tests.conftest import TINY_MODELS

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def test_a_small_soak_leaves_nothing_held_and_the_reference_exact() -> None:
    # Each wave arrives at once: exactly max_sequences + max_queued of its 30 get in.
    plan = SoakPlan(requests=60, waves=2, arrival_s=0.0, max_prompt_tokens=40, max_new_tokens=12)
    async with Engine.open(
        TINY_MODELS["llama-q4k-tiny"], max_sequences=2, max_queued=3, kv_blocks=24, log_level="error"
    ) as engine:
        report = await soak(engine, plan)
    assert report.requests == 60
    assert report.completed + report.rejected + report.cancelled + report.failed == 60
    assert report.failed == 0, report.failures
    assert report.completed + report.cancelled == 2 * (2 + 3)
    assert report.rejected == 60 - 2 * (2 + 3)
    assert report.leaked == {"running": 0, "waiting": 0, "kv_blocks_used": 0}
    assert report.reference_exact
    assert report.peak_rss_mib > 0
