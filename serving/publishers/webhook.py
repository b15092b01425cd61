"""The webhook publisher, for custom schedulers: each run's tier changes as one JSON POST.

Body: `{"source": "gpufail", "delivery_id": ..., "sent_at": ISO time, "changes": [{id, node,
from, to, risk, reason, gpus, top_features, model_version}, ...]}`. Headers:
- `X-Gpufail-Signature: sha256=<hex>`: the HMAC-SHA256 of the exact body bytes with the shared
  secret, so a receiver can check that the message is ours and unchanged (compare with
  `hmac.compare_digest`);
- `Idempotency-Key`: the delivery id, a digest of the ids of its changes. A change's id names
  the decision (node, from, to, and when the policy decided it: `Change.change_id`), so every
  retry of a delivery carries the same key: the retries after a time-out within a run (the
  same bytes), and the next runs' deliveries of a change that was never acknowledged (state
  not advanced). A receiver that keeps the keys it has acted on can ignore the copies; one
  that acts per change can keep the change ids instead (a later delivery may group them
  differently);
- `X-Gpufail-Timestamp`: the body's `sent_at` in Unix seconds, for a receiver that refuses
  old messages (the body, and so the time, is signed).
Connection errors, time-outs, HTTP 429 and 5xx are retried with exponential back-off; another
4xx is not (it will not get better by itself). A run with no change sends nothing.

Job-aware actions (docs/actions.md) go as separate deliveries, signed the same way, of
`{"source", "delivery_id", "sent_at", "events": [...]}` with events of type `checkpoint`,
`placement` and `standby`; the job map is read from `jobs_url` (`serving.jobs`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from serving.cost_policy import Hint
from serving.jobs import JobMap, JobMapUnreadable, read_job_document
from serving.publishers import Applied, Change, NodeView, SchedulerUnavailable, with_retries

SIGNATURE_HEADER = "X-Gpufail-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
TIMESTAMP_HEADER = "X-Gpufail-Timestamp"


def signature(secret: bytes, body: bytes) -> str:
    """The value of `SIGNATURE_HEADER` for `body`."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def delivery_id(changes: Sequence[Change]) -> str:
    """The idempotency key of a delivery of `changes` (independent of their order)."""
    return hashlib.sha256("\n".join(sorted(c.change_id for c in changes)).encode()).hexdigest()[:32]


class _Retryable(RuntimeError):
    pass


