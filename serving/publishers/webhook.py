"""The webhook publisher, for custom schedulers: each run's tier changes as one JSON POST.

Body: `{"source": "gpufail", "sent_at": ISO time, "changes": [{node, from, to, risk, reason,
gpus, top_features, model_version}, ...]}`. Header `X-Gpufail-Signature: sha256=<hex>` is the
HMAC-SHA256 of the exact body bytes with the shared secret, so a receiver can check that the
message is ours and unchanged (compare with `hmac.compare_digest`). Connection errors, time-outs,
HTTP 429 and 5xx are retried with exponential back-off; another 4xx is not (it will not get
better by itself). A run with no change sends nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from serving.publishers import Applied, Change, NodeView, SchedulerUnavailable, with_retries

SIGNATURE_HEADER = "X-Gpufail-Signature"


def signature(secret: bytes, body: bytes) -> str:
    """The value of `SIGNATURE_HEADER` for `body`."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


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
    name = "webhook"

    def observe(self, nodes: Sequence[str]) -> dict[str, NodeView]:
        # A webhook receiver has no node list to read: every node may be published.
        return {node: NodeView() for node in nodes}

    def body(self, changes: Sequence[Change]) -> bytes:
        payload = {
            "source": "gpufail",
            "sent_at": self.clock().isoformat(),
            "changes": [
                {
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
        body = self.body(changes)
        request = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", SIGNATURE_HEADER: signature(self.secret, body)},
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
            return [Applied(False, f"failed: {exc}") for _ in changes]
        return [Applied(True, f"sent (HTTP {status})") for _ in changes]
