"""What the node and actions pages read from the store, each read bounded by a time window and
pruned by date partition: a node's feature values and raw telemetry, its XID events, the
publish audit, and the publish policy's state files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from ingest.schema import metric_catalogue
from serving.api_metrics import PUBLISH_STATE_GLOB
from serving.policy import PolicyState
from serving.publish import AUDIT_SCHEMA

AUDIT_DATASET = "actions"


def _frame(table: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    return frame


def _last_day(end: datetime) -> Any:
    return (end - timedelta(microseconds=1)).date()


@cache
def _metrics_longest_first() -> tuple[tuple[str, str], ...]:
    metrics = [(m.column, m.kind) for m in metric_catalogue()]
    return tuple(sorted(metrics, key=lambda m: -len(m[0])))


def source_metric(feature: str) -> str | None:
    """The telemetry column a window feature summarises (`temp_gpu_c_max_24h` -> `temp_gpu_c`),
    None for features of no single plottable metric (XID counts, ages, bitmask flags)."""
    for column, kind in _metrics_longest_first():
        if feature.startswith(column + "_") and kind != "bitmask":
            return column
    return None


def _no_rows(values: Sequence[str]) -> pl.DataFrame:
    schema: dict[str, Any] = {"ts": pl.Datetime("us", "UTC"), "gpu_uuid": pl.String, "gpu_index": pl.Int16}
    return pl.DataFrame(schema={**schema, **{v: pl.Float64 for v in values}})


def node_filter(cluster: str, node: str) -> pc.Expression:
    return (pc.field("cluster") == cluster) & (pc.field("node") == node)


def node_features(
    store: Any, cluster: str, node: str, features: Sequence[str], start: datetime, end: datetime
) -> pl.DataFrame:
    """ts, gpu_uuid, gpu_index and `features` of the node's rows in the features dataset with
    start <= ts < end (`features.dataset.scan_features`), sorted by (gpu_uuid, ts)."""
    from features.dataset import scan_features

    if not store.files("features", start.date(), _last_day(end)):
        return _no_rows(features)
    rows = scan_features(store, start, end, ["cluster", "node", "gpu_index", *features])
    rows = rows.filter((pl.col("cluster") == cluster) & (pl.col("node") == node))
    return rows.collect().sort("gpu_uuid", "ts")


def node_telemetry(
    store: Any, cluster: str, node: str, metrics: Sequence[str], start: datetime, end: datetime
) -> pl.DataFrame:
    """ts, gpu_uuid, gpu_index and `metrics` of the node's telemetry samples in [start, end),
    sorted by (gpu_uuid, ts); empty when there is no telemetry."""
    if not metrics or not store.files("telemetry", start.date(), _last_day(end)):
        return _no_rows(metrics)
    table = store.read(
        "telemetry",
        start=start,
        end=end,
        columns=["ts", "gpu_uuid", "gpu_index", *metrics],
        filter=node_filter(cluster, node),
    )
    return _frame(table).sort("gpu_uuid", "ts")


def node_xids(store: Any, cluster: str, node: str, start: datetime, end: datetime, limit: int) -> pl.DataFrame:
    """The node's XID events in [start, end), newest first, at most `limit`."""
    if not store.files("xid_events", start.date(), _last_day(end)):
        return pl.DataFrame()
    table = store.read("xid_events", start=start, end=end, filter=node_filter(cluster, node))
    return _frame(table).sort("ts", descending=True).head(limit)


def audit(
    store: Any,
    start: datetime,
    end: datetime,
    *,
    cluster: str | None = None,
    node: str | None = None,
    actions: Sequence[str] | None = None,
    columns: Sequence[str] | None = None,
) -> pl.DataFrame:
    """Publish audit rows (`serving.publish.AUDIT_SCHEMA`, or only `columns`) with start <=
    time < end, optionally of one node and some actions, newest first. Temporary files
    (`.tmp-*`) are not read."""
    files = store.files(AUDIT_DATASET, start.date(), _last_day(end))
    if not files:
        empty = _frame(AUDIT_SCHEMA.empty_table())
        return empty if columns is None else empty.select(columns)
    expr = (pc.field("time") >= start) & (pc.field("time") < end)
    if node is not None:
        expr &= pc.field("node") == node
    if cluster is not None:
        expr &= pc.field("cluster") == cluster
    if actions is not None:
        expr &= pc.field("action").isin(list(actions))
    dataset = ds.dataset(files, schema=AUDIT_SCHEMA, format="parquet", filesystem=store.fs)
    frame = _frame(dataset.to_table(columns=None if columns is None else list(columns), filter=expr))
    return frame.sort("time", descending=True, maintain_order=True) if "time" in frame.columns else frame


@dataclass(frozen=True)
class PublishState:
    name: str
    """`publish-<target>` or `publish-<target>-shadow` (`serving.publish.state_name`)."""
    policy: PolicyState | None
    error: str = ""
    """Why the file could not be read ('' when it could)."""
    dry_run_only: bool = False
    """Only dry runs have published to this target: they commit their audit through the
    state's journal but never a policy state (`serving.publishing.publish_latest`)."""


def publish_states(store: Any) -> list[PublishState]:
    """Every publish policy state file under `_state/`, by name; a file that does not read is
    listed with the reason (naming the file within the data root)."""
    from ingest.journal import state_without_commit

    out = []
    paths = store.fs.glob(store.path("_state", PUBLISH_STATE_GLOB))
    for name, path in sorted((p.rsplit("/", 1)[-1].removesuffix(".json"), p) for p in paths):
        where = f"_state/{name}.json"
        try:
            raw = json.loads(store.fs.cat_file(path))
            state = state_without_commit(raw) if isinstance(raw, dict) else raw
            if state is None:
                out.append(PublishState(name, None, dry_run_only=True))
            else:
                out.append(PublishState(name, PolicyState.from_json(state, where)))
        except Exception as exc:  # one unreadable file must not hide the others
            out.append(PublishState(name, None, f"{where}: {type(exc).__name__}: {exc}"))
    return out


def last_dry_runs(store: Any, start: datetime, end: datetime) -> dict[str, pl.DataFrame]:
    """Target -> the audit rows of its newest dry run in [start, end) (every row written at
    that run's time)."""
    rows = audit(store, start, end, columns=["time", "cluster", "node", "tier", "action", "target", "mode"])
    rows = rows.filter(pl.col("mode") == "dry-run")
    out = {}
    for target in sorted(set(rows["target"].to_list())):
        mine = rows.filter(pl.col("target") == target)
        out[target] = mine.filter(pl.col("time") == mine["time"].max())
    return out
