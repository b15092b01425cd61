"""Parse a dcgm-exporter Prometheus text scrape into `telemetry` rows (one row per GPU).

Metric names are mapped through the DCGM field id, not by name: DCGM renamed its fields in 2026
(`DCGM_FI_DEV_GPU_TEMP` -> `DCGM_FI_DEV_GPU_TEMP_CELSIUS`, ...) while dcgm-exporter still emits
the old names, and `dcgm_field_ids.csv` lists both under one id. The id then picks our column
through the metric catalogue's `dcgm_field_id`, so the catalogue stays the one place that says
what gpufail collects.
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from importlib import resources

import pyarrow as pa
from prometheus_client.parser import text_string_to_metric_families

from ingest.errors import InputError
from ingest.metric_ranges import in_range
from ingest.schema import Metric, metric_catalogue, normalise_pci_bus_id, telemetry_schema

# dcgm-exporter prints DCGM's int64 "blank" sentinels (DCGM_INT64_BLANK = 0x7ffffffffffffff0 and
# its NOT_FOUND / NOT_SUPPORTED / NOT_PERMISSIONED neighbours, ~9.22e18) as plain numbers.
INT64_BLANK_MIN = 9.2e18
# DCGM_FP64_BLANK (2**47) and its three neighbours: the same sentinels for float fields.
FP64_BLANKS = frozenset(float(2**47 + i) for i in range(4))

# DCGM_FI_DEV_XID_ERRORS holds only the last XID and never clears, so one scrape cannot say
# whether an XID happened: XIDs come from kernel logs (ingest.kernel_log_parser), and from the
# changes of this series over time where Prometheus kept them (ingest.prometheus_rows).
IGNORED_METRICS = frozenset({"DCGM_FI_DEV_XID_ERRORS"})

# Where DCGM's unit differs from our column's: violation times are ns in DCGM, us in our schema.
SCALE_BY_FIELD_ID = {240: 1e-3, 241: 1e-3}

_GPU_LABELS = ("gpu", "UUID")


@dataclass
class ScrapeParse:
    """The rows of one scrape and what was left out of them, for a collector to report."""

    table: pa.Table
    # metric name -> samples skipped because no column of ours takes that DCGM field
    ignored_metrics: Counter[str] = field(default_factory=Counter)
    # samples of a known metric without the `gpu`/`UUID` labels (e.g. NVSwitch or host series)
    samples_without_gpu: int = 0
    # readings that were a DCGM blank sentinel or NaN and became nulls
    blank_values: int = 0
    # per column, readings outside the metric's valid range (`ingest.metric_ranges`), now nulls
    out_of_range: Counter[str] = field(default_factory=Counter)


@cache
def dcgm_field_ids() -> dict[str, int]:
    """DCGM field name -> field id, old (alias) and new names alike."""
    text = resources.files("ingest").joinpath("dcgm_field_ids.csv").read_text()
    return {row["name"]: int(row["field_id"]) for row in csv.DictReader(text.splitlines())}


def metric_by_name() -> dict[str, Metric]:
    """DCGM field name -> the metric of this process's catalogue that stores it (module notes)."""
    return _metric_by_name(metric_catalogue())


@cache
def _metric_by_name(catalogue: tuple[Metric, ...]) -> dict[str, Metric]:
    """DCGM field name -> our metric: gpufail's own by field id; a user metric by the field
    name it declares (`dcgm_field`), and that field's other names when DCGM renamed it. A field
    gpufail already stores stays in gpufail's column."""
    by_field_id = {m.dcgm_field_id: m for m in catalogue if not m.user}
    by_name = {
        name: by_field_id[field_id]
        for name, field_id in dcgm_field_ids().items()
        if field_id in by_field_id and name not in IGNORED_METRICS
    }
    for metric in catalogue:
        if metric.dcgm_field is None:
            continue
        field_id = dcgm_field_ids().get(metric.dcgm_field)
        aliases = [n for n, i in dcgm_field_ids().items() if field_id is not None and i == field_id]
        for name in {metric.dcgm_field, *aliases}:
            by_name.setdefault(name, metric)
    return by_name


def parse_scrape(
    text: str, *, now: datetime, cluster: str, node: str | None = None, source: str = "<scrape>"
) -> pa.Table:
    """One `telemetry` row per GPU in a dcgm-exporter scrape, stamped `now`.

    `node` defaults to each GPU's `Hostname` label. Metrics without a column of ours are
    skipped; columns the scrape lacks are null. A scrape with no DCGM GPU metrics gives an
    empty table; text that is not Prometheus exposition raises `InputError` naming `source`.
    """
    return parse_scrape_detailed(text, now=now, cluster=cluster, node=node, source=source).table


