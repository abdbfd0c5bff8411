"""What the server checks before a request reaches its endpoint: how many header fields it
has, the host it names (`Host`, and `Origin` where a browser sent one), CORS, the API key, the
body's content type, its size and how long it takes to arrive.

`RequestGuard` is ASGI middleware (it needs no Starlette to import). It reads the whole body
itself, bounded in size (the `Content-Length` before anything is read, the bytes counted as
they come for chunked bodies) and in time, then hands the endpoint the buffered body. Every
refusal is an OpenAI error object with its status (401, 403, 408, 413, 415, 431); a client
that leaves while its body is arriving is dropped quietly (status 499 in the access log, no
error line).

The host check stops DNS rebinding: a web page whose own name its DNS server re-points at
this machine reaches the server as a same-origin page, but its requests still carry that
name in `Host`. A server answers to IP addresses, to `localhost` (and its subdomains, which
resolve to loopback only) and to the names it is given (`RequestLimits.allowed_hosts`).

CORS lets a web page of another origin call the server (`RequestLimits.cors_origins`, none by
default): a browser's preflight (`OPTIONS` with `Access-Control-Request-Method`) is answered
before the API key is asked for, since a browser never sends credentials with it, and every
response to an allowed origin carries the `Access-Control-Allow-*` headers, refusals too, so
that the page can read why. An allowed origin passes the Origin check; the Host check stays.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import msgspec

from actors.errors import InvalidRequest
from actors.serve.replies import error_body

if TYPE_CHECKING:  # the CLI reads this module's defaults without the `serve` extra installed
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A chat request for a long context is well under 1 MB of JSON; token-id prompts a few MB.
DEFAULT_MAX_BODY_BYTES = 8 << 20
# A client on a slow link sends a few MB in seconds.
DEFAULT_BODY_TIMEOUT_S = 30.0
# A request's head (request line and header fields) at most this large: Node.js's default,
# and h11's; a client's head takes well under 1 KiB, a large bearer token a few KiB.
DEFAULT_MAX_HEAD_BYTES = 16 << 10
# Seconds a connection may take to send a request's whole head, from its opening (or from the
# first byte after an answer: an idle keep-alive connection closes after uvicorn's 5 s).
DEFAULT_HEAD_TIMEOUT_S = 10.0
# Connections open at once: the engine's default admission (64 decoding + 256 queued), its
# probes and clients' idle keep-alive connections fit well within it.
DEFAULT_MAX_CONNECTIONS = 512
# Paths that answer without the API key: load balancers and probes poll them.
OPEN_PATHS = frozenset(("/health", "/metrics"))
# What the request answers when its client left (nginx's 499; nobody reads it).
CLIENT_LEFT_STATUS = 499
# The most header fields one request may carry (Apache's and Tomcat's default); their size
# together is bounded where the head is read (`ConnectionLimits.max_head_bytes`).
MAX_HEADER_FIELDS = 100
# Where the API key is read from when the command line gives none (`ps` shows a command line
# to every user of the machine; an environment only to its owner).
API_KEY_ENV = "Q4K_API_KEY"
# Names every server answers to besides IP addresses: `localhost` and, by a leading dot, its
# subdomains (RFC 6761: they resolve to loopback only).
LOOPBACK_NAMES = (".localhost",)
# An allowed host that turns the host check off.
ANY_HOST = "*"
# A Host header or an origin's host: a bracketed IPv6 address or a name, and an optional port.
HOST_AND_PORT = re.compile(r"(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[^:\[\]/@\s]*))(?::[0-9]*)?")
# What a preflight from an allowed origin is told: the methods the API takes, how long the
# browser may keep the answer (seconds), and the headers a page may read (a 429's wait).
CORS_METHODS = "GET, POST, OPTIONS"
CORS_MAX_AGE_S = 600
CORS_EXPOSED_HEADERS = "Retry-After"
# A refused body is read to its end (up to this much, kept nowhere) before the refusal is
# sent: a server that closes while the client still sends resets the connection, and the
# client never sees the refusal.
DISCARD_BYTES = 1 << 30


@dataclass(frozen=True)
class RequestLimits:
    """The server's request checks (`q4k serve --max-body-bytes --body-timeout --api-key
    --allowed-host --cors-origin`). `allowed_hosts`: the names the server answers to besides
    IP addresses and `localhost`: a name, `.name` for it and its subdomains, or `*` for any
    host. `cors_origins`: the origins (`scheme://host[:port]`, lower case) whose pages may
    call the server, or `*` for any."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()

    def cors_allows(self, origin: str) -> bool:
        """Whether a page of `origin` (an Origin header) may call the server."""
        origin = origin.strip().lower().rstrip("/")
        return bool(origin) and any(allowed in (ANY_HOST, origin) for allowed in self.cors_origins)


@dataclass(frozen=True)
class ConnectionLimits:
    """What `q4k serve`'s HTTP server holds before a request reaches the app (`--header-timeout
    --max-connections`): see `actors.serve.connections`."""

    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS


def api_key_from_environment(environment: Mapping[str, str] = os.environ) -> str | None:
    """The API key Q4K_API_KEY holds, None where it is unset; one set but empty is refused,
    never read as "no key"."""
    key = environment.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise InvalidRequest(f"{API_KEY_ENV} is set but empty: unset it to serve without an API "
                             "key, or set it to the key", field="api_key")
    return key


def own_host_names(bound_to: str) -> tuple[str, ...]:
    """The names a server bound to `bound_to` answers to by default, besides IP addresses and
    `localhost`: that address where it is a name, and this machine's name (a client on the
    network may call the machine by it; a rebinding page comes with a name of its own)."""
    names = [socket.gethostname()]
    if not _is_ip_address(bound_to.strip("[]")):
        names.append(bound_to)
    return tuple(name.lower().rstrip(".") for name in names if name)


def host_allowed(host: str, allowed_hosts: Sequence[str]) -> bool:
    """Whether `host` (a Host header, or an origin's host and port) names this server: an IP
    address, `localhost` or a subdomain of it, or one of `allowed_hosts`."""
    found = HOST_AND_PORT.fullmatch(host.strip().lower())
    if found is None:
        return False
    name = (found["v6"] or found["name"]).rstrip(".")
    if not name:
        return False
    if _is_ip_address(name):
        return True
    patterns = [pattern.lower().rstrip(".") for pattern in (*LOOPBACK_NAMES, *allowed_hosts)]
    return any(pattern == ANY_HOST or name == pattern.lstrip(".")
               or (pattern.startswith(".") and name.endswith(pattern)) for pattern in patterns)


def _is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


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
        origin = _header(scope, b"origin")
        if self.limits.cors_allows(origin):
            send = _with_cors_headers(send, origin)
        try:
            self._check_head(scope)
            if _is_preflight(scope):
                await self._answer_preflight(scope, origin, send)
                return
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

    def _check_head(self, scope: Scope) -> None:
        """The header fields' count, and the host the request (and its page) names."""
        if len(scope["headers"]) > MAX_HEADER_FIELDS:
            raise _Refusal(431, f"the request has {len(scope['headers']):,} header fields; this "
                           f"server reads at most {MAX_HEADER_FIELDS}",
                           "request_header_fields_too_large")
        allowed = self.limits.allowed_hosts
        host = _header(scope, b"host")
        if host and not host_allowed(host, allowed):
            raise _Refusal(403, f"this server does not answer to the host {host[:100]!r}: a web "
                           "page that points its own name at this machine must not reach it "
                           "(DNS rebinding); if this is the server's own name, start it with "
                           "--allowed-host NAME", "host_not_allowed")
        origin = _header(scope, b"origin")
        _, separator, origin_host = origin.partition("://")
        if origin and not (self.limits.cors_allows(origin)
                           or separator and host_allowed(origin_host, allowed)):
            raise _Refusal(403, f"this server does not answer pages from {origin[:100]!r} "
                           "(--allowed-host names the hosts it serves, --cors-origin the origins "
                           "whose pages may call it)", "origin_not_allowed")

    async def _answer_preflight(self, scope: Scope, origin: str, send: Send) -> None:
        """A browser asks whether a page of `origin` may send a request: 204 with what it may
        send (its `send` adds the allowed origin), or 403 for an origin not allowed."""
        if not self.limits.cors_allows(origin):
            raise _Refusal(403, f"this server takes no cross-origin requests from "
                           f"{origin[:100]!r} (q4k serve --cors-origin ORIGIN allows one)",
                           "cors_origin_not_allowed")
        headers = [(b"access-control-allow-methods", CORS_METHODS.encode()),
                   (b"access-control-max-age", str(CORS_MAX_AGE_S).encode()),
                   (b"content-length", b"0")]
        asked_headers = _header(scope, b"access-control-request-headers")
        if asked_headers:
            headers.append((b"access-control-allow-headers", asked_headers.encode("latin-1")))
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

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


def _is_preflight(scope: Scope) -> bool:
    return scope["method"] == "OPTIONS" and bool(_header(scope, b"origin")) and bool(
        _header(scope, b"access-control-request-method"))


def _with_cors_headers(send: Send, origin: str) -> Send:
    """A `send` whose response tells the browser that the page of `origin` may read it
    (unless the response says so already: on Ray Serve, the replica's guard has added them
    to what the front relays)."""
    added = [(b"access-control-allow-origin", origin.encode("latin-1")),
             (b"access-control-expose-headers", CORS_EXPOSED_HEADERS.encode()),
             (b"vary", b"Origin")]

    async def send_with_cors(message: Message) -> None:
        headers = message.get("headers", [])
        if message["type"] == "http.response.start" and all(
                name.lower() != added[0][0] for name, _ in headers):
            message = {**message, "headers": [*headers, *added]}
        await send(message)

    return send_with_cors


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
