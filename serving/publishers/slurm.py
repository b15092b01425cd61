"""The Slurm publisher, through `scontrol` and `sinfo --json` run as subprocesses.

Slurm 22.05 (Debian bookworm) has no `scontrol --json`, its slurmrestd cannot update nodes and
there is no pyslurm for it, so the command-line tools are the interface (INFRA.md).

Tiers on a node:
- `watch`: nothing (audit only);
- `avoid`: the node's scheduling weight raised to `avoid_weight` (Slurm fills lower weights
  first, so large jobs land elsewhere while there is room); the previous weight is saved and
  restored when the node leaves the tier, unless someone changed the weight meanwhile;
- `drain_after_job` and `drain_now`: `State=DRAIN` with a reason starting with `gpufail:`.
  A Slurm drain lets running jobs finish in both; the reason says which tier asked, so an
  operator can cancel or requeue the job on a `drain-now` node. Ending jobs is left to people.

Safety: a node that is down, failed, or drained with a reason that is not ours is reported
unavailable and never touched; a node is resumed only while its drain reason is ours.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from serving.policy import tier_rank
from serving.publishers import REASON_PREFIX, Applied, Change, NodeView, SchedulerUnavailable, tier_phrase, with_retries

UNAVAILABLE_STATES = frozenset({"down", "future", "unknown", "error"})
BLOCKING_FLAGS = frozenset(
    {"DRAIN", "DRAINED", "DRAINING", "FAIL", "NOT_RESPONDING", "REBOOT_REQUESTED", "MAINTENANCE"}
)


class _CommandFailed(RuntimeError):
    pass


@dataclass
class SlurmPublisher:
    name = "slurm"
    bin_dir: str = ""
    """Folder of `sinfo`/`scontrol` ('' = PATH)."""
    slurm_conf: str = ""
    """SLURM_CONF for the commands ('' = Slurm's default)."""
    avoid_weight: int = 100_000
    timeout: float = 30.0
    attempts: int = 3
    backoff: float = 2.0

    def __post_init__(self) -> None:
        self._nodes: dict[str, dict[str, Any]] = {}

    def _run(self, *argv: str) -> str:
        tool = os.path.join(self.bin_dir, argv[0]) if self.bin_dir else argv[0]
        env = {**os.environ, "SLURM_CONF": self.slurm_conf} if self.slurm_conf else None
        try:
            done = subprocess.run([tool, *argv[1:]], capture_output=True, text=True, timeout=self.timeout, env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise _CommandFailed(f"{argv[0]}: {exc}") from None
        if done.returncode != 0:
            raise _CommandFailed(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[:300]}")
        return done.stdout

    def _call(self, *argv: str) -> str:
        return with_retries(
            lambda: self._run(*argv),
            what=f"slurm ({argv[0]})",
            attempts=self.attempts,
            backoff=self.backoff,
            retry_on=(_CommandFailed,),
        )

    def _sinfo(self) -> dict[str, dict[str, Any]]:
        text = self._run("sinfo", "--json")
        try:
            answer = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _CommandFailed(f"sinfo --json: not JSON ({exc})") from None
        # With the controller unreachable, 22.05's sinfo --json exits 0 with an "errors" list.
        errors = answer.get("errors") if isinstance(answer, dict) else None
        if errors:
            raise _CommandFailed(f"sinfo --json reported {errors}")
        try:
            return {str(r["name"]): r for r in answer["nodes"]}
        except (KeyError, TypeError) as exc:
            raise _CommandFailed(f"sinfo --json: not Slurm's node list (no {exc})") from None

    def read_nodes(self) -> dict[str, dict[str, Any]]:
        """Node name -> its `sinfo --json` record."""
        self._nodes = with_retries(
            self._sinfo, what="slurm (sinfo)", attempts=self.attempts, backoff=self.backoff, retry_on=(_CommandFailed,)
        )
        return self._nodes

    def observe(self, nodes: Sequence[str]) -> dict[str, NodeView]:
        known = self.read_nodes()
        return {
            n: _view(known[n]) if n in known else NodeView(exists=False, unavailable="not a node of this Slurm cluster")
            for n in nodes
        }

    def apply(self, changes: Sequence[Change]) -> list[Applied]:
        if not changes:
            return []
        try:
            known = self.read_nodes()
        except SchedulerUnavailable as exc:
            return [Applied(False, f"failed: {exc}") for _ in changes]
        return [self._apply_one(c, known.get(c.node)) for c in changes]

    def _apply_one(self, change: Change, record: Mapping[str, Any] | None) -> Applied:
        if record is None:
            return Applied(False, "skipped: not a node of this Slurm cluster")
        view = _view(record)
        if view.unavailable:
            return Applied(False, f"skipped: {view.unavailable}")
        saved = dict(change.saved)
        done = []
        try:
            if _drains(change.new):
                reason = f"{REASON_PREFIX} {tier_phrase(change.new)} risk={change.risk:.2f}"
                if change.model_version:
                    reason += f" model={change.model_version}"
                self._call("scontrol", "update", f"NodeName={change.node}", "State=DRAIN", f"Reason={reason}")
                done.append("drained")
            elif _drains(change.old) and _drained_by_us(record):
                self._call("scontrol", "update", f"NodeName={change.node}", "State=RESUME")
                done.append("resumed")
            if _weighs(change.new) and not _weighs(change.old):
                saved["weight"] = int(record.get("weight", 1))
                self._call("scontrol", "update", f"NodeName={change.node}", f"Weight={self.avoid_weight}")
                done.append(f"weight {saved['weight']} -> {self.avoid_weight}")
            elif _weighs(change.old) and not _weighs(change.new):
                if int(record.get("weight", -1)) == self.avoid_weight:
                    previous = int(saved.pop("weight", 1))
                    self._call("scontrol", "update", f"NodeName={change.node}", f"Weight={previous}")
                    done.append(f"weight restored to {previous}")
                else:
                    saved.pop("weight", None)
                    done.append(f"weight left at {record.get('weight')} (changed by someone else)")
        except SchedulerUnavailable as exc:
            return Applied(False, f"failed: {exc}" + (f" (after: {', '.join(done)})" if done else ""), saved)
        return Applied(True, ", ".join(done) or "nothing to change in Slurm", saved)


def _drains(tier: str) -> bool:
    return tier_rank(tier) >= tier_rank("drain_after_job")


def _weighs(tier: str) -> bool:
    return tier_rank(tier) >= tier_rank("avoid")


def _state(record: Mapping[str, Any]) -> tuple[str, set[str]]:
    # 22.05: "state": "idle", "state_flags": ["DRAIN"]; newer Slurm: "state": ["IDLE", "DRAIN"].
    raw = record.get("state", "")
    flags = {str(f).upper() for f in record.get("state_flags") or []}
    if isinstance(raw, list):
        parts = [str(p) for p in raw]
        base = parts[0].lower() if parts else ""
        flags |= {p.upper() for p in parts[1:]}
    else:
        base = str(raw).lower().rstrip("*~#!%$@^-")
    return base, flags


def _drained_by_us(record: Mapping[str, Any]) -> bool:
    _, flags = _state(record)
    return bool(flags & {"DRAIN", "DRAINED", "DRAINING"}) and str(record.get("reason", "")).startswith(REASON_PREFIX)


def _view(record: Mapping[str, Any]) -> NodeView:
    base, flags = _state(record)
    reason = str(record.get("reason", "") or "")
    if base in UNAVAILABLE_STATES:
        return NodeView(unavailable=f"Slurm state {base}" + (f" ({reason})" if reason else ""))
    if _drained_by_us(record):
        return NodeView()
    blocking = sorted(flags & BLOCKING_FLAGS)
    if blocking:
        return NodeView(unavailable=f"Slurm state {base}+{'+'.join(blocking)}, reason {reason or '(none)'!r}: not ours")
    return NodeView()
