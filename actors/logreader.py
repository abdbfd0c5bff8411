"""Reading the engine's JSON-lines logs back: parsing, per-request rows, timelines, summaries.

Pure functions over lines of text; `q4k logs` does the I/O and the presentation. A line that is
not a JSON object with a string `event` and an ISO 8601 `timestamp` is counted as malformed and
skipped, never fatal: logs get truncated by crashes and interleaved by careless redirection.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

import msgspec
import numpy as np

from actors.errors import InvalidRequest

# How many malformed lines a summary quotes (all are counted).
MALFORMED_EXAMPLES = 5
# Longest excerpt of a malformed line kept for the report.
EXCERPT_CHARS = 80
# Deeper JSON than this is no engine event (they are flat); it would make views recurse.
MAX_NESTING = 32
# Counts past this are no real token counts (and break float arithmetic): not counted.
MAX_COUNT = 1 << 53
# Times every view can print: datetime's range, in UTC.
_EARLIEST = datetime(1, 1, 2, tzinfo=timezone.utc).timestamp()
_LATEST = datetime(9999, 12, 30, tzinfo=timezone.utc).timestamp()
# Keys every event has; a timeline shows the others.
_ENVELOPE_KEYS = frozenset({"event", "timestamp", "level", "request_id", "logger_name"})
_TERMINAL_STATUS = {
    "request_finished": "finished",
    "request_cancelled": "cancelled",
    "request_failed": "failed",
    "request_rejected": "rejected",
}


class LogEvent(msgspec.Struct, frozen=True):
    """One well-formed log line."""

    event: str
    time: float  # seconds since the epoch, UTC
    level: str
    fields: dict[str, Any]  # the whole decoded object, envelope included
    source: str
    line: int

    @property
    def request_id(self) -> str | None:
        value = self.fields.get("request_id")
        return None if value is None else str(value)


class MalformedLine(msgspec.Struct, frozen=True):
    source: str
    line: int
    reason: str
    excerpt: str


class ParsedLog(msgspec.Struct, frozen=True):
    """Events of one or several sources, in time order (ties keep their input order)."""

    sources: tuple[str, ...]
    lines: int
    events: tuple[LogEvent, ...]
    malformed: tuple[MalformedLine, ...]


class Percentiles(msgspec.Struct, frozen=True):
    count: int
    p50: float
    p95: float
    p99: float


class RequestRow(msgspec.Struct, frozen=True):
    """What the log says about one request; fields it never logged stay None."""

    request_id: str
    status: str  # finished | cancelled | failed | rejected | running
    first_seen: str
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    decode_tokens_per_s: float | None = None
    total_ms: float | None = None
    error: str | None = None


class TimelineEntry(msgspec.Struct, frozen=True):
    offset_ms: float  # since the request's first event
    timestamp: str
    event: str
    level: str
    details: dict[str, Any]


class LogSummary(msgspec.Struct, frozen=True):
    sources: tuple[str, ...]
    lines: int
    events: int
    malformed: int
    malformed_examples: tuple[MalformedLine, ...]
    first_timestamp: str | None
    last_timestamp: str | None
    span_s: float
    models: tuple[str, ...]
    requests_seen: int
    admitted: int
    finished: int
    finish_reasons: dict[str, int]
    cancelled: int
    failed: int
    rejected: int
    rejection_reasons: dict[str, int]
    errors: dict[str, int]  # error message -> count, over failed and rejected requests
    error_events: int  # lines logged at level error or above
    notices: tuple[str, ...]
    prompt_tokens: int
    completion_tokens: int
    tokens_per_s: float | None  # completion tokens / wall span of the log, idle gaps included
    busy_s: float  # time at least one request was running (union of request intervals)
    busy_tokens_per_s: float | None  # completion tokens / busy_s: the rate while working
    ttft_ms: Percentiles | None
    per_token_latency_ms: Percentiles | None  # 1000 / decode_tokens_per_s, per request
    steps: int
    batch_sizes: dict[int, int]  # items per step -> number of steps
    mean_batch_size: float | None


def _timestamp_seconds(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None:  # the engine writes UTC; a naive stamp is read as UTC too
        moment = moment.replace(tzinfo=timezone.utc)
    try:
        seconds = moment.timestamp()
    except (OverflowError, ValueError):
        return None
    # Year 9999 with a negative offset is past year 9999 in UTC, where no view can print it.
    return seconds if _EARLIEST <= seconds <= _LATEST else None


def _nesting(value: Any) -> int:
    """How deeply `value` nests lists and dicts, counted without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth <= MAX_NESTING and isinstance(item, dict | list):
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_line(text: str, source: str, line: int) -> LogEvent | MalformedLine:
    """One line of a log, or why it is not one."""

    def malformed(reason: str) -> MalformedLine:
        excerpt = "".join(c if c.isprintable() else "\ufffd" for c in text.strip()[:EXCERPT_CHARS])
        return MalformedLine(source, line, reason, excerpt)

    try:
        obj = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return malformed("not JSON (truncated or garbage)")
    except RecursionError:
        return malformed(f"JSON nested deeper than {MAX_NESTING} levels")
    if not isinstance(obj, dict):
        return malformed("not a JSON object")
    # Counting brackets is C-speed: only a line with many of them is walked.
    if text.count("[") + text.count("{") > MAX_NESTING and _nesting(obj) > MAX_NESTING:
        return malformed(f"JSON nested deeper than {MAX_NESTING} levels")
    event = obj.get("event")
    if not isinstance(event, str) or not event:
        return malformed("no 'event' name")
    seconds = _timestamp_seconds(obj.get("timestamp"))
    if seconds is None:
        return malformed("no ISO 8601 'timestamp'")
    level = obj.get("level")
    return LogEvent(event, seconds, level if isinstance(level, str) else "info", obj, source, line)


