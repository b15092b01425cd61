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

With `JobActions`, a run also reads the scheduler's job map and can decide by the cost policy
(`serving.cost_policy`), send checkpoint hints, set placement levels and keep warm standbys
(docs/actions.md); each of those is an audit row too.

The audit log is the store's `actions` dataset, one new file per run under `date=YYYY-MM-DD/`
(the UTC date of the decisions, `decisions_table`), never rewritten, committed together with
the policy state it leads to (`serving.publishing`), so that a run killed at any point leaves
its rows either recorded once or not at all. `read_audit` reads what was committed;
`append_audit` adds a file without a state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import fsspec
import pandas as pd
import pyarrow as pa

from ingest.errors import InputError
from ingest.store import Store
from serving.cost_policy import OPTIONS, CostConfig, CostDecision, Hint, costs_json
from serving.cost_policy import decide as cost_decide
from serving.jobs import JobMap, JobMapUnreadable, node_loads
from serving.placement import placement_levels, standby_nodes
from serving.policy import NodeRisk, NodeState, PolicyConfig, PolicyState, decide
from serving.prediction_schema import FAIL_SLOW_FIELD
from serving.publishers import Applied, Change, NodeView, Publisher, SchedulerUnavailable, publisher_notices
from serving.score import node_risks

MODES = ("dry-run", "shadow", "live")
AUDIT_DATASET = "actions"

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
        # The job-aware fields (docs/actions.md); null in rows of the tiered policy and in files
        # written before them.
        ("policy", pa.string()),
        ("option", pa.string()),
        ("costs", pa.struct([(o, pa.float64()) for o in OPTIONS])),
        ("jobs", pa.list_(pa.string())),
        ("blast_radius", pa.int64()),
        ("work_at_risk", pa.float64()),
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
    policy: str = "tiers"
    option: str = ""
    """The cost policy's cheapest option ('' for the tiered policy)."""
    costs: Mapping[str, float | None] | None = None
    """The cost policy: expected GPU-hours of every option (None where not offered)."""
    jobs: tuple[str, ...] = ()
    blast_radius: int | None = None
    work_at_risk: float | None = None


POLICIES = ("tiers", "cost")


@dataclass(frozen=True)
class JobActions:
    """What `publish` does with the jobs on the nodes, beyond the tiers (docs/actions.md)."""

    policy: str = "tiers"
    """"tiers" (`serving.policy`) or "cost" (`serving.cost_policy`)."""
    cost: CostConfig = field(default_factory=CostConfig)
    placement_levels: int = 0
    """Placement levels (`serving.placement`); 0: no placement hints."""
    standby_nodes: int = 0
    """Warm standbys to keep; 0: none."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InputError(f"policy: expected one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.placement_levels < 0 or self.standby_nodes < 0:
            raise InputError(
                f"placement_levels and standby_nodes: expected >= 0, got {self.placement_levels} and {self.standby_nodes}"
            )

    @property
    def needs_jobs(self) -> bool:
        return self.policy == "cost" or self.standby_nodes > 0


@dataclass(frozen=True)
class PublishOutcome:
    rows: list[AuditRow]
    state: PolicyState
    """The state to persist (for a dry run: the state it started from, unchanged)."""
    scheduler_error: str
    """Why the scheduler could not be read ('' when it could)."""
    notices: list[str] = field(default_factory=list)
    """What the publisher has to tell the operator beyond the decisions (`publisher_notices`)."""
    hinted: dict[str, datetime] = field(default_factory=dict)
    """The cost policy's state: job id -> when it was last told to checkpoint."""


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
    slowest = _slowest_gpus(predictions)
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
                **slowest.get((cluster, node), {}),
            )
        )
    return out


