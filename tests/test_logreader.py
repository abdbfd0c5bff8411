"""actors.logreader over synthetic logs written to the agreed schema, checked against a recount
done independently from the raw lines."""

from __future__ import annotations

import json
import math
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

from actors.errors import InvalidRequest
from actors.logreader import (
    format_event,
    parse_line,
    parse_log,
    request_rows,
    request_timeline,
    summarize,
    time_series,
)

START = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
GARBAGE = [
    '{"event": "request_finished", "timestamp": "2026-01-02T03:0',  # truncated mid-write
    "\x00\x01binary junk\xff",
    "[1, 2, 3]",
    '{"timestamp": "2026-01-02T03:04:05Z", "level": "info"}',  # no event
    '{"event": "step", "timestamp": "yesterday", "items": 3}',  # bad timestamp
]


def _stamp(t: float) -> str:
    return (START + timedelta(seconds=t)).isoformat().replace("+00:00", "Z")


def synthetic_log_lines(requests: int = 40, seed: int = 0, *, garbage: bool = False) -> list[str]:
    """A plausible engine log: startup, admitted requests with every outcome, debug steps,
    notices; optionally with malformed lines mixed in."""
    rng = random.Random(seed)
    events: list[tuple[float, dict]] = [
        (0.0, {"event": "engine_started", "level": "info", "backend": "cpu", "model": "m.gguf",
               "arch": "llama"}),
        (0.01, {"event": "model_loaded", "level": "info", "arch": "llama", "backend": "cpu",
                "quant_mix": {"Q4_K": 10, "F32": 3}, "load_ms": 12.5, "path": "m.gguf"}),
        (0.02, {"event": "notice", "level": "warning", "message": "no GPU: running on the CPU"}),
    ]
    for i in range(requests):
        rid = f"req-{i:04d}"
        t0 = 0.1 + i * 0.05 + rng.random() * 0.02
        prompt = rng.randint(3, 200)
        outcome = rng.choice(["stop", "stop", "length", "context", "cancelled", "failed",
                              "overloaded", "context_length"])
        if outcome in ("overloaded", "context_length"):
            events.append((t0, {"event": "request_rejected", "level": "warning",
                                "request_id": rid, "reason": outcome,
                                "error": f"{outcome} error text"}))
            continue
        events.append((t0, {"event": "request_admitted", "level": "info", "request_id": rid,
                            "prompt_tokens": prompt, "max_tokens": 64}))
        prefill_ms = rng.uniform(5, 80)
        events.append((t0 + prefill_ms / 1000, {
            "event": "prefill_finished", "level": "info", "request_id": rid,
            "prompt_tokens": prompt, "cached_tokens": rng.randint(0, prompt), "ms": prefill_ms}))
        tokens = rng.randint(1, 64)
        rate = rng.uniform(5, 60)
        total_ms = prefill_ms + 1000 * tokens / rate
        t1 = t0 + total_ms / 1000
        if outcome == "cancelled":
            events.append((t1, {"event": "request_cancelled", "level": "info", "request_id": rid,
                                "completion_tokens": tokens, "ttft_ms": prefill_ms,
                                "total_ms": total_ms}))
        elif outcome == "failed":
            events.append((t1, {"event": "request_failed", "level": "error", "request_id": rid,
                                "error": "ComputeError: step failed twice"}))
        else:
            events.append((t1, {
                "event": "request_finished", "level": "info", "request_id": rid,
                "finish_reason": outcome, "prompt_tokens": prompt, "completion_tokens": tokens,
                "ttft_ms": prefill_ms, "decode_tokens_per_s": rate, "total_ms": total_ms}))
    for step in range(requests * 3):
        items = rng.choice([1, 1, 2, 3, 4, 7, 8, 16, 17])
        events.append((0.1 + step * 0.017, {
            "event": "step", "level": "debug", "step": step, "items": items,
            "decode_items": items - 1, "prefill_items": 1, "tokens": items + 10, "ms": 12.0}))
    lines = [
        json.dumps({"event": e["event"], "timestamp": _stamp(t), **e}) for t, e in events
    ]
    rng.shuffle(lines)  # several writers, out of order: the reader sorts by time
    if garbage:
        for text in GARBAGE:
            lines.insert(rng.randrange(len(lines)), text)
        lines.append(lines[-1][: len(lines[-1]) // 2])  # crash while writing the last line
    return lines


def write_synthetic_log(path: Path, **kwargs) -> list[str]:
    lines = synthetic_log_lines(**kwargs)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogateescape")
    return lines


def recount(lines: list[str]) -> dict:
    """The summary figures, computed straight from the raw lines with the json module."""
    objs, bad = [], 0
    for text in lines:
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
            assert isinstance(obj, dict) and isinstance(obj.get("event"), str)
            datetime.fromisoformat(obj["timestamp"])
        except (ValueError, AssertionError, KeyError, TypeError):
            bad += 1
            continue
        objs.append(obj)
    times = [datetime.fromisoformat(o["timestamp"]).timestamp() for o in objs]
    finished = [o for o in objs if o["event"] == "request_finished"]
    generated = sum(o["completion_tokens"] for o in objs
                    if o["event"] in ("request_finished", "request_cancelled"))
    steps = [o["items"] for o in objs if o["event"] == "step"]
    ended = sorted(
        (datetime.fromisoformat(o["timestamp"]).timestamp() - o["total_ms"] / 1000,
         datetime.fromisoformat(o["timestamp"]).timestamp())
        for o in objs if o["event"] in ("request_finished", "request_cancelled")
    )
    busy, reach = 0.0, -math.inf  # merge the sorted intervals one by one
    for start, end in ended:
        busy += max(0.0, end - max(start, reach)) if end > reach else 0.0
        reach = max(reach, end)
    return {
        "malformed": bad,
        "events": len(objs),
        "finished": len(finished),
        "finish_reasons": {r: sum(o["finish_reason"] == r for o in finished)
                           for r in {o["finish_reason"] for o in finished}},
        "cancelled": sum(o["event"] == "request_cancelled" for o in objs),
        "failed": sum(o["event"] == "request_failed" for o in objs),
        "rejected": sum(o["event"] == "request_rejected" for o in objs),
        "admitted": sum(o["event"] == "request_admitted" for o in objs),
        "ttft": np.percentile([o["ttft_ms"] for o in finished], [50, 95, 99]),
        "per_token": np.percentile([1000 / o["decode_tokens_per_s"] for o in finished],
                                   [50, 95, 99]),
        "tokens_per_s": generated / (max(times) - min(times)),
        "busy_s": busy,
        "busy_tokens_per_s": generated / busy,
        "batch_sizes": {k: steps.count(k) for k in set(steps)},
        "mean_batch": sum(steps) / len(steps) if steps else None,
    }


@pytest.mark.parametrize("garbage", [False, True])
def test_summary_agrees_with_a_recount_from_raw_lines(garbage: bool) -> None:
    lines = synthetic_log_lines(60, seed=3, garbage=garbage)
    summary = summarize(parse_log([("synthetic", lines)]))
    expected = recount(lines)
    assert summary.malformed == expected["malformed"] == (len(GARBAGE) + 1 if garbage else 0)
    assert summary.lines == len(lines)
    assert summary.events == expected["events"]
    assert summary.finished == expected["finished"]
    assert summary.finish_reasons == expected["finish_reasons"]
    assert (summary.cancelled, summary.failed, summary.rejected, summary.admitted) == (
        expected["cancelled"], expected["failed"], expected["rejected"], expected["admitted"])
    assert summary.rejected == sum(summary.rejection_reasons.values())
    ttft = summary.ttft_ms
    assert ttft is not None and ttft.count == expected["finished"]
    np.testing.assert_allclose([ttft.p50, ttft.p95, ttft.p99], expected["ttft"], rtol=1e-9)
    per_token = summary.per_token_latency_ms
    assert per_token is not None
    np.testing.assert_allclose([per_token.p50, per_token.p95, per_token.p99],
                               expected["per_token"], rtol=1e-9)
    # Timestamps are microseconds, so the span is exact to about 1e-6 s.
    assert summary.tokens_per_s == pytest.approx(expected["tokens_per_s"], rel=1e-6)
    assert summary.busy_s == pytest.approx(expected["busy_s"], rel=1e-6)
    assert summary.busy_tokens_per_s == pytest.approx(expected["busy_tokens_per_s"], rel=1e-6)
    assert summary.batch_sizes == expected["batch_sizes"]
    assert summary.mean_batch_size == pytest.approx(expected["mean_batch"])
    assert summary.errors["ComputeError: step failed twice"] == expected["failed"]
    assert summary.error_events == expected["failed"]
    assert summary.notices == ("no GPU: running on the CPU",)
    assert summary.models == ("m.gguf (llama, cpu)",)


def test_malformed_lines_are_reported_with_where_and_why() -> None:
    lines = ["", *GARBAGE, "   "]
    log = parse_log([("bad.log", lines)])
    assert log.events == ()
    assert [m.line for m in log.malformed] == [2, 3, 4, 5, 6]
    reasons = [m.reason for m in log.malformed]
    assert reasons == ["not JSON (truncated or garbage)", "not JSON (truncated or garbage)",
                       "not a JSON object", "no 'event' name", "no ISO 8601 'timestamp'"]
    summary = summarize(log)
    assert (summary.lines, summary.malformed, summary.span_s, summary.tokens_per_s) == (5, 5, 0, None)
    assert summary.ttft_ms is None and summary.mean_batch_size is None


def test_fields_of_the_wrong_type_are_ignored_not_fatal() -> None:
    line = json.dumps({"event": "request_finished", "timestamp": _stamp(0), "request_id": 7,
                       "ttft_ms": "fast", "decode_tokens_per_s": True, "completion_tokens": None})
    log = parse_log([("odd", [line])])
    summary = summarize(log)
    assert summary.finished == 1 and summary.ttft_ms is None and summary.completion_tokens == 0
    (row,) = request_rows(log)
    assert row.request_id == "7" and row.status == "finished" and row.ttft_ms is None
    huge = ('{"event": "request_finished", "timestamp": "2026-01-02T03:04:05Z", "ttft_ms": 1'
            + "0" * 400 + ', "completion_tokens": 1e999}')
    summary = summarize(parse_log([("huge", [huge])]))
    assert summary.ttft_ms is None and summary.completion_tokens == 0


def test_request_rows_one_per_request_with_the_last_outcome() -> None:
    lines = synthetic_log_lines(30, seed=5)
    log = parse_log([("synthetic", lines)])
    rows = {r.request_id: r for r in request_rows(log)}
    objs = [json.loads(t) for t in lines]
    ids = {o["request_id"] for o in objs if "request_id" in o}
    assert set(rows) == ids
    for o in objs:
        row = rows.get(o.get("request_id"))
        if o["event"] == "request_finished":
            assert row.status == "finished" and row.finish_reason == o["finish_reason"]
            assert row.completion_tokens == o["completion_tokens"]
            assert row.ttft_ms == o["ttft_ms"] and row.total_ms == o["total_ms"]
        elif o["event"] == "request_rejected":
            assert row.status == "rejected" and row.error == o["error"]
        elif o["event"] == "request_cancelled":
            assert row.status == "cancelled" and row.completion_tokens == o["completion_tokens"]
            assert row.ttft_ms == o["ttft_ms"]  # it produced tokens, so it has one
        elif o["event"] == "request_failed":
            assert row.status == "failed" and row.error == o["error"]
        elif o["event"] == "prefill_finished":
            assert row.cached_tokens == o["cached_tokens"]


def test_request_timeline_by_id_and_unique_prefix() -> None:
    log = parse_log([("synthetic", synthetic_log_lines(30, seed=5))])
    full, entries = request_timeline(log, "req-0002")
    assert full == "req-0002"
    assert entries[0].offset_ms == 0.0
    assert [e.offset_ms for e in entries] == sorted(e.offset_ms for e in entries)
    assert all("request_id" not in e.details for e in entries)
    with pytest.raises(InvalidRequest, match="matches no request"):
        request_timeline(log, "nope")
    with pytest.raises(InvalidRequest, match="ambiguous"):
        request_timeline(log, "req-00")


def test_request_timeline_accepts_a_unique_prefix() -> None:
    lines = [json.dumps({"event": e, "timestamp": _stamp(t), "request_id": rid})
             for t, e, rid in [(0, "request_admitted", "alpha-1"), (1, "request_admitted", "beta"),
                               (2.5, "request_finished", "alpha-1")]]
    full, entries = request_timeline(parse_log([("x", lines)]), "alp")
    assert full == "alpha-1"
    assert [(e.event, e.offset_ms) for e in entries] == [
        ("request_admitted", 0.0), ("request_finished", 2500.0)]


def test_format_event_is_one_readable_line() -> None:
    line = json.dumps({"event": "request_finished", "timestamp": "2026-01-02T03:04:05.678901Z",
                       "level": "info", "request_id": "abc", "finish_reason": "stop",
                       "ttft_ms": 12.3456, "error": "two words"})
    event = parse_line(line, "x", 1)
    text = format_event(event)
    assert text.startswith("03:04:05.678 info    request_finished")
    assert "[abc]" in text and "finish_reason=stop" in text and "ttft_ms=12.35" in text
    assert "error='two words'" in text and "\n" not in text


def test_time_series_conserves_generated_tokens() -> None:
    lines = synthetic_log_lines(40, seed=9)
    log = parse_log([("synthetic", lines)])
    series = time_series(log, bins=30)
    finished = [json.loads(t) for t in lines if '"request_finished"' in t]
    assert len(series.finish_s) == len(finished)
    width = series.bin_start_s[1] - series.bin_start_s[0]
    generated = sum(series.tokens_per_s) * width
    assert generated == pytest.approx(sum(o["completion_tokens"] for o in finished))
    assert time_series(parse_log([("empty", [])])).tokens_per_s == []


def test_the_busy_rate_leaves_idle_gaps_out() -> None:
    """Two 1-second requests an hour apart: 20 tokens in 2 busy seconds, not in an hour."""

    def finished(at: float) -> str:
        return json.dumps({"event": "request_finished", "timestamp": _stamp(at), "request_id":
                           f"r{at}", "completion_tokens": 10, "total_ms": 1000.0})

    summary = summarize(parse_log([("gaps", [finished(1.0), finished(3601.0)])]))
    assert summary.busy_s == pytest.approx(2.0)
    assert summary.busy_tokens_per_s == pytest.approx(10.0)
    assert summary.tokens_per_s == pytest.approx(20 / 3600)


HOSTILE_LINES = {
    "1,000 nested brackets": "[" * 1000 + "]" * 1000,
    "a deep value in an event": json.dumps(
        {"event": "step", "timestamp": _stamp(1), "x": json.loads("[" * 200 + "]" * 200)}),
    "year 9999 with a negative offset": json.dumps(
        {"event": "step", "timestamp": "9999-12-31T23:00:00-05:00"}),
    "year 1 with a positive offset": json.dumps(
        {"event": "step", "timestamp": "0001-01-01T00:00:00+05:00"}),
}


def test_hostile_lines_are_malformed_and_every_view_goes_on() -> None:
    good = synthetic_log_lines(10, seed=9)
    huge_counts = json.dumps({"event": "request_finished", "timestamp": _stamp(2),
                              "request_id": "huge", "completion_tokens": 1e308,
                              "prompt_tokens": -5, "total_ms": 1e308, "ttft_ms": 1e308})
    log = parse_log([("hostile", [*good, *HOSTILE_LINES.values(), huge_counts])])
    assert len(log.malformed) == len(HOSTILE_LINES)
    assert all("nested" in m.reason or "timestamp" in m.reason for m in log.malformed)
    summary = summarize(log)
    assert summary.completion_tokens == summarize(parse_log([("good", good)])).completion_tokens
    rows = {row.request_id: row for row in request_rows(log)}
    assert rows["huge"].completion_tokens is None and rows["huge"].prompt_tokens is None
    request_timeline(log, "huge")
    time_series(log)
    for event in log.events:
        format_event(event)
