"""Publishing: the latest predictions through the action policy (`serving.policy`) to a
scheduler (`serving.publishers`), with every decision appended to the audit log.

Modes:
- `dry-run` (the default): decide from the persisted state and the scheduler's current view
  (read, never written), record what would be done; the state is not advanced, so a dry run
  can be repeated and changes nothing.
- `shadow`: as if live, against a separate state (`publish-<target>-shadow`), without touching
  the scheduler: shows over weeks what the policy would have done.
- `live`: act. A change that the scheduler did not take (unreachable, refused) leaves the
  node's `applied` tier as it was, so the next run tries again; re-running with the same
  predictions changes nothing (idempotent).

The audit log is a Parquet dataset, one new file per run under `date=YYYY-MM-DD/` (the UTC
date of the decisions), never rewritten. A file is first written complete under a hidden
`.pending-` name (`stage_audit`), which readers ignore, and then renamed to its final name
(`finish_audit`); `append_audit` does both. A caller that keeps state commits the staged file's
names with its state between the two steps, so that a run killed at any point leaves its rows
either recorded once or not at all (`serving.publishing`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ingest.errors import InputError
from serving.policy import NodeRisk, NodeState, PolicyConfig, PolicyState, decide
from serving.publishers import Change, NodeView, Publisher, SchedulerUnavailable, publisher_notices
from serving.score import node_risks

MODES = ("dry-run", "shadow", "live")
PENDING_PREFIX = ".pending-"
"""Staged audit files (`stage_audit`) start with this; readers skip every hidden file."""

AUDIT_SCHEMA = pa.schema(
    [
        ("time", pa.timestamp("us", tz="UTC")),
        ("cluster", pa.string()),
        ("node", pa.string()),
        ("gpus", pa.list_(pa.string())),
        ("risk", pa.float64()),
        ("previous_tier", pa.string()),
        ("tier", pa.string()),
        ("action", pa.string()),
        ("reason", pa.string()),
        ("top_features", pa.list_(pa.string())),
        ("model_version", pa.string()),
        ("target", pa.string()),
        ("mode", pa.string()),
        ("dry_run", pa.bool_()),
        ("result", pa.string()),
    ]
)


@dataclass(frozen=True)
class AuditRow:
    """One decision and what became of it (a row of `AUDIT_SCHEMA`)."""

    time: datetime
    cluster: str
    node: str
    gpus: tuple[str, ...]
    risk: float
    previous_tier: str
    tier: str
    action: str
    reason: str
    top_features: tuple[str, ...]
    model_version: str
    target: str
    mode: str
    dry_run: bool
    result: str


@dataclass(frozen=True)
class PublishOutcome:
    rows: list[AuditRow]
    state: PolicyState
    """The state to persist (for a dry run: the state it started from, unchanged)."""
    scheduler_error: str
    """Why the scheduler could not be read ('' when it could)."""
    notices: list[str] = field(default_factory=list)
    """What the publisher has to tell the operator beyond the decisions (`publisher_notices`)."""


def state_name(target: str, mode: str) -> str:
    """The `Store` state file of a target: shadow runs keep their own, dry runs read the live one."""
    return f"publish-{target}-shadow" if mode == "shadow" else f"publish-{target}"


def node_inputs(
    predictions: pd.DataFrame,
    *,
    flag_threshold: float,
    views: Mapping[str, NodeView] | None = None,
    repairs: Mapping[tuple[str, str], datetime] | None = None,
    top_features: Mapping[str, Sequence[str]] | None = None,
) -> list[NodeRisk]:
    """The policy's input per node of `predictions` (`serving.score` output): node risk, the
    GPUs at or over `flag_threshold` (else the riskiest), the riskiest GPU's top features, the
    scheduler's view and the latest repair."""
    out = []
    for row in node_risks(predictions).to_dict("records"):
        uuids, risks = list(row["gpu_uuids"]), list(row["gpu_risks"])
        flagged = tuple(str(u) for u, r in zip(uuids, risks, strict=True) if r >= flag_threshold) or (str(uuids[0]),)
        cluster, node = str(row["cluster"]), str(row["node"])
        view = (views or {}).get(node, NodeView())
        out.append(
            NodeRisk(
                key=f"{cluster}/{node}",
                cluster=cluster,
                node=node,
                risk=float(row["node_risk"]),
                gpus=flagged,
                top_features=tuple((top_features or {}).get(str(uuids[0]), ())),
                unavailable=view.unavailable,
                repaired_at=(repairs or {}).get((cluster, node)),
            )
        )
    return out


