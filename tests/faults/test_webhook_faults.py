"""The webhook publisher against a receiver that redirects (a real HTTP server on 127.0.0.1):
only a 2xx from the configured URL, or from a 307/308 target within its origin posted again
with the same body and signature, is a delivery. Anything else leaves the policy state where
it was, so the next run sends the same change again."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pandas as pd
import pytest

from serving.policy import PolicyConfig, PolicyState, Tier
from serving.publish import publish
from serving.publishers.webhook import IDEMPOTENCY_HEADER, SIGNATURE_HEADER, WebhookPublisher, signature

SECRET = b"hook-secret-5f1"
CONFIG = PolicyConfig(
    tiers=(Tier("avoid", 0.35, 0.25), Tier("drain_now", 0.8, 0.6)),
    recovery_period=timedelta(0),
    cooldown=timedelta(0),
    breaker_max_nodes=10,
)
NOW = datetime(2026, 1, 5, 12, tzinfo=UTC)


@dataclass
class Receiver:
    """An HTTP server: `redirects` maps a path to (status, Location) answered to any method;
    every other path answers 200. `requests` records (method, path, headers, body)."""

    origin: str
    redirects: dict[str, tuple[int, str]] = field(default_factory=dict)
    requests: list[tuple[str, str, dict[str, str], bytes]] = field(default_factory=list)

    def posts(self, path: str) -> list[tuple[dict[str, str], bytes]]:
        return [(h, b) for m, p, h, b in self.requests if m == "POST" and p == path]


def _start(servers: list[ThreadingHTTPServer]) -> Receiver:
    receiver = Receiver("")

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            receiver.requests.append((self.command, self.path, dict(self.headers), body))
            status, location = receiver.redirects.get(self.path, (200, ""))
            self.send_response(status)
            if location:
                self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = do_PUT = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    servers.append(server)
    receiver.origin = f"http://127.0.0.1:{server.server_port}"
    return receiver


@pytest.fixture
def receivers() -> Iterator[tuple[Receiver, Receiver]]:
    """Two receivers: the configured one, and another origin (another port)."""
    servers: list[ThreadingHTTPServer] = []
    yield _start(servers), _start(servers)
    for server in servers:
        server.shutdown()
        server.server_close()


def fleet(risk: float) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "cluster": "c1",
            "node": ["n1", "n2"],
            "gpu_index": 0,
            "gpu_uuid": ["n1-g0", "n2-g0"],
            "risk": [risk, 0.05],
            "model_version": "lgbm-1",
        }
    )


def run(url: str, state: PolicyState, now: datetime = NOW) -> Any:
    publisher = WebhookPublisher(url, SECRET, attempts=2, backoff=0.01, timeout=5, clock=lambda: now)
    return publish(fleet(0.9), publisher, CONFIG, state, mode="live", now=now)


def delivered(receiver: Receiver, path: str) -> list[dict[str, Any]]:
    """The changes POSTed to `path` with a valid signature."""
    out = []
    for headers, body in receiver.posts(path):
        assert headers[SIGNATURE_HEADER] == signature(SECRET, body)
        out.extend(json.loads(body)["changes"])
    return out


@pytest.mark.parametrize(
    ("status", "location"),
    [
        (301, "/moved"),  # relative
        (302, "{origin}/moved"),  # absolute, same origin
        (303, "/moved"),
        (301, "https://127.0.0.1:{port}/hook"),  # a load balancer's http -> https
        (302, "{other}/hook"),  # another origin
    ],
)
def test_a_redirect_that_would_drop_the_body_is_not_a_delivery_and_the_next_run_sends_it(receivers, status, location):
    hook, other = receivers
    port = hook.origin.rsplit(":", 1)[1]
    hook.redirects["/hook"] = (status, location.format(origin=hook.origin, other=other.origin, port=port))
    first = run(f"{hook.origin}/hook", PolicyState())
    n1 = next(r for r in first.rows if r.node == "n1")
    assert n1.result.startswith("failed:") and f"redirected with HTTP {status}" in n1.result
    assert first.state.nodes["c1/n1"].applied == "none"  # the state did not advance
    # Nothing followed the redirect: no GET (which a 200 would have made "sent"), no POST there.
    assert [(m, p) for m, p, _, _ in hook.requests] == [("POST", "/hook")]
    assert other.requests == []
    # The receiver is fixed: the next run delivers the same change (same id) and advances.
    del hook.redirects["/hook"]
    later = NOW + timedelta(hours=1)
    second = run(f"{hook.origin}/hook", first.state, later)
    assert second.state.nodes["c1/n1"].applied == "drain_now"
    changes = delivered(hook, "/hook")
    assert [c["node"] for c in changes] == ["n1", "n1"] and len({c["id"] for c in changes}) == 1


@pytest.mark.parametrize("status", [307, 308])
def test_a_307_or_308_within_the_origin_is_posted_again_with_its_body_and_signature(receivers, status):
    hook, other = receivers
    hook.redirects["/hook"] = (status, "/v2/hook")
    first = run(f"{hook.origin}/hook", PolicyState())
    assert first.state.nodes["c1/n1"].applied == "drain_now"
    assert next(r for r in first.rows if r.node == "n1").result == "sent (HTTP 200)"
    (sent_headers, sent_body), (moved_headers, moved_body) = hook.posts("/hook")[0], hook.posts("/v2/hook")[0]
    assert moved_body == sent_body
    assert moved_headers[SIGNATURE_HEADER] == sent_headers[SIGNATURE_HEADER] == signature(SECRET, moved_body)
    assert moved_headers[IDEMPOTENCY_HEADER] == sent_headers[IDEMPOTENCY_HEADER]
    assert [c["node"] for c in delivered(hook, "/v2/hook")] == ["n1"]
    assert other.requests == []


@pytest.mark.parametrize("status", [307, 308])
def test_a_307_or_308_elsewhere_or_in_a_loop_is_refused_and_sent_again_next_run(receivers, status):
    hook, other = receivers
    hook.redirects["/hook"] = (status, f"{other.origin}/hook")  # the signature stays with its origin
    hook.redirects["/loop"] = (status, "/loop")
    for path, why in (("/hook", "another origin"), ("/loop", "more than 3 times")):
        out = run(f"{hook.origin}{path}", PolicyState())
        assert out.state.nodes["c1/n1"].applied == "none"
        assert why in next(r for r in out.rows if r.node == "n1").result
    assert other.requests == []
    # A within-origin 307/308 is followed; the first run above was refused: its retry goes through.
    hook.redirects["/hook"] = (status, "/v2/hook")
    again = run(f"{hook.origin}/hook", PolicyState(), NOW + timedelta(hours=1))
    assert again.state.nodes["c1/n1"].applied == "drain_now"
    assert [c["node"] for c in delivered(hook, "/v2/hook")] == ["n1"]
