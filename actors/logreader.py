"""Reading the engine's JSON-lines logs back: parsing, per-request rows, timelines, summaries.

Pure functions over lines of text; `q4k logs` does the I/O and the presentation. A line that is
not a JSON object with a string `event` and an ISO 8601 `timestamp` is counted as malformed and
skipped, never fatal: logs get truncated by crashes and interleaved by careless redirection.
"""

from __future__ import annotations

import math
from array import array
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
# A summary keeps at most this many distinct texts of one kind (errors, reasons, models,
# notices), each cut to TEXT_CHARS; the rest are counted under _OTHER_TEXTS.
MAX_DISTINCT = 1000
TEXT_CHARS = 500
_OTHER_TEXTS = "(other texts, past the first 1,000)"
_TEXT_KINDS = ("finish_reasons", "rejection_reasons", "errors", "notices", "models")
# A field value shown on one line (tail, a timeline) is cut to this many characters.
VALUE_CHARS = 300
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
    return gather_log(
        (name, (parse_line(text, name, number)
                for number, text in enumerate(lines, start=1) if text.strip()))
        for name, lines in sources
    )  # fmt: skip


def gather_log(
    sources: Iterable[tuple[str, Iterable[LogEvent | MalformedLine]]],
) -> ParsedLog:
    """(name, parsed lines) pairs as one log, its events in time order."""
    names: list[str] = []
    events: list[LogEvent] = []
    malformed: list[MalformedLine] = []
    for name, parsed_lines in sources:
        names.append(name)
        for parsed in parsed_lines:
            (events if isinstance(parsed, LogEvent) else malformed).append(parsed)
    events.sort(key=lambda e: e.time)
    return ParsedLog(tuple(names), len(events) + len(malformed), tuple(events), tuple(malformed))


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


def percentiles(values: Sequence[float] | array) -> Percentiles | None:
    """p50/p95/p99 with numpy's default (linear) interpolation; None without data."""
    if not len(values):
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