def parse_log(sources: Iterable[tuple[str, Iterable[str]]]) -> ParsedLog:
    """Parse (name, lines) pairs; blank lines are skipped, not counted as malformed."""
    names: list[str] = []
    events: list[LogEvent] = []
    malformed: list[MalformedLine] = []
    total = 0
    for name, lines in sources:
        names.append(name)
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            total += 1
            parsed = parse_line(text, name, number)
            (events if isinstance(parsed, LogEvent) else malformed).append(parsed)
    events.sort(key=lambda e: e.time)
    return ParsedLog(tuple(names), total, tuple(events), tuple(malformed))


def iso(seconds: float) -> str:
    """An epoch time as the log writes it (ISO 8601, UTC, microseconds)."""
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def _number(value: Any) -> float | None:
    """A numeric field, or None when absent or not a finite number (bool is not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer too big for a float
        return None
    return number if math.isfinite(number) else None


def _count(value: Any) -> int | None:
    """A token count, or None when absent or not a count (negative, or past 2**53)."""
    number = _number(value)
    return int(number) if number is not None and 0 <= number <= MAX_COUNT else None


def percentiles(values: Sequence[float]) -> Percentiles | None:
    """p50/p95/p99 with numpy's default (linear) interpolation; None without data."""
    if not values:
        return None
    p50, p95, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 95, 99])
    return Percentiles(len(values), float(p50), float(p95), float(p99))


def request_rows(log: ParsedLog) -> list[RequestRow]:
    """One row per request id, in order of first appearance; the last terminal event wins."""
    rows: dict[str, dict[str, Any]] = {}
    for event in log.events:
        request_id = event.request_id
        if request_id is None:
            continue
        row = rows.setdefault(
            request_id,
            {"request_id": request_id, "status": "running", "first_seen": iso(event.time)},
        )
        fields = event.fields
        status = _TERMINAL_STATUS.get(event.event)
        if status is not None:
            row["status"] = status
        if event.event == "request_finished":
            reason = fields.get("finish_reason")
            row["finish_reason"] = str(reason) if reason is not None else None
            row["decode_tokens_per_s"] = _number(fields.get("decode_tokens_per_s"))
        if event.event in ("request_finished", "request_cancelled"):
            # A cancelled request logs its ttft_ms once a token came.
            row["ttft_ms"] = _number(fields.get("ttft_ms"))
        if event.event in ("request_failed", "request_rejected") and "error" in fields:
            row["error"] = str(fields["error"])
        if event.event == "prefill_finished":
            row["cached_tokens"] = _count(fields.get("cached_tokens"))
        # Later events repeat these counts with their final values.
        counts = {key: _count(fields.get(key)) for key in ("prompt_tokens", "completion_tokens")}
        row.update((key, value) for key, value in counts.items() if value is not None)
        if (total_ms := _number(fields.get("total_ms"))) is not None:
            row["total_ms"] = total_ms
    return [RequestRow(**row) for row in rows.values()]