def _slowest_gpus(predictions: pd.DataFrame) -> dict[tuple[str, str], dict[str, Any]]:
    """(cluster, node) -> `slow` and `slow_gpu`: its GPU of the largest fail-slow score, where
    the predictions carry the scores (`serving.score`)."""
    if FAIL_SLOW_FIELD.name not in predictions:
        return {}
    scored = predictions[predictions[FAIL_SLOW_FIELD.name].notna()]
    if scored.empty:
        return {}
    top = scored.sort_values([FAIL_SLOW_FIELD.name, "gpu_uuid"], ascending=[False, True], kind="stable")
    top = top.drop_duplicates(["cluster", "node"])
    return {
        (str(c), str(n)): {"slow": float(v), "slow_gpu": str(u)}
        for c, n, v, u in zip(top["cluster"], top["node"], top[FAIL_SLOW_FIELD.name], top["gpu_uuid"], strict=True)
    }


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
    actions: JobActions | None = None,
    hinted: Mapping[str, datetime] | None = None,
) -> PublishOutcome:
    """Decide for every node of `predictions` and, in live mode, make the scheduler follow.
    Never raises for an unreachable scheduler: the rows say so and the next run retries.
    `actions` adds the job-aware ones (the cost policy, checkpoint hints, placement, standbys),
    `hinted` is the cost policy's state from the last run."""
    actions = actions or JobActions()
    if mode not in MODES:
        raise InputError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    predictions = cluster_rows(predictions, publisher)
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
    job_map = None
    if actions.needs_jobs and views is not None:
        job_map = read_job_map(publisher, notices)
    priced: dict[str, CostDecision] = {}
    new_hinted: dict[str, datetime] = dict(hinted or {})
    hints: list[Hint] = []
    held: list[tuple[Hint, str]] = []
    if actions.policy == "cost":
        gpus_per_node = {str(k): int(v) for k, v in predictions.groupby("node").size().items()}
        co = cost_decide(inputs, job_map, gpus_per_node, actions.cost, state, hinted or {}, config, now)
        decisions, after = [c.decision for c in co.decisions], co.state
        priced = {c.decision.key: c for c in co.decisions}
        new_hinted, hints, held = co.hinted, co.hints, co.held
    else:
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
                d.node,
                applied,
                d.tier,
                d.risk,
                d.reason,
                d.gpus,
                d.top_features,
                version,
                saved,
                decided_at,
                cluster=d.cluster,
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

    common: dict[str, Any] = {
        "model_version": version,
        "target": publisher.name,
        "mode": mode,
        "dry_run": mode != "live",
    }
    rows = []
    for d in decisions:
        c = priced.get(d.key)
        rows.append(
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
                result=results[d.key],
                policy=actions.policy,
                **common,
                **(_priced_fields(c) if c is not None and c.costs else {}),
            )
        )
    by_node = {n.node: n for n in inputs}
    tiers_after = {key: s.tier for key, s in final.nodes.items()}
    job_rows, failed_hints = job_action_rows(
        publisher, hints, held, mode=mode, scheduler_error=scheduler_error, reachable=views is not None
    )
    for job_id in failed_hints:
        new_hinted.pop(job_id, None)
    rows += [_job_row(row, by_node, tiers_after, now, actions.policy, common) for row in job_rows]
    if views is not None:
        hint_rows = placement_and_standby(publisher, inputs, job_map, tiers_after, config, actions, mode, now, notices)
        rows += [_job_row(row, by_node, tiers_after, now, actions.policy, common) for row in hint_rows]
    kept_hinted = dict(hinted or {}) if mode == "dry-run" else new_hinted
    return PublishOutcome(rows=rows, state=final, scheduler_error=scheduler_error, notices=notices, hinted=kept_hinted)


def cluster_rows(predictions: pd.DataFrame, publisher: Publisher) -> pd.DataFrame:
    """The predictions `publisher` acts on. A publisher of one scheduler (it has a `cluster`:
    Slurm, Kubernetes) knows the nodes by their bare names, which two clusters may share: it
    gets the rows of its configured cluster alone, and, with none configured, refuses
    predictions of several clusters instead of acting on a name of each."""
    scope = getattr(publisher, "cluster", None)
    if scope is None:
        return predictions
    wanted = str(scope)
    clusters = sorted(set(predictions["cluster"].astype(str)))
    if not wanted:
        if len(clusters) > 1:
            raise InputError(
                f"publish --to {publisher.name}: the predictions hold the clusters {', '.join(clusters)} and a "
                f"{publisher.name} scheduler knows its nodes by name alone; expected [publish] cluster naming the "
                "cluster it runs"
            )
        return predictions
    if wanted not in clusters:
        raise InputError(
            f"[publish] cluster {wanted!r}: no node of that cluster in the predictions (they hold "
            f"{', '.join(clusters) or 'no cluster'}); expected the cluster the {publisher.name} target runs"
        )
    return predictions[predictions["cluster"].astype(str) == wanted].reset_index(drop=True)


