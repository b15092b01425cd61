"""The Slurm publisher, through `scontrol` and `sinfo --json` run as subprocesses.

Slurm 22.05 (Debian bookworm) has no `scontrol --json`, its slurmrestd cannot update nodes and
there is no pyslurm for it, so the command-line tools are the interface.

Tiers on a node:
- `watch`: nothing (audit only);
- `avoid`: the node's scheduling weight raised to `avoid_weight` (Slurm fills lower weights
  first, so large jobs land elsewhere while there is room); the previous weight is recorded in
  the ledger (below) before ours is set, and restored when the node leaves the tier, unless
  someone changed the weight meanwhile;
- `drain_after_job` and `drain_now`: `State=DRAIN` with a reason starting with `gpufail:`.
  A Slurm drain lets running jobs finish in both; the reason says which tier asked, so an
  operator can cancel or requeue the job on a `drain-now` node. Ending jobs is left to people.

Ownership of drains is recorded, not inferred from the reason: before each drain the publisher
writes the node, the exact reason string and the time into its ledger (`SlurmLedger`; the CLI
keeps it in the data root, `_state/publish-slurm-ledger.json`), and after a resume it removes
the entry. A drained node is ours only while its current reason is the one recorded; a reason
changed by an operator, even one that keeps the `gpufail:` prefix, makes the node theirs: never
resumed by us, reported. A drain with our prefix that the ledger does not know (the state was
lost, or written by another data root) is orphaned: never touched, reported on every run
(`notices`) until an operator adopts it (`adopt`, `gpufail publish --to slurm --adopt NODE`)
or clears it (`scontrol update NodeName=NODE State=RESUME`). Recording before acting means a
run killed between the two leaves an entry that covers what Slurm may show, never an orphan.

Safety: a node that is down, failed, or drained with a reason that is not ours is reported
unavailable and never touched.

Job-aware actions (docs/actions.md): the job map from `squeue --json`; checkpoint hints as
`scancel --signal=USR1 --batch JOB`; placement levels added to node weights (the base weight is
recorded in the ledger before ours is set; a weight someone else set becomes the new base); and
the warm standbys as the reservation `gpufail-standby`, recorded in the ledger before it is
created or changed (a reservation of that name the ledger does not know is not ours).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from ingest.errors import InputError
from ingest.store import Store
from serving.cost_policy import Hint
from serving.jobs import JobMap, expand_hostlist, slurm_job_map
from serving.policy import TIERS, tier_rank
from serving.publishers import REASON_PREFIX, Applied, Change, NodeView, SchedulerUnavailable, tier_phrase, with_retries

UNAVAILABLE_STATES = frozenset({"down", "future", "unknown", "error"})
BLOCKING_FLAGS = frozenset(
    {"DRAIN", "DRAINED", "DRAINING", "FAIL", "NOT_RESPONDING", "REBOOT_REQUESTED", "MAINTENANCE"}
)


LEDGER = "publish-slurm-ledger"
"""The store state file (`_state/<name>.json`) of what gpufail set in Slurm."""
DRAIN_FLAGS = frozenset({"DRAIN", "DRAINED", "DRAINING"})
STANDBY_RESERVATION = "gpufail-standby"
"""The Slurm reservation that holds the warm standby nodes (docs/actions.md)."""


class _CommandFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class OwnedDrain:
    """A drain gpufail set: the exact reason string and when."""

    reason: str
    at: datetime
    replaces: str = ""
    """While our reason on the node is being changed: the reason of ours it replaces (a run
    killed between recording and `scontrol` leaves the node with that one)."""

    def covers(self, reason: str) -> bool:
        return reason == self.reason or (bool(self.replaces) and reason == self.replaces)


@dataclass
class Marks:
    """What gpufail set in Slurm, per node name."""

    drains: dict[str, OwnedDrain] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)
    """The node's weight before we set `avoid_weight` (to restore it)."""
    placement: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Node -> (its weight before our placement level, the weight we set)."""
    standby: tuple[str, ...] | None = None
    """The nodes of our standby reservation (None: we hold none)."""

    def copy(self) -> Marks:
        return Marks(dict(self.drains), dict(self.weights), dict(self.placement), self.standby)


class SlurmLedger(Protocol):
    """Where the publisher records what it set (`Marks`), before it sets it."""

    where: str

    def load(self) -> Marks: ...

    def save(self, marks: Marks) -> None: ...


class MemoryLedger:
    """A ledger that lasts as long as the object (for one process, and tests)."""

    where = "this process's memory"

    def __init__(self) -> None:
        self._marks = Marks()

    def load(self) -> Marks:
        return self._marks.copy()

    def save(self, marks: Marks) -> None:
        self._marks = marks.copy()


def ledger_name(cluster: str) -> str:
    """The ledger of the Slurm cluster that runs `cluster`: one per cluster, as two clusters
    may have nodes of the same name ('' : the one ledger of a data root of one cluster)."""
    return f"{LEDGER}-{cluster}" if cluster else LEDGER


class StoreLedger:
    """The ledger as a state file of a data root (written atomically by the store). A
    cluster's ledger not written yet starts from the data root's unnamed one (`LEDGER`, kept
    before [publish] cluster was set): its entries of nodes this cluster does not show
    drained are dropped at the first `apply`, as any ended drain's."""

    def __init__(self, store: Store, name: str = LEDGER) -> None:
        self.store, self.name = store, name
        self.where = f"{store.root}: _state/{name}.json"

    def load(self) -> Marks:
        data = self.store.read_state(self.name)
        if data is None and self.name != LEDGER:
            data = self.store.read_state(LEDGER)
        data = data or {}
        try:
            drains = {
                str(node): OwnedDrain(
                    reason=str(d["reason"]), at=datetime.fromisoformat(d["at"]), replaces=str(d.get("replaces") or "")
                )
                for node, d in (data.get("drains") or {}).items()
            }
            weights = {str(node): int(w) for node, w in (data.get("weights") or {}).items()}
            placement = {
                str(node): (int(p["base"]), int(p["set"])) for node, p in (data.get("placement") or {}).items()
            }
            standby = data.get("standby")
            standby = None if standby is None else tuple(str(n) for n in standby)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(
                f"{self.where}: not a gpufail Slurm ledger ({type(exc).__name__}: {exc}); expected "
                '{"drains": {NODE: {"reason": ..., "at": ISO time}}, "weights": {NODE: weight}, '
                '"placement": {NODE: {"base": weight, "set": weight}}, "standby": [NODE, ...] or null}'
            ) from None
        return Marks(drains, weights, placement, standby)

    def save(self, marks: Marks) -> None:
        drains = {
            node: {"reason": d.reason, "at": d.at.isoformat(), **({"replaces": d.replaces} if d.replaces else {})}
            for node, d in sorted(marks.drains.items())
        }
        placement = {node: {"base": b, "set": w} for node, (b, w) in sorted(marks.placement.items())}
        standby = None if marks.standby is None else list(marks.standby)
        self.store.write_state(
            self.name,
            {
                "version": 1,
                "drains": drains,
                "weights": dict(sorted(marks.weights.items())),
                "placement": placement,
                "standby": standby,
            },
        )


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
    ledger: SlurmLedger = field(default_factory=MemoryLedger)
    """Where what we set is recorded; give a `StoreLedger` to keep it across runs."""
    checkpoint_signal: str = "USR1"
    """The signal of a checkpoint hint (`scancel --signal=... --batch JOB`)."""
    standby_users: tuple[str, ...] = ("root",)
    """Who may run jobs in the standby reservation."""
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    cluster: str = ""
    """The cluster of the predictions this Slurm cluster runs ('' when they hold one):
    `serving.publish` gives the publisher that cluster's nodes alone."""

    def __post_init__(self) -> None:
        self._nodes: dict[str, dict[str, Any]] = {}
        self._marks = Marks()

    def _run(self, *argv: str) -> str:
        tool = os.path.join(self.bin_dir, argv[0]) if self.bin_dir else argv[0]
        env = {**os.environ, "SLURM_CONF": self.slurm_conf} if self.slurm_conf else None
        try:
            done = subprocess.run([tool, *argv[1:]], capture_output=True, text=True, timeout=self.timeout, env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise _CommandFailed(f"{argv[0]}: {exc}") from None
        if done.returncode != 0:
            # scontrol prints some refusals ("Reservation ... not found") on stdout.
            said = done.stderr.strip() or done.stdout.strip()
            raise _CommandFailed(f"{' '.join(argv)} exited {done.returncode}: {said[:300]}")
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
        self._marks = self.ledger.load()
        return {
            n: _view(known[n], self._marks.drains.get(n))
            if n in known
            else NodeView(exists=False, unavailable="not a node of this Slurm cluster")
            for n in nodes
        }

    def notices(self) -> list[str]:
        """The drains of the cluster (as last read) that look like ours but are not: orphaned
        ones, and ours whose reason someone changed."""
        out = []
        for node, record in sorted(self._nodes.items()):
            entry = self._marks.drains.get(node)
            owner = _ownership(record, entry)
            reason = _reason(record)
            if owner == "orphaned":
                out.append(
                    f"{node}: drained with {reason!r}, a gpufail reason that {self.ledger.where} does not record "
                    f"(an orphaned drain, left as it is); `gpufail publish --to slurm --adopt {node}` hands it to "
                    f"gpufail, `scontrol update NodeName={node} State=RESUME` clears it"
                )
            elif owner == "edited" and entry is not None:
                out.append(
                    f"{node}: drain reason is now {reason!r}, not the {entry.reason!r} gpufail set at "
                    f"{entry.at:%Y-%m-%d %H:%M}Z: the operator's now; gpufail will not resume it"
                )
        return out

    def apply(self, changes: Sequence[Change]) -> list[Applied]:
        if not changes:
            return []
        try:
            known = self.read_nodes()
        except SchedulerUnavailable as exc:
            return [Applied(False, f"failed: {exc}") for _ in changes]
        marks = self.ledger.load()
        # A drain that ended (resumed by someone, or a run killed before its scontrol) is
        # nobody's any more, nor a weight no longer ours: forget them, so that a later drain
        # with that reason is not taken for ours.
        self._marks = Marks(
            drains={n: d for n, d in marks.drains.items() if n in known and _is_drained(known[n])},
            weights={n: w for n, w in marks.weights.items() if n in known and _weight(known[n]) == self.avoid_weight},
            placement=marks.placement,
            standby=marks.standby,
        )
        if self._marks != marks:
            self.ledger.save(self._marks)
        return [self._apply_one(c, known.get(c.node)) for c in changes]

    def adopt(self, node: str) -> tuple[str, OwnedDrain]:
        """Record the node's current gpufail drain as ours (an orphaned one, after its state
        was lost); returns the tier its reason names and the entry recorded."""
        known = self.read_nodes()
        record = known.get(node)
        if record is None:
            raise InputError(f"--adopt {node}: not a node of this Slurm cluster")
        reason = _reason(record)
        if not _is_drained(record) or not reason.startswith(REASON_PREFIX):
            state = "drained" if _is_drained(record) else "not drained"
            raise InputError(
                f"--adopt {node}: expected a node drained with a {REASON_PREFIX!r} reason, got {state} with "
                f"reason {reason!r}; nothing to adopt"
            )
        words = reason.removeprefix(REASON_PREFIX).split()
        tier = words[0].replace("-", "_") if words else ""
        if tier not in TIERS or not _drains(tier):
            raise InputError(f"--adopt {node}: the reason {reason!r} names no drain tier of gpufail")
        entry = OwnedDrain(reason, self.clock())
        self._marks = self.ledger.load()
        self._record(node, entry)
        return tier, entry

    def _record(self, node: str, entry: OwnedDrain | None) -> None:
        if entry is None:
            self._marks.drains.pop(node, None)
        else:
            self._marks.drains[node] = entry
        self.ledger.save(self._marks)

    def _record_weight(self, node: str, previous: int | None) -> None:
        if previous is None:
            self._marks.weights.pop(node, None)
        else:
            self._marks.weights[node] = previous
        self.ledger.save(self._marks)

    def _apply_one(self, change: Change, record: Mapping[str, Any] | None) -> Applied:
        if record is None:
            return Applied(False, "skipped: not a node of this Slurm cluster")
        entry = self._marks.drains.get(change.node)
        view = _view(record, entry)
        if view.unavailable:
            return Applied(False, f"skipped: {view.unavailable}")
        owner = _ownership(record, entry)
        saved = dict(change.saved)
        done = []
        try:
            if _drains(change.new):
                reason = drain_reason(change)
                ours_now = _reason(record) if owner == "ours" else ""
                # Recorded before scontrol runs: a kill in between leaves a covering entry.
                self._record(
                    change.node, OwnedDrain(reason, self.clock(), replaces=ours_now if ours_now != reason else "")
                )
                try:
                    self._call("scontrol", "update", f"NodeName={change.node}", "State=DRAIN", f"Reason={reason}")
                except SchedulerUnavailable:
                    self._record(change.node, entry)
                    raise
                self._record(change.node, OwnedDrain(reason, self.clock()))
                done.append("drained")
            elif _drains(change.old) and owner == "ours":
                self._call("scontrol", "update", f"NodeName={change.node}", "State=RESUME")
                self._record(change.node, None)
                done.append("resumed")
            if _weighs(change.new) and not _weighs(change.old):
                recorded = self._marks.weights.get(change.node)
                # The ledger's weight is the one before ours, should a killed run have set ours.
                saved["weight"] = recorded if recorded is not None else _weight(record)
                self._record_weight(change.node, saved["weight"])
                try:
                    self._call("scontrol", "update", f"NodeName={change.node}", f"Weight={self.avoid_weight}")
                except SchedulerUnavailable:
                    self._record_weight(change.node, recorded)
                    raise
                done.append(f"weight {saved['weight']} -> {self.avoid_weight}")
            elif _weighs(change.old) and not _weighs(change.new):
                recorded = self._marks.weights.get(change.node)
                previous = int(saved.pop("weight", recorded if recorded is not None else 1))
                if _weight(record) == self.avoid_weight:
                    self._call("scontrol", "update", f"NodeName={change.node}", f"Weight={previous}")
                    done.append(f"weight restored to {previous}")
                else:
                    done.append(f"weight left at {record.get('weight')} (changed by someone else)")
                self._record_weight(change.node, None)
        except SchedulerUnavailable as exc:
            return Applied(False, f"failed: {exc}" + (f" (after: {', '.join(done)})" if done else ""), saved)
        return Applied(True, ", ".join(done) or "nothing to change in Slurm", saved)

    # --- job-aware actions (docs/actions.md) ----------------------------------------------

    def read_jobs(self) -> JobMap:
        """The running jobs, from `squeue --json`."""
        return slurm_job_map(self._call("squeue", "--json"))

    def checkpoint(self, hints: Sequence[Hint]) -> list[Applied]:
        """Tell each job to checkpoint: `scancel --signal=<checkpoint_signal> --batch JOB` (the
        batch script traps the signal and passes it on to the training processes)."""
        out = []
        for hint in hints:
            try:
                self._call("scancel", f"--signal={self.checkpoint_signal}", "--batch", hint.job.id)
            except SchedulerUnavailable as exc:
                out.append(Applied(False, f"failed: {exc}"))
                continue
            out.append(Applied(True, f"signalled {self.checkpoint_signal} to job {hint.job.id} (batch step)"))
        return out

    def place(self, levels: Mapping[str, int], count: int, apply: bool) -> list[tuple[str, Applied]]:
        """Give each node of `levels` the weight its base (the weight before ours; a weight
        someone else set becomes the new base) plus its placement level, so Slurm fills the
        healthiest nodes first. Nodes in the avoid tier or above (their weight is the avoid
        weight), unavailable ones and unknown ones are left alone. An available node with a
        placement weight of ours that is not in `levels` gets its base back."""
        marks = self.ledger.load()
        self._marks = marks
        if not levels and not marks.placement:
            return []
        try:
            known = self.read_nodes()
        except SchedulerUnavailable as exc:
            return [(node, Applied(False, f"failed: {exc}")) for node in sorted(levels)]
        wanted: dict[int, list[tuple[str, int, int]]] = {}
        for node in sorted(set(levels) | set(marks.placement)):
            record = known.get(node)
            if record is None:
                marks.placement.pop(node, None)
                continue
            if _view(record, marks.drains.get(node)).unavailable or node in marks.weights:
                continue
            current = _weight(record)
            if current == self.avoid_weight:
                continue
            entry = marks.placement.get(node)
            base = entry[0] if entry is not None and current == entry[1] else current
            target = base + levels[node] if node in levels else base
            if current != target:
                wanted.setdefault(target, []).append((node, base, current))
            elif node not in levels:
                marks.placement.pop(node, None)
            elif entry != (base, target):
                marks.placement[node] = (base, target)
        out: list[tuple[str, Applied]] = []
        if not apply:
            return [
                (node, Applied(True, f"would set weight {current} -> {target}"))
                for target, group in sorted(wanted.items())
                for node, _, current in group
            ]
        for target, group in sorted(wanted.items()):
            before = {node: marks.placement.get(node) for node, _, _ in group}
            for node, base, _ in group:
                marks.placement[node] = (base, target)
            self.ledger.save(marks)  # recorded before scontrol: a kill in between leaves it covered
            names = ",".join(node for node, _, _ in group)
            try:
                self._call("scontrol", "update", f"NodeName={names}", f"Weight={target}")
            except SchedulerUnavailable as exc:
                for node, entry in before.items():
                    if entry is None:
                        marks.placement.pop(node, None)
                    else:
                        marks.placement[node] = entry
                out.extend((node, Applied(False, f"failed: {exc}")) for node, _, _ in group)
                continue
            for node, _, current in group:
                if node not in levels:
                    marks.placement.pop(node, None)
                why = f"placement level {levels[node]}" if node in levels else "placement off: base restored"
                out.append((node, Applied(True, f"weight {current} -> {target} ({why})")))
        self.ledger.save(marks)
        return out

    def standby(self, nodes: Sequence[str], apply: bool) -> list[tuple[str, Applied]]:
        """Make the reservation `gpufail-standby` hold exactly `nodes` (created, updated, or
        deleted when `nodes` is empty). A reservation of that name the ledger does not record
        is someone else's (or left by a lost state): reported, never changed."""
        wanted = tuple(sorted(nodes))
        marks = self.ledger.load()
        self._marks = marks
        if not wanted and marks.standby is None:
            return []
        try:
            current = self._reservation()
        except SchedulerUnavailable as exc:
            return [(node, Applied(False, f"failed: {exc}")) for node in wanted]
        if current is not None and marks.standby is None:
            detail = (
                f"skipped: reservation {STANDBY_RESERVATION} ({','.join(current) or 'no nodes'}) is not recorded in "
                f"{self.ledger.where}: not ours; `scontrol delete ReservationName={STANDBY_RESERVATION}` lets gpufail make its own"
            )
            return [(node, Applied(False, detail)) for node in wanted]
        have = set(current or ())
        added, removed = [n for n in wanted if n not in have], sorted(have - set(wanted))
        if not added and not removed:
            if marks.standby != (wanted or None):
                marks.standby = wanted or None
                self.ledger.save(marks)
            return []
        verb = "would add to" if not apply else "added to"
        rows = [(n, Applied(True, f"{verb} reservation {STANDBY_RESERVATION}")) for n in added]
        rows += [
            (n, Applied(True, f"{'would remove' if not apply else 'removed'} from reservation {STANDBY_RESERVATION}"))
            for n in removed
        ]
        if not apply:
            return rows
        previous = marks.standby
        # Recorded first, the union of before and after: a kill before scontrol leaves it ours.
        marks.standby = tuple(sorted(have | set(wanted)))
        self.ledger.save(marks)
        try:
            if not wanted:
                try:
                    self._run("scontrol", "delete", f"ReservationName={STANDBY_RESERVATION}")
                except _CommandFailed as exc:
                    if "in use" not in str(exc):
                        raise
                    # A job restarted into a standby still runs there: deleted once it ends.
                    marks.standby = previous
                    self.ledger.save(marks)
                    kept = f"kept: reservation {STANDBY_RESERVATION} is in use by a running job; deleted after it ends"
                    return [(n, Applied(False, kept)) for n, _ in rows]
            elif current is None:
                self._call(
                    "scontrol",
                    "create",
                    "reservation",
                    f"ReservationName={STANDBY_RESERVATION}",
                    f"Nodes={','.join(wanted)}",
                    "StartTime=now",
                    "Duration=infinite",
                    f"Users={','.join(self.standby_users)}",
                )
            else:
                self._call("scontrol", "update", f"ReservationName={STANDBY_RESERVATION}", f"Nodes={','.join(wanted)}")
        except (SchedulerUnavailable, _CommandFailed) as exc:
            marks.standby = previous
            self.ledger.save(marks)
            return [(n, Applied(False, f"failed: {exc}")) for n, _ in rows]
        marks.standby = wanted or None
        self.ledger.save(marks)
        return rows

    def _reservation(self) -> tuple[str, ...] | None:
        """The nodes of our standby reservation as Slurm shows it (None: there is none)."""
        tool = os.path.join(self.bin_dir, "scontrol") if self.bin_dir else "scontrol"
        argv = ("scontrol", "show", "reservation", STANDBY_RESERVATION, "--oneliner")

        def show() -> str | None:
            try:
                return self._run(*argv)
            except _CommandFailed as exc:
                if "not found" in str(exc):
                    return None
                raise

        text = with_retries(
            show,
            what=f"slurm ({tool} show reservation)",
            attempts=self.attempts,
            backoff=self.backoff,
            retry_on=(_CommandFailed,),
        )
        if text is None:
            return None
        fields = dict(word.split("=", 1) for word in text.split() if "=" in word)
        nodes = fields.get("Nodes", "")
        return tuple(sorted(expand_hostlist(nodes))) if nodes and nodes != "(null)" else ()


def drain_reason(change: Change) -> str:
    """The Slurm drain reason of a change to a drain tier (it names the tier, risk and model)."""
    reason = f"{REASON_PREFIX} {tier_phrase(change.new)} risk={change.risk:.2f}"
    return reason + (f" model={change.model_version}" if change.model_version else "")


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


def _weight(record: Mapping[str, Any]) -> int:
    return int(record.get("weight", 1))


def _reason(record: Mapping[str, Any]) -> str:
    return str(record.get("reason", "") or "")


def _is_drained(record: Mapping[str, Any]) -> bool:
    return bool(_state(record)[1] & DRAIN_FLAGS)


def _ownership(record: Mapping[str, Any], entry: OwnedDrain | None) -> str:
    """Whose drain the node has: 'free' (not drained), 'ours' (the reason we recorded),
    'edited' (we recorded one, it now has another), 'orphaned' (our prefix, no record) or
    'operator'."""
    if not _is_drained(record):
        return "free"
    reason = _reason(record)
    if entry is not None:
        return "ours" if entry.covers(reason) else "edited"
    return "orphaned" if reason.startswith(REASON_PREFIX) else "operator"


def _view(record: Mapping[str, Any], entry: OwnedDrain | None) -> NodeView:
    base, flags = _state(record)
    reason = _reason(record)
    if base in UNAVAILABLE_STATES:
        return NodeView(unavailable=f"Slurm state {base}" + (f" ({reason})" if reason else ""))
    owner = _ownership(record, entry)
    if owner == "ours":
        return NodeView()
    if owner == "orphaned":
        return NodeView(
            unavailable=f"drained with {reason!r}, a gpufail reason gpufail has no record of (orphaned): not touched"
        )
    if owner == "edited" and entry is not None:
        return NodeView(
            unavailable=f"drain reason {reason!r} is not the {entry.reason!r} gpufail set: the operator's, not ours"
        )
    blocking = sorted(flags & BLOCKING_FLAGS)
    if blocking:
        return NodeView(unavailable=f"Slurm state {base}+{'+'.join(blocking)}, reason {reason or '(none)'!r}: not ours")
    return NodeView()
