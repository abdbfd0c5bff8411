"""`q4k logs`: read the engine's JSON-lines logs back (summary, requests, one request, tail)."""

from __future__ import annotations

import argparse
import os
import stat
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from actors.cli.common import (
    add_logging_flags,
    at_least,
    configure_logging_from,
    console,
    error_line,
)
from actors.logreader import (
    EXCERPT_CHARS,
    LogEvent,
    LogSummary,
    MalformedLine,
    ParsedLog,
    Percentiles,
    SummaryBuilder,
    clip,
    format_event,
    format_value,
    gather_log,
    parse_line,
    request_rows,
    request_timeline,
    summarize,
    time_series,
)

# How often `tail -f` looks for new lines.
POLL_S = 0.2
# A line longer than this is no engine event: counted as malformed, its bytes not kept.
MAX_LINE_BYTES = 4 << 20
# A text cell of a table (an id, a reason, an error) shows at most this many characters.
CELL_CHARS = 200
_LEVEL_STYLES = {"debug": "dim", "warning": "yellow", "error": "bold red", "critical": "bold red"}


class _NoInput(Exception):
    """The log files named cannot be read; the message says which and why."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "logs",
        help="inspect the engine's JSON-lines logs",
        description="Read logs written with --log-file (one JSON object per line). FILES may be "
        "several files, or '-' for stdin. Malformed lines are "
        "counted and reported, never fatal.",
    )
    views = parser.add_subparsers(dest="view", metavar="VIEW", required=True)

    def view(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = views.add_parser(name, help=help_text, description=help_text)
        add_logging_flags(sub)
        return sub

    summary = view("summary", "outcomes, errors, latency percentiles, throughput, batch sizes")
    summary.add_argument("files", nargs="+", metavar="FILE", help="log file, or '-' for stdin")
    summary.add_argument("--json", action="store_true", help="print the summary as JSON")
    summary.add_argument("--plot", metavar="FILE.png", help="also draw latency and throughput "
                         "over time (needs matplotlib: pip install 'q4k-actors[plot]')")
    summary.set_defaults(handler=_summary)

    requests = view("requests", "one row per request")
    requests.add_argument("files", nargs="+", metavar="FILE", help="log file, or '-' for stdin")
    requests.add_argument("--json", action="store_true", help="print the rows as JSON")
    requests.set_defaults(handler=_requests)

    request = view("request", "the timeline of one request (an id or a unique prefix of one)")
    request.add_argument("request_id", metavar="ID")
    request.add_argument("files", nargs="+", metavar="FILE", help="log file, or '-' for stdin")
    request.add_argument("--json", action="store_true", help="print the timeline as JSON")
    request.set_defaults(handler=_request)

    tail = view("tail", "print a log human-readably; with -f, keep following it as it grows")
    tail.add_argument("file", metavar="FILE", help="log file, or '-' for stdin")
    tail.add_argument("-f", "--follow", action="store_true", help="wait for new lines")
    tail.add_argument("-n", "--lines", type=at_least(0), default=10, metavar="N",
                      help="start with the last N lines (default 10; 0 = none)")
    tail.set_defaults(handler=_tail)


# --- input ---------------------------------------------------------------------------------


def _open_input(name: str) -> tuple[str, BinaryIO]:
    """(source name, binary stream) for a FILE argument: a regular file, or stdin ('-') when
    it is a file, a pipe or a terminal. Devices (/dev/zero), FIFOs and sockets are refused
    before anything is read: they can be endless or block forever."""
    if name == "-":
        mode = os.fstat(sys.stdin.fileno()).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or sys.stdin.isatty()):
            raise _NoInput("<stdin>: is a device or socket, not a log (pipe or redirect a file)")
        return "<stdin>", sys.stdin.buffer
    try:
        # Non-blocking: opening a FIFO without a writer would wait forever.
        descriptor = os.open(name, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise _NoInput(f"{name}: no such log file") from None
    except OSError as exc:
        raise _NoInput(f"{name}: cannot read: {exc.strerror}") from None
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        kind = "a directory" if stat.S_ISDIR(mode) else "a device, FIFO or socket"
        raise _NoInput(f"{name}: is {kind}, not a log file")
    os.set_blocking(descriptor, True)
    return name, os.fdopen(descriptor, "rb")


def _parsed_lines(source: str, stream: BinaryIO) -> Iterator[LogEvent | MalformedLine]:
    """The stream's non-blank lines, parsed one at a time; a line past MAX_LINE_BYTES is
    malformed, and read past without keeping it."""
    number = 0
    while raw := stream.readline(MAX_LINE_BYTES + 1):
        number += 1
        if _cut_short(raw):
            _skip_rest_of_line(stream)
        if (parsed := _parse_raw(raw, source, number)) is not None:
            yield parsed


def _cut_short(raw: bytes) -> bool:
    """Whether `readline(MAX_LINE_BYTES + 1)` stopped at its limit inside a longer line."""
    return len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n")


def _skip_rest_of_line(stream: BinaryIO) -> None:
    while (rest := stream.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
        pass


def _parse_raw(raw: bytes, source: str, number: int) -> LogEvent | MalformedLine | None:
    """One line's bytes parsed (None when blank); past MAX_LINE_BYTES, malformed."""
    if len(raw.removesuffix(b"\n")) > MAX_LINE_BYTES:
        excerpt = raw[:EXCERPT_CHARS].decode("utf-8", errors="replace")
        return MalformedLine(source, number, f"longer than {MAX_LINE_BYTES:,} bytes",
                             "".join(c if c.isprintable() else "\ufffd" for c in excerpt))
    # Garbage bytes become U+FFFD and then a malformed line, never a decode crash.
    text = raw.decode("utf-8", errors="replace").removesuffix("\n")
    return parse_line(text, source, number) if text.strip() else None


