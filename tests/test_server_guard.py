"""What `q4k serve` refuses before a request reaches its endpoint: JSON
nested too deep, bodies too large (by Content-Length or counted as they stream), too slow,
of another content type, without the API key; and a client that leaves mid-body. Each is an
OpenAI error object with its status, and neither the server's log nor its stderr holds a
traceback or an error line. A real `q4k serve` subprocess over the tiny model (fast to open)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from test_server import Server, _start, _stop

KEY = "sk-test-key"
MAX_BODY = 4096
BODY_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def guarded(tiny_model_paths: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("guarded") / "serve.log"
    running = _start(tiny_model_paths["llama-q4k-tiny"], log, "--api-key", KEY,
                     "--max-body-bytes", str(MAX_BODY), "--body-timeout", str(BODY_TIMEOUT_S))
    yield running
    _stop(running)  # asserts a clean exit and no traceback on stderr
    assert_log_is_clean(running.log)


@pytest.fixture
def http(guarded: Server) -> Iterator[httpx.Client]:
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=guarded.url, timeout=30, headers=headers) as client:
        yield client


def assert_log_is_clean(log: Path) -> None:
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert not [line for line in lines if line.get("level") in ("error", "critical")]
    assert "Traceback" not in log.read_text()


def completion(server: Server, **fields: object) -> dict[str, object]:
    return {"model": server.model, "prompt": "hi", "max_tokens": 2, **fields}


def assert_refused(response: httpx.Response, status: int, code: str | None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["code"] == code and "param" in error
    return error


def test_a_request_with_the_key_is_served(guarded: Server, http: httpx.Client) -> None:
    answer = http.post("/v1/completions", json=completion(guarded))
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] is not None
    assert http.get("/v1/models").json()["data"][0]["id"] == guarded.model


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", KEY, "Bearer"])
def test_without_the_key_every_v1_path_is_401(guarded: Server, authorization: str | None) -> None:
    headers = {} if authorization is None else {"authorization": authorization}
    with httpx.Client(base_url=guarded.url, timeout=30, headers=headers) as client:
        for response in (client.post("/v1/completions", json=completion(guarded)),
                         client.get("/v1/models")):
            assert_refused(response, 401, "invalid_api_key")
            assert response.headers["www-authenticate"] == "Bearer"
        # Probes and scrapers need no key.
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize("field", ["ignored", "prompt"])
def test_json_nested_past_the_depth_limit_is_400(guarded: Server, http: httpx.Client,
                                                 field: str) -> None:
    """Past msgspec's depth limit, in a field the server ignores or in one it reads; deeper
    still, the body passes the size limit first."""
    for depth, status, code in ((1500, 400, None), (100_000, 413, "request_too_large")):
        nested = "[" * depth + "]" * depth
        body = json.dumps(completion(guarded))[:-1] + f', "{field}": {nested}}}'
        error = assert_refused(http.post("/v1/completions", content=body,
                                         headers={"content-type": "application/json"}),
                               status, code)
        assert status != 400 or "deeper" in error["message"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_body_that_is_not_declared_json_is_415(guarded: Server, http: httpx.Client,
                                                 content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    body = json.dumps(completion(guarded))
    assert_refused(http.post("/v1/completions", content=body, headers=headers),
                   415, "unsupported_media_type")
    # Parameters and case do not matter.
    ok = http.post("/v1/completions", content=body,
                   headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200


def test_a_body_past_the_limit_is_413_by_its_length_or_as_it_streams(
    guarded: Server, http: httpx.Client
) -> None:
    big = json.dumps(completion(guarded, prompt="x" * MAX_BODY)).encode()
    assert_refused(http.post("/v1/completions", content=big,
                             headers={"content-type": "application/json"}),
                   413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        yield big[:1000]
        yield big[1000:]

    assert_refused(http.post("/v1/completions", content=chunks(),
                             headers={"content-type": "application/json"}),
                   413, "request_too_large")


def _raw_request(server: Server, head_fields: str, body: bytes) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=30)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{head_fields}\r\n")
    connection.sendall(head.encode() + body)
    return connection


def _status_line(connection: socket.socket) -> str:
    received = b""
    while b"\r\n" not in received:
        part = connection.recv(4096)
        if not part:
            break
        received += part
    return received.split(b"\r\n", 1)[0].decode()


def test_a_slow_body_times_out_with_408(guarded: Server) -> None:
    started = time.monotonic()
    with _raw_request(guarded, "Content-Length: 1000\r\n", b'{"model": ') as connection:
        status = _status_line(connection)
    assert status.startswith("HTTP/1.1 408")
    assert BODY_TIMEOUT_S <= time.monotonic() - started < BODY_TIMEOUT_S + 10


def test_a_client_that_leaves_mid_body_is_dropped_quietly(guarded: Server) -> None:
    before = len(access_lines(guarded.log, 499))
    _raw_request(guarded, "Content-Length: 1000\r\n", b'{"model": ').close()
    deadline = time.monotonic() + 30
    while len(access_lines(guarded.log, 499)) == before:
        assert time.monotonic() < deadline, "no access line for the client that left"
        time.sleep(0.05)
    assert_log_is_clean(guarded.log)


def access_lines(log: Path, status: int) -> list[dict]:
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return [line for line in lines if line["event"] == "http_request" and line["status"] == status]


def test_no_refusal_left_a_traceback_or_an_error_line(guarded: Server,
                                                      http: httpx.Client) -> None:
    http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_log_is_clean(guarded.log)
    statuses = {json.loads(line).get("status") for line in guarded.log.read_text().splitlines()}
    assert statuses >= {200, 400, 401, 413, 415}
