"""The data contract of the raw datasets that `ingest` owns.

Two datasets, both hive-partitioned by `date=YYYY-MM-DD` (the UTC date of `ts`):

- `telemetry`: one row per GPU sample. Identity columns first, then one typed column per
  metric from the metric catalogue (`metrics.csv`); every metric column carries its unit in
  its name, and a missing reading is a null, never a sentinel value.
- `xid_events`: one row per distinct XID incident; a flood of identical lines becomes one
  row with `repeat_count` (see `ingest.kernel_log_parser`).

`SCHEMA_VERSION` changes whenever a column is added, removed or retyped, so a store written by
another version is refused with a clear message instead of being read wrong.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Literal

import pyarrow as pa

from ingest.errors import InputError

SCHEMA_VERSION = 1

MetricKind = Literal["gauge", "counter", "flag", "bitmask"]

TIMESTAMP = pa.timestamp("us", tz="UTC")


@dataclass(frozen=True)
class Metric:
    """One row of the metric catalogue (`ingest/metrics.csv`)."""

    column: str
    kind: MetricKind
    arrow_type: pa.DataType
    unit: str
    nvml_field: str
    dcgm_field_id: int
    description: str
    valid_min: float | None = None
    valid_max: float | None = None
    """The range a reading can physically have; an import counts a value outside it and stores
    it as a missing reading (`ingest.metric_ranges`). None: unbounded on that side."""
    user: bool = False
    dcgm_field: str | None = None
    """A user metric's dcgm-exporter field name (`DCGM_FI_PROF_SM_ACTIVE`), if it comes from there."""
    """Declared by the user (`[metrics.<name>]`, recorded in the data root), not in `metrics.csv`."""


_ARROW_TYPES = {"float32": pa.float32(), "float64": pa.float64(), "int64": pa.int64()}


def metric_catalogue() -> tuple[Metric, ...]:
    """The metrics of this process: gpufail's own (`builtin_metrics`, from the packaged
    `metrics.csv`) followed by the user's (`use_user_metrics`). This is the one place the
    user's metrics extend the catalogue: the telemetry schema, the importers and the feature
    windows all ask here, so a user metric is stored, imported and turned into features like a
    built-in one of its kind.

    Kept as data so that a new counter is a one-line change and so that features can ask
    which columns are gauges and which are counters instead of hard-coding names.
    """
    return builtin_metrics() + _user_metrics


def user_metrics() -> tuple[Metric, ...]:
    """The user's metrics in use (those of the data root opened last, `ingest.user_metrics`)."""
    return _user_metrics


def use_user_metrics(metrics: tuple[Metric, ...]) -> None:
    """Make `metrics` the user's part of the catalogue (replacing any before). The process
    follows one data root at a time: `Store.open` calls this with what the root records."""
    global _user_metrics
    builtin = {m.column for m in builtin_metrics()} | {f.name for f in TELEMETRY_ID_FIELDS}
    clash = sorted(m.column for m in metrics if m.column in builtin)
    if clash:
        raise InputError(f"[metrics] {', '.join(clash)}: gpufail's own column; give your metric another name")
    _user_metrics = tuple(metrics)


_user_metrics: tuple[Metric, ...] = ()


@cache
def builtin_metrics() -> tuple[Metric, ...]:
    """gpufail's own metrics, read from the packaged `metrics.csv`."""
    text = resources.files("ingest").joinpath("metrics.csv").read_text()
    metrics = []
    for line_no, row in enumerate(csv.DictReader(text.splitlines()), start=2):
        if row["kind"] not in ("gauge", "counter", "flag", "bitmask"):
            raise ValueError(f"metrics.csv line {line_no}: unknown kind {row['kind']!r}")
        metrics.append(
            Metric(
                column=row["column"],
                kind=row["kind"],  # type: ignore[arg-type]
                arrow_type=_ARROW_TYPES[row["arrow_type"]],
                unit=row["unit"],
                nvml_field=row["nvml_field"],
                dcgm_field_id=int(row["dcgm_field_id"]),
                description=row["description"],
                valid_min=float(row["valid_min"]) if row["valid_min"] else None,
                valid_max=float(row["valid_max"]) if row["valid_max"] else None,
            )
        )
    return tuple(metrics)


