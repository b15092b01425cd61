"""Slow clients against a real `gpufail serve` (real sockets): a request whose headers or body
trickle in is answered 408 and cut off after `[serve] header_timeout` / `body_timeout`, while
other clients are served as usual (`serving.http_timeouts`)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest

from tests.serving.api_server import serve_test_fleet

pytestmark = pytest.mark.slow

SLOW_CONNECTIONS = 5
TRICKLE_S = 0.2  # between two bytes of a slow client: ~30 s for what it sends in all


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = serve_test_fleet(tmp_path_factory.mktemp("timeouts"), serve={"header_timeout": "1s", "body_timeout": "2s"})
    yield srv
    srv.stop()


def connect(url: str) -> socket.socket:
    address = urlparse(url)
    sock = socket.create_connection((address.hostname, address.port), timeout=30)
    sock.settimeout(30)
    return sock


def trickle(url: str, head: bytes, slow: bytes) -> tuple[bool, bytes]:
    """Send `head` at once, then `slow` a byte at a time. Returns whether the server closed the
    connection before all of `slow` was sent, and what it answered."""
    with connect(url) as sock:
        sock.sendall(head)
        cut = False
        for i in range(len(slow)):
            try:
                sock.sendall(slow[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            time.sleep(TRICKLE_S)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
            cut = cut or answer != b""
        except (ConnectionResetError, TimeoutError):
            pass
        return cut, answer


SLOW_HEADERS = b"X-Slow: " + b"a" * 150 + b"\r\n\r\n"


def test_slow_headers_are_cut_off_while_other_clients_are_served(server):
    with ThreadPoolExecutor(SLOW_CONNECTIONS) as pool:
        slow = [
            pool.submit(trickle, server.url, b"GET /healthz HTTP/1.1\r\nHost: test\r\n", SLOW_HEADERS)
            for _ in range(SLOW_CONNECTIONS)
        ]
        time.sleep(0.5)
        # Served as usual while the slow connections are open.
        with server.client() as client:
            assert [client.get("/healthz").status_code for _ in range(3)] == [200, 200, 200]
        outcomes = [future.result(timeout=120) for future in slow]
    for cut, answer in outcomes:
        assert cut
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
        assert b"request header not received within 1 s ([serve] header_timeout)" in answer
    assert server.logs().count("request header not received within 1 s; connection closed") >= SLOW_CONNECTIONS


def test_a_connection_that_sends_nothing_is_closed(server):
    with connect(server.url) as sock:
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")


def test_a_slow_body_is_cut_off_and_a_whole_one_is_answered(server):
    body = b'{"gpus": []}' + b" " * 150
    head = (
        b"POST /v1/predict HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    cut, answer = trickle(server.url, head, body)
    assert cut
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"request body not received within 2 s ([serve] body_timeout)" in answer
    # The same request sent at once is answered by the app.
    with server.client() as client:
        answered = client.post("/v1/predict", content=body, headers={"Content-Type": "application/json"})
        assert answered.status_code == 422 and "gpus" in answered.text  # the app read it and refused it


def test_a_kept_alive_connection_gets_a_new_header_clock_per_request(server):
    # Two requests on one connection, the second after longer than header_timeout: the idle
    # time between them is uvicorn's keep-alive, not a slow header.
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/healthz").status_code == 200
        threading.Event().wait(1.5)
        assert client.get("/healthz").status_code == 200