def _each_input(files: list[str]) -> Iterator[tuple[str, Iterator[LogEvent | MalformedLine]]]:
    """(source name, its parsed lines) per FILE, each opened as its turn comes."""
    for name in files:
        source, stream = _open_input(name)
        try:
            yield source, _parsed_lines(source, stream)
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()


def _read_inputs(files: list[str]) -> ParsedLog:
    return gather_log(_each_input(files))


def _streamed_summary(files: list[str]) -> LogSummary:
    """The summary, each line parsed, counted and dropped: memory stays flat however long
    the log."""
    builder = SummaryBuilder()
    for source, lines in _each_input(files):
        builder.add_source(source)
        for parsed in lines:
            builder.add(parsed)
    return builder.summary()


def _with_log(args: argparse.Namespace, show: Callable[[ParsedLog], int]) -> int:
    """Read the inputs, then `show(log)`; unreadable input is one error line."""
    configure_logging_from(args)
    try:
        log = _read_inputs(args.files)
    except _NoInput as exc:
        return error_line(f"logs {args.view}", str(exc))
    return show(log)


def _print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value)).decode() + "\n")


# --- summary -------------------------------------------------------------------------------


def _summary(args: argparse.Namespace) -> int:
    def show(log: ParsedLog) -> int:
        problem = _write_plot(log, Path(args.plot))
        if problem:
            return error_line("logs summary", problem)
        return show_summary(summarize(log))

    def show_summary(summary: LogSummary) -> int:
        if args.json:
            _print_json(summary)
        else:
            _render_summary(summary, console())
        return 0

    if args.plot:  # the plot needs every event: the whole log is held
        return _with_log(args, show)
    configure_logging_from(args)
    try:
        return show_summary(_streamed_summary(args.files))
    except _NoInput as exc:
        return error_line("logs summary", str(exc))


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _render_summary(s: LogSummary, out: Console) -> None:
    overview = Table(title="log", show_header=False, title_justify="left")
    overview.add_row("sources", _data(", ".join(s.sources)))
    overview.add_row("lines", f"{s.lines:,} ({s.events:,} events, {s.malformed:,} malformed)")
    overview.add_row("span", f"{s.first_timestamp} .. {s.last_timestamp} ({s.span_s:,.1f} s)")
    for model in s.models:
        overview.add_row("model", _data(model))
    out.print(overview)

    outcomes = Table(title="requests", title_justify="left")
    outcomes.add_column("outcome")
    outcomes.add_column("count", justify="right")
    outcomes.add_row("seen", str(s.requests_seen))
    outcomes.add_row("admitted", str(s.admitted))
    for reason, count in sorted(s.finish_reasons.items()):
        outcomes.add_row(_data(f"finished: {reason}"), str(count))
    outcomes.add_row("cancelled", str(s.cancelled))
    outcomes.add_row("failed", str(s.failed))
    for reason, count in sorted(s.rejection_reasons.items()):
        outcomes.add_row(_data(f"rejected: {reason}"), str(count))
    out.print(outcomes)

    latency = Table(title="latency (ms)", title_justify="left")
    for column in ("", "n", "p50", "p95", "p99"):
        latency.add_column(column, justify="right" if column else "left")
    for name, p in (("time to first token", s.ttft_ms), ("per token", s.per_token_latency_ms)):
        latency.add_row(name, *_percentile_cells(p))
    out.print(latency)

    throughput = Table(title="throughput", show_header=False, title_justify="left")
    throughput.add_column()
    throughput.add_column(justify="right")
    throughput.add_row("prompt tokens (finished)", f"{s.prompt_tokens:,}")
    throughput.add_row("completion tokens", f"{s.completion_tokens:,}")
    throughput.add_row("busy time (a request running)", f"{s.busy_s:,.1f} s of {s.span_s:,.1f} s")
    throughput.add_row("tokens/s while busy", _fmt(s.busy_tokens_per_s))
    throughput.add_row("tokens/s over the whole span", _fmt(s.tokens_per_s))
    out.print(throughput)

    if s.steps:
        batches = Table(title=f"batch sizes ({s.steps:,} steps, mean {_fmt(s.mean_batch_size, 2)})",
                        title_justify="left")
        batches.add_column("items per step", justify="right")
        batches.add_column("steps", justify="right")
        batches.add_column("share", justify="right")
        for label, count in _bucket_batches(s.batch_sizes):
            batches.add_row(label, f"{count:,}", f"{100 * count / s.steps:.1f}%")
        out.print(batches)

    if s.errors or s.error_events or s.malformed:
        problems = Table(title="problems", title_justify="left")
        problems.add_column("what")
        problems.add_column("count", justify="right")
        for message, count in s.errors.items():
            problems.add_row(_data(message), str(count))
        problems.add_row("lines at level error or above", str(s.error_events))
        problems.add_row("malformed lines", str(s.malformed))
        out.print(problems)
        for bad in s.malformed_examples:
            out.print(Text(f"  {_where(bad)}: {bad.reason}: {bad.excerpt}", style="dim"))
    if s.notices:
        # A notice speaks of the machine that ran the engine (no GPU there...), which need not
        # be this one: it is shown as what the log says.
        out.print("notices the log holds (from the run that wrote it, about the machine it ran "
                  "on):")
        for notice in s.notices:
            out.print(Text(f"  {_cell(notice)}", style="yellow"))