def metric_columns(kind: MetricKind | None = None) -> list[str]:
    """Names of the metric columns, optionally only those of one kind."""
    return [m.column for m in metric_catalogue() if kind is None or m.kind == kind]


# Identity of a sample. `pci_bus_id` is normalised to `dddd:bb:dd` (lower-case, no function),
# the form kernel-log XID lines use, so XID events can be joined to GPUs.
TELEMETRY_ID_FIELDS = [
    pa.field("ts", TIMESTAMP, nullable=False),
    pa.field("cluster", pa.string(), nullable=False),
    pa.field("node", pa.string(), nullable=False),
    pa.field("gpu_index", pa.int16(), nullable=False),
    pa.field("gpu_uuid", pa.string(), nullable=False),
    pa.field("pci_bus_id", pa.string()),
    pa.field("gpu_model", pa.string()),
    pa.field("driver", pa.string()),
]


def telemetry_schema() -> pa.Schema:
    return _telemetry_schema(metric_catalogue())


@cache
def _telemetry_schema(catalogue: tuple[Metric, ...]) -> pa.Schema:
    metric_fields = [pa.field(m.column, m.arrow_type) for m in catalogue]
    return pa.schema(TELEMETRY_ID_FIELDS + metric_fields, metadata=_metadata("telemetry"))


def optional_columns(dataset: str) -> frozenset[str]:
    """Columns of `dataset` a file may lack, read as nulls: the user's metrics, since a metric
    declared after telemetry was written has no column in the older files."""
    return frozenset(m.column for m in _user_metrics) if dataset == "telemetry" else frozenset()