def request_timeline(log: ParsedLog, request_id: str) -> tuple[str, list[TimelineEntry]]:
    """The events of one request (an exact id or a unique prefix of one): (full id, entries)."""
    ids = {e.request_id for e in log.events if e.request_id is not None}
    if request_id in ids:
        match = request_id
    else:
        candidates = sorted(i for i in ids if i.startswith(request_id))
        if len(candidates) != 1:
            problem = "matches no request" if not candidates else (
                f"is ambiguous ({', '.join(candidates[:5])}...)"
            )
            raise InvalidRequest(
                f"request id {request_id!r} {problem}; `q4k logs requests` lists them",
                field="request_id",
            )
        match = candidates[0]
    events = [e for e in log.events if e.request_id == match]
    start = events[0].time
    entries = [
        TimelineEntry(
            offset_ms=(e.time - start) * 1000.0,
            timestamp=iso(e.time),
            event=e.event,
            level=e.level,
            details={k: v for k, v in e.fields.items() if k not in _ENVELOPE_KEYS},
        )
        for e in events
    ]
    return match, entries


def _model_names(log: ParsedLog) -> tuple[str, ...]:
    names: dict[str, None] = {}  # ordered set
    for event in log.events:
        if event.event == "model_loaded":
            arch = event.fields.get("arch", "?")
            where = event.fields.get("path") or event.fields.get("model") or "?"
            backend = event.fields.get("backend", "?")
            names[f"{where} ({arch}, {backend})"] = None
    return tuple(names)


def summarize(log: ParsedLog) -> LogSummary:
    """Figures of a whole log: outcomes, errors, latency percentiles, throughput, batching."""
    by_event: dict[str, list[LogEvent]] = {}
    for event in log.events:
        by_event.setdefault(event.event, []).append(event)

    def fields_of(name: str) -> list[dict[str, Any]]:
        return [e.fields for e in by_event.get(name, [])]

    finished = fields_of("request_finished")
    cancelled = fields_of("request_cancelled")
    failed = fields_of("request_failed")
    rejected = fields_of("request_rejected")
    steps = fields_of("step")

    ttfts = [v for v in (_number(f.get("ttft_ms")) for f in finished) if v is not None]
    rates = [v for v in (_number(f.get("decode_tokens_per_s")) for f in finished) if v]
    per_token = [1000.0 / r for r in rates if r > 0]
    completion = sum(_count(f.get("completion_tokens")) or 0 for f in finished + cancelled)
    prompt = sum(_count(f.get("prompt_tokens")) or 0 for f in finished)
    span = log.events[-1].time - log.events[0].time if log.events else 0.0
    batch = Counter(c for c in (_count(f.get("items")) for f in steps) if c is not None)
    batch_total = sum(batch.values())
    errors = Counter(str(f["error"]) for f in failed + rejected if "error" in f)
    busy = busy_seconds(by_event.get("request_finished", []) + by_event.get("request_cancelled", []))
    notices = dict.fromkeys(str(f.get("message", "")) for f in fields_of("notice"))

    return LogSummary(
        sources=log.sources,
        lines=log.lines,
        events=len(log.events),
        malformed=len(log.malformed),
        malformed_examples=log.malformed[:MALFORMED_EXAMPLES],
        first_timestamp=iso(log.events[0].time) if log.events else None,
        last_timestamp=iso(log.events[-1].time) if log.events else None,
        span_s=span,
        models=_model_names(log),
        requests_seen=len({e.request_id for e in log.events if e.request_id is not None}),
        admitted=len(by_event.get("request_admitted", [])),
        finished=len(finished),
        finish_reasons=dict(Counter(str(f.get("finish_reason")) for f in finished)),
        cancelled=len(cancelled),
        failed=len(failed),
        rejected=len(rejected),
        rejection_reasons=dict(Counter(str(f.get("reason")) for f in rejected)),
        errors=dict(errors.most_common()),
        error_events=sum(e.level in ("error", "critical") for e in log.events),
        notices=tuple(notices),
        prompt_tokens=prompt,
        completion_tokens=completion,
        tokens_per_s=completion / span if span > 0 else None,
        busy_s=busy,
        busy_tokens_per_s=completion / busy if busy > 0 else None,
        ttft_ms=percentiles(ttfts),
        per_token_latency_ms=percentiles(per_token),
        steps=len(steps),
        batch_sizes=dict(sorted(batch.items())),
        mean_batch_size=(sum(k * v for k, v in batch.items()) / batch_total) if batch_total else None,
    )


