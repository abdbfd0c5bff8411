"""What `q4k serve` holds before any request reaches its app, on real sockets to a
`q4k serve` subprocess over the tiny model: a request head past its size limit is 431 and the
rest of it is never read, one that arrives too slowly (even a byte at a time) is 408, a
connection that sends nothing is closed, past the connection limit a new connection takes an
idle one's place (and is 503 only when every one is busy), a request naming another host is
403; the API key comes from Q4K_API_KEY, off the command line.
Every refusal is an OpenAI error object; the server's log holds no error line and its stderr
no traceback."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from actors.serve.guard import API_KEY_ENV, DEFAULT_MAX_HEAD_BYTES
from test_server import Server, _start, _stop
from test_server_guard import assert_log_is_clean

KEY = "sk-from-the-environment"
HEAD_TIMEOUT_S = 2
MAX_CONNECTIONS = 8
# Long enough for anything the server should answer sooner, on a loaded machine.
PATIENCE_S = 30


@pytest.fixture(scope="module")
def server(tiny_model_paths: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("connections") / "serve.log"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(API_KEY_ENV, KEY)
        running = _start(tiny_model_paths["llama-q4k-tiny"], log,
                         "--header-timeout", str(HEAD_TIMEOUT_S),
                         "--max-connections", str(MAX_CONNECTIONS))
    yield running
    _stop(running)  # asserts a clean exit and no traceback on stderr
    assert_log_is_clean(running.log)


def connect(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=PATIENCE_S)
    return connection


def answer(connection: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the one answer the server sends before it closes."""
    received = b""
    while part := connection.recv(65536):
        received += part
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    return int(head.split(b" ", 2)[1]), json.loads(body)


def assert_error(body: dict, code: str) -> str:
    error = body["error"]
    assert error["code"] == code and error["message"]
    return error["message"]


def test_the_api_key_comes_from_the_environment_not_the_command_line(server: Server) -> None:
    assert KEY.encode() not in Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    with httpx.Client(base_url=server.url, timeout=PATIENCE_S) as client:
        refused = client.get("/v1/models")
        served = client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert served.status_code == 200


def test_a_head_past_the_limit_is_431(server: Server) -> None:
    with connect(server) as connection:
        connection.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
                           + b"b" * (DEFAULT_MAX_HEAD_BYTES + 1024))
        status, body = answer(connection)
    assert status == 431
    assert f"at most {DEFAULT_MAX_HEAD_BYTES:,} bytes" in assert_error(
        body, "request_header_fields_too_large")


def test_a_head_that_is_not_http_is_400_naming_the_problem(server: Server) -> None:
    with connect(server) as connection:
        connection.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n")
        status, body = answer(connection)
    assert status == 400
    assert "not valid HTTP/1.1" in assert_error(body, "invalid_http_request")


def test_a_flood_of_header_bytes_is_cut_off_long_before_it_ends(server: Server) -> None:
    """64 MiB of one header field, never finished: the server stops reading at the limit and
    closes, so the sender's writes fail (what the kernel's buffers took is all it got)."""
    sent = 0
    with connect(server) as connection, pytest.raises(OSError):
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Flood: ")
        piece = b"f" * (1 << 20)
        while sent < 64 << 20:
            connection.sendall(piece)
            sent += len(piece)
    assert sent < 64 << 20


def test_a_head_that_arrives_too_slowly_is_408(server: Server) -> None:
    """A header line every 0.2 s: each byte arrives in time, the whole head never does."""
    with connect(server) as connection:
        connection.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        deadline = time.monotonic() + PATIENCE_S
        while not select.select([connection], [], [], 0.2)[0]:
            assert time.monotonic() < deadline, "the server waits for ever"
            connection.sendall(b"X-Slow: 1\r\n")
        status, body = answer(connection)
    assert status == 408
    assert f"within {HEAD_TIMEOUT_S} s" in assert_error(body, "request_timeout")


def test_a_connection_that_sends_nothing_is_closed(server: Server) -> None:
    with connect(server) as connection:
        assert connection.recv(1) == b""  # closed, with nothing to answer


def closed_within(connection: socket.socket, seconds: float) -> bool:
    """Whether the server closes `connection` (which sends nothing) within `seconds`."""
    if not select.select([connection], [], [], seconds)[0]:
        return False
    return connection.recv(65536) == b""


def test_a_new_connection_takes_the_place_of_the_one_idle_longest(server: Server) -> None:
    """Past the limit, idle connections (none sending anything) give way to new ones, oldest
    first, long before their head timeout: holding connections open keeps nobody out."""
    idle = [connect(server) for _ in range(MAX_CONNECTIONS)]
    time.sleep(0.2)  # accepted in order
    newer = [connect(server) for _ in range(3)]
    try:
        assert [closed_within(connection, HEAD_TIMEOUT_S / 2) for connection in idle[:3]] \
            == [True] * 3
        with httpx.Client(base_url=server.url, timeout=PATIENCE_S) as client:
            assert client.get("/health").status_code == 200
    finally:
        for connection in idle + newer:
            connection.close()


def test_a_connection_just_answered_is_the_newest_idle_one(server: Server) -> None:
    """A keep-alive connection becomes idle again when its answer is sent, as the newest:
    past the limit, the connections silent since before that answer give way first."""
    kept = connect(server)
    time.sleep(0.2)
    idle = [connect(server) for _ in range(MAX_CONNECTIONS - 1)]
    time.sleep(0.2)
    try:
        assert keep_alive_health(kept) == 200
        with connect(server):
            assert closed_within(idle[0], HEAD_TIMEOUT_S / 2)
            assert keep_alive_health(kept) == 200
    finally:
        for connection in [kept, *idle]:
            connection.close()


def keep_alive_health(connection: socket.socket) -> int:
    """GET /health on `connection`, kept open: the answer's status."""
    connection.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    received = b""
    while b"\r\n\r\n" not in received:
        received += connection.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += connection.recv(65536)
    return int(head.split(b" ", 2)[1])


def test_connections_past_the_limit_with_every_one_busy_are_503(server: Server) -> None:
    """Every connection has a request in progress (a body still arriving): a new one is
    answered 503 at once and closed; once they end, the server serves again."""
    busy = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        for connection in busy:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                               b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                               b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.5)  # their heads read
        with connect(server) as refused:
            status, body = answer(refused)
    finally:
        for connection in busy:
            connection.close()
    assert status == 503
    assert f"{MAX_CONNECTIONS} connections" in assert_error(body, "too_many_connections")
    deadline = time.monotonic() + PATIENCE_S
    with httpx.Client(base_url=server.url, timeout=PATIENCE_S) as client:
        while (health := client.get("/health")).status_code != 200:
            assert time.monotonic() < deadline, health.text


def test_a_request_naming_another_host_is_403_before_its_key_is_read(server: Server) -> None:
    with connect(server) as connection:
        connection.sendall(b"GET /v1/models HTTP/1.1\r\nHost: rebound.example\r\n\r\n")
        status, body = answer(connection)
    assert status == 403
    assert "rebound.example" in assert_error(body, "host_not_allowed")
