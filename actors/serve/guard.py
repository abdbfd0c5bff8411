"""What the server checks before a request reaches its endpoint: the API key, the body's
content type, its size and how long it takes to arrive.

`RequestGuard` is ASGI middleware (it needs no Starlette to import). It reads the whole body
itself, bounded in size (the `Content-Length` before anything is read, the bytes counted as
they come for chunked bodies) and in time, then hands the endpoint the buffered body. Every refusal is an OpenAI error
object with its status (401, 408, 413, 415); a client that leaves while its body is arriving
is dropped quietly (status 499 in the access log, no error line).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import msgspec

from actors.serve.replies import error_body

if TYPE_CHECKING:  # the CLI reads this module's defaults without the `serve` extra installed
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A chat request for a long context is well under 1 MB of JSON; token-id prompts a few MB.
DEFAULT_MAX_BODY_BYTES = 8 << 20
# A client on a slow link sends a few MB in seconds.
DEFAULT_BODY_TIMEOUT_S = 30.0
# Paths that answer without the API key: load balancers and probes poll them.
OPEN_PATHS = frozenset(("/health", "/metrics"))
# What the request answers when its client left (nginx's 499; nobody reads it).
CLIENT_LEFT_STATUS = 499
# A refused body is read to its end (up to this much, kept nowhere) before the refusal is
# sent: a server that closes while the client still sends resets the connection, and the
# client never sees the refusal.
DISCARD_BYTES = 1 << 30


@dataclass(frozen=True)
class RequestLimits:
    """The server's request checks (`q4k serve --max-body-bytes --body-timeout --api-key`)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    api_key: str | None = None


class _Refusal(Exception):
    def __init__(self, status: int, message: str, code: str, *, discard_body: bool = True):
        super().__init__(message)
        self.status = status
        self.body = error_body(message, "invalid_request_error", None, code)
        self.discard_body = discard_body


class _ClientLeft(Exception):
    pass


class RequestGuard:
    """Checks every HTTP request against `limits` before `app` sees it."""

    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_key(scope)
            if scope["method"] not in ("POST", "PUT", "PATCH"):
                await self.app(scope, receive, send)
                return
            self._check_content(scope)
            body = await self._body(receive)
        except _Refusal as refusal:
            if refusal.discard_body:
                await self._discard_body(receive)
            await _send_refusal(send, refusal)
            return
        except _ClientLeft:
            await send({"type": "http.response.start", "status": CLIENT_LEFT_STATUS,
                        "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, _replaying(body, receive), send)

    def _check_key(self, scope: Scope) -> None:
        key = self.limits.api_key
        if key is None or scope["path"] in OPEN_PATHS:
            return
        given = _header(scope, b"authorization")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), key.encode()
        ):
            raise _Refusal(
                401,
                "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                "invalid_api_key",
            )

    def _check_content(self, scope: Scope) -> None:
        media_type = _header(scope, b"content-type").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise _Refusal(
                415,
                f"the request body must be JSON sent as 'Content-Type: application/json', "
                f"not {media_type[:100] or 'no content type'!r}",
                "unsupported_media_type",
            )
        length = _header(scope, b"content-length")
        if length and (not length.isdigit() or int(length) > self.limits.max_body_bytes):
            raise self._too_large(length[:30])

    async def _body(self, receive: Receive) -> bytes:
        """The whole body, refused once it passes the size limit or the time limit."""
        parts: list[bytes] = []
        size = 0
        with anyio.move_on_after(self.limits.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _ClientLeft
                part = message.get("body", b"")
                size += len(part)
                if size > self.limits.max_body_bytes:
                    raise self._too_large(f"more than {self.limits.max_body_bytes:,}")
                parts.append(part)
                if not message.get("more_body", False):
                    return b"".join(parts)
        raise _Refusal(  # only a timeout leaves the loop without a return
            408,
            f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
            "request_timeout",
            discard_body=False,
        )

    async def _discard_body(self, receive: Receive) -> None:
        """Read what is left of a refused body without keeping it, within the body timeout."""
        discarded = 0
        with anyio.move_on_after(self.limits.body_timeout_s):
            while discarded <= DISCARD_BYTES:
                message = await receive()
                discarded += len(message.get("body", b""))
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return

    def _too_large(self, size: str) -> _Refusal:
        return _Refusal(
            413,
            f"the request body is {size} bytes; this server takes at most "
            f"{self.limits.max_body_bytes:,} (q4k serve --max-body-bytes)",
            "request_too_large",
        )


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the buffered body first, then the client's later messages (the
    disconnect the endpoints watch for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


async def _send_refusal(send: Send, refusal: _Refusal) -> None:
    body = msgspec.json.encode(refusal.body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if refusal.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    # The body was not read to its end: the connection cannot carry another request.
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
