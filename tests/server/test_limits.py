"""The server's limits at the socket: header and body timeouts, the connection cap, errors of
the HTTP parser in the API's shape (with no traceback in the log), `Expect: 100-continue`
against the body limit, and shutdown within its grace (cut streams end with an error event
and [DONE]). Loopback only, against `FakeBackend`."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

from mox.server.app import SHUTDOWN_END_S, create_app, stop_server
from mox.server.limits import ServerLimits
from tests.server.conftest import API_KEY, FakeBackend, LiveServer

LIMITS = ServerLimits(header_timeout_s=1.0, body_timeout_s=1.0, max_connections=6,
                      max_body_bytes=4096, shutdown_grace_s=3.0)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BOUND_S = 10.0             # a connection the server should close is closed well before this


@pytest.fixture
def server(fake_backend):
    live = LiveServer(create_app(fake_backend, api_key=API_KEY, limits=LIMITS))
    yield live
    live.close()


def _connect(server: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=BOUND_S)
    sock.settimeout(BOUND_S)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _json_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    assert b"application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return status, error


def _echo_works(server: LiveServer) -> bool:
    status, _, body = server.request("POST", "/v1/completions",
                                     {"model": "echo", "prompt": "hi"}, AUTH)
    return status == 200 and json.loads(body)["choices"][0]["text"] == "abc"


def test_slow_headers_and_silent_connections_are_closed_while_others_are_served(server):
    slow = [_connect(server) for _ in range(3)]
    silent = _connect(server)
    partial = _connect(server)
    partial.sendall(b"GET /hea")
    start = time.monotonic()

    def drip(sock: socket.socket) -> None:         # a header line every 0.2 s, for ever
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            for i in range(int(BOUND_S / 0.2)):
                sock.sendall(b"X-Slow-%d: 1\r\n" % i)
                time.sleep(0.2)
        except OSError:
            pass                                   # closed by the server: the point

    drippers = [threading.Thread(target=drip, args=(s,), daemon=True) for s in slow]
    for t in drippers:
        t.start()
    assert _echo_works(server)                     # served meanwhile
    for sock in [*slow, silent, partial]:
        try:
            assert _read_all(sock) == b""          # closed without an answer
        except ConnectionResetError:
            pass
    assert time.monotonic() - start < LIMITS.header_timeout_s + 3
    for t in drippers:
        t.join(BOUND_S)
    assert _echo_works(server)


def test_a_slow_body_gets_408_and_the_connection_closes(server):
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nAuthorization: Bearer " + API_KEY.encode() +
                 b"\r\nContent-Length: 200\r\n\r\n{")
    start = time.monotonic()
    status, error = _json_error(_read_all(sock))
    assert status == 408 and error["code"] == "request_timeout"
    assert time.monotonic() - start < LIMITS.body_timeout_s + 3


def test_connections_past_the_cap_get_503_until_others_close(server):
    held = [_connect(server) for _ in range(LIMITS.max_connections)]
    time.sleep(0.2)                                # accepted and counted by the server
    status, error = _json_error(_read_all(_connect(server)))
    assert status == 503 and error["code"] == "too_many_connections"
    for sock in held:
        sock.close()
    deadline = time.monotonic() + BOUND_S
    while not _echo_works_quietly(server):
        assert time.monotonic() < deadline, "the cap did not free up"
        time.sleep(0.1)


def _echo_works_quietly(server: LiveServer) -> bool:
    try:
        return _echo_works(server)
    except OSError:
        return False


PARSER_CASES = {
    "64 KB path": (b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    "100 KB header": (b"GET / HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 100_000 + b"\r\n\r\n", 431),
    "200 headers": (b"GET / HTTP/1.1\r\nHost: x\r\n" +
                    b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n", 431),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    "TLS hello": (bytes.fromhex("16030100a5010000a10303") + b"\0" * 100, 400),
    "garbage": (b"\x00\xff hello\r\n\r\n", 400),
}


@pytest.mark.parametrize("case", PARSER_CASES)
def test_parser_errors_are_json_with_the_right_status_and_one_log_line(server, case, caplog):
    data, expected = PARSER_CASES[case]
    caplog.set_level(logging.DEBUG)
    sock = _connect(server)
    sock.sendall(data)
    status, error = _json_error(_read_all(sock))
    assert status == expected and len(error["message"]) < 300
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_expect_continue_with_an_oversize_body_gets_413_before_any_100(server):
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                 b"Content-Length: %d\r\n\r\n" % (LIMITS.max_body_bytes + 1))
    raw = _read_all(sock)
    assert not raw.startswith(b"HTTP/1.1 100")
    status, error = _json_error(raw)
    assert status == 413 and error["code"] == "request_too_large"


def test_expect_continue_within_the_limit_is_served(server):
    body = json.dumps({"model": "echo", "prompt": "hi"}).encode()
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                 b"Content-Type: application/json\r\nAuthorization: Bearer " +
                 API_KEY.encode() + b"\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body))
    assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue")
    sock.sendall(body)
    assert b" 200 OK" in _read_all(sock).split(b"\r\n")[0]


def test_shutdown_cuts_streams_after_the_grace_with_an_error_event(fake_backend):
    backend = FakeBackend(fake_backend._tokenizer, fake_backend._template)
    live = LiveServer(create_app(backend, api_key=API_KEY, limits=LIMITS))
    sock = _connect(live)
    body = json.dumps({"model": "slow", "prompt": "hi", "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nAuthorization: Bearer " + API_KEY.encode() +
                 b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    received = b""
    while b"data: " not in received:               # streaming
        received += sock.recv(4096)
    start = time.monotonic()
    live.call(stop_server(live.runner))
    took = time.monotonic() - start
    assert LIMITS.shutdown_grace_s - SHUTDOWN_END_S - 0.2 < took <= LIMITS.shutdown_grace_s
    received += _read_all(sock)
    events = [line for line in received.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"]
    live.loop.call_soon_threadsafe(live.loop.stop)
