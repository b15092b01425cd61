"""The webhook publisher against a real HTTP receiver on 127.0.0.1 (started by the test)."""

import hashlib
import hmac
import json
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serving.publishers import Change
from serving.publishers.webhook import SIGNATURE_HEADER, WebhookPublisher, signature

SECRET = b"s3cret"
CHANGE = Change("gpu003", "none", "drain_now", 0.91, "node risk 0.910", ("g-1",), ("ecc_sbe_rate_24h",), "lgbm-1")


@pytest.fixture
def receiver():
    """A receiver answering with the given statuses in turn (then 200), recording each request."""
    received, statuses = [], []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((dict(self.headers), body))
            self.send_response(statuses.pop(0) if statuses else 200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/hook", received, statuses
    server.shutdown()
    server.server_close()


def publisher(url, **kw):
    return WebhookPublisher(url, SECRET, backoff=0.01, clock=lambda: datetime(2026, 1, 5, tzinfo=UTC), **kw)


def test_changes_are_posted_as_signed_json(receiver):
    url, received, _ = receiver
    results = publisher(url).apply([CHANGE])
    assert [r.ok for r in results] == [True] and results[0].detail == "sent (HTTP 200)"
    headers, body = received[0]
    expected = "sha256=" + hmac.new(SECRET, body, hashlib.sha256).hexdigest()
    assert headers[SIGNATURE_HEADER] == expected == signature(SECRET, body)
    payload = json.loads(body)
    assert payload["source"] == "gpufail" and payload["sent_at"] == "2026-01-05T00:00:00+00:00"
    assert payload["changes"] == [
        {
            "node": "gpu003",
            "from": "none",
            "to": "drain_now",
            "risk": 0.91,
            "reason": "node risk 0.910",
            "gpus": ["g-1"],
            "top_features": ["ecc_sbe_rate_24h"],
            "model_version": "lgbm-1",
        }
    ]


def test_server_errors_are_retried_with_back_off(receiver):
    url, received, statuses = receiver
    statuses.extend([503, 500])
    sleeps = []
    results = publisher(url, attempts=3, sleep=sleeps.append).apply([CHANGE])
    assert results[0].ok and len(received) == 3 and sleeps == [0.01, 0.02]


def test_a_refusal_is_not_retried_and_is_reported(receiver):
    url, received, statuses = receiver
    statuses.append(403)
    results = publisher(url, attempts=3).apply([CHANGE, CHANGE])
    assert len(received) == 1
    assert [r.ok for r in results] == [False, False] and "refused with HTTP 403" in results[0].detail


def test_an_unreachable_receiver_is_reported_after_the_tries():
    # A port that was just free on loopback: nothing listens there.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = publisher(f"http://127.0.0.1:{port}/hook", attempts=2, timeout=2).apply([CHANGE])
    assert not results[0].ok and "no answer after 2 tries" in results[0].detail


def test_nothing_is_sent_without_changes(receiver):
    url, received, _ = receiver
    assert publisher(url).apply([]) == [] and received == []