XID_EVENTS_SCHEMA = pa.schema(
    [
        pa.field("ts", TIMESTAMP, nullable=False),  # first line of the incident
        pa.field("last_ts", TIMESTAMP, nullable=False),  # last repeated line folded into it
        pa.field("cluster", pa.string(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("pci_bus_id", pa.string(), nullable=False),
        pa.field("gpu_index", pa.int16()),  # null when the bus id could not be mapped
        pa.field("gpu_uuid", pa.string()),
        pa.field("xid", pa.int32(), nullable=False),
        pa.field("pid", pa.int64()),
        pa.field("process", pa.string()),
        pa.field("message", pa.string()),
        pa.field("source", pa.string(), nullable=False),  # e.g. "kmsg", "journal", "file:<name>"
        pa.field("repeat_count", pa.int32(), nullable=False),
    ],
    metadata=None,
)


def _metadata(dataset: str) -> dict[bytes, bytes]:
    return {b"gpufail.dataset": dataset.encode(), b"gpufail.schema_version": str(SCHEMA_VERSION).encode()}


def xid_events_schema() -> pa.Schema:
    return XID_EVENTS_SCHEMA.with_metadata(_metadata("xid_events"))


# Ground truth written only by the simulator (never a label source), so that evaluation and tests can compare what
# the pipeline infers (labels from XIDs and gaps) with what really happened.
FAILURES_SCHEMA = pa.schema(
    [
        pa.field("ts", TIMESTAMP, nullable=False),
        pa.field("cluster", pa.string(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("gpu_index", pa.int16(), nullable=False),
        pa.field("gpu_uuid", pa.string(), nullable=False),
        pa.field("gpu_model", pa.string(), nullable=False),
        pa.field("mode", pa.string(), nullable=False),
        pa.field("xid", pa.int32()),  # the terminal XID; null when the GPU left no Xid line
        pa.field("precursor_start", TIMESTAMP),  # null for modes without precursors
        pa.field("precursor_strength", pa.float32()),
    ]
)

# Failures seen by someone other than the GPU's own log, one row per event, all label sources
# beside the XIDs (`features.labels`): `source` is "record" (a ticket or failure record imported
# by `gpufail ingest table` or `gpufail ingest failures`), "slurm" (a NODE_FAIL job end, a node
# set DOWN with a reason) or "kubernetes" (a node's Ready condition gone False/Unknown).
# A scheduler sees nodes, not GPUs: `gpu_uuid` (and `gpu_index`) may be null, and such a row
# stands for every GPU of the node. `end`: when the node or GPU was back in service, if known.
FAILURE_EVENT_SOURCES = ("record", "slurm", "kubernetes")
FAILURE_EVENTS_SCHEMA = pa.schema(
    [
        pa.field("ts", TIMESTAMP, nullable=False),
        pa.field("cluster", pa.string(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("gpu_index", pa.int16()),
        pa.field("gpu_uuid", pa.string()),
        pa.field("source", pa.string(), nullable=False),
        pa.field("reason", pa.string()),
        pa.field("ref", pa.string()),  # the ticket, job or object it came from
        pa.field("xid", pa.int32()),
        pa.field("end", TIMESTAMP),
    ]
)
FAILURE_EVENT_KEY = ["ts", "cluster", "node", "gpu_uuid", "source", "ref"]
"""What makes a failure event the same event again (an import run twice adds nothing)."""

# Operator records: a failed GPU is replaced (new UUID in the same slot) or returned to service.
REPAIRS_SCHEMA = pa.schema(
    [
        pa.field("ts", TIMESTAMP, nullable=False),
        pa.field("cluster", pa.string(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("gpu_index", pa.int16(), nullable=False),
        pa.field("old_gpu_uuid", pa.string(), nullable=False),
        pa.field("new_gpu_uuid", pa.string()),
        pa.field("action", pa.string(), nullable=False),  # "replace" | "reseat" | "reset"
    ]
)

# One row per call of a live collector (ingest.collect): whether it worked, how long it took,
# how many rows it returned and, when it failed, why. Lets an operator see a dying collector.
COLLECTOR_RUNS_SCHEMA = pa.schema(
    [
        pa.field("ts", TIMESTAMP, nullable=False),
        pa.field("cluster", pa.string(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("collector", pa.string(), nullable=False),
        pa.field("ok", pa.bool_(), nullable=False),
        pa.field("duration_s", pa.float64(), nullable=False),
        pa.field("rows", pa.int64(), nullable=False),
        pa.field("error", pa.string()),
    ]
)

DatasetName = Literal["telemetry", "xid_events", "failures", "failure_events", "repairs", "collector_runs"]


def schema_for(dataset: str) -> pa.Schema:
    """The schema a dataset must have, with gpufail's identifying metadata attached."""
    schemas = {
        "telemetry": telemetry_schema(),
        "xid_events": xid_events_schema(),
        "failures": FAILURES_SCHEMA.with_metadata(_metadata("failures")),
        "failure_events": FAILURE_EVENTS_SCHEMA.with_metadata(_metadata("failure_events")),
        "repairs": REPAIRS_SCHEMA.with_metadata(_metadata("repairs")),
        "collector_runs": COLLECTOR_RUNS_SCHEMA.with_metadata(_metadata("collector_runs")),
    }
    try:
        return schemas[dataset]
    except KeyError:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {sorted(schemas)}") from None


def normalise_pci_bus_id(raw: str) -> str:
    """`00000000:3B:00.0`, `0000:3b:00.0` or `PCI:0000:3b:00` -> `0000:3b:00`.

    NVML reports an 8-digit domain and a function; the kernel log prints a 4-digit domain and
    no function. One canonical form lets XID lines be joined to NVML samples.
    """
    text = raw.strip().lower().removeprefix("pci:")
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"PCI bus id {raw!r}: expected domain:bus:device[.function]")
    domain, bus, device = parts
    device = device.split(".")[0]
    try:
        return f"{int(domain, 16) & 0xFFFF:04x}:{int(bus, 16):02x}:{int(device, 16):02x}"
    except ValueError:
        raise ValueError(f"PCI bus id {raw!r}: expected hexadecimal domain:bus:device") from None
