"""The raw inputs of a feature build: XID events, repair records and GPU presence read from the
store, and the checks and normalisation every build applies to them, whoever read them.

A frame handed to `features.build.build_features` goes through the same `prepare_xids` /
`prepare_repairs` as one read here, so an in-memory build and a store build see the same inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta

import polars as pl
import pyarrow as pa

from features.labels import GPU, combine_presence, gpu_presence
from features.schema import TS_DTYPE
from features.xids import drop_cross_source_duplicates
from ingest.schema import FAILURE_EVENT_KEY
from ingest.store import Store

PRESENCE_COLUMNS = ["ts", "cluster", "node", "gpu_index", "pci_bus_id", GPU]
"""The telemetry columns GPU presence is read from (identity columns only)."""

_XID_DEFAULTS: dict[str, pl.DataType] = {
    "cluster": pl.String(),
    "node": pl.String(),
    "pci_bus_id": pl.String(),
    "gpu_index": pl.Int16(),
    GPU: pl.String(),
}


def as_frame(data: pl.DataFrame | pa.Table) -> pl.DataFrame:
    frame = data if isinstance(data, pl.DataFrame) else pl.from_arrow(data)
    assert isinstance(frame, pl.DataFrame)
    return frame


def utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def normalise_ts(frame: pl.DataFrame, columns: Sequence[str], what: str) -> pl.DataFrame:
    fixes = []
    for c in columns:
        if c not in frame.columns:
            continue
        dtype = frame.schema[c]
        if not isinstance(dtype, pl.Datetime):
            raise TypeError(f"{what}.{c}: expected a UTC datetime column, got {dtype}")
        if dtype != TS_DTYPE:
            # A naive timestamp is taken as UTC, which is what every gpufail writer stores.
            e = pl.col(c) if dtype.time_zone is None else pl.col(c).dt.convert_time_zone("UTC")
            e = e.dt.cast_time_unit("us")
            fixes.append(e.dt.replace_time_zone("UTC") if dtype.time_zone is None else e)
    return frame.with_columns(fixes) if fixes else frame


XID_COLUMNS = ["ts", "last_ts", "cluster", "node", "pci_bus_id", "gpu_index", GPU, "xid", "source", "repeat_count"]
"""The columns of `xid_events` the labels and features use. The rest (the log line's message,
the process) is nine tenths of the dataset's bytes: kept in the fleet facts, it made their cache
222 MB on the paper fleet, read by every process that computes features."""


def read_xid_events(store: Store) -> pl.DataFrame:
    """The store's XID events as the labels and features take them (`XID_COLUMNS`); none (a
    fleet without kernel logs or NVML events yet) is an empty frame of the same columns."""
    if store.exists("xid_events"):
        return prepare_xids(as_frame(store.read("xid_events", columns=XID_COLUMNS)))
    return prepare_xids(pl.DataFrame(schema={"ts": TS_DTYPE, "xid": pl.Int32()}))


def prepare_xids(xid_events: pl.DataFrame) -> pl.DataFrame:
    missing = [c for c in ("ts", "xid") if c not in xid_events.columns]
    if missing:
        raise ValueError(f"xid_events: missing required columns {missing}; got {xid_events.columns}")
    xid = normalise_ts(xid_events, ["ts", "last_ts"], "xid_events")
    extra = [pl.lit(None, dtype=t).alias(c) for c, t in _XID_DEFAULTS.items() if c not in xid.columns]
    if "last_ts" not in xid.columns:
        extra.append(pl.col("ts").alias("last_ts"))
    if "repeat_count" not in xid.columns:
        extra.append(pl.lit(1, dtype=pl.Int32).alias("repeat_count"))
    xid = xid.with_columns(extra) if extra else xid
    return drop_cross_source_duplicates(xid)


def prepare_repairs(repairs: pl.DataFrame | pa.Table | None) -> pl.DataFrame | None:
    if repairs is None:
        return None
    frame = as_frame(repairs)
    missing = [c for c in ("ts", "old_gpu_uuid") if c not in frame.columns]
    if missing:
        raise ValueError(f"repairs: missing required columns {missing}; got {frame.columns}")
    return normalise_ts(frame, ["ts"], "repairs")


def read_failure_events(store: Store) -> pl.DataFrame | None:
    """The store's failure events (records, scheduler-seen failures; `features.labels` source 4),
    once each; None when there are none."""
    if not store.exists("failure_events"):
        return None
    events = normalise_ts(as_frame(store.read("failure_events")), ["ts", "end"], "failure_events")
    return events.unique(FAILURE_EVENT_KEY, keep="first", maintain_order=True)


def read_repairs(store: Store) -> pl.DataFrame | None:
    """The store's repair records, prepared (`prepare_repairs`); None when there are none."""
    return prepare_repairs(store.read("repairs")) if store.exists("repairs") else None


def read_telemetry(
    store: Store, start: datetime, end: datetime, *, nodes: tuple[str, str] | None = None, one_piece: bool = True
) -> pl.DataFrame:
    """Telemetry rows with start <= ts < end (and node in the closed range `nodes`); with
    `one_piece` False, in the chunks read (a caller that copies parts of it anyway)."""
    where = None if nodes is None else pl.col("node").is_between(pl.lit(nodes[0]), pl.lit(nodes[1]))
    frame = store.collect(store.scan("telemetry", start, end, where=where), "telemetry", start, end)
    # In one piece: the scan returns a column in as many chunks as it read row groups (142 for a
    # paper fleet-day), and gathering rows from a chunked column was ~8x slower (2.2 s against
    # 0.25 s for the day's frame, plus 0.25 s to rechunk it).
    return frame.rechunk() if one_piece else frame


def scan_presence(store: Store) -> tuple[pl.DataFrame, set[date]]:
    """GPU presence over all telemetry, and the days that have telemetry. The streaming engine
    keeps this one pass over the whole history in bounded memory."""
    days = set(store.dates("telemetry"))
    if not days:
        return combine_presence([]), days
    return gpu_presence(store.scan("telemetry", columns=PRESENCE_COLUMNS), engine="streaming"), days


def read_day_presence(store: Store, day: date) -> pl.DataFrame:
    """GPU presence (`labels.gpu_presence`) of one UTC day of telemetry."""
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    table = store.read("telemetry", start, start + timedelta(days=1), columns=PRESENCE_COLUMNS)
    return gpu_presence(pl.DataFrame(pl.from_arrow(table)))


def read_nodes(store: Store, nodes: pl.DataFrame, start: datetime, end: datetime) -> pl.DataFrame:
    """Raw telemetry of the (cluster, node) pairs `nodes` with start <= ts < end."""
    where = pl.col("node").is_in(nodes["node"].unique().to_list())
    frame = store.collect(store.scan("telemetry", start, end, where=where), "telemetry", start, end)
    return frame.join(nodes, on=["cluster", "node"], how="semi")
