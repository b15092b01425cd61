"""Compose the feature frame, in memory (`build_features`) or over a store (`build_features_from_store`).

`build_features` is a pure function of two frames. `build_features_from_store` is the I/O edge:
it reads telemetry in (time block x chunk of nodes) pieces with enough lookback that every
emitted row equals what an all-history build would give, builds, and writes the `features`
dataset (hive-partitioned by UTC date, files written once and atomically, like `ingest.store`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from features.labels import (
    DEFAULT_HORIZON,
    DEFAULT_LOST_AFTER,
    DEFAULT_MERGE_WINDOW,
    GPU,
    attach_labels,
    combine_presence,
    episodes_for,
    gpu_presence,
    resolve_xid_gpus,
)
from features.schema import (
    FEATURE_DTYPE,
    FEATURES_SCHEMA_VERSION,
    ID_COLUMNS,
    ID_DTYPES,
    LABEL_COLUMNS,
    LABEL_DTYPES,
    TS_DTYPE,
    validate_features,
    window_label,
)
from features.windows import (
    DEFAULT_GRID,
    DEFAULT_MAX_SILENCE,
    DEFAULT_WINDOWS,
    DEFAULT_XID_SINCE_CAP,
    ENGINE,
    check_grid,
    dense_grid,
    grid_floor,
    hourly_aggregate,
    peer_features,
    window_features,
    xid_features,
)
from ingest.schema import metric_catalogue
from ingest.store import Store
from ingest.xid_catalog import default_failure_xids

FEATURES_DATASET = "features"

_XID_DEFAULTS: dict[str, pl.DataType] = {
    "cluster": pl.String(),
    "node": pl.String(),
    "pci_bus_id": pl.String(),
    "gpu_index": pl.Int16(),
    GPU: pl.String(),
}


def _as_frame(data: pl.DataFrame | pa.Table) -> pl.DataFrame:
    frame = data if isinstance(data, pl.DataFrame) else pl.from_arrow(data)
    assert isinstance(frame, pl.DataFrame)
    return frame


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _normalise_ts(frame: pl.DataFrame, columns: Sequence[str], what: str) -> pl.DataFrame:
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


def _prepare_xids(xid_events: pl.DataFrame) -> pl.DataFrame:
    missing = [c for c in ("ts", "xid") if c not in xid_events.columns]
    if missing:
        raise ValueError(f"xid_events: missing required columns {missing}; got {xid_events.columns}")
    xid = _normalise_ts(xid_events, ["ts", "last_ts"], "xid_events")
    extra = [pl.lit(None, dtype=t).alias(c) for c, t in _XID_DEFAULTS.items() if c not in xid.columns]
    if "last_ts" not in xid.columns:
        extra.append(pl.col("ts").alias("last_ts"))
    if "repeat_count" not in xid.columns:
        extra.append(pl.lit(1, dtype=pl.Int32).alias("repeat_count"))
    return xid.with_columns(extra) if extra else xid


def _presence_from_buckets(hourly: pl.DataFrame, grid: timedelta) -> pl.DataFrame:
    """`labels.gpu_presence` computed from bucket aggregates (60x fewer rows than samples at
    one sample a minute); a GPU that changes slot inside one bucket is seen in its last slot."""
    keys = ["cluster", "node", "gpu_index", "pci_bus_id", GPU]
    n_col = f"n_samples_{window_label(grid)}"
    return (
        hourly.lazy()
        .with_columns(pl.lit(None, dtype=pl.String).alias(k) for k in keys if k not in hourly.columns)
        .group_by(keys)
        .agg(
            pl.col("first_sample_ts").min().alias("first_ts"),
            pl.col("last_sample_ts").max().alias("last_ts"),
            pl.col(n_col).sum().cast(pl.Int64).alias("n_samples"),
        )
        .sort(GPU, "first_ts")
        .collect(engine=ENGINE)
    )


def empty_features(
    telemetry_columns: Sequence[str], *, grid: timedelta = DEFAULT_GRID, windows: Sequence[timedelta] = DEFAULT_WINDOWS
) -> pl.DataFrame:
    """A zero-row feature frame with the columns a build over frames with these telemetry
    columns produces."""
    metric_types = {m.column: pl.from_arrow(pa.array([], type=m.arrow_type)).dtype for m in metric_catalogue()}  # type: ignore[union-attr]
    schema = {c: ID_DTYPES.get(c, metric_types.get(c, pl.Float32())) for c in telemetry_columns}
    schema.setdefault("ts", TS_DTYPE)
    schema.setdefault(GPU, pl.String())
    tel = pl.DataFrame(schema=schema)
    end = datetime(1970, 1, 2, tzinfo=UTC)
    return build_features(
        tel,
        pl.DataFrame(schema={"ts": TS_DTYPE, GPU: pl.String(), "xid": pl.Int32()}),
        grid=grid,
        windows=windows,
        data_end=end,
    )


def build_features(
    telemetry: pl.DataFrame | pa.Table,
    xid_events: pl.DataFrame | pa.Table,
    *,
    grid: timedelta = DEFAULT_GRID,
    windows: Sequence[timedelta] = DEFAULT_WINDOWS,
    horizon: timedelta = DEFAULT_HORIZON,
    failure_xids: Iterable[int] | None = None,
    merge_window: timedelta = DEFAULT_MERGE_WINDOW,
    data_end: datetime | None = None,
    lost_after: timedelta | None = DEFAULT_LOST_AFTER,
    max_silence: timedelta = DEFAULT_MAX_SILENCE,
    xid_since_cap: timedelta = DEFAULT_XID_SINCE_CAP,
    presence: pl.DataFrame | None = None,
    episodes: pl.DataFrame | None = None,
    emit_start: datetime | None = None,
    emit_end: datetime | None = None,
) -> pl.DataFrame:
    """The feature frame (`features.schema`) for the GPUs in `telemetry`.

    One row per (gpu_uuid, grid time t) from the GPU's first bucket up to `data_end` (default:
    the last telemetry timestamp), while the GPU's last sample is at most `max_silence` old,
    and before its first failure episode. Features use only data <= t; labels look at
    (t, t + horizon] (see `features.windows` and `features.labels`).

    `presence`, `episodes` let a caller that sees only part of the fleet or of the history
    (`build_features_from_store`) pass fleet-wide facts: GPU presence (`labels.gpu_presence`:
    first sample, for `gpu_age_h`, and lost-GPU detection) and failure episodes. `emit_start` /
    `emit_end` keep only rows with emit_start <= t < emit_end (the rest served as lookback).
    """
    check_grid(grid, windows)
    tel = _normalise_ts(_as_frame(telemetry), ["ts"], "telemetry")
    missing = [c for c in ("ts", GPU) if c not in tel.columns]
    if missing:
        raise ValueError(f"telemetry: missing required columns {missing}; got {tel.columns}")
    xid = _prepare_xids(_as_frame(xid_events))
    if data_end is None:
        if tel.height == 0:
            raise ValueError("telemetry is empty and no data_end was given; cannot place the grid")
        data_end = tel["ts"].max()  # type: ignore[assignment]
    assert data_end is not None
    data_end = _utc(data_end)
    failure_xids = default_failure_xids() if failure_xids is None else tuple(failure_xids)

    hourly = hourly_aggregate(tel, grid, max_gap=max_silence)
    if presence is None:
        presence = _presence_from_buckets(hourly, grid)
    xid = resolve_xid_gpus(xid, presence)
    if episodes is None:
        episodes = episodes_for(
            xid,
            presence,
            failure_xids=failure_xids,
            merge_window=merge_window,
            data_end=data_end,
            lost_after=lost_after,
        )
    first_seen = presence.group_by(GPU).agg(pl.col("first_ts").min())

    dense = dense_grid(hourly, grid, data_end=data_end, max_silence=max_silence)
    keys = dense.select(GPU, "ts")
    wf = window_features(dense, grid, windows, first_seen=first_seen)
    xf = xid_features(keys, xid, grid, windows, since_cap=xid_since_cap)
    pf = peer_features(dense, grid)

    ids = [c for c in ID_COLUMNS if c in dense.columns]
    # The three feature frames have the rows of `dense` in its order (checked: a silent
    # misalignment would be the worst kind of bug), so they are placed side by side.
    for part in (wf, xf, pf):
        if not part.select(GPU, "ts").equals(keys):
            raise AssertionError("feature frames are not aligned with the grid; this is a bug in features.windows")
    keep = wf["telemetry_since_last_h"] <= max_silence.total_seconds() / 3600
    if emit_start is not None:
        keep &= dense["ts"] >= _utc(emit_start)
    if emit_end is not None:
        keep &= dense["ts"] < _utc(emit_end)
    # Filter the narrow frames before placing them side by side (one wide filter is costly).
    frame = pl.concat(
        [
            dense.select(ids).filter(keep),
            wf.drop(GPU, "ts").filter(keep),
            xf.drop(GPU, "ts").filter(keep),
            pf.drop(GPU, "ts").filter(keep),
        ],
        how="horizontal",
    )
    frame = attach_labels(frame, episodes, horizon=horizon, data_end=data_end)

    features = [c for c in frame.columns if c not in ID_COLUMNS and c not in LABEL_COLUMNS]
    return frame.select(
        *[
            pl.col(c).cast(ID_DTYPES[c]) if c in frame.columns else pl.lit(None, dtype=ID_DTYPES[c]).alias(c)
            for c in ID_COLUMNS
        ],
        *[pl.col(c).cast(FEATURE_DTYPE) for c in features],
        *[pl.col(c).cast(LABEL_DTYPES[c]) for c in LABEL_COLUMNS],
    )  # already sorted by (gpu_uuid, ts): the order of the dense grid


# -- the features dataset -----------------------------------------------------------------------


def _metadata() -> dict[bytes, bytes]:
    return {
        b"gpufail.dataset": FEATURES_DATASET.encode(),
        b"gpufail.features_schema_version": str(FEATURES_SCHEMA_VERSION).encode(),
    }


def write_features(store: Store, table: pl.DataFrame) -> list[str]:
    """Append a feature frame to the store's `features` dataset: one new file per UTC date of
    `ts`, through `Store.write_owned` (hidden temporary name, then rename), so readers never
    see a partial file. The frame is validated first. Returns the paths written."""
    validate_features(table)
    if table.height == 0:
        return []
    written = []
    # Rechunk first: the frame is assembled from many pieces, and partitioning a frame of many
    # small chunks was 10x slower than rechunking and partitioning it.
    parts = table.rechunk().with_columns(pl.col("ts").dt.date().alias("_day")).partition_by("_day", as_dict=True)
    for (day,), part in sorted(parts.items()):
        part = part.drop("_day").sort(GPU, "ts")
        arrow = part.to_arrow(compat_level=pl.CompatLevel.oldest())
        arrow = arrow.replace_schema_metadata({**(arrow.schema.metadata or {}), **_metadata()})
        # Dictionary-encoding only the string columns: trying it on 280 float columns made
        # writing 2.5x slower for no gain.
        dictionary = [c for c in ID_COLUMNS if part.schema[c] == pl.String]
        final = store.write_owned(FEATURES_DATASET, day, arrow, use_dictionary=dictionary)
        written.append(final)
    return written


def feature_files(store: Store, first_day: date | None = None, last_day: date | None = None) -> list[str]:
    """Visible part files of the features dataset dated within [first_day, last_day]."""
    return store.files(FEATURES_DATASET, first_day, last_day)


def read_features(
    store: Store,
    start: datetime | None = None,
    end: datetime | None = None,
    columns: Sequence[str] | None = None,
) -> pl.DataFrame:
    """Feature rows with start <= ts < end (all when omitted), sorted by (ts, gpu_uuid). Only
    the date partitions overlapping the range are opened."""
    first_day = _utc(start).date() if start is not None else None
    last_day = (_utc(end) - timedelta(microseconds=1)).date() if end is not None else None
    files = feature_files(store, first_day, last_day)
    if not files:
        return pl.DataFrame(schema={**ID_DTYPES, **LABEL_DTYPES})
    cols = None if columns is None else list(dict.fromkeys(["ts", GPU, *columns]))
    if _local(store):
        # polars read these files 2.5x faster than pyarrow's dataset reader (see _read_telemetry).
        lf = pl.scan_parquet(files, hive_partitioning=False)
        if start is not None:
            lf = lf.filter(pl.col("ts") >= pl.lit(_utc(start), dtype=TS_DTYPE))
        if end is not None:
            lf = lf.filter(pl.col("ts") < pl.lit(_utc(end), dtype=TS_DTYPE))
        return (lf if cols is None else lf.select(cols)).collect().sort("ts", GPU)
    dataset = ds.dataset(files, format="parquet", filesystem=store.fs)
    expr = None
    if start is not None:
        expr = ds.field("ts") >= pa.scalar(_utc(start), pa.timestamp("us", tz="UTC"))
    if end is not None:
        term = ds.field("ts") < pa.scalar(_utc(end), pa.timestamp("us", tz="UTC"))
        expr = term if expr is None else expr & term
    frame = pl.from_arrow(dataset.to_table(columns=cols, filter=expr))
    assert isinstance(frame, pl.DataFrame)
    return frame.sort("ts", GPU)


# -- building over a store ----------------------------------------------------------------------


@dataclass
class FeatureBuildSummary:
    rows: int = 0
    gpus: int = 0
    positives: int = 0
    censored: int = 0
    telemetry_rows_read: int = 0
    chunks: int = 0
    blocks: int = 0
    files_written: list[str] = field(default_factory=list)
    files_replaced: int = 0
    start: datetime | None = None
    end: datetime | None = None
    data_end: datetime | None = None
    seconds: float = 0.0

    def __str__(self) -> str:
        rate = self.telemetry_rows_read / self.seconds if self.seconds else 0.0
        return (
            f"features: {self.rows:,} rows for {self.gpus:,} GPUs ({self.positives:,} positive, {self.censored:,} censored) "
            f"from {self.telemetry_rows_read:,} telemetry rows in {self.seconds:.1f} s ({rate:,.0f} rows/s); "
            f"{len(self.files_written)} files written, {self.files_replaced} replaced"
        )


def _day_start(moment: datetime) -> datetime:
    m = _utc(moment)
    return datetime(m.year, m.month, m.day, tzinfo=UTC)


def node_chunks(presence: pl.DataFrame, gpus_per_chunk: int) -> list[pl.DataFrame]:
    """Group whole nodes (peer features need every GPU of a node together) into chunks of about
    `gpus_per_chunk` GPUs, in (cluster, node) order so a chunk is a contiguous node range."""
    per_node = presence.group_by("cluster", "node").agg(pl.col(GPU).n_unique().alias("_n")).sort("cluster", "node")
    chunks: list[pl.DataFrame] = []
    current: list[tuple[str, str]] = []
    count = 0
    for cluster, node, n in per_node.iter_rows():
        current.append((cluster, node))
        count += n
        if count >= gpus_per_chunk:
            chunks.append(pl.DataFrame(current, schema=["cluster", "node"], orient="row"))
            current, count = [], 0
    if current:
        chunks.append(pl.DataFrame(current, schema=["cluster", "node"], orient="row"))
    return chunks


_ID_COLS = ["ts", "cluster", "node", "gpu_index", "pci_bus_id", GPU]


def _local(store: Store) -> bool:
    protocol = store.fs.protocol
    return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))


def _day_of(path: str) -> date:
    return date.fromisoformat(path.rsplit("/date=", 1)[1].split("/", 1)[0])


def _read_telemetry(
    store: Store, start: datetime, end: datetime, *, nodes: tuple[str, str] | None = None
) -> pl.DataFrame:
    """Telemetry rows with start <= ts < end (and node in the closed range `nodes`). On a local
    store the files (schema-checked by `Store.dataset`) are read with polars, which read the
    simulator's 60 day files 6x faster than pyarrow's dataset reader on these machines; other
    filesystems go through `Store.read`."""
    if not _local(store):
        node_filter = None if nodes is None else (pc.field("node") >= nodes[0]) & (pc.field("node") <= nodes[1])
        return _as_frame(store.read("telemetry", start, end, filter=node_filter))
    files = store.dataset("telemetry", start.date(), (end - timedelta(microseconds=1)).date()).files
    if not files:
        return _as_frame(store.read("telemetry", start, end))
    lf = pl.scan_parquet(files, hive_partitioning=False).filter(
        (pl.col("ts") >= pl.lit(start, dtype=TS_DTYPE)) & (pl.col("ts") < pl.lit(end, dtype=TS_DTYPE))
    )
    if nodes is not None:
        lf = lf.filter(pl.col("node").is_between(pl.lit(nodes[0]), pl.lit(nodes[1])))
    return lf.collect()


def _scan_presence(store: Store, *, progress: bool) -> tuple[pl.DataFrame, dict[date, int]]:
    """GPU presence over all telemetry, and the number of rows per day partition."""
    from tqdm.auto import tqdm

    if _local(store):
        dataset = store.dataset("telemetry")
        day_rows: dict[date, int] = {}
        for fragment in dataset.get_fragments():
            day = _day_of(fragment.path)
            day_rows[day] = day_rows.get(day, 0) + fragment.metadata.num_rows
        if not dataset.files:
            return combine_presence([]), day_rows
        # The streaming engine keeps this one pass over the whole history in bounded memory.
        scan = pl.scan_parquet(dataset.files, hive_partitioning=False).select(_ID_COLS)
        return gpu_presence(scan, engine="streaming"), day_rows
    parts = []
    day_rows = {}
    for day in tqdm(store.dates("telemetry"), desc="features: scan", unit="day", disable=not progress):
        day_start = datetime(day.year, day.month, day.day, tzinfo=UTC)
        table = store.read("telemetry", day_start, day_start + timedelta(days=1), columns=_ID_COLS)
        day_rows[day] = table.num_rows
        parts.append(gpu_presence(_as_frame(table)))
    return combine_presence(parts), day_rows


def _chunk_ids(frame: pl.DataFrame, chunk_of: pl.DataFrame) -> pl.Expr:
    """`_chunk` for each row of `frame` from (cluster, node) -> chunk; null for other nodes."""
    if chunk_of["cluster"].n_unique() == 1:
        cluster = chunk_of["cluster"][0]
        ids = pl.col("node").replace_strict(chunk_of["node"], chunk_of["_chunk"], default=None, return_dtype=pl.Int32)
        return pl.when(pl.col("cluster") == cluster).then(ids).alias("_chunk")
    if chunk_of["node"].n_unique() == chunk_of.height:
        # Node names are unique across clusters (the usual case): a lookup on node is enough.
        ids = pl.col("node").replace_strict(chunk_of["node"], chunk_of["_chunk"], default=None, return_dtype=pl.Int32)
        clusters = dict(zip(chunk_of["node"].to_list(), chunk_of["cluster"].to_list(), strict=True))
        same = pl.col("cluster") == pl.col("node").replace_strict(clusters, default=None, return_dtype=pl.String)
        return pl.when(same).then(ids).alias("_chunk")
    key = pl.concat_str("cluster", pl.lit("\x00"), "node")
    keys = chunk_of.select(pl.concat_str("cluster", pl.lit("\x00"), "node")).to_series()
    return key.replace_strict(keys, chunk_of["_chunk"], default=None, return_dtype=pl.Int32).alias("_chunk")


def plan_blocks(
    emit_start: datetime,
    emit_end: datetime,
    *,
    lookback: timedelta,
    day_rows: dict[date, int],
    max_rows: int,
    block: timedelta,
) -> list[tuple[datetime, datetime, bool]]:
    """Split [emit_start, emit_end) into whole-day blocks `(start, end, whole)`. A block is
    `whole` when the fleet's telemetry for it plus its lookback is at most `max_rows` rows (it is
    read once, then split by chunk), and then as long as that allows; otherwise it is `block`
    long and read chunk by chunk."""
    day = timedelta(days=1)

    def rows(a: datetime, b: datetime) -> int:
        first, last = a.date(), (b - timedelta(microseconds=1)).date()
        return sum(n for d, n in day_rows.items() if first <= d <= last)

    blocks = []
    b0 = emit_start
    while b0 < emit_end:
        b1 = min(b0 + day, emit_end)
        if rows(b0 - lookback, b1) > max_rows:
            b1 = min(b0 + max(block, day), emit_end)
            blocks.append((b0, b1, False))
        else:
            while b1 < emit_end and rows(b0 - lookback, min(b1 + day, emit_end)) <= max_rows:
                b1 = min(b1 + day, emit_end)
            blocks.append((b0, b1, True))
        b0 = b1
    return blocks


def build_features_from_store(
    store: Store,
    *,
    start: datetime | None = None,
    end: datetime | None = None,
    grid: timedelta = DEFAULT_GRID,
    windows: Sequence[timedelta] = DEFAULT_WINDOWS,
    horizon: timedelta = DEFAULT_HORIZON,
    failure_xids: Iterable[int] | None = None,
    merge_window: timedelta = DEFAULT_MERGE_WINDOW,
    lost_after: timedelta | None = DEFAULT_LOST_AFTER,
    max_silence: timedelta = DEFAULT_MAX_SILENCE,
    xid_since_cap: timedelta = DEFAULT_XID_SINCE_CAP,
    gpus_per_chunk: int = 256,
    block: timedelta = timedelta(days=14),
    max_rows_in_memory: int = 4_000_000,
    flush_rows: int = 1_000_000,
    overwrite: bool = False,
    progress: bool = True,
) -> FeatureBuildSummary:
    """Build and write the `features` dataset for grid times in [start, end), widened to whole
    UTC days (so every date partition is complete). Default: all telemetry in the store.

    Labels look as far past `end` as the store's data goes (the data end is the last telemetry
    sample in the store), so building yesterday's features today labels them as well as today's
    data allows; rows whose horizon is not yet observed are censored (null) and are filled by a
    later rebuild.

    How it bounds memory: one pass over telemetry reads only identity columns (GPU presence:
    first/last sample per GPU, for `gpu_age_h`, lost-GPU labels and XID resolution; the data
    end); XID events are read whole (they are small). Then, per time block of `block` and per
    chunk of whole nodes of about `gpus_per_chunk` GPUs, telemetry is read for the block plus a
    lookback of max(windows) + max_silence, which makes each row equal to an all-history build.
    A chunk read filters on a node range; it is cheap when telemetry files are sorted by node.
    When the whole fleet's telemetry for a block plus its lookback is at most
    `max_rows_in_memory` rows, the block is instead read once and split by chunk in memory, and
    made as long as that budget allows (fewer lookback re-reads).

    Dates that already hold feature files are refused unless `overwrite=True`; then the old
    files are removed after the new ones are written.
    """
    from tqdm.auto import tqdm

    began = time.perf_counter()
    check_grid(grid, windows)
    failure_xids = default_failure_xids() if failure_xids is None else tuple(failure_xids)
    summary = FeatureBuildSummary()

    # Pass 1: presence (identity columns only) over the whole store: labels and lost-GPU
    # detection look past `end` as far as the data goes.
    presence, day_rows = _scan_presence(store, progress=progress)
    if presence.height == 0:
        summary.seconds = time.perf_counter() - began
        return summary
    data_end = _utc(presence["last_ts"].max())  # type: ignore[arg-type]
    summary.data_end = data_end

    if store.exists("xid_events"):
        xid = _prepare_xids(_as_frame(store.read("xid_events")))
    else:
        xid = _prepare_xids(pl.DataFrame(schema={"ts": TS_DTYPE, "xid": pl.Int32()}))
    xid = resolve_xid_gpus(xid, presence)
    episodes = episodes_for(
        xid, presence, failure_xids=failure_xids, merge_window=merge_window, data_end=data_end, lost_after=lost_after
    )

    # The emitted range, in whole UTC days, within the data.
    first_data = _utc(presence["first_ts"].min())  # type: ignore[arg-type]
    emit_start = _day_start(max(_utc(start), first_data) if start is not None else first_data)
    last = min(_utc(end) - timedelta(microseconds=1), data_end) if end is not None else data_end
    emit_end = _day_start(last) + timedelta(days=1)
    if emit_end <= emit_start:
        summary.seconds = time.perf_counter() - began
        return summary
    summary.start, summary.end = emit_start, emit_end

    old_files = feature_files(store, emit_start.date(), (emit_end - timedelta(days=1)).date())
    if old_files and not overwrite:
        raise FileExistsError(
            f"features: {len(old_files)} files already cover {emit_start.date()}..{(emit_end - timedelta(days=1)).date()} "
            f"(e.g. {old_files[0]}); pass overwrite=True to rebuild them"
        )

    max_window = max(windows)
    lookback_us = (max_window + max_silence + grid) // timedelta(microseconds=1)
    g_us = grid // timedelta(microseconds=1)
    lookback = timedelta(microseconds=-(-lookback_us // g_us) * g_us)
    blocks = plan_blocks(
        emit_start, emit_end, lookback=lookback, day_rows=day_rows, max_rows=max_rows_in_memory, block=block
    )
    chunks = node_chunks(presence, gpus_per_chunk)
    chunk_of = pl.concat([c.with_columns(pl.lit(i, dtype=pl.Int32).alias("_chunk")) for i, c in enumerate(chunks)])
    summary.blocks, summary.chunks = len(blocks), len(chunks)

    buffer: list[pl.DataFrame] = []
    buffered = 0
    gpus: set[str] = set()

    def flush() -> None:
        nonlocal buffer, buffered
        if buffer:
            out = pl.concat(buffer, how="vertical")
            summary.files_written += write_features(store, out)
            buffer, buffered = [], 0

    def build_chunk(tel: pl.DataFrame, nodes: pl.DataFrame, b0: datetime, b1: datetime) -> None:
        nonlocal buffered
        summary.telemetry_rows_read += tel.height
        if tel.height == 0:
            return
        chunk_xid = xid.join(nodes, on=["cluster", "node"], how="semi").filter(
            pl.col("ts") < pl.lit(b1, dtype=TS_DTYPE)
        )
        frame = build_features(
            tel,
            chunk_xid,
            grid=grid,
            windows=windows,
            horizon=horizon,
            failure_xids=failure_xids,
            merge_window=merge_window,
            data_end=data_end,
            lost_after=lost_after,
            max_silence=max_silence,
            xid_since_cap=xid_since_cap,
            presence=presence,
            episodes=episodes,
            emit_start=b0,
            emit_end=b1,
        )
        if frame.height:
            summary.rows += frame.height
            summary.positives += int((frame["label"] == 1).sum())
            summary.censored += frame["label"].null_count()
            gpus.update(frame[GPU].unique().to_list())
            buffer.append(frame)
            buffered += frame.height
            if buffered >= flush_rows:
                flush()

    bar = tqdm(total=len(blocks) * len(chunks), desc="features: build", unit="chunk", disable=not progress)
    for b0, b1, whole in blocks:
        read_start = b0 - lookback + timedelta(microseconds=1)
        if whole:
            # The block fits in memory: read it once and split it by chunk.
            # One sort by (chunk, GPU, time) leaves each chunk a zero-copy slice that is already
            # in the order `hourly_aggregate` needs.
            table = _read_telemetry(store, read_start, b1)
            table = table.with_columns(_chunk_ids(table, chunk_of))
            if table["_chunk"].null_count():  # rows of nodes that appeared after the presence scan
                table = table.filter(pl.col("_chunk").is_not_null())
            table = table.sort("_chunk", pl.col(GPU).hash(), "ts")
            sizes = dict(table["_chunk"].value_counts().iter_rows())
            offset = 0
            for i, nodes in enumerate(chunks):
                n = sizes.get(i, 0)
                build_chunk(table.slice(offset, n).drop("_chunk"), nodes, b0, b1)
                offset += n
                bar.update(1)
            del table
            continue
        for nodes in chunks:
            # One read per chunk; cheap when the files are sorted by node (row-group statistics
            # let the reader skip the other nodes).
            node_range = (str(nodes["node"].min()), str(nodes["node"].max()))
            tel = _read_telemetry(store, read_start, b1, nodes=node_range)
            build_chunk(tel.join(nodes, on=["cluster", "node"], how="semi"), nodes, b0, b1)
            bar.update(1)
    bar.close()
    flush()
    for f in old_files:
        if store.fs.exists(f):
            store.fs.rm(f)
    summary.files_replaced = len(old_files)
    summary.gpus = len(gpus)
    summary.seconds = time.perf_counter() - began
    return summary


def grid_times(start: datetime, end: datetime, grid: timedelta = DEFAULT_GRID) -> list[datetime]:
    """Grid times t with start <= t < end (helper for callers that score on the grid)."""
    t = grid_floor(_utc(start), grid)
    if t < _utc(start):
        t += grid
    out = []
    while t < _utc(end):
        out.append(t)
        t += grid
    return out