def read_job_map(publisher: Publisher, notices: list[str]) -> JobMap | None:
    """The publisher's job map, or None (with a notice saying why) when it has none or it
    cannot be read."""
    read = getattr(publisher, "read_jobs", None)
    if not callable(read):
        notices.append(f"job map: the {publisher.name} target has no job map; the cost policy keeps every tier")
        return None
    try:
        job_map: JobMap = read()
    except (SchedulerUnavailable, JobMapUnreadable) as exc:
        notices.append(f"job map: {exc}; the cost policy keeps every tier, standbys are left as they are")
        return None
    notices.extend(f"job map: {n}" for n in job_map.notices)
    return job_map


def _priced_fields(c: CostDecision) -> dict[str, Any]:
    return {
        "option": c.option,
        "costs": costs_json(c.costs),
        "jobs": c.load.jobs,
        "blast_radius": c.load.blast_radius,
        "work_at_risk": c.load.work_at_risk,
    }


@dataclass(frozen=True)
class _JobActionRow:
    node: str
    action: str
    reason: str
    result: str
    jobs: tuple[str, ...] = ()
    blast_radius: int | None = None
    work_at_risk: float | None = None


def job_action_rows(
    publisher: Publisher,
    hints: Sequence[Hint],
    held: Sequence[tuple[Hint, str]],
    *,
    mode: str,
    scheduler_error: str,
    reachable: bool,
) -> tuple[list[_JobActionRow], list[str]]:
    """Send the checkpoint hints (live mode) and describe them, and those held, as audit rows;
    also the ids of the jobs whose hint did not go out (to be tried again next run)."""
    if not hints and not held:
        return [], []
    send = getattr(publisher, "checkpoint", None)
    if mode != "live":
        results = [Applied(True, f"{mode}: would tell job {h.job.id} to checkpoint") for h in hints]
    elif not reachable:
        results = [Applied(False, f"failed: {scheduler_error}; retried next run") for _ in hints]
    elif not callable(send):
        results = [Applied(False, f"skipped: the {publisher.name} target cannot send checkpoint hints") for _ in hints]
    else:
        results = send(list(hints))
    rows = [
        _JobActionRow(h.nodes[0], "checkpoint", h.reason, r.detail, (h.job.id,), h.job.gpus)
        for h, r in zip(hints, results, strict=True)
    ]
    rows += [
        _JobActionRow(h.nodes[0], "checkpoint_held", f"{h.reason}; held: {why}", "held", (h.job.id,), h.job.gpus)
        for h, why in held
    ]
    failed = [h.job.id for h, r in zip(hints, results, strict=True) if not r.ok]
    return rows, failed


