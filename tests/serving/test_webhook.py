"""The webhook publisher against a real HTTP receiver on 127.0.0.1 (started by the test)."""

import hashlib
import hmac
import json
import threading
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serving.policy import PolicyConfig, PolicyState, Tier
from serving.publish import publish
from serving.publishers import Change
from serving.publishers.webhook import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WebhookPublisher,
    delivery_id,
    signature,
)

SECRET = b"s3cret"
SLOW_S = 5.0
"""How long a "slow" receiver holds its answer: far beyond the clients' time-out in these tests."""
CHANGE = Change("gpu003", "none", "drain_now", 0.91, "node risk 0.910", ("g-1",), ("ecc_sbe_rate_24h",), "lgbm-1")


@pytest.fixture
def receiver():
    """A receiver answering with the given statuses in turn (then 200), recording each request;
    a status "slow" answers 200 only after the client has given up waiting (it acted, the
    sender does not know)."""
    received, statuses = [], []
    answered = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((dict(self.headers), body))
            status = statuses.pop(0) if statuses else 200
            if status == "slow":
                answered.wait(SLOW_S)
                status = 200
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/hook", received, statuses
    answered.set()
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
    assert headers[TIMESTAMP_HEADER] == str(int(datetime(2026, 1, 5, tzinfo=UTC).timestamp()))
    assert headers[IDEMPOTENCY_HEADER] == payload["delivery_id"] == delivery_id([CHANGE])
    assert payload["changes"] == [
        {
            "id": CHANGE.change_id,
            "cluster": "",
            "node": "gpu003",
            "from": "none",
            "to": "drain_now",
            "risk": 0.91,
            "reason": "node risk 0.910",
            "gpus": ["g-1"],
            "top_features": ["ecc_sbe_rate_24h"],
            "model_version": "lgbm-1",
            "alarm": "failure",
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


def test_a_receiver_that_timed_out_gets_every_copy_with_the_same_idempotency_key(receiver):
    url, received, statuses = receiver
    statuses.extend(["slow", "slow"])
    results = publisher(url, attempts=3, timeout=0.3).apply([CHANGE])
    assert results[0].ok and len(received) == 3  # the receiver got 3 copies of one delivery
    keys = {headers[IDEMPOTENCY_HEADER] for headers, _ in received}
    stamps = {headers[TIMESTAMP_HEADER] for headers, _ in received}
    assert len(keys) == 1 and len(stamps) == 1 and len({body for _, body in received}) == 1
    assert keys == {json.loads(received[0][1])["delivery_id"]}


CONFIG = PolicyConfig(
    tiers=(Tier("avoid", 0.35, 0.25), Tier("drain_now", 0.8, 0.6)),
    recovery_period=timedelta(0),
    cooldown=timedelta(0),
    breaker_max_nodes=10,
)
NOW = datetime(2026, 1, 5, 12, tzinfo=UTC)


def fleet(risks):
    import pandas as pd

    return pd.DataFrame(
        {
            "cluster": "c1",
            "node": list(risks),
            "gpu_index": 0,
            "gpu_uuid": [f"{n}-g0" for n in risks],
            "risk": list(risks.values()),
            "model_version": "lgbm-1",
        }
    )


def test_a_decision_never_acknowledged_is_sent_by_the_next_run_with_the_same_key(receiver):
    url, received, statuses = receiver
    statuses.extend([503, 503])
    first = publish(
        fleet({"n1": 0.9, "n2": 0.1}), publisher(url, attempts=2), CONFIG, PolicyState(), mode="live", now=NOW
    )
    assert first.state.nodes["c1/n1"].applied == "none" and len(received) == 2
    later = NOW + timedelta(hours=1)
    second = publish(fleet({"n1": 0.92, "n2": 0.1}), publisher(url), CONFIG, first.state, mode="live", now=later)
    assert second.state.nodes["c1/n1"].applied == "drain_now" and len(received) == 3
    assert len({headers[IDEMPOTENCY_HEADER] for headers, _ in received}) == 1
    assert len({json.loads(body)["changes"][0]["id"] for _, body in received}) == 1
    # Another decision is another delivery: n1 back to none, then raised again later.
    calm = publish(
        fleet({"n1": 0.1, "n2": 0.1}), publisher(url), CONFIG, second.state, mode="live", now=later + timedelta(days=2)
    )
    again = publish(
        fleet({"n1": 0.9, "n2": 0.1}), publisher(url), CONFIG, calm.state, mode="live", now=later + timedelta(days=3)
    )
    assert again.state.nodes["c1/n1"].applied == "drain_now"
    keys = [headers[IDEMPOTENCY_HEADER] for headers, _ in received]
    assert len(keys) == 5 and len(set(keys)) == 3


def test_a_url_with_a_user_part_is_sent_with_basic_authentication(receiver):
    import base64

    url, received, _ = receiver
    with_user = url.replace("http://", "http://hooks:pa%2055@")
    results = publisher(with_user).apply([CHANGE])
    assert results[0].ok, results[0].detail
    headers, _ = received[0]
    assert headers["Authorization"] == "Basic " + base64.b64encode(b"hooks:pa 55").decode()


def test_a_straggler_is_posted_as_a_change_and_a_fail_slow_event(receiver):
    url, received, _ = receiver
    reason = "fail-slow: GPU g-7 runs 12.0% slower than its peers (fail-slow score 0.120 >= 0.05); node risk 0.010"
    slow = Change("gpu005", "none", "avoid", 0.01, reason, ("g-7",), (), "lgbm-1")
    assert [r.ok for r in publisher(url).apply([CHANGE, slow])] == [True, True]
    payload = json.loads(received[0][1])
    assert [c["alarm"] for c in payload["changes"]] == ["failure", "fail_slow"]
    assert payload["events"] == [
        {
            "type": "fail_slow",
            "id": slow.change_id,
            "node": "gpu005",
            "gpus": ["g-7"],
            "tier": "avoid",
            "reason": reason,
        }
    ]
    assert "events" not in json.loads(publisher(url).body([CHANGE]))  # none without a straggler