def busy_seconds(ended: Sequence[LogEvent]) -> float:
    """Seconds at least one of these requests was running: the union of the intervals
    [end - total_ms, end] of their finish or cancel events, so idle gaps do not count."""
    intervals = [
        (event.time - total / 1000.0, event.time)
        for event in ended
        if (total := _number(event.fields.get("total_ms"))) is not None and total >= 0
    ]
    if not intervals:
        return 0.0
    starts, ends = np.array(intervals, dtype=np.float64)[np.argsort([i[0] for i in intervals])].T
    reach = np.maximum.accumulate(ends)
    covered_before = np.concatenate(([-np.inf], reach[:-1]))
    # Each interval adds what it covers past everything that started before it.
    return float(np.maximum(reach - np.maximum(starts, covered_before), 0.0).sum())


def format_event(event: LogEvent) -> str:
    """One human-readable line for `q4k logs tail`: time, level, event, then key=value pairs."""
    clock = datetime.fromtimestamp(event.time, timezone.utc).strftime("%H:%M:%S.%f")[:-3]
    pairs = [
        f"{k}={format_value(v)}" for k, v in event.fields.items() if k not in _ENVELOPE_KEYS
    ]
    request = f"[{event.request_id}] " if event.request_id is not None else ""
    return f"{clock} {event.level:<7} {event.event:<18} {request}{' '.join(pairs)}".rstrip()


def format_value(value: Any) -> str:
    """A field value for a one-line display: floats to 4 significant digits, no spaces unquoted."""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    return text if " " not in text else repr(text)


class TimeSeries(msgspec.Struct, frozen=True):
    """What `--plot` draws: per-request latency at finish time, throughput per time bin."""

    finish_s: list[float]  # seconds since the log's first event
    ttft_ms: list[float]
    per_token_ms: list[float]
    bin_start_s: list[float]
    tokens_per_s: list[float]


def time_series(log: ParsedLog, bins: int = 60) -> TimeSeries:
    """Latency per finished request, and generated tokens/s over time: each request's completion
    tokens are spread evenly over its decode interval (after its first token), then binned."""
    if not log.events:
        return TimeSeries([], [], [], [], [])
    origin = log.events[0].time
    end = log.events[-1].time - origin
    finished = [e for e in log.events if e.event == "request_finished"]
    stats = np.array(
        [
            [
                e.time - origin,
                _number(e.fields.get("ttft_ms")) or np.nan,
                _number(e.fields.get("decode_tokens_per_s")) or np.nan,
                _number(e.fields.get("total_ms")) or np.nan,
                _count(e.fields.get("completion_tokens")) or 0,
            ]
            for e in finished
        ],
        dtype=np.float64,
    ).reshape(-1, 5)
    finish, ttft, rate, total, tokens = stats.T
    with np.errstate(divide="ignore", invalid="ignore"):
        per_token = np.where(rate > 0, 1000.0 / rate, np.nan)
    decode_start = finish - (np.nan_to_num(total) - np.nan_to_num(ttft)) / 1000.0
    width = max(end, 1e-3) / bins
    edges = np.arange(bins + 1) * width
    overlap = np.clip(
        np.minimum(finish[:, None], edges[None, 1:]) - np.maximum(decode_start[:, None], edges[None, :-1]),
        0.0,
        None,
    )
    duration = np.maximum(finish - decode_start, 1e-9)
    # A request with no decode interval (one token) lands whole in the bin it finished in.
    point = np.zeros_like(overlap)
    point[np.arange(len(finish)), np.clip((finish / width).astype(int), 0, bins - 1)] = 1.0
    share = np.where((finish - decode_start > 0)[:, None], overlap / duration[:, None], point)
    per_bin = (share * tokens[:, None]).sum(axis=0) / width
    return TimeSeries(
        finish_s=finish.tolist(),
        ttft_ms=ttft.tolist(),
        per_token_ms=per_token.tolist(),
        bin_start_s=edges[:-1].tolist(),
        tokens_per_s=per_bin.tolist(),
    )