def placement_and_standby(
    publisher: Publisher,
    inputs: Sequence[NodeRisk],
    job_map: JobMap | None,
    tiers_after: Mapping[str, str],
    config: PolicyConfig,
    actions: JobActions,
    mode: str,
    now: datetime,
    notices: list[str],
) -> list[_JobActionRow]:
    """Placement levels and warm standbys through the publisher (what would change, outside
    live mode), as audit rows."""
    rows = []
    apply = mode == "live"
    prefix = "" if apply else f"{mode}: "
    place = getattr(publisher, "place", None)
    if callable(place):
        levels = placement_levels(inputs, actions.placement_levels, config)
        for node, r in place(levels, actions.placement_levels, apply):
            why = f"placement level {levels[node]} of {actions.placement_levels}" if node in levels else "placement"
            rows.append(_JobActionRow(node, "placement", why, prefix + r.detail))
    elif actions.placement_levels:
        notices.append(f"placement: the {publisher.name} target takes no placement hints")
    standby = getattr(publisher, "standby", None)
    if callable(standby):
        if job_map is None and actions.standby_nodes:
            notices.append("standby: not refreshed, the job map is unavailable")
        else:
            loads = node_loads(job_map, now, actions.cost.checkpoint_interval) if job_map is not None else {}
            chosen = standby_nodes(inputs, loads, tiers_after, actions.standby_nodes)
            why = f"warm standby: among the {actions.standby_nodes} lowest-risk idle nodes"
            for node, r in standby(chosen, apply):
                reason = why if node in chosen or not node else "no longer a warm standby"
                rows.append(_JobActionRow(node, "standby", reason, prefix + r.detail))
    elif actions.standby_nodes:
        notices.append(f"standby: the {publisher.name} target keeps no standbys")
    return rows


def _job_row(
    row: _JobActionRow,
    by_node: Mapping[str, NodeRisk],
    tiers_after: Mapping[str, str],
    now: datetime,
    policy: str,
    common: Mapping[str, Any],
) -> AuditRow:
    n = by_node.get(row.node)
    tier = tiers_after.get(n.key, "none") if n is not None else "none"
    return AuditRow(
        time=now,
        cluster=n.cluster if n is not None else "",
        node=row.node,
        gpus=(),
        risk=n.risk if n is not None else float("nan"),
        previous_tier=tier,
        tier=tier,
        action=row.action,
        reason=row.reason,
        top_features=(),
        result=row.result,
        policy=policy,
        jobs=row.jobs,
        blast_radius=row.blast_radius,
        work_at_risk=row.work_at_risk,
        **common,
    )


def decisions_table(decisions: Sequence[AuditRow]) -> pa.Table:
    """Audit rows as a table of `AUDIT_SCHEMA`."""
    columns: dict[str, list[Any]] = {name: [] for name in AUDIT_SCHEMA.names}
    for d in decisions:
        for name in AUDIT_SCHEMA.names:
            value = getattr(d, name)
            if name in ("gpus", "top_features", "jobs"):
                value = list(value)
            elif name == "costs" and value is not None:
                value = dict(value)
            columns[name].append(value)
    return pa.Table.from_pydict(columns, schema=AUDIT_SCHEMA)


def append_audit(decisions: Sequence[AuditRow], path: str, fs: Any = None) -> str | None:
    """Add the decisions to the audit log at `path` (a data root's `actions` folder: a local
    folder or fsspec URL, or a path within `fs`) as one new file, visible at once, whole or not
    at all; returns its path (None, and nothing written, for no decisions). For writers without
    a policy state (benchmarks, tests): `gpufail publish` commits its audit file together with
    its state (`serving.publishing`)."""
    if not decisions:
        return None
    first = min(d.time for d in decisions)
    return _audit_store(path, fs).write_owned(AUDIT_DATASET, first.date(), decisions_table(decisions))


def read_audit(path: str, fs: Any = None) -> pd.DataFrame:
    """The whole audit log at `path` (see `append_audit`), oldest first: the files readers of
    the store see (those committed)."""
    table = _audit_store(path, fs).read_owned(AUDIT_DATASET)
    if table is None:
        return AUDIT_SCHEMA.empty_table().to_pandas()
    for column in AUDIT_SCHEMA:
        if column.name not in table.column_names:  # written before the column was added
            table = table.append_column(column, pa.nulls(table.num_rows, column.type))
    frame = table.select(AUDIT_SCHEMA.names).cast(AUDIT_SCHEMA).to_pandas()
    return frame.sort_values("time", kind="stable", ignore_index=True)


def _audit_store(path: str, fs: Any) -> Store:
    """The data root whose `actions` dataset is at `path`."""
    if fs is None:
        fs, path = fsspec.core.url_to_fs(str(path))
    root = str(path).rstrip("/")
    if root.rsplit("/", 1)[-1] == AUDIT_DATASET:
        root = root.rsplit("/", 1)[0]
    return Store(root, fs, root)
