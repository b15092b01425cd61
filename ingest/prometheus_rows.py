"""dcgm-exporter series, as Prometheus stores them, -> `telemetry` rows and XID events.

The mapping is `gpufail ingest dcgm-exporter`'s (`ingest.dcgm_scrape`): a series' name picks
our column through its DCGM field id (or a user metric's `dcgm_field`), a reading is missing
when it is NaN, infinite, a DCGM blank sentinel or outside the metric's valid range, and the
labels `Hostname`, `UUID`, `gpu`, `pci_bus_id`, `modelName` and `DCGM_FI_DRIVER_VERSION` say
which GPU it is. So the samples of one scrape give the same rows whichever way they come in.

What differs is time: every sample lands at its own timestamp, and the samples of one GPU at
one timestamp (the metrics of one scrape) are one row. Counters are stored as read, resets and
all: the features take a counter's increases and treat a drop as a reset, as for the collector.
Two series that give one GPU the same metric at the same time (two Prometheus replicas, a MIG
instance repeating a GPU-level field) give one reading: the first series' (the first with a
reading, as in a scrape). A series without the labels that name its GPU is counted by reason
and left out, never guessed.

`DCGM_FI_DEV_XID_ERRORS` holds the last XID of its GPU. Each change to a non-zero value is an
XID event of that GPU at that sample's time (`xid_changes`).

numpy and pyarrow only: `gpufail collect --source prometheus` uses this without polars.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ingest.dcgm_scrape import (
    FP64_BLANKS,
    INT64_BLANK_MIN,
    SCALE_BY_FIELD_ID,
    ZERO_MEANS_NO_SENSOR,
    dcgm_field_ids,
    metric_by_name,
)
from ingest.metric_ranges import largest_magnitude
from ingest.prometheus_api import Series
from ingest.prometheus_labels import Attributes, GpuKey, LabelMap
from ingest.schema import TIMESTAMP, Metric, telemetry_schema, xid_events_schema

XID_FIELD_ID = 230
XID_METRICS = frozenset(name for name, field_id in dcgm_field_ids().items() if field_id == XID_FIELD_ID)
"""`DCGM_FI_DEV_XID_ERRORS` and DCGM's newer name for it."""
SOURCE = "prometheus"
"""The `source` of the XID events read from Prometheus."""


@dataclass
class SeriesCounts:
    """What the mapping read and what it left out, summed over the batches of a run."""

    samples: int = 0
    """Samples read of the series that name their GPU (XID series included)."""
    blank_values: int = 0
    """Readings that were NaN, infinite or a DCGM blank sentinel: stored as missing."""
    out_of_range: Counter[str] = field(default_factory=Counter)
    """Per column, readings outside the metric's valid range: stored as missing."""
    duplicates: int = 0
    """Readings of a GPU, metric and time another series gave already (replicas): dropped."""
    unlabelled: Counter[str] = field(default_factory=Counter)
    """Why series were left out (a label missing or malformed) -> how many series."""
    xid_changes: int = 0

    def add(self, other: SeriesCounts) -> None:
        self.samples += other.samples
        self.blank_values += other.blank_values
        self.out_of_range += other.out_of_range
        self.duplicates += other.duplicates
        self.unlabelled += other.unlabelled
        self.xid_changes += other.xid_changes


def readings(values: np.ndarray, metric: Metric, counts: SeriesCounts) -> np.ndarray:
    """`ingest.dcgm_scrape`'s reading rules over an array: the values in our column's unit, NaN
    where the reading is missing (counted as blank or out of range)."""
    out = values.astype(np.float64, copy=True)
    blank = ~np.isfinite(out) | (out >= INT64_BLANK_MIN) | np.isin(out, list(FP64_BLANKS))
    if metric.column in ZERO_MEANS_NO_SENSOR:
        blank |= out == 0
    counts.blank_values += int(blank.sum())
    out[blank] = np.nan
    scale = SCALE_BY_FIELD_ID.get(metric.dcgm_field_id)
    if scale is not None:
        out *= scale
    if pa.types.is_integer(metric.arrow_type):
        out = np.round(out)
    # A magnitude the column cannot hold (`ingest.metric_ranges`): -1e308 of a bitmask.
    outside = np.abs(out) >= largest_magnitude(metric)
    if metric.valid_min is not None:
        outside |= out < metric.valid_min
    if metric.valid_max is not None:
        outside |= out > metric.valid_max
    if outside.any():
        counts.out_of_range[metric.column] += int(outside.sum())
        out[outside] = np.nan
    return out


