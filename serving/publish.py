"""The action policy and its audit log. This first version decides and records; it acts on
nothing (dry-run only: there is no scheduler publisher yet).

Policy, per (cluster, node), on the node risk of `serving.score`:

- `drain`: node risk >= `risk_threshold`, and within the circuit breaker's limit;
- `breaker_held`: would be drained, but more than `max_nodes_fraction` of the fleet's
  `total_nodes` would then be drained at once; the highest-risk nodes up to the limit
  (floor(max_nodes_fraction * total_nodes), possibly 0) are drained and the rest held. Mass
  drains after an XID flood or a bad model are the top complaint about existing tools
  (DOMAIN.md 5);
- `watch`: node risk >= `watch_threshold` (default half the risk threshold);
- `none`: below both.

The audit log is a Parquet dataset, one new file per call of `append_audit` under
`date=YYYY-MM-DD/` (the UTC date of the decisions): files are written to a temporary name and
renamed, and old files are never rewritten.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ingest.errors import InputError
from serving.score import node_risks

ACTIONS = ("drain", "breaker_held", "watch", "none")

AUDIT_SCHEMA = pa.schema(
    [
        ("time", pa.timestamp("us", tz="UTC")),
        ("cluster", pa.string()),
        ("node", pa.string()),
        ("gpus", pa.list_(pa.string())),
        ("risk", pa.float64()),
        ("action", pa.string()),
        ("reason", pa.string()),
        ("dry_run", pa.bool_()),
        ("model_version", pa.string()),
    ]
)


@dataclass(frozen=True)
class Decision:
    """What the policy decided for one node. `gpus` names the GPUs behind the decision (those
    at or above the watch threshold, else the riskiest one; none for action `none`)."""

    time: pd.Timestamp
    cluster: str
    node: str
    gpus: tuple[str, ...]
    risk: float
    action: str
    reason: str
    dry_run: bool
    model_version: str


def _breaker_limit(max_nodes_fraction: float, total_nodes: int) -> int:
    # The epsilon keeps 0.2 * 10 at 2 despite binary floating point.
    return math.floor(max_nodes_fraction * total_nodes + 1e-9)


def decide_actions(
    predictions: pd.DataFrame,
    *,
    risk_threshold: float,
    max_nodes_fraction: float,
    total_nodes: int,
    watch_threshold: float | None = None,
    dry_run: bool = True,
    now: datetime | pd.Timestamp | None = None,
) -> list[Decision]:
    """One decision per (cluster, node) in `predictions` (the output of
    `serving.score.score_latest`), highest node risk first. See the module docstring."""
    if not dry_run:
        raise InputError(
            "dry_run: only dry-run publishing exists in this version (no scheduler publisher yet), got dry_run=False"
        )
    watch = risk_threshold / 2 if watch_threshold is None else watch_threshold
    if not 0.0 <= watch <= risk_threshold <= 1.0:
        raise InputError(
            f"thresholds: expected 0 <= watch_threshold <= risk_threshold <= 1, got {watch} and {risk_threshold}"
        )
    if not 0.0 < max_nodes_fraction <= 1.0:
        raise InputError(f"max_nodes_fraction: expected a share in (0, 1], got {max_nodes_fraction}")
    nodes = node_risks(predictions)
    if total_nodes < len(nodes):
        raise InputError(
            f"total_nodes: expected at least the {len(nodes)} nodes present in the predictions, got {total_nodes}"
        )
    versions = predictions["model_version"].astype(str).unique().tolist() if "model_version" in predictions else []
    model_version = ",".join(sorted(versions)) if versions else "unknown"
    time = pd.Timestamp.now(tz="UTC") if now is None else pd.Timestamp(now)
    time = time.tz_localize("UTC") if time.tzinfo is None else time.tz_convert("UTC")

    limit = _breaker_limit(max_nodes_fraction, total_nodes)
    over = int((nodes["node_risk"] >= risk_threshold).sum())
    prefix = "dry-run: " if dry_run else ""
    decisions = []
    for position, row in enumerate(nodes.to_dict("records")):
        risk = float(row["node_risk"])
        uuids, risks = list(row["gpu_uuids"]), list(row["gpu_risks"])
        flagged = tuple(u for u, r in zip(uuids, risks, strict=True) if r >= watch)
        top = f"riskiest GPU {uuids[0]} (index {row['gpu_indices'][0]}) at {risks[0]:.3f}"
        if risk >= risk_threshold and position < limit:
            action = "drain"
            reason = f"{prefix}would drain: node risk {risk:.3f} >= drain threshold {risk_threshold:.3f}; {top}"
        elif risk >= risk_threshold:
            action = "breaker_held"
            reason = (
                f"{prefix}circuit breaker held the drain: {over} nodes at or over drain threshold "
                f"{risk_threshold:.3f}, at most {limit} ({max_nodes_fraction:.0%} of {total_nodes} nodes) "
                f"may be drained at once; this node ranks {position + 1}; node risk {risk:.3f}; {top}"
            )
        elif risk >= watch:
            action = "watch"
            reason = f"{prefix}would watch: node risk {risk:.3f} >= watch threshold {watch:.3f}; {top}"
        else:
            action = "none"
            reason = f"node risk {risk:.3f} below watch threshold {watch:.3f}"
        gpus = flagged or ((uuids[0],) if action != "none" else ())
        decisions.append(
            Decision(
                time=time,
                cluster=str(row["cluster"]),
                node=str(row["node"]),
                gpus=tuple(str(g) for g in gpus),
                risk=risk,
                action=action,
                reason=reason,
                dry_run=dry_run,
                model_version=model_version,
            )
        )
    return decisions


def decisions_table(decisions: Sequence[Decision]) -> pa.Table:
    """Decisions as a table of `AUDIT_SCHEMA`."""
    columns: dict[str, list[Any]] = {name: [] for name in AUDIT_SCHEMA.names}
    for d in decisions:
        for name in AUDIT_SCHEMA.names:
            value = getattr(d, name)
            columns[name].append(list(value) if name == "gpus" else value)
    return pa.Table.from_pydict(columns, schema=AUDIT_SCHEMA)


def _filesystem(path: str, fs: Any) -> tuple[Any, str]:
    import fsspec

    if fs is not None:
        return fs, str(path)
    return fsspec.core.url_to_fs(str(path))


def append_audit(decisions: Sequence[Decision], path: str, fs: Any = None) -> str | None:
    """Add the decisions to the audit log rooted at `path` as one new Parquet file; returns its
    path (None, and nothing written, for no decisions). `path` is a local folder or fsspec URL,
    or a path within `fs` (an fsspec filesystem, e.g. `Store.fs` with `Store.path("actions")`)."""
    if not decisions:
        return None
    table = decisions_table(decisions)
    fs, root = _filesystem(path, fs)
    first = min(d.time for d in decisions)
    folder = f"{root.rstrip('/')}/date={first:%Y-%m-%d}"
    fs.makedirs(folder, exist_ok=True)
    name = f"part-{first:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex}.parquet"
    final, tmp = f"{folder}/{name}", f"{folder}/.tmp-{name}"
    try:
        with fs.open(tmp, "wb") as fh:
            pq.write_table(table, fh)
        fs.mv(tmp, final)
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp)
        raise
    return final


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
