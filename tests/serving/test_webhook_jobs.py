"""The webhook publisher's job-aware side against real HTTP servers on 127.0.0.1: the job map
GET from `jobs_url`, and checkpoint, placement and standby events, signed like the changes."""

import json
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serving.cost_policy import Hint
from serving.jobs import Job, JobMapUnreadable
from serving.publishers.webhook import IDEMPOTENCY_HEADER, SIGNATURE_HEADER, WebhookPublisher, signature
from tests.serving.test_webhook import SECRET, receiver  # noqa: F401 (the fixture)

JOB = Job("run-7", {"n1": 8, "n2": 8})


@pytest.fixture
def job_document():
    """A server answering GET /jobs.json with `box["body"]` and status `box["status"]`."""
    box = {"status": 200, "body": b'{"jobs": []}'}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(box["status"])
            self.end_headers()
            self.wfile.write(box["body"])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/jobs.json", box
    server.shutdown()
    server.server_close()


def publisher(url, **kw):
    return WebhookPublisher(url, SECRET, backoff=0.01, clock=lambda: datetime(2026, 1, 5, tzinfo=UTC), **kw)


def test_the_job_map_is_read_from_jobs_url(receiver, job_document):  # noqa: F811
    url, box = job_document
    box["body"] = json.dumps({"jobs": [{"id": "run-7", "nodes": {"n1": 8}, "start": "2026-01-05T00:00:00Z"}]}).encode()
    job_map = publisher(receiver[0], jobs_url=url).read_jobs()
    assert [(j.id, dict(j.gpus_on)) for j in job_map.jobs] == [("run-7", {"n1": 8})]
    box["status"] = 503
    with pytest.raises(JobMapUnreadable, match="no answer"):
        publisher(receiver[0], jobs_url=url).read_jobs()
    with pytest.raises(JobMapUnreadable, match="expected \\[publish\\] jobs_url"):
        publisher(receiver[0]).read_jobs()


def test_checkpoint_hints_are_signed_events(receiver):  # noqa: F811
    url, received, _ = receiver
    results = publisher(url).checkpoint([Hint(JOB, ("n1",), "job run-7 (16 GPUs) on risky n1")])
    assert results[0].ok and results[0].detail == "sent (HTTP 200)"
    headers, body = received[0]
    assert headers[SIGNATURE_HEADER] == signature(SECRET, body)
    payload = json.loads(body)
    assert headers[IDEMPOTENCY_HEADER] == payload["delivery_id"]
    (event,) = payload["events"]
    assert {k: event[k] for k in ("type", "job", "nodes", "reason")} == {
        "type": "checkpoint",
        "job": "run-7",
        "nodes": ["n1"],
        "reason": "job run-7 (16 GPUs) on risky n1",
    }


def test_a_refused_event_delivery_fails_every_hint(receiver):  # noqa: F811
    url, _, statuses = receiver
    statuses.extend([400])
    results = publisher(url).checkpoint([Hint(JOB, ("n1",), "r"), Hint(Job("b", {"n3": 1}), ("n3",), "r")])
    assert [r.ok for r in results] == [False, False] and "refused with HTTP 400" in results[0].detail


def test_placement_and_standby_events_carry_the_whole_set(receiver):  # noqa: F811
    url, received, _ = receiver
    pub = publisher(url)
    assert pub.place({"n2": 3, "n1": 0}, 4, apply=False)[0][1].detail == "would send placement levels of 2 nodes"
    assert received == []
    pub.place({"n2": 3, "n1": 0}, 4, apply=True)
    pub.standby(["n9", "n8"], apply=True)
    assert pub.standby([], apply=True) == []  # none to keep: nothing sent
    placement, standby = (json.loads(body)["events"][0] for _, body in received)
    assert (placement["type"], placement["count"], placement["levels"]) == ("placement", 4, {"n1": 0, "n2": 3})
    assert (standby["type"], standby["nodes"]) == ("standby", ["n8", "n9"])