def model_version(predictions: pd.DataFrame) -> str:
    versions = predictions["model_version"].astype(str).unique().tolist() if "model_version" in predictions else []
    return ",".join(sorted(versions)) if versions else "unknown"


def publish(
    predictions: pd.DataFrame,
    publisher: Publisher,
    config: PolicyConfig,
    state: PolicyState,
    *,
    mode: str,
    now: datetime,
    repairs: Mapping[tuple[str, str], datetime] | None = None,
    top_features: Mapping[str, Sequence[str]] | None = None,
) -> PublishOutcome:
    """Decide for every node of `predictions` and, in live mode, make the scheduler follow.
    Never raises for an unreachable scheduler: the rows say so and the next run retries."""
    if mode not in MODES:
        raise InputError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    nodes = sorted(set(predictions["node"].astype(str)))
    scheduler_error = ""
    views: dict[str, NodeView] | None
    notices: list[str] = []
    try:
        views = publisher.observe(nodes)
        notices = publisher_notices(publisher)
    except SchedulerUnavailable as exc:
        views, scheduler_error = None, str(exc)
    inputs = node_inputs(
        predictions,
        flag_threshold=config.tiers[0].enter,
        views=views,
        repairs=repairs,
        top_features=top_features,
    )
    decisions, after = decide(inputs, state, config, now)
    version = model_version(predictions)

    results: dict[str, str] = {}
    pending: list[tuple[str, Change]] = []
    for d in decisions:
        node_state = after.nodes.get(d.key)
        applied = (node_state or state.nodes.get(d.key) or NodeState()).applied
        if d.action == "skip":
            results[d.key] = "skipped"
        elif d.tier == applied:
            results[d.key] = "unchanged"
        elif mode == "dry-run":
            results[d.key] = f"dry-run: would set {applied} -> {d.tier}"
        elif mode == "shadow":
            results[d.key] = f"shadow: would set {applied} -> {d.tier}"
        elif views is None:
            results[d.key] = f"failed: {scheduler_error}; retried next run"
        else:
            saved = node_state.saved if node_state else {}
            decided_at = node_state.since if node_state and node_state.since else d.time
            change = Change(
                d.node, applied, d.tier, d.risk, d.reason, d.gpus, d.top_features, version, saved, decided_at
            )
            pending.append((d.key, change))

    nodes_after = dict(after.nodes)
    if mode == "shadow":
        for key, s in after.nodes.items():
            nodes_after[key] = replace(s, applied=s.tier)
    for (key, change), outcome in zip(pending, publisher.apply([c for _, c in pending]), strict=True):
        results[key] = outcome.detail
        if outcome.ok:
            nodes_after[key] = replace(
                nodes_after.get(key) or after.nodes[key], applied=change.new, saved=dict(outcome.saved)
            )
        elif key in nodes_after:
            nodes_after[key] = replace(nodes_after[key], saved=dict(outcome.saved) or nodes_after[key].saved)
    final = state if mode == "dry-run" else replace(after, nodes=nodes_after)

    rows = [
        AuditRow(
            time=d.time,
            cluster=d.cluster,
            node=d.node,
            gpus=d.gpus,
            risk=d.risk,
            previous_tier=d.previous_tier,
            tier=d.tier,
            action=d.action,
            reason=d.reason,
            top_features=d.top_features,
            model_version=version,
            target=publisher.name,
            mode=mode,
            dry_run=mode != "live",
            result=results[d.key],
        )
        for d in decisions
    ]
    return PublishOutcome(rows=rows, state=final, scheduler_error=scheduler_error, notices=notices)