def _data(text: str) -> Text:
    """Text from the log, as it is (a `Text` is never read as rich markup: `[x]` stays), cut
    to CELL_CHARS."""
    return Text(_cell(text))


def _percentile_cells(p: Percentiles | None) -> list[str]:
    if p is None:
        return ["0", "-", "-", "-"]
    return [str(p.count), _fmt(p.p50), _fmt(p.p95), _fmt(p.p99)]


def _bucket_batches(sizes: dict[int, int]) -> list[tuple[str, int]]:
    """Batch sizes grouped by powers of two (1, 2, 3-4, 5-8, ...) so a table stays short."""
    buckets: dict[int, int] = {}
    for size, count in sizes.items():
        upper = 1 if size <= 1 else 1 << (size - 1).bit_length()
        buckets[upper] = buckets.get(upper, 0) + count
    return [
        (str(upper) if upper <= 2 else f"{upper // 2 + 1}-{upper}", count)
        for upper, count in sorted(buckets.items())
    ]


def _where(bad: MalformedLine) -> str:
    return f"{bad.source}:{bad.line}"


def _write_plot(log: ParsedLog, path: Path) -> str | None:
    """Draw latency and throughput over time to `path`; the problem as a line, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib: pip install 'q4k-actors[plot]'"
    series = time_series(log)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(series.finish_s, series.ttft_ms, "o", markersize=3, label="time to first token")
    top.plot(series.finish_s, series.per_token_ms, "x", markersize=3, label="per-token latency")
    top.set_ylabel("ms (at request finish)")
    top.legend(loc="upper left")
    bottom.step(series.bin_start_s, series.tokens_per_s, where="post")
    bottom.set_ylabel("generated tokens/s")
    bottom.set_xlabel("seconds since the log's first event")
    figure.suptitle(", ".join(log.sources))
    figure.tight_layout()
    try:
        figure.savefig(path)
    except OSError as exc:
        return f"{path}: cannot write the plot: {exc.strerror}"
    finally:
        plt.close(figure)
    return None


# --- requests / request --------------------------------------------------------------------


def _requests(args: argparse.Namespace) -> int:
    def show(log: ParsedLog) -> int:
        rows = request_rows(log)
        if args.json:
            _print_json(rows)
            return 0
        columns = ("id", "status", "finish", "prompt", "cached", "completion", "ttft ms",
                   "tok/s", "total ms", "error")
        cells = [
            (_cell(r.request_id), r.status, _cell(r.finish_reason or "-"),
             *(_fmt(v, 0) for v in (r.prompt_tokens, r.cached_tokens, r.completion_tokens)),
             _fmt(r.ttft_ms), _fmt(r.decode_tokens_per_s), _fmt(r.total_ms), _cell(r.error or ""))
            for r in rows
        ]
        text_columns = {"id", "status", "finish", "error"}
        # Plain aligned text, not a rich Table: rich measures every cell (2 ms a row).
        sys.stdout.write(f"{len(rows)} requests\n")
        sys.stdout.write(_aligned(columns, cells, [c in text_columns for c in columns]))
        return 0

    return _with_log(args, show)


def _one_line(text: str) -> str:
    return text.replace("\n", " ").replace("\r", " ")


def _cell(text: str) -> str:
    return clip(_one_line(text), CELL_CHARS)


def _aligned(header: tuple[str, ...], rows: list[tuple[str, ...]], left: list[bool]) -> str:
    """Columns padded to their widest cell, two spaces apart, in time linear in the cells."""
    table = [header, *rows]
    widths = [max(map(len, column)) for column in zip(*table)]
    pads = [str.ljust if is_left else str.rjust for is_left in left]
    lines = (
        "  ".join(pad(cell, width) for pad, cell, width in zip(pads, row, widths)).rstrip()
        for row in table
    )
    return "\n".join(lines) + "\n"


def _request(args: argparse.Namespace) -> int:
    def show(log: ParsedLog) -> int:
        request_id, entries = request_timeline(log, args.request_id)
        if args.json:
            _print_json({"request_id": request_id, "events": entries})
            return 0
        table = Table(title=Text(f"request {_cell(request_id)}"), title_justify="left")
        for column in ("+ms", "time", "level", "event", "details"):
            table.add_column(column, justify="right" if column == "+ms" else "left")
        for e in entries:
            details = " ".join(f"{clip(k, CELL_CHARS)}={format_value(v)}"
                               for k, v in e.details.items())
            table.add_row(_fmt(e.offset_ms), e.timestamp, _data(e.level), _data(e.event),
                          Text(_one_line(details)), style=_LEVEL_STYLES.get(e.level))
        console().print(table)
        return 0

    return _with_log(args, show)


# --- tail ----------------------------------------------------------------------------------


def _tail(args: argparse.Namespace) -> int:
    configure_logging_from(args)
    out = console()
    try:
        source, stream = _open_input(args.file)
    except _NoInput as exc:
        return error_line("logs tail", str(exc))
    try:
        if stream is sys.stdin.buffer:
            for parsed in _parsed_lines(source, stream):
                _show(out, parsed)
            return 0
        _tail_file(out, stream, source, args.lines, args.follow)
    except KeyboardInterrupt:  # the usual way to stop following
        pass
    return 0


def _show(out: Console, parsed: LogEvent | MalformedLine | None) -> None:
    if parsed is None:
        return
    if isinstance(parsed, LogEvent):
        out.print(Text(format_event(parsed), style=_LEVEL_STYLES.get(parsed.level, "")),
                  soft_wrap=True)  # one event, one line, however long
    else:
        out.print(Text(f"malformed line {parsed.line} ({parsed.reason}): {parsed.excerpt}",
                       style="magenta"), soft_wrap=True)
    out.file.flush()


def _tail_file(out: Console, stream: BinaryIO, path: str, count: int, follow: bool) -> None:
    """Print the last `count` lines (read in one pass, keeping only those); when following,
    print lines as they are appended and start over when the file is truncated or replaced
    (log rotation). A partly written last line waits for its newline."""
    try:
        last: deque[LogEvent | MalformedLine | None] = deque(maxlen=max(count, 0))
        number, pending = 0, b""
        while raw := stream.readline(MAX_LINE_BYTES + 1):
            if not raw.endswith(b"\n") and not _cut_short(raw) and follow:
                pending = raw  # the end of the file, mid-line: its writer is still at it
                break
            number += 1
            if _cut_short(raw):
                _skip_rest_of_line(stream)
            last.append(_parse_raw(raw, path, number))
        for parsed in last:
            _show(out, parsed)
        skipping = False  # the rest of a line already reported as too long
        while follow:
            chunk = stream.read(MAX_LINE_BYTES)
            if chunk:
                if skipping:
                    skipping, chunk = b"\n" not in chunk, chunk.partition(b"\n")[2]
                *complete, pending = (pending + chunk).split(b"\n")
                for raw in complete:
                    number += 1
                    _show(out, _parse_raw(raw, path, number))
                if len(pending) > MAX_LINE_BYTES:
                    number += 1
                    _show(out, _parse_raw(pending, path, number))
                    pending, skipping = b"", True
                continue
            time.sleep(POLL_S)
            try:
                on_disk = os.stat(path)
            except FileNotFoundError:
                continue  # being rotated; the new file appears shortly
            if on_disk.st_ino != os.fstat(stream.fileno()).st_ino or on_disk.st_size < stream.tell():
                stream.close()
                stream = open(path, "rb")
                pending, number = b"", 0
                out.print(Text(f"({path} was truncated or replaced; following it from the start)",
                               style="dim"))
    finally:
        stream.close()
