"""Scheduler publishers: how each risk tier reaches a scheduler, and how it is undone.

Every publisher has the same small interface (`Publisher`): `observe` reads what the scheduler
says about the nodes (which may be touched, which are down or drained by an operator), and
`apply` moves nodes from the tier the scheduler was last told to a new one, returning one
`Applied` per change. A publisher changes and removes only marks it made itself (a reason
prefix, a taint key, a label, a condition type), so an operator's decisions are never undone.

A scheduler that cannot be reached raises `SchedulerUnavailable` after `with_retries` gave up;
the caller records it and tries again at the next run.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, TypeVar

from ingest.errors import GpufailError
from serving.policy import FAIL_SLOW_REASON

REASON_PREFIX = "gpufail:"
"""Every drain reason, condition message and annotation of ours starts with this."""

T = TypeVar("T")


class SchedulerUnavailable(GpufailError):
    """The scheduler did not answer (after retries); nothing was changed by this call."""


@dataclass(frozen=True)
class NodeView:
    """What the scheduler says about one node."""

    exists: bool = True
    unavailable: str = ""
    """Why the node must not be touched ('' if it may be): down, drained by an operator, ..."""


@dataclass(frozen=True)
class Change:
    """Move `node` from the tier the scheduler was last told (`old`) to `new`."""

    node: str
    old: str
    new: str
    risk: float
    reason: str
    gpus: tuple[str, ...] = ()
    top_features: tuple[str, ...] = ()
    model_version: str = ""
    saved: Mapping[str, Any] = field(default_factory=dict)
    """What this publisher saved when it first marked the node (to restore it)."""
    decided_at: datetime | None = None
    """When the policy moved the node to `new`: with node, old and new, it names the decision,
    the same on every retry of it (a change that did not reach the scheduler is sent again by
    the next run) and different for a later decision between the same tiers."""
    cluster: str = ""
    """The node's cluster (two clusters may have nodes of the same name)."""

    @property
    def alarm(self) -> str:
        """The alarm class the change acts on: `fail_slow` (a straggler, `serving.policy`'s
        fail-slow rule) or `failure` (the risk of failing)."""
        return alarm_class(self.reason)

    @property
    def change_id(self) -> str:
        """A stable id of this decision (see `decided_at`), for receivers to deduplicate on."""
        decided = self.decided_at.isoformat() if self.decided_at else ""
        named = f"{self.cluster}/{self.node}" if self.cluster else self.node
        return hashlib.sha256(f"{named}\x00{self.old}\x00{self.new}\x00{decided}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Applied:
    ok: bool
    detail: str
    saved: Mapping[str, Any] = field(default_factory=dict)


class Publisher(Protocol):
    name: str

    def observe(self, nodes: Sequence[str]) -> dict[str, NodeView]:
        """The scheduler's view of `nodes` (a node it does not know has `exists=False`)."""
        ...

    def apply(self, changes: Sequence[Change]) -> list[Applied]:
        """Make each change; one result per change, in order. Never raises for one node's
        failure: that node's result says what went wrong."""
        ...


def publisher_notices(publisher: Any) -> list[str]:
    """What a publisher has to tell the operator beyond the per-node decisions (e.g. Slurm
    drains of ours it has no record of), from its optional `notices()` method."""
    notices = getattr(publisher, "notices", None)
    return list(notices()) if callable(notices) else []


def with_retries(
    call: Callable[[], T],
    *,
    what: str,
    attempts: int,
    backoff: float,
    retry_on: tuple[type[BaseException], ...],
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`call()`, retried up to `attempts` times in all with exponential back-off (backoff,
    2 x backoff, ...) on `retry_on`; then `SchedulerUnavailable` naming `what` and the last error."""
    last: BaseException | None = None
    for attempt in range(max(attempts, 1)):
        if attempt:
            sleep(backoff * 2 ** (attempt - 1))
        try:
            return call()
        except retry_on as exc:
            last = exc
    raise SchedulerUnavailable(f"{what}: no answer after {max(attempts, 1)} tries ({last})")


def alarm_class(reason: str) -> str:
    """`fail_slow` for a decision the policy made for a straggler (its reason says so first),
    else `failure`."""
    return "fail_slow" if reason.startswith(FAIL_SLOW_REASON) else "failure"


def tier_phrase(tier: str) -> str:
    return tier.replace("_", "-")