@dataclass
class Mapped:
    """The rows of a batch of series."""

    telemetry: pa.Table
    xids: list[tuple[GpuKey, Attributes, Series]]
    """The XID series, by GPU, for `xid_changes`."""


def map_series(series: list[Series], labels: LabelMap, counts: SeriesCounts) -> Mapped:
    """`telemetry` rows (one per GPU and timestamp) of `series`, in the order given (which
    decides which of two series with the same reading wins)."""
    by_name = metric_by_name()
    catalogue = list(telemetry_schema().names)
    keys: dict[GpuKey, int] = {}
    attributes: dict[Attributes, int] = {}
    parts: list[tuple[int, int, int, Series, np.ndarray]] = []  # gpu, attributes, column, series, values
    xids: list[tuple[GpuKey, Attributes, Series]] = []
    for one in series:
        name = one.labels.get("__name__", "")
        metric = by_name.get(name)
        if metric is None and name not in XID_METRICS:
            continue  # the import asks only for mapped names; a collector's selector may match more
        who = labels.identity(one.labels)
        if isinstance(who, str):
            counts.unlabelled[who] += 1
            continue
        key, attrs = who
        counts.samples += len(one.values)
        if metric is None:
            xids.append((key, attrs, one))
            continue
        values = readings(one.values, metric, counts)
        gpu = keys.setdefault(key, len(keys))
        attr = attributes.setdefault(attrs, len(attributes))
        parts.append((gpu, attr, catalogue.index(metric.column), one, values))
    return Mapped(_table(parts, list(keys), list(attributes), counts), xids)