class SummaryBuilder:
    """The figures of `summarize`, gathered one event at a time: `q4k logs summary` streams a
    log of any length through it without keeping its events. It keeps counts, a few numbers
    per request (latencies, busy intervals, an 8-byte hash of each id) and at most
    `MAX_DISTINCT` texts of at most `TEXT_CHARS` characters per kind (errors, reasons,
    models, notices): a log of a million distinct 50 MB error messages costs what one does."""

    def __init__(self, sources: Sequence[str] = ()) -> None:
        self.sources = tuple(sources)
        self.lines = 0
        self.events = 0
        self.malformed = 0
        self.malformed_examples: list[MalformedLine] = []
        self.first = math.inf
        self.last = -math.inf
        self.request_hashes = array("q")
        self.counts: Counter[str] = Counter()
        self.error_events = 0
        self.texts: dict[str, Counter[str]] = {kind: Counter() for kind in _TEXT_KINDS}
        self.ttfts = array("d")
        self.per_token = array("d")
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.busy_starts = array("d")
        self.busy_ends = array("d")
        self.batch: Counter[int] = Counter()

    def add_source(self, name: str) -> None:
        self.sources += (name,)

    def add(self, parsed: LogEvent | MalformedLine) -> None:
        """One non-blank line, parsed."""
        self.lines += 1
        if isinstance(parsed, MalformedLine):
            self.malformed += 1
            if len(self.malformed_examples) < MALFORMED_EXAMPLES:
                self.malformed_examples.append(parsed)
            return
        self.events += 1
        self.first = min(self.first, parsed.time)
        self.last = max(self.last, parsed.time)
        if parsed.request_id is not None:
            self.request_hashes.append(hash(parsed.request_id))
        self.error_events += parsed.level in ("error", "critical")
        self.counts[parsed.event] += 1
        self._add_fields(parsed)

    def _add_fields(self, event: LogEvent) -> None:
        fields = event.fields
        name = event.event
        if name == "request_finished":
            self._note("finish_reasons", str(fields.get("finish_reason")))
            if (ttft := _number(fields.get("ttft_ms"))) is not None:
                self.ttfts.append(ttft)
            if (rate := _number(fields.get("decode_tokens_per_s"))) and rate > 0:
                self.per_token.append(1000.0 / rate)
            self.prompt_tokens += _count(fields.get("prompt_tokens")) or 0
        if name in ("request_finished", "request_cancelled"):
            self.completion_tokens += _count(fields.get("completion_tokens")) or 0
            total = _number(fields.get("total_ms"))
            if total is not None and total >= 0:
                self.busy_starts.append(event.time - total / 1000.0)
                self.busy_ends.append(event.time)
        if name in ("request_failed", "request_rejected") and "error" in fields:
            self._note("errors", str(fields["error"]))
        if name == "request_rejected":
            self._note("rejection_reasons", str(fields.get("reason")))
        if name == "notice":
            self._note("notices", str(fields.get("message", "")))
        if name == "model_loaded":
            where = fields.get("path") or fields.get("model") or "?"
            arch, backend = fields.get("arch", "?"), fields.get("backend", "?")
            self._note("models", f"{where} ({arch}, {backend})")
        if name == "step" and (items := _count(fields.get("items"))) is not None:
            self.batch[items] += 1

    def _note(self, kind: str, text: str) -> None:
        counter = self.texts[kind]
        key = clip(text, TEXT_CHARS)
        if key in counter or len(counter) < MAX_DISTINCT:
            counter[key] += 1
        else:
            counter[_OTHER_TEXTS] += 1

    def summary(self) -> LogSummary:
        has_events = self.events > 0
        span = self.last - self.first if has_events else 0.0
        busy = _union_seconds(np.frombuffer(self.busy_starts, np.float64),
                              np.frombuffer(self.busy_ends, np.float64))
        completion = self.completion_tokens
        batch_total = sum(self.batch.values())
        finished = self.counts["request_finished"]
        return LogSummary(
            sources=self.sources,
            lines=self.lines,
            events=self.events,
            malformed=self.malformed,
            malformed_examples=tuple(self.malformed_examples),
            first_timestamp=iso(self.first) if has_events else None,
            last_timestamp=iso(self.last) if has_events else None,
            span_s=span,
            models=tuple(self.texts["models"]),
            requests_seen=int(np.unique(np.frombuffer(self.request_hashes, np.int64)).size),
            admitted=self.counts["request_admitted"],
            finished=finished,
            finish_reasons=dict(self.texts["finish_reasons"]),
            cancelled=self.counts["request_cancelled"],
            failed=self.counts["request_failed"],
            rejected=self.counts["request_rejected"],
            rejection_reasons=dict(self.texts["rejection_reasons"]),
            errors=dict(self.texts["errors"].most_common()),
            error_events=self.error_events,
            notices=tuple(self.texts["notices"]),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            tokens_per_s=completion / span if span > 0 else None,
            busy_s=busy,
            busy_tokens_per_s=completion / busy if busy > 0 else None,
            ttft_ms=percentiles(self.ttfts),
            per_token_latency_ms=percentiles(self.per_token),
            steps=self.counts["step"],
            batch_sizes=dict(sorted(self.batch.items())),
            mean_batch_size=(
                sum(k * v for k, v in self.batch.items()) / batch_total if batch_total else None
            ),
        )


def summarize(log: ParsedLog) -> LogSummary:
    """Figures of a whole log: outcomes, errors, latency percentiles, throughput, batching."""
    builder = SummaryBuilder(log.sources)
    for item in (*log.events, *log.malformed):
        builder.add(item)
    return builder.summary()


def clip(text: str, chars: int) -> str:
    """`text` cut to `chars` characters, the cut marked."""
    return text if len(text) <= chars else text[: chars - 1] + "\u2026"


def _union_seconds(starts: np.ndarray, ends: np.ndarray) -> float:
    """The length of the union of the intervals [starts[i], ends[i]]."""
    if not starts.size:
        return 0.0
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    covered_before = np.concatenate(([-np.inf], reach[:-1]))
    # Each interval adds what it covers past everything that started before it.
    return float(np.maximum(reach - np.maximum(starts, covered_before), 0.0).sum())


def format_event(event: LogEvent) -> str:
    """One human-readable line for `q4k logs tail`: time, level, event, then key=value pairs."""
    clock = datetime.fromtimestamp(event.time, timezone.utc).strftime("%H:%M:%S.%f")[:-3]
    pairs = [
        f"{clip(k, VALUE_CHARS)}={format_value(v)}"
        for k, v in event.fields.items()
        if k not in _ENVELOPE_KEYS
    ]
    request = f"[{clip(event.request_id, VALUE_CHARS)}] " if event.request_id is not None else ""
    level, name = clip(event.level, VALUE_CHARS), clip(event.event, VALUE_CHARS)
    return f"{clock} {level:<7} {name:<18} {request}{' '.join(pairs)}".rstrip()


def format_value(value: Any) -> str:
    """A field value for a one-line display: floats to 4 significant digits, no spaces unquoted,
    at most VALUE_CHARS characters."""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    text = clip(text, VALUE_CHARS)
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