@dataclass
class WebhookPublisher:
    url: str
    secret: bytes
    timeout: float = 10.0
    attempts: int = 3
    backoff: float = 2.0
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    sleep: Callable[[float], None] = time.sleep
    jobs_url: str = ""
    """Where the receiver's side publishes its job map (a URL or a file; '' = none)."""
    name = "webhook"

    def observe(self, nodes: Sequence[str]) -> dict[str, NodeView]:
        # A webhook receiver has no node list to read: every node may be published.
        return {node: NodeView() for node in nodes}

    def body(self, changes: Sequence[Change], sent_at: datetime | None = None) -> bytes:
        payload = {
            "source": "gpufail",
            "delivery_id": delivery_id(changes),
            "sent_at": (sent_at or self.clock()).isoformat(),
            "changes": [
                {
                    "id": c.change_id,
                    "node": c.node,
                    "from": c.old,
                    "to": c.new,
                    "risk": c.risk,
                    "reason": c.reason,
                    "gpus": list(c.gpus),
                    "top_features": list(c.top_features),
                    "model_version": c.model_version,
                }
                for c in changes
            ],
        }
        return json.dumps(payload, sort_keys=True).encode()

    def apply(self, changes: Sequence[Change]) -> list[Applied]:
        if not changes:
            return []
        sent_at = self.clock()
        ok, detail = self._post(self.body(changes, sent_at), delivery_id(changes), sent_at)
        return [Applied(ok, detail) for _ in changes]

    # --- job-aware actions (docs/actions.md) ----------------------------------------------

    def read_jobs(self) -> JobMap:
        """The job map the receiver's side publishes at `jobs_url` (`serving.jobs.job_map_from_document`)."""
        if not self.jobs_url:
            raise JobMapUnreadable(
                "webhook: no job map; expected [publish] jobs_url (a URL or file of the job document)"
            )
        return read_job_document(self.jobs_url, self.timeout)

    def checkpoint(self, hints: Sequence[Hint]) -> list[Applied]:
        """One delivery of `checkpoint` events, one per job."""
        if not hints:
            return []
        events = [
            {
                "type": "checkpoint",
                "id": _digest(f"checkpoint\x00{h.job.id}\x00{self.clock().isoformat()}"),
                "job": h.job.id,
                "nodes": list(h.nodes),
                "reason": h.reason,
            }
            for h in hints
        ]
        ok, detail = self._send_events(events)
        return [Applied(ok, detail) for _ in hints]

    def place(self, levels: Mapping[str, int], count: int, apply: bool) -> list[tuple[str, Applied]]:
        """One `placement` event with every node's level (0 = healthiest of `count`); the
        receiver keeps no state of ours to compare, so each run sends the whole map."""
        if not levels:
            return []
        if not apply:
            return [("", Applied(True, f"would send placement levels of {len(levels)} nodes"))]
        event = {"type": "placement", "count": count, "levels": dict(sorted(levels.items()))}
        event["id"] = _digest(json.dumps(event, sort_keys=True))
        ok, detail = self._send_events([event])
        return [("", Applied(ok, f"{detail}: placement levels of {len(levels)} nodes"))]

    def standby(self, nodes: Sequence[str], apply: bool) -> list[tuple[str, Applied]]:
        """One `standby` event naming the standby nodes (the whole set, each run; nothing when
        there are none to keep: a receiver lets a standby list expire when no event renews it)."""
        if not nodes:
            return []
        if not apply:
            return [("", Applied(True, f"would send standby nodes {', '.join(sorted(nodes)) or '(none)'}"))]
        event: dict[str, Any] = {"type": "standby", "nodes": sorted(nodes)}
        event["id"] = _digest(json.dumps(event, sort_keys=True))
        ok, detail = self._send_events([event])
        return [("", Applied(ok, f"{detail}: standby {', '.join(sorted(nodes)) or '(none)'}"))]

    def _send_events(self, events: list[dict[str, Any]]) -> tuple[bool, str]:
        sent_at = self.clock()
        key = _digest("\n".join(sorted(str(e["id"]) for e in events)))
        payload = {"source": "gpufail", "delivery_id": key, "sent_at": sent_at.isoformat(), "events": events}
        return self._post(json.dumps(payload, sort_keys=True).encode(), key, sent_at)

    def _post(self, body: bytes, key: str, sent_at: datetime) -> tuple[bool, str]:
        """POST `body`, signed, with idempotency key `key`; (acknowledged, what happened)."""
        # One request object for every try: each retry sends the same bytes and headers.
        request = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                SIGNATURE_HEADER: signature(self.secret, body),
                IDEMPOTENCY_HEADER: key,
                TIMESTAMP_HEADER: str(int(sent_at.timestamp())),
            },
        )

        def post() -> int:
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return int(response.status)
            except urllib.error.HTTPError as exc:
                if exc.code == 429 or exc.code >= 500:
                    raise _Retryable(f"HTTP {exc.code} {exc.reason}") from None
                raise SchedulerUnavailable(f"webhook {self.url}: refused with HTTP {exc.code} {exc.reason}") from None
            except (urllib.error.URLError, OSError) as exc:
                raise _Retryable(str(getattr(exc, "reason", exc))) from None

        try:
            status = with_retries(
                post,
                what=f"webhook {self.url}",
                attempts=self.attempts,
                backoff=self.backoff,
                retry_on=(_Retryable,),
                sleep=self.sleep,
            )
        except SchedulerUnavailable as exc:
            return False, f"failed: {exc}"
        return True, f"sent (HTTP {status})"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]