def _table(
    parts: list[tuple[int, int, int, Series, np.ndarray]],
    keys: list[GpuKey],
    attributes: list[Attributes],
    counts: SeriesCounts,
) -> pa.Table:
    schema = telemetry_schema()
    if not parts:
        return schema.empty_table()
    sizes = [len(p[3].times_ms) for p in parts]
    gpu = np.repeat([p[0] for p in parts], sizes)
    attr = np.repeat([p[1] for p in parts], sizes)
    times = np.concatenate([p[3].times_ms for p in parts])
    # One stable sort on (GPU, time): entries are in series order, so ties keep it.
    first_time = int(times.min())
    span = int(times.max()) - first_time + 1
    if span < 2**40 and len(keys) < 2**22:
        order = np.argsort(gpu.astype(np.int64) * span + (times - first_time), kind="stable")
    else:
        order = np.lexsort((times, gpu))
    sorted_gpu, sorted_times = gpu[order], times[order]
    new_row = np.ones(len(order), dtype=bool)
    new_row[1:] = (sorted_gpu[1:] != sorted_gpu[:-1]) | (sorted_times[1:] != sorted_times[:-1])
    row_of_sorted = np.cumsum(new_row) - 1
    n_rows = int(row_of_sorted[-1]) + 1
    row = np.empty(len(order), dtype=np.int64)
    row[order] = row_of_sorted  # each entry's row, in series order
    row_gpu, row_attr = sorted_gpu[new_row], attr[order][new_row]

    identity = {
        "ts": pa.array(sorted_times[new_row] * 1000, TIMESTAMP),
        "cluster": pa.array([k[0] for k in keys], pa.string()).take(row_gpu),
        "node": pa.array([k[1] for k in keys], pa.string()).take(row_gpu),
        "gpu_index": pa.array([k[2] for k in keys], pa.int16()).take(row_gpu),
        "gpu_uuid": pa.array([k[3] for k in keys], pa.string()).take(row_gpu),
        "pci_bus_id": pa.array([a[0] for a in attributes], pa.string()).take(row_attr),
        "gpu_model": pa.array([a[1] for a in attributes], pa.string()).take(row_attr),
        "driver": pa.array([a[2] for a in attributes], pa.string()).take(row_attr),
    }
    bounds = np.cumsum([0, *sizes])
    by_column: dict[int, list[int]] = {}
    for i, part in enumerate(parts):
        by_column.setdefault(part[2], []).append(i)
    arrays: list[pa.Array] = []
    for index, f in enumerate(schema):
        if f.name in identity:
            arrays.append(identity[f.name])
        elif index in by_column:
            mine = by_column[index]
            rows = np.concatenate([row[bounds[i] : bounds[i + 1]] for i in mine])
            values = np.concatenate([parts[i][4] for i in mine])
            present = ~np.isnan(values)
            rows, values = rows[present], values[present]
            # The first series with a reading of a row wins (np.unique's index is the first).
            taken, first = np.unique(rows, return_index=True)
            counts.duplicates += len(rows) - len(taken)
            filled = np.zeros(n_rows, dtype=bool)
            filled[taken] = True
            dense = np.zeros(n_rows, dtype=np.float64)
            dense[taken] = values[first]
            arrays.append(pa.array(dense.astype(f.type.to_pandas_dtype()), type=f.type, mask=~filled))
        else:
            arrays.append(pa.nulls(n_rows, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def xid_changes(
    xids: list[tuple[GpuKey, Attributes, Series]],
    last: dict[GpuKey, float],
    counts: SeriesCounts,
) -> pa.Table:
    """XID events: each sample of a GPU's `DCGM_FI_DEV_XID_ERRORS` whose value is non-zero and
    differs from the one before (`last`: each GPU's value before these samples, updated here;
    a GPU absent from it takes its first non-zero value as a change)."""
    merged: dict[GpuKey, tuple[Attributes, list[Series]]] = {}
    for key, attrs, one in xids:
        merged.setdefault(key, (attrs, []))[1].append(one)
    rows: list[tuple[int, GpuKey, Attributes, int]] = []
    for key, (attrs, parts) in merged.items():
        if attrs[0] is None:
            # An XID event names its GPU by bus id, as a kernel log does.
            counts.unlabelled["XID series without a PCI bus id"] += len(parts)
            continue
        times = np.concatenate([p.times_ms for p in parts])
        values = np.concatenate([p.values for p in parts])
        order = np.argsort(times, kind="stable")
        times, values = times[order], values[order]
        unique = np.ones(len(times), dtype=bool)
        unique[1:] = times[1:] != times[:-1]  # replicas: one reading per time
        values = values[unique]
        times = times[unique]
        readable = np.isfinite(values) & (values < INT64_BLANK_MIN) & ~np.isin(values, list(FP64_BLANKS))
        values, times = values[readable], times[readable]
        if not len(values):
            continue
        before = np.concatenate([[last.get(key, np.nan)], values[:-1]])
        changed = (values != before) & (values != 0)
        rows += [(int(t), key, attrs, int(v)) for t, v in zip(times[changed], values[changed], strict=True)]
        last[key] = float(values[-1])
    counts.xid_changes += len(rows)
    return xid_table(rows)


def xid_table(rows: list[tuple[int, GpuKey, Attributes, int]]) -> pa.Table:
    """`xid_events` rows (one line each, no message) for (time ms, GPU, attributes, XID)."""
    rows.sort(key=lambda r: r[0])
    n = len(rows)
    stamps = pa.array([r[0] * 1000 for r in rows], TIMESTAMP)
    columns = {
        "ts": stamps,
        "last_ts": stamps,
        "cluster": pa.array([r[1][0] for r in rows], pa.string()),
        "node": pa.array([r[1][1] for r in rows], pa.string()),
        "pci_bus_id": pa.array([r[2][0] for r in rows], pa.string()),
        "gpu_index": pa.array([r[1][2] for r in rows], pa.int16()),
        "gpu_uuid": pa.array([r[1][3] for r in rows], pa.string()),
        "xid": pa.array([r[3] for r in rows], pa.int32()),
        "pid": pa.nulls(n, pa.int64()),
        "process": pa.nulls(n, pa.string()),
        "message": pa.nulls(n, pa.string()),
        "source": pa.array([SOURCE] * n, pa.string()),
        "repeat_count": pa.array([1] * n, pa.int32()),
    }
    return pa.table(columns, schema=xid_events_schema())