def parse_scrape_detailed(
    text: str, *, now: datetime, cluster: str, node: str | None = None, source: str = "<scrape>"
) -> ScrapeParse:
    """`parse_scrape`, plus counts of what was skipped."""
    if now.tzinfo is None:
        raise ValueError(f"now={now!r} is naive; expected a timezone-aware datetime (UTC)")
    ts = now.astimezone(UTC)
    result = ScrapeParse(table=telemetry_schema().empty_table())
    metrics_by_name = metric_by_name()
    rows: dict[tuple[int, str], dict[str, object]] = {}

    for name, family_name, labels, value in _samples(text, source):
        # The parser names a counter's samples `<name>_total` even when the scrape printed no
        # such suffix (dcgm-exporter never does); the family keeps the printed name.
        metric = metrics_by_name.get(name) or metrics_by_name.get(family_name)
        if metric is None:
            result.ignored_metrics[family_name] += 1
            continue
        if not all(labels.get(label) for label in _GPU_LABELS):
            result.samples_without_gpu += 1
            continue
        key = (_gpu_index(labels["gpu"], name, source), labels["UUID"])
        row = rows.get(key)
        if row is None:
            row = rows[key] = _identity(key, labels, ts=ts, cluster=cluster, node=node, source=source)
        reading = _reading(value, metric)
        if reading is None:
            result.blank_values += 1
        elif not in_range(reading, metric):
            result.out_of_range[metric.column] += 1
            reading = None
        # A MIG instance or a repeated scrape can repeat a GPU-level series: the first reading wins.
        if row.get(metric.column) is None:
            row[metric.column] = reading

    if rows:
        schema = telemetry_schema()
        columns = {f.name: [row.get(f.name) for row in rows.values()] for f in schema}
        result.table = pa.Table.from_pydict(columns, schema=schema)
    return result


def _samples(text: str, source: str) -> list[tuple[str, str, dict[str, str], float]]:
    try:
        return [
            (s.name, family.name, s.labels, float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on bad text
        raise InputError(
            f"{source}{_bad_line(text)}: not Prometheus text exposition format ({exc or type(exc).__name__}); "
            'expected lines like \'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-..."} 42\''
        ) from None


def _bad_line(text: str) -> str:
    """`, line N` for the first line that does not parse on its own, to point at the problem."""
    for line_no, line in enumerate(text.splitlines(), start=1):
        try:
            list(text_string_to_metric_families(line + "\n"))
        except Exception:
            return f", line {line_no}"
    return ""


def _gpu_index(raw: str, metric: str, source: str) -> int:
    try:
        index = int(raw)
    except ValueError:
        index = -1
    if not 0 <= index < 2**15:
        raise InputError(f"{source}: {metric} has gpu={raw!r}; expected a GPU index (a small non-negative integer)")
    return index


def _identity(
    key: tuple[int, str],
    labels: dict[str, str],
    *,
    ts: datetime,
    cluster: str,
    node: str | None,
    source: str,
) -> dict[str, object]:
    host = node or labels.get("Hostname")
    if not host:
        raise InputError(f"{source}: GPU {key[1]} has no Hostname label; expected one, or pass node=")
    raw_bus = labels.get("pci_bus_id")
    try:
        bus = normalise_pci_bus_id(raw_bus) if raw_bus else None
    except ValueError as exc:
        raise InputError(f"{source}: GPU {key[1]}: {exc}") from None
    return {
        "ts": ts,
        "cluster": cluster,
        "node": host,
        "gpu_index": key[0],
        "gpu_uuid": key[1],
        "pci_bus_id": bus,
        "gpu_model": labels.get("modelName") or None,
        "driver": labels.get("DCGM_FI_DRIVER_VERSION") or None,
    }


# Boards without an HBM temperature sensor (T4, L4: GDDR6) report memory temperature as 0. No
# board in a data centre runs at 0 degC, and a 0 would drag temperature features down, so it is
# a missing reading.
ZERO_MEANS_NO_SENSOR = frozenset({"temp_mem_c"})


def _reading(value: float, metric: Metric) -> float | int | None:
    """The value in our column's unit and type; None for NaN, infinities and DCGM blank sentinels."""
    if not math.isfinite(value) or value >= INT64_BLANK_MIN or value in FP64_BLANKS:
        return None
    if metric.column in ZERO_MEANS_NO_SENSOR and value == 0:
        return None
    value *= SCALE_BY_FIELD_ID.get(metric.dcgm_field_id, 1.0)
    if pa.types.is_integer(metric.arrow_type):
        return round(value)
    return value


def fetch_scrape(source: str, timeout_s: float = 10.0) -> str:
    """The text of a scrape: an http(s) URL of a dcgm-exporter `/metrics` endpoint, or a file
    holding a saved scrape. Failures become one `InputError` naming the source."""
    if source.startswith(("http://", "https://")):
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(source, timeout=timeout_s) as response:
                return response.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise InputError(
                f"dcgm-exporter scrape {source}: cannot fetch ({exc}); expected a reachable /metrics URL"
            ) from None
    try:
        with open(source, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError as exc:
        raise InputError(
            f"dcgm-exporter scrape {source}: cannot read ({exc.strerror}); expected a file or an http(s) URL"
        ) from None
