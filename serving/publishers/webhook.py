"""The webhook publisher, for custom schedulers: each run's tier changes as one JSON POST.

Body: `{"source": "gpufail", "delivery_id": ..., "sent_at": ISO time, "changes": [{id, cluster,
node, from, to, risk, reason, gpus, top_features, model_version, alarm}, ...]}` (a receiver of
several clusters tells nodes of the same name apart by `cluster`; `alarm` is `failure`, or
`fail_slow` for a straggler's node, which the same body also carries as an event
`{"type": "fail_slow", id, node, gpus, tier, reason}` in `events`). Headers:
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

Only a 2xx answer is a delivery. Redirects are not followed as a browser would: a 301, 302 or
303 would turn the POST into a GET without the body (whose 200 says nothing about the
delivery), so they are refused, as is a 307 or 308 to another origin (scheme, host and port:
the signature is not sent elsewhere); a 307 or 308 within the configured URL's origin is
posted again there with the same body and headers, up to `MAX_REDIRECTS` times. A refused
delivery leaves the state as it was, so the next run sends it again.

A URL with a user part (`https://user:password@host/...`) is sent with basic authentication.
The URL is shown masked (`ingest.urls.described_url`: chat webhooks carry their key in the
path) in every result, and so in the audit and on the pages.

Job-aware actions (docs/actions.md) go as separate deliveries, signed the same way, of
`{"source", "delivery_id", "sent_at", "events": [...]}` with events of type `checkpoint`,
`placement` and `standby`; the job map is read from `jobs_url` (`serving.jobs`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ingest.urls import described_url
from serving.cost_policy import Hint
from serving.jobs import JobMap, JobMapUnreadable, read_job_document
from serving.publishers import Applied, Change, NodeView, SchedulerUnavailable, with_retries

SIGNATURE_HEADER = "X-Gpufail-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
TIMESTAMP_HEADER = "X-Gpufail-Timestamp"
MAX_REDIRECTS = 3
"""307/308 redirects within the origin followed for one delivery."""
REPOSTED = frozenset({307, 308})
"""The redirects that keep the method and body (RFC 9110 15.4)."""


def signature(secret: bytes, body: bytes) -> str:
    """The value of `SIGNATURE_HEADER` for `body`."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def delivery_id(changes: Sequence[Change]) -> str:
    """The idempotency key of a delivery of `changes` (independent of their order)."""
    return hashlib.sha256("\n".join(sorted(c.change_id for c in changes)).encode()).hexdigest()[:32]


class _Retryable(RuntimeError):
    pass


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Every 3xx reaches the caller as an `HTTPError` (with its Location), never followed."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _without_user(url: str) -> tuple[str, str]:
    """`url` without its user part, and that part as an `Authorization: Basic` value ('' when
    none): urllib would take `user:password@host` for the host name."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return url, ""
    user = urllib.parse.unquote(parts.username) + ":" + urllib.parse.unquote(parts.password or "")
    netloc = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)), "Basic " + base64.b64encode(user.encode()).decode()


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or ""), parts.port or default


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
                    "cluster": c.cluster,
                    "node": c.node,
                    "from": c.old,
                    "to": c.new,
                    "risk": c.risk,
                    "reason": c.reason,
                    "gpus": list(c.gpus),
                    "top_features": list(c.top_features),
                    "model_version": c.model_version,
                    "alarm": c.alarm,
                }
                for c in changes
            ],
        }
        stragglers = [c for c in changes if c.alarm == "fail_slow"]
        if stragglers:
            # The fail_slow alarm class as events too, like the job-aware ones: a receiver that
            # only handles events learns which nodes to keep large gang jobs off, and why.
            payload["events"] = [
                {
                    "type": "fail_slow",
                    "id": c.change_id,
                    "node": c.node,
                    "gpus": list(c.gpus),
                    "tier": c.new,
                    "reason": c.reason,
                }
                for c in stragglers
            ]
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
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: signature(self.secret, body),
            IDEMPOTENCY_HEADER: key,
            TIMESTAMP_HEADER: str(int(sent_at.timestamp())),
        }
        shown = described_url(self.url)
        start, credentials = _without_user(self.url)
        if credentials:
            headers["Authorization"] = credentials

        def post() -> int:
            url = start
            for _ in range(MAX_REDIRECTS + 1):
                # A new request per hop, the same bytes and headers on each hop and each retry.
                request = urllib.request.Request(url, data=body, method="POST", headers=headers)
                try:
                    with _OPENER.open(request, timeout=self.timeout) as response:
                        return int(response.status)
                except urllib.error.HTTPError as exc:
                    if 300 <= exc.code < 400:
                        exc.close()
                        url = self._redirected(url, exc, shown)
                        continue
                    if exc.code == 429 or exc.code >= 500:
                        raise _Retryable(f"HTTP {exc.code} {exc.reason}") from None
                    raise SchedulerUnavailable(f"webhook {shown}: refused with HTTP {exc.code} {exc.reason}") from None
                except (urllib.error.URLError, OSError) as exc:
                    raise _Retryable(str(getattr(exc, "reason", exc))) from None
            raise SchedulerUnavailable(
                f"webhook {shown}: redirected more than {MAX_REDIRECTS} times; not delivered: set [publish] "
                "webhook_url to the address that answers"
            )

        try:
            status = with_retries(
                post,
                what=f"webhook {shown}",
                attempts=self.attempts,
                backoff=self.backoff,
                retry_on=(_Retryable,),
                sleep=self.sleep,
            )
        except SchedulerUnavailable as exc:
            return False, f"failed: {exc}"
        return True, f"sent (HTTP {status})"

    def _redirected(self, url: str, answer: urllib.error.HTTPError, shown: str) -> str:
        """Where a 3xx answer to a POST of ours may be posted again (a 307/308 within the
        configured URL's origin); `SchedulerUnavailable` for any other redirect."""
        location = answer.headers.get("Location", "") if answer.headers else ""
        target = urllib.parse.urljoin(url, location) if location else ""
        to = f" to {described_url(target)}" if target else " without a Location"
        if answer.code in REPOSTED and target and _origin(target) == _origin(self.url):
            return target
        why = (
            "a redirect to another origin is not followed (the signature stays with the configured origin)"
            if answer.code in REPOSTED and target
            else "a redirect is not a delivery (a client would repeat the POST as a GET without its body)"
        )
        raise SchedulerUnavailable(
            f"webhook {shown}: redirected with HTTP {answer.code}{to}; {why}: not delivered, sent again next run; "
            "set [publish] webhook_url to the address that answers"
        )


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]