def decisions_table(decisions: Sequence[AuditRow]) -> pa.Table:
    """Audit rows as a table of `AUDIT_SCHEMA`."""
    columns: dict[str, list[Any]] = {name: [] for name in AUDIT_SCHEMA.names}
    for d in decisions:
        for name in AUDIT_SCHEMA.names:
            value = getattr(d, name)
            columns[name].append(list(value) if name in ("gpus", "top_features") else value)
    return pa.Table.from_pydict(columns, schema=AUDIT_SCHEMA)


def _filesystem(path: str, fs: Any) -> tuple[Any, str]:
    import fsspec

    if fs is not None:
        return fs, str(path)
    return fsspec.core.url_to_fs(str(path))


@dataclass(frozen=True)
class StagedAudit:
    """An audit file written complete under its hidden `pending` name, to be renamed to `final`."""

    pending: str
    final: str


def stage_audit(decisions: Sequence[AuditRow], path: str, fs: Any = None, run_id: str = "") -> StagedAudit | None:
    """Write the decisions as one complete Parquet file under a hidden name in the audit log
    rooted at `path` (None, and nothing written, for no decisions); `finish_audit` makes it
    visible. `path` is a local folder or fsspec URL, or a path within `fs` (an fsspec
    filesystem, e.g. `Store.fs` with `Store.path("actions")`); `run_id` names the file (default:
    a random one)."""
    if not decisions:
        return None
    table = decisions_table(decisions)
    fs, root = _filesystem(path, fs)
    first = min(d.time for d in decisions)
    folder = f"{root.rstrip('/')}/date={first:%Y-%m-%d}"
    fs.makedirs(folder, exist_ok=True)
    name = f"part-{first:%Y%m%dT%H%M%SZ}-{run_id or uuid.uuid4().hex}.parquet"
    final, pending = f"{folder}/{name}", f"{folder}/{PENDING_PREFIX}{name}"
    tmp = f"{folder}/.tmp-{uuid.uuid4().hex}-{name}"
    try:
        with fs.open(tmp, "wb") as fh:
            pq.write_table(table, fh)
        _sync(fs, tmp)
        fs.mv(tmp, pending)
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp)
        raise
    return StagedAudit(pending, final)


def finish_audit(staged: StagedAudit, fs: Any) -> str:
    """Make a staged audit file visible under its final name (`fs`: the filesystem it was
    staged on); done already is fine, so a run that resumes after a kill can call it again.
    Returns the final path."""
    if fs.exists(staged.pending):
        if fs.exists(staged.final):
            # A rename that copies (object stores) was cut between copy and delete.
            fs.rm(staged.pending)
        else:
            fs.mv(staged.pending, staged.final)
    return staged.final


def append_audit(decisions: Sequence[AuditRow], path: str, fs: Any = None) -> str | None:
    """Add the decisions to the audit log rooted at `path` as one new Parquet file; returns its
    path (None, and nothing written, for no decisions). See `stage_audit` for `path` and `fs`."""
    staged = stage_audit(decisions, path, fs)
    return None if staged is None else finish_audit(staged, _filesystem(path, fs)[0])


def _sync(fs: Any, path: str) -> None:
    # A local file reaches the disk before it is renamed into place (a crash of the machine,
    # not only of the process, then leaves the old or the new file, never an empty one).
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocol:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_audit(path: str, fs: Any = None) -> pd.DataFrame:
    """The whole audit log rooted at `path`, oldest first (temporary files are skipped)."""
    fs, root = _filesystem(path, fs)
    files = sorted(f for f in fs.glob(f"{root.rstrip('/')}/date=*/part-*.parquet"))
    if not files:
        return AUDIT_SCHEMA.empty_table().to_pandas()
    tables = []
    for f in files:
        with fs.open(f, "rb") as fh:
            tables.append(pq.read_table(fh, schema=AUDIT_SCHEMA))
    return pa.concat_tables(tables).to_pandas().sort_values("time", kind="stable", ignore_index=True)
