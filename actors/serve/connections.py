"""The connections `q4k serve` holds, bounded before any request reaches the app: a request's
head (request line and header fields) at most `max_head_bytes`, arriving whole within
`head_timeout_s` of the connection opening (or of its first byte after an answer), and at
most `max_connections` connections open at once (`actors.serve.guard.ConnectionLimits`). Past
that, a new connection takes the place of the one idle longest (no request in progress: a
keep-alive connection, or one whose head is still arriving), as nginx drains idle connections
when it runs out; only when every connection has a request in progress is it refused. So
connections held open by a client that sends nothing, or a head a byte at a time, cannot
keep anyone else out.

uvicorn (0.55) bounds none of these itself: its httptools parser keeps a head of any size, a
connection that never completes its first request is held for ever (its keep-alive timeout
starts only after an answer), and `limit_concurrency` answers 503 only once a whole head has
arrived. `bounded_h11_protocol(limits)` is uvicorn's h11 protocol with them added; h11 keeps at
most `max_head_bytes` of an unfinished head. Refusals are OpenAI error objects, as the app's
are, sent with `Connection: close`: 431 for a head too large, 408 for one too slow, 400 for
one h11 cannot read, 503 past the connection limit with every connection busy.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any, ClassVar

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from actors.serve.guard import ConnectionLimits
from actors.serve.replies import error_body

# Connections the kernel queues for accepting, and so the most the event loop accepts in one
# turn (asyncio accepts up to the backlog at once, each with its protocol made in that turn):
# uvicorn's 2048 let a burst of connections hold the loop for hundreds of milliseconds.
ACCEPT_BACKLOG = 128
# What a client refused for too many connections should wait before it retries.
RETRY_AFTER_S = 1


class _Connection(h11.Connection):
    """h11's server side, keeping the protocol error it raised (uvicorn's protocol passes on
    only that there was one)."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.refused: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as error:
            self.refused = error
            raise


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol within `limits` (a subclass sets them: `bounded_h11_protocol`)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    # The server's connections with no request in progress, longest idle first (a dict keeps
    # insertion order): finding the one to close is O(1), so a flood of connections costs
    # the loop a constant amount each, not a scan of all the others.
    idle_connections: ClassVar[dict[BoundedH11Protocol, None]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(self.limits.max_head_bytes)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_begun = False  # some of the next request's head has arrived

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._mark_idle()
        if len(self.connections) > self.limits.max_connections and not self._close_longest_idle():
            self._refuse(503, f"this server holds {self.limits.max_connections} connections at "
                         "most, and every one has a request in progress; retry shortly",
                         "too_many_connections")
            return
        self._start_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:
            self._mark_idle()

    def _mark_idle(self) -> None:
        """No request in progress from now (no head has arrived whole since the last answer):
        the newest idle connection."""
        self.idle_connections.pop(self, None)
        self.idle_connections[self] = None

    def _close_longest_idle(self) -> bool:
        """Close the connection that has had no request in progress the longest, to make room;
        False where every other connection has one."""
        while self.idle_connections:
            longest = next(iter(self.idle_connections))
            if longest is self:  # the newest: no other connection is idle
                return False
            del self.idle_connections[longest]
            if not longest.transport.is_closing():  # (one closing already frees no room)
                longest.transport.close()
                return True
        return False

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # the next request's head is arriving
            self._head_begun = True
            if self._head_timer is None:
                self._start_head_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self.idle_connections.pop(self, None)
            self._stop_head_timer()
            self._head_begun = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.idle_connections.pop(self, None)
        self._stop_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused: 431 for a head past the limit, else
        400, either naming the problem."""
        refused = self.conn.refused
        if refused is not None and refused.error_status_hint == 431:
            limit = self.limits.max_head_bytes
            self._refuse(431, f"the request's head (request line and header fields) is larger "
                         f"than this server reads: at most {limit:,} bytes",
                         "request_header_fields_too_large")
        else:
            self._refuse(400, f"the request is not valid HTTP/1.1: {refused or msg}",
                         "invalid_http_request")

    def _start_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self._head_begun:  # nothing sent at all: closed as an idle connection is
            self.transport.close()
            return
        self._refuse(408, f"the request's head did not arrive within "
                     f"{self.limits.head_timeout_s:g} s", "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer `status` with an OpenAI error object and close the connection."""
        kind = "server_error" if status >= 500 else "invalid_request_error"
        body = msgspec.json.encode(error_body(message, kind, None, code))
        head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
                f"content-length: {len(body)}", "connection: close"]
        if status == 503:
            head.append(f"retry-after: {RETRY_AFTER_S}")
        self.transport.write("\r\n".join([*head, "", ""]).encode() + body)
        self.transport.close()


def bounded_h11_protocol(limits: ConnectionLimits) -> type[BoundedH11Protocol]:
    """The HTTP protocol class for uvicorn (`uvicorn.Config(http=...)`) within `limits`."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,),
                {"limits": limits, "idle_connections": {}})
