"""Telemetry, failures and repairs from another system's CSV or Parquet export.

A fleet that already keeps its GPU history elsewhere (a metrics warehouse, a ticket system)
exports it as a table and writes a small TOML mapping (`ingest.table_mapping`): which column
is the GPU, the node, the time, and each metric; optionally which rows or which other file are
failures and repairs. `import_table` then writes our `telemetry`, `failure_events` (source
`record`, a label source like the failure XIDs) and `repairs` datasets, and the rest of the pipeline (`gpufail features`, ...) runs on them unchanged.

Rows that cannot be used are skipped and counted with their reason and an example place
(file, row, column): a time that does not parse or is implausible, no GPU id, a GPU that
already has a sample at that time. A metric cell that is not a number becomes a missing
reading, also counted, and so does a reading outside its metric's valid range
(`ingest.metric_ranges`), counted per metric. A mapping that names a column the file lacks is an `InputError`.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
import pyarrow as pa

from ingest.errors import InputError
from ingest.failure_events import write_failure_events
from ingest.metric_ranges import describe_range, outside_range
from ingest.schema import REPAIRS_SCHEMA, Metric, metric_catalogue, normalise_pci_bus_id
from ingest.store import Store
from ingest.table_mapping import (
    EventMapping,
    FailureMapping,
    RepairMapping,
    TableMapping,
    TelemetryMapping,
    TimeColumns,
)
from ingest.time_bounds import EARLIEST_PLAUSIBLE, FUTURE_SLACK, IMPLAUSIBLE

log = logging.getLogger(__name__)

_TRUE_WORDS = ("true", "1", "yes", "y", "t")
_UTC_US = pl.Datetime("us", "UTC")
_ROW = "__row"  # 1-based row number in the data file (after the header), for messages


@dataclass
class TableImportSummary:
    telemetry_rows: int = 0
    failures: int = 0
    repairs: int = 0
    bad_cells: int = 0  # metric cells that were not numbers, now missing readings
    out_of_range: Counter[str] = field(default_factory=Counter)
    """Per metric, readings outside its valid range (`ingest.metric_ranges`), now missing readings."""
    skipped: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # reason -> first place

    def skip(self, reason: str, count: int, where: str) -> None:
        if count:
            self.skipped[reason] += count
            self.examples.setdefault(reason, where)

    def line(self) -> str:
        text = f"{self.telemetry_rows:,} telemetry rows, {self.failures} failures, {self.repairs} repairs"
        if self.bad_cells:
            text += f", {self.bad_cells:,} metric cells that were not numbers left missing"
        if self.out_of_range:
            per_metric = ", ".join(
                f"{metric} {n:,}, e.g. {self.examples[f'out of range {metric}']}"
                for metric, n in self.out_of_range.most_common()
            )
            total = sum(self.out_of_range.values())
            text += f", {total:,} readings outside their metric's valid range left missing ({per_metric})"
        if self.skipped:
            text += "; skipped " + ", ".join(
                f"{n:,} {reason} (e.g. {self.examples[reason]})" for reason, n in self.skipped.most_common()
            )
        return text


# -- reading ----------------------------------------------------------------------------------


def read_table(path: Path) -> pl.DataFrame:
    """A CSV (every column as text, so that nothing is guessed) or Parquet file, with `__row`."""
    suffixes = [s.lower() for s in path.suffixes]
    try:
        if ".parquet" in suffixes or ".pq" in suffixes:
            frame = pl.read_parquet(path)
        elif ".csv" in suffixes or ".tsv" in suffixes:
            frame = pl.read_csv(path, infer_schema=False, separator="\t" if ".tsv" in suffixes else ",")
        else:
            raise InputError(
                f"data file {path}: unknown type; expected .csv, .tsv or .parquet (optionally .gz for CSV)"
            )
    except (OSError, pl.exceptions.PolarsError) as exc:
        raise InputError(f"data file {path}: cannot read ({str(exc).splitlines()[0]})") from None
    return frame.with_row_index(_ROW, offset=1)


def _require(frame: pl.DataFrame, columns: dict[str, str | None], path: Path, section: str) -> None:
    for key, column in columns.items():
        if column is not None and column not in frame.columns:
            raise InputError(
                f"data file {path}: no column {column!r} (mapping [{section}] {key}); "
                f"its columns are {[c for c in frame.columns if c != _ROW][:20]}"
            )


# -- times ------------------------------------------------------------------------------------


def _times(frame: pl.DataFrame, column: str, spec: TimeColumns) -> pl.Series:
    """The column as UTC microsecond times; null where a value cannot be read."""
    series = frame[column]
    if spec.time_unit is not None:
        numbers = series.cast(pl.Float64, strict=False) if series.dtype == pl.String else series.cast(pl.Float64)
        scale = {"s": 1e6, "ms": 1e3, "us": 1.0, "ns": 1e-3}[spec.time_unit]
        return (numbers * scale).round().cast(pl.Int64).cast(pl.Datetime("us")).dt.replace_time_zone("UTC")
    if series.dtype == pl.String:
        text = series.str.strip_chars()
        if spec.time_format is not None:
            series = text.str.strptime(pl.Datetime("us"), spec.time_format, strict=False)
        else:
            series = _iso_times(text, spec.time_zone or "UTC")
    if not isinstance(series.dtype, pl.Datetime):
        raise InputError(
            f"column {column!r} holds {series.dtype}; expected times (text, datetime or epoch numbers with time_unit)"
        )
    if series.dtype.time_zone is None:  # type: ignore[union-attr]
        series = series.dt.replace_time_zone(spec.time_zone or "UTC", ambiguous="null", non_existent="null")
    return series.dt.convert_time_zone("UTC").dt.cast_time_unit("us")


def _iso_times(text: pl.Series, zone: str) -> pl.Series:
    """ISO 8601 text (`T` or a space between date and time), with or without an offset; rows
    without one are in `zone`."""
    spaced = text.str.replace(" ", "T", literal=True).str.replace(r"[Zz]$", "+00:00")
    with_offset = spaced.str.strptime(_UTC_US, "%Y-%m-%dT%H:%M:%S%.f%z", strict=False)
    naive = spaced.str.strptime(pl.Datetime("us"), "%Y-%m-%dT%H:%M:%S%.f", strict=False)
    naive = naive.fill_null(spaced.str.strptime(pl.Datetime("us"), "%Y-%m-%d", strict=False))
    local = naive.dt.replace_time_zone(zone, ambiguous="null", non_existent="null").dt.convert_time_zone("UTC")
    return with_offset.fill_null(local)


def _usable_times(
    frame: pl.DataFrame, ts: pl.Series, column: str, path: Path, summary: TableImportSummary, now: datetime
) -> pl.DataFrame:
    frame = frame.with_columns(ts.alias("ts"))
    bad = frame.filter(pl.col("ts").is_null())
    if bad.height:
        raw = frame[column][int(bad[_ROW][0]) - 1]
        summary.skip(
            "rows whose time does not parse", bad.height, f"{path} row {bad[_ROW][0]}, column {column!r}: {raw!r}"
        )
    frame = frame.filter(pl.col("ts").is_not_null())
    plausible = (pl.col("ts") >= EARLIEST_PLAUSIBLE) & (pl.col("ts") <= now + FUTURE_SLACK)
    odd = frame.filter(~plausible)
    if odd.height:
        summary.skip(IMPLAUSIBLE, odd.height, f"{path} row {odd[_ROW][0]}")
    return frame.filter(plausible)


# -- telemetry --------------------------------------------------------------------------------


def telemetry_rows(
    frame: pl.DataFrame, spec: TelemetryMapping, *, cluster: str, path: Path, summary: TableImportSummary, now: datetime
) -> pl.DataFrame:
    """`telemetry` rows (before the store's schema check) from a data frame."""
    metrics = spec.metric_columns()
    _require(
        frame,
        {
            "gpu": spec.gpu,
            "time": spec.time,
            "node": spec.node,
            "gpu_index": spec.gpu_index,
            "gpu_model": spec.gpu_model,
            "driver": spec.driver,
            "pci_bus_id": spec.pci_bus_id,
        }
        | {f"metrics.{ours}": m.column for ours, m in metrics.items()},
        path,
        "telemetry",
    )
    try:
        ts = _times(frame, spec.time, spec)
    except InputError as exc:
        raise InputError(f"data file {path}, mapping [telemetry] time: {exc}") from None
    frame = _usable_times(frame, ts, spec.time, path, summary, now)
    frame = frame.with_columns(_text(spec.gpu).alias("gpu_uuid"))
    no_gpu = frame.filter(pl.col("gpu_uuid").is_null())
    summary.skip("rows without a GPU id", no_gpu.height, f"{path} row {no_gpu[_ROW][0] if no_gpu.height else 0}")
    frame = frame.filter(pl.col("gpu_uuid").is_not_null())
    node = _text(spec.node) if spec.node is not None else pl.lit(spec.node_value)
    frame = frame.with_columns(node.alias("node"))
    no_node = frame.filter(pl.col("node").is_null())
    summary.skip("rows without a node", no_node.height, f"{path} row {no_node[_ROW][0] if no_node.height else 0}")
    frame = frame.filter(pl.col("node").is_not_null())

    columns: list[pl.Expr] = [
        pl.col("ts"),
        pl.lit(cluster).alias("cluster"),
        pl.col("node"),
        pl.col("gpu_uuid"),
        (_text(spec.gpu_model) if spec.gpu_model else pl.lit(None, pl.String)).alias("gpu_model"),
        (_text(spec.driver) if spec.driver else pl.lit(None, pl.String)).alias("driver"),
    ]
    for metric in metric_catalogue():
        source = metrics.get(metric.column)
        if source is None:
            columns.append(pl.lit(None).alias(metric.column))
            continue
        raw = pl.col(source.column)
        number = (raw.cast(pl.String).str.strip_chars().cast(pl.Float64, strict=False)) * source.scale
        bad = frame.select(
            (raw.is_not_null() & (raw.cast(pl.String).str.strip_chars() != "") & number.is_null()).sum()
        ).item()
        if bad:
            summary.bad_cells += bad
            first = frame.filter(raw.is_not_null() & number.is_null() & (raw.cast(pl.String).str.strip_chars() != ""))
            summary.examples.setdefault(
                "metric cells that are not numbers", f"{path} row {first[_ROW][0]}, column {source.column!r}"
            )
        number = _within_range(frame, number, metric, source.column, path, summary)
        if pa.types.is_integer(metric.arrow_type):
            columns.append(number.round().cast(pl.Int64).alias(metric.column))
        else:
            columns.append(number.alias(metric.column))
    rows = frame.select([*columns, pl.col(_ROW), *_index_source(spec), *_bus_source(spec)])
    rows = _with_bus_ids(rows, path, summary)
    rows = _with_gpu_index(rows)
    before = rows.height
    rows = rows.sort(["gpu_uuid", "ts", _ROW]).unique(["gpu_uuid", "ts"], keep="first", maintain_order=True)
    summary.skip("rows repeating a GPU's time (clock jump or duplicate)", before - rows.height, f"{path}")
    return rows.drop(_ROW).sort(["ts", "node", "gpu_index"])


def _within_range(
    frame: pl.DataFrame, number: pl.Expr, metric: Metric, column: str, path: Path, summary: TableImportSummary
) -> pl.Expr:
    """`number` with readings outside the metric's valid range made null, counted per metric."""
    outside = outside_range(number, metric)
    found = frame.filter(outside)
    if found.height:
        summary.out_of_range[metric.column] += found.height
        summary.examples.setdefault(
            f"out of range {metric.column}",
            f"{found[0, column]} at {path} row {found[_ROW][0]}, column {column!r}, valid {describe_range(metric)}",
        )
    return pl.when(outside).then(None).otherwise(number)


def _text(column: str) -> pl.Expr:
    text = pl.col(column).cast(pl.String).str.strip_chars()
    return pl.when(text == "").then(None).otherwise(text)


def _index_source(spec: TelemetryMapping) -> list[pl.Expr]:
    if spec.gpu_index is None:
        return []
    return [pl.col(spec.gpu_index).cast(pl.String).str.strip_chars().cast(pl.Int16, strict=False).alias("gpu_index")]


def _bus_source(spec: TelemetryMapping) -> list[pl.Expr]:
    return [] if spec.pci_bus_id is None else [_text(spec.pci_bus_id).alias("pci_bus_id")]


def _with_bus_ids(rows: pl.DataFrame, path: Path, summary: TableImportSummary) -> pl.DataFrame:
    if "pci_bus_id" not in rows.columns:
        return rows.with_columns(pl.lit(None, pl.String).alias("pci_bus_id"))
    canonical: dict[str, str | None] = {}
    for raw in rows["pci_bus_id"].drop_nulls().unique():
        try:
            canonical[raw] = normalise_pci_bus_id(raw)
        except ValueError:
            canonical[raw] = None  # the readings are still good; only the join to XIDs is lost
            summary.examples.setdefault("PCI bus ids that do not parse", f"{path}: {raw!r}")
    return rows.with_columns(pl.col("pci_bus_id").replace_strict(canonical, default=None, return_dtype=pl.String))


def _with_gpu_index(rows: pl.DataFrame) -> pl.DataFrame:
    """Without an index column, a node's GPUs are numbered in the order the file first lists them."""
    if "gpu_index" in rows.columns and rows["gpu_index"].null_count() == 0:
        return rows
    first = rows.group_by(["node", "gpu_uuid"]).agg(pl.col(_ROW).min().alias("_first")).sort("_first")
    first = first.with_columns(pl.col("_first").rank("ordinal").over("node").sub(1).cast(pl.Int16).alias("_order"))
    rows = rows.join(first.select("node", "gpu_uuid", "_order"), on=["node", "gpu_uuid"], how="left")
    index = pl.col("gpu_index").fill_null(pl.col("_order")) if "gpu_index" in rows.columns else pl.col("_order")
    return rows.with_columns(index.alias("gpu_index")).drop("_order")


# -- failures and repairs ---------------------------------------------------------------------


def _events(
    spec: EventMapping,
    section: str,
    mapping: TableMapping,
    frames: tuple[pl.DataFrame, Path, Path],
    identity: pl.DataFrame,
    summary: TableImportSummary,
    now: datetime,
    extra: dict[str, str | None],
) -> pl.DataFrame:
    """Event rows with `ts`, `gpu_uuid`, identity (node, gpu_index, gpu_model) and `extra` columns."""
    telemetry_frame, data_path, mapping_dir = frames
    if spec.file is None:
        frame, path = telemetry_frame, data_path
    else:
        path = mapping_dir / spec.file  # an absolute `file` stays as it is
        frame = read_table(path)
    gpu = spec.gpu or mapping.telemetry.gpu
    time = spec.time or mapping.telemetry.time
    # An event file is usually written by the same system: how to read its times is inherited
    # from [telemetry] unless the section says otherwise.
    inherited = mapping.telemetry
    times = TimeColumns(
        time=time,
        time_format=spec.time_format or (inherited.time_format if spec.time_unit is None else None),
        time_zone=spec.time_zone or inherited.time_zone,
        time_unit=spec.time_unit or (inherited.time_unit if spec.time_format is None else None),
    )
    _require(frame, {"gpu": gpu, "time": time, "flag": spec.flag} | extra, path, section)
    if spec.flag is not None:
        values = [v.lower() for v in spec.values] if spec.values else list(_TRUE_WORDS)
        frame = frame.filter(pl.col(spec.flag).cast(pl.String).str.strip_chars().str.to_lowercase().is_in(values))
    try:
        ts = _times(frame, time, times)
    except InputError as exc:
        raise InputError(f"data file {path}, mapping [{section}] time: {exc}") from None
    frame = _usable_times(frame, ts, time, path, summary, now)
    frame = frame.with_columns(_text(gpu).alias("gpu_uuid")).filter(pl.col("gpu_uuid").is_not_null())
    joined = frame.join(identity, on="gpu_uuid", how="left")
    unknown = joined.filter(pl.col("node").is_null())
    summary.skip(
        f"{section} of GPUs with no telemetry",
        unknown.height,
        f"{path} row {unknown[_ROW][0] if unknown.height else 0}",
    )
    return joined.filter(pl.col("node").is_not_null())


def _identity(telemetry: pl.DataFrame) -> pl.DataFrame:
    """Each GPU's node, index and model, from its latest sample."""
    return (
        telemetry.sort("ts")
        .group_by("gpu_uuid")
        .agg(pl.col("node").last(), pl.col("gpu_index").last(), pl.col("gpu_model").drop_nulls().last())
    )


def failure_rows(
    spec: FailureMapping,
    mapping: TableMapping,
    frames: tuple[pl.DataFrame, Path, Path],
    identity: pl.DataFrame,
    *,
    cluster: str,
    summary: TableImportSummary,
    now: datetime,
) -> pl.DataFrame:
    events = _events(spec, "failures", mapping, frames, identity, summary, now, {"mode": spec.mode, "xid": spec.xid})
    return events.select(
        pl.col("ts"),
        pl.lit(cluster).alias("cluster"),
        pl.col("node"),
        pl.col("gpu_index"),
        pl.col("gpu_uuid"),
        pl.lit("record").alias("source"),
        (_text(spec.mode) if spec.mode else pl.lit(None, pl.String)).alias("reason"),
        pl.lit(None, pl.String).alias("ref"),
        (
            pl.col(spec.xid).cast(pl.String).str.strip_chars().cast(pl.Int32, strict=False)
            if spec.xid
            else pl.lit(None, pl.Int32)
        ).alias("xid"),
        pl.lit(None, _UTC_US).alias("end"),
    )


def repair_rows(
    spec: RepairMapping,
    mapping: TableMapping,
    frames: tuple[pl.DataFrame, Path, Path],
    identity: pl.DataFrame,
    *,
    cluster: str,
    summary: TableImportSummary,
    now: datetime,
) -> pl.DataFrame:
    events = _events(
        spec, "repairs", mapping, frames, identity, summary, now, {"action": spec.action, "new_gpu": spec.new_gpu}
    )
    if spec.action is not None:
        raw = _text(spec.action)
        known = {**{a: a for a in ("replace", "reseat", "reset")}, **spec.actions}
        action = raw.replace_strict(known, default=None, return_dtype=pl.String)
        events = events.with_columns(raw.alias("_raw_action"), action.alias("action"))
        odd = events.filter(pl.col("action").is_null() & pl.col("_raw_action").is_not_null())
        summary.skip(
            "repairs with an action the mapping does not name (add it to [repairs] actions)",
            odd.height,
            f"row {odd[_ROW][0]}: {odd['_raw_action'][0]!r}" if odd.height else "",
        )
        events = events.filter(pl.col("action").is_not_null() | pl.col("_raw_action").is_null())
        events = events.with_columns(pl.col("action").fill_null(spec.default_action))
    else:
        events = events.with_columns(pl.lit(spec.default_action).alias("action"))
    return events.select(
        pl.col("ts"),
        pl.lit(cluster).alias("cluster"),
        pl.col("node"),
        pl.col("gpu_index"),
        pl.col("gpu_uuid").alias("old_gpu_uuid"),
        (_text(spec.new_gpu) if spec.new_gpu else pl.lit(None, pl.String)).alias("new_gpu_uuid"),
        pl.col("action"),
    )


# -- the whole import -------------------------------------------------------------------------


def import_table(
    store: Store,
    data_path: Path,
    mapping: TableMapping,
    *,
    mapping_path: Path,
    cluster: str,
    now: datetime | None = None,
) -> TableImportSummary:
    """Import one exported table (and the event files its mapping names) into the store.

    Everything is read and checked before anything is written, so a mapping that does not fit
    the data writes nothing.
    """
    now = now or datetime.now(UTC)
    summary = TableImportSummary()
    frame = read_table(data_path)
    telemetry = telemetry_rows(frame, mapping.telemetry, cluster=cluster, path=data_path, summary=summary, now=now)
    identity = _identity(telemetry)
    frames = (frame, data_path, mapping_path.parent)
    failures = repairs = None
    if mapping.failures is not None:
        failures = failure_rows(mapping.failures, mapping, frames, identity, cluster=cluster, summary=summary, now=now)
    if mapping.repairs is not None:
        repairs = repair_rows(mapping.repairs, mapping, frames, identity, cluster=cluster, summary=summary, now=now)
    if telemetry.height:
        store.write("telemetry", telemetry.to_arrow())
    if failures is not None and failures.height:
        write_failure_events(store, failures)
    if repairs is not None and repairs.height:
        store.write("repairs", repairs.to_arrow().cast(REPAIRS_SCHEMA))
    summary.telemetry_rows = telemetry.height
    summary.failures = 0 if failures is None else failures.height
    summary.repairs = 0 if repairs is None else repairs.height
    for reason, n in summary.skipped.most_common():
        log.warning("table import skipped %d %s (e.g. %s)", n, reason, summary.examples[reason])
    return summary
