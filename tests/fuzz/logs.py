"""Hostile log files for `q4k logs`: engine events with fields of every wrong kind (numbers
past float range, negative counts, deep nesting), timestamps at and past datetime's range,
garbage lines. Every view must go on: bad lines are counted as malformed, never fatal."""

from __future__ import annotations

import json

import msgspec
from hypothesis import strategies as st

from actors.errors import InvalidRequest
from actors.logreader import (
    format_event,
    parse_log,
    request_rows,
    request_timeline,
    summarize,
    time_series,
)
from tests.fuzz.target import Target, only_project_errors

EVENTS = ("request_admitted", "prefill_finished", "request_finished", "request_cancelled",
          "request_failed", "request_rejected", "step", "notice", "model_loaded",
          "engine_started")  # fmt: skip
FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens", "ttft_ms", "total_ms",
          "decode_tokens_per_s", "items", "ms", "finish_reason", "error", "reason", "message")  # fmt: skip

timestamps = st.one_of(
    st.datetimes(timezones=st.timezones()).map(lambda moment: moment.isoformat()),
    st.sampled_from(["9999-12-31T23:00:00-05:00", "0001-01-01T00:00:00+05:00", "2026-13-01",
                     "2026-01-01T00:00:00Z", "", "yesterday", "2026-01-01T00:00:00+99:00"]),
    st.integers(),
)  # fmt: skip
numbers = st.one_of(
    st.integers(-5, 10**6),
    st.floats(),
    st.sampled_from([1e308, -1e308, 2**80]),
    st.just(400).map(lambda digits: 10**digits),  # (built late: its repr is long)
)


def _nested(depth: int) -> object:
    return json.loads("[" * depth + "]" * depth)


values = st.one_of(
    numbers,
    st.text(max_size=12),
    st.booleans(),
    st.none(),
    st.integers(1, 200).map(_nested),
    st.dictionaries(st.text(max_size=3), numbers, max_size=2),
)
events = st.fixed_dictionaries(
    {"event": st.one_of(st.sampled_from(EVENTS), st.text(max_size=5)), "timestamp": timestamps},
    optional={
        "request_id": st.one_of(st.sampled_from(["a", "b", "c"]), values),
        "level": st.one_of(st.sampled_from(["info", "error", "debug"]), values),
        **{field: values for field in FIELDS},
    },
)


def _line(event: dict) -> str:
    return json.dumps(event, allow_nan=True)


lines = st.one_of(
    events.map(_line),
    events.map(_line).map(lambda text: text[: len(text) // 2]),  # cut mid-write
    st.integers(0, 3000).map(lambda depth: "[" * depth + "]" * depth),
    st.integers(0, 3000).map(lambda depth: '{"a":' * depth + "1" + "}" * depth),
    st.text(max_size=40),
)
cases = st.lists(lines, min_size=1, max_size=40)


def check(log_lines: list[str]) -> str:
    with only_project_errors(log_lines) as outcome:
        log = parse_log([("fuzzed", log_lines)])
        msgspec.json.encode(summarize(log))
        msgspec.json.encode(request_rows(log))
        time_series(log)
        for event in log.events:
            format_event(event)
        for row in request_rows(log)[:3]:
            try:
                request_timeline(log, row.request_id)
            except InvalidRequest:
                pass  # an id that is a prefix of another is ambiguous by design
    return outcome[0]


TARGET = Target("log files (q4k logs)", cases, check)
