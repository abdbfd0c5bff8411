"""`GET /metrics`: the server's counters and the engine's load in Prometheus' text format."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from actors.errors import (
    EngineClosed,
    EngineOverloaded,
    InvalidRequest,
    Q4KError,
    TemplateError,
)
from actors.messages import EngineStats, Usage

# How a generation request ended; every outcome is always exported, so its series exists at 0.
OUTCOMES = ("stop", "length", "cancelled", "invalid", "overloaded", "failed", "unavailable")
_OUTCOME_OF_ERROR = (
    (InvalidRequest, "invalid"),
    (TemplateError, "invalid"),
    (EngineOverloaded, "overloaded"),
    (EngineClosed, "unavailable"),
)


def outcome_of(error: Q4KError) -> str:
    """The outcome a request that raised `error` counts under ("failed": a compute error)."""
    return next((name for kind, name in _OUTCOME_OF_ERROR if isinstance(error, kind)), "failed")


class Metrics:
    """Counts what requests did; `render` adds a snapshot of the engine."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0

    def count(self, outcome: str, usage: Usage | None = None) -> None:
        self.requests[outcome] += 1
        if usage is not None:
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.cached_tokens
            self.completion_tokens += usage.completion_tokens

    def render(self, stats: EngineStats | None) -> str:
        """Prometheus text exposition (version 0.0.4); engine figures only once it is loaded."""
        return "".join(f"{line}\n" for line in self._lines(stats))

    def _lines(self, stats: EngineStats | None) -> Iterator[str]:
        yield from _family("q4k_requests_total", "counter",
                           "Generation requests by how they ended.",
                           [(f'{{outcome="{o}"}}', self.requests[o]) for o in OUTCOMES])
        yield from _family("q4k_prompt_tokens_total", "counter",
                           "Prompt tokens of finished requests.", [("", self.prompt_tokens)])
        yield from _family("q4k_cached_prompt_tokens_total", "counter",
                           "Prompt tokens served from the prefix cache.", [("", self.cached_tokens)])
        yield from _family("q4k_completion_tokens_total", "counter",
                           "Tokens generated for finished requests.", [("", self.completion_tokens)])
        yield from _family("q4k_model_loaded", "gauge", "1 once the model is loaded.",
                           [("", int(stats is not None))])
        if stats is None:
            return
        yield from _family("q4k_requests_running", "gauge",
                           "Sequences in the running batch.", [("", stats.running)])
        yield from _family("q4k_requests_waiting", "gauge",
                           "Sequences queued for admission.", [("", stats.waiting)])
        yield from _family("q4k_kv_blocks", "gauge", "KV cache blocks by state.", [
            ('{state="used"}', stats.kv_blocks_used),
            ('{state="free"}', stats.kv_blocks_free),
            ('{state="cached"}', stats.kv_blocks_cached),
        ])
        yield from _family("q4k_steps_total", "counter", "Forward steps run.", [("", stats.steps)])
        yield from _family("q4k_step_tokens_total", "counter",
                           "Tokens run through forward steps (prefill and decode).",
                           [("", stats.tokens)])
        yield from _family("q4k_last_step_seconds", "gauge",
                           "Wall time of the latest forward step.", [("", stats.last_step_s)])


def _family(name: str, kind: str, help_text: str,
            samples: list[tuple[str, float]]) -> Iterator[str]:
    yield f"# HELP {name} {help_text}"
    yield f"# TYPE {name} {kind}"
    for labels, value in samples:
        yield f"{name}{labels} {value}"
