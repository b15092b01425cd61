"""Compose the feature frame, in memory (`build_features`) or over a store (`build_features_from_store`).

`build_features` is a pure function of two frames. `build_features_from_store` is the I/O edge:
it reads telemetry in (time block x chunk of nodes) pieces with enough lookback that every
emitted row equals what an all-history build would give, builds, and writes the `features`
dataset (hive-partitioned by UTC date, files written once and atomically, like `ingest.store`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any, NoReturn

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from features.labels import (
    GPU,
    combine_presence,
    episodes_for,
    gpu_presence,
    label_rows,
    resolve_xid_gpus,
)
from features.manifest import DATASET as FEATURES_DATASET
from features.manifest import BuildPlan, FeatureManifest, settle_time
from features.peers import PEER_METRICS, model_medians, peer_features
from features.sample_key import PRESAMPLED_FRACTION, SAMPLE_KEY, drawn, sample_keys
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
from features.shards import SHARD, ShardedBuckets, shard_map
from features.spec import DEFAULT_GRID, FeatureSpec
from features.windows import (
    BUCKET_ID_COLUMNS,
    ENGINE,
    dense_grid,
    grid_floor,
    grid_suffix,
    grid_time,
    hourly_aggregate,
    window_features,
)
from features.xids import drop_cross_source_duplicates, xid_features
from ingest.errors import StoreError
from ingest.schema import metric_catalogue
from ingest.store import Store

# Feature files of different dates written at once (`write_features`).
WRITE_THREADS = min(4, os.cpu_count() or 1)


class _Stopped(Exception):
    """A block's build was told to stop because the build failed elsewhere."""


class FeaturesExistError(StoreError, FileExistsError):
    """The features dataset already has files for the dates a build would write."""


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


def read_xid_events(store: Store) -> pl.DataFrame:
    """The store's XID events as the labels and features take them; none (a fleet without kernel
    logs or NVML events yet) is an empty frame of the same columns."""
    if store.exists("xid_events"):
        return _prepare_xids(_as_frame(store.read("xid_events")))
    return _prepare_xids(pl.DataFrame(schema={"ts": TS_DTYPE, "xid": pl.Int32()}))


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
    xid = xid.with_columns(extra) if extra else xid
    return drop_cross_source_duplicates(xid)


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


def empty_features(telemetry_columns: Sequence[str], spec: FeatureSpec | None = None) -> pl.DataFrame:
    """A zero-row feature frame with the columns a build with `spec` (default: the default spec)
    over frames with these telemetry columns produces."""
    metric_types = {m.column: pl.from_arrow(pa.array([], type=m.arrow_type)).dtype for m in metric_catalogue()}  # type: ignore[union-attr]
    schema = {c: ID_DTYPES.get(c, metric_types.get(c, pl.Float32())) for c in telemetry_columns}
    schema.setdefault("ts", TS_DTYPE)
    schema.setdefault(GPU, pl.String())
    tel = pl.DataFrame(schema=schema)
    end = datetime(1970, 1, 2, tzinfo=UTC)
    return build_features(
        tel, pl.DataFrame(schema={"ts": TS_DTYPE, GPU: pl.String(), "xid": pl.Int32()}), spec, data_end=end
    )


def build_features(
    telemetry: pl.DataFrame | pa.Table,
    xid_events: pl.DataFrame | pa.Table,
    spec: FeatureSpec | None = None,
    *,
    data_end: datetime | None = None,
    repairs: pl.DataFrame | pa.Table | None = None,
    presence: pl.DataFrame | None = None,
    episodes: pl.DataFrame | None = None,
    emit_start: datetime | None = None,
    emit_end: datetime | None = None,
) -> pl.DataFrame:
    """The feature frame (`features.schema`) for the GPUs in `telemetry`, built in memory with
    the settings of `spec` (default: the default spec).

    One row per (gpu_uuid, grid time t) from the GPU's first bucket up to `data_end` (default:
    the last telemetry timestamp), while the GPU's last sample is at most `spec.max_silence`
    old, and while the GPU is in service (not between a failure episode and its repair).
    Features use only data <= t; labels look at (t, t + horizon] (see `features.windows`,
    `features.labels`).

    `repairs` are operator records (the `repairs` dataset). `presence`, `episodes` let a caller
    that sees only part of the fleet or of the history pass fleet-wide facts: GPU presence
    (`labels.gpu_presence`: first sample, for `gpu_age_h`, and lost-GPU detection) and failure
    episodes. `emit_start` / `emit_end` keep only rows with emit_start <= t < emit_end.
    """
    spec = spec or FeatureSpec()
    tel = _normalise_ts(_as_frame(telemetry), ["ts"], "telemetry")
    missing = [c for c in ("ts", GPU) if c not in tel.columns]
    if missing:
        raise ValueError(f"telemetry: missing required columns {missing}; got {tel.columns}")
    if data_end is None:
        if tel.height == 0:
            raise ValueError("telemetry is empty and no data_end was given; cannot place the grid")
        data_end = tel["ts"].max()  # type: ignore[assignment]
    assert data_end is not None
    hourly = hourly_aggregate(tel, spec.grid, max_gap=spec.max_silence)
    return features_from_buckets(
        hourly,
        xid_events,
        spec,
        data_end=data_end,
        repairs=repairs,
        presence=presence,
        episodes=episodes,
        emit_start=emit_start,
        emit_end=emit_end,
    )


def features_from_buckets(
    hourly: pl.DataFrame, xid_events: pl.DataFrame | pa.Table, spec: FeatureSpec | None = None, **options: Any
) -> pl.DataFrame:
    """`build_features` from bucket aggregates (`features.windows.hourly_aggregate` output)
    instead of raw samples: the second half of a build, as one frame. `options` are
    `iter_features_from_buckets`' (data_end is required); its parts are concatenated here, so a
    setting is declared once, there."""
    return pl.concat(list(iter_features_from_buckets(hourly, xid_events, spec, **options)), how="vertical")


def iter_features_from_buckets(
    hourly: pl.DataFrame,
    xid_events: pl.DataFrame | pa.Table,
    spec: FeatureSpec | None = None,
    *,
    data_end: datetime,
    repairs: pl.DataFrame | pa.Table | None = None,
    presence: pl.DataFrame | None = None,
    episodes: pl.DataFrame | None = None,
    emit_start: datetime | None = None,
    emit_end: datetime | None = None,
    rows_per_chunk: int | None = None,
    rows_per_part: int | None = None,
    model_medians: pl.DataFrame | None = None,
) -> Iterator[pl.DataFrame]:
    """The feature frame (`features.schema`) of the buckets' GPUs, in parts of whole GPUs, each
    a finished feature frame (sorted by (gpu_uuid, ts); at least one part, possibly empty).

    Window and XID features are computed for chunks of whole GPUs of about `rows_per_chunk`
    grid rows at a time (all at once when None), which bounds the memory of their
    intermediate columns; peer features for all GPUs together (the fleet median needs them all).

    With `rows_per_part` set, the wide grid (every bucket statistic on every grid row) exists
    for one part of about that many grid rows at a time: which rows are emitted, their labels
    and the peer features (which need every GPU of a node and of the fleet at once) are decided
    first on a narrow grid of a few columns. A shard of a store build over a fleet of tens of
    thousands of GPUs carries a block of days and the eight before it; its wide grid alone would
    be several GB.

    `model_medians` (`features.peers.model_medians` of the whole fleet) is given when the
    buckets hold only a shard of the fleet; by default the fleet medians are the buckets' own."""
    spec = spec or FeatureSpec()
    grid, max_silence = spec.grid, spec.max_silence
    data_end = _utc(data_end)
    xid = _prepare_xids(_as_frame(xid_events))
    fixes = _prepare_repairs(repairs)
    if presence is None:
        presence = _presence_from_buckets(hourly, grid)
    xid = resolve_xid_gpus(xid, presence)
    if episodes is None:
        episodes = episodes_for(
            xid,
            presence,
            failure_xids=spec.failure_xids,
            merge_window=spec.merge_window,
            data_end=data_end,
            lost_after=spec.lost_after,
            repairs=fixes,
        )
    first_seen = presence.group_by(GPU).agg(pl.col("first_ts").min())
    # A GPU seen before the frame's first bucket gets grid rows from there on, as in a build
    # over all history (`dense_grid`'s `starts`).
    frame_start = hourly["ts"].min() if hourly.height else None
    starts = (
        None
        if frame_start is None
        else first_seen.select(
            GPU,
            pl.max_horizontal(grid_time(pl.col("first_ts"), grid), pl.lit(frame_start, dtype=TS_DTYPE)).alias("_start"),
        )
    )

    whole = rows_per_part is None
    if whole:
        dense = dense_grid(hourly, grid, data_end=data_end, max_silence=max_silence, starts=starts)
        narrow = dense
    else:
        sfx = grid_suffix(grid)
        wanted = {GPU, "ts", "last_sample_ts", *BUCKET_ID_COLUMNS, *(f"{m}_mean{sfx}" for m in PEER_METRICS)}
        narrow = dense_grid(
            hourly.select(c for c in hourly.columns if c in wanted),
            grid,
            data_end=data_end,
            max_silence=max_silence,
            starts=starts,
        )
    # Which rows are emitted, and their labels, are decided on narrow columns first, so that the
    # wide feature columns are materialised once, for the emitted rows only.
    ts = narrow["ts"]
    emit = pl.repeat(True, narrow.height, eager=True)
    if emit_start is not None:
        emit &= ts >= _utc(emit_start)
    if emit_end is not None:
        emit &= ts < _utc(emit_end)
    facts = label_rows(narrow.select(GPU, "ts"), episodes, horizon=spec.horizon, data_end=data_end, repairs=fixes)
    silent = narrow.select((pl.col("ts") - pl.col("last_sample_ts")) > max_silence).to_series()
    keep = emit & facts["in_service"] & ~silent.fill_null(True)
    peers = peer_features(narrow.filter(emit), grid, medians=model_medians).filter(keep.filter(emit))
    facts = facts.filter(keep).drop("in_service")
    # Kept rows before each grid row: where a part's rows start in `peers` and `facts`.
    kept_before = keep.cast(pl.Int64).cum_sum() - keep.cast(pl.Int64)

    parts = [(0, narrow.height)] if whole else _gpu_slices(narrow[GPU], rows_per_part)
    if len(parts) > 1:
        # Tagged once: filtering each part on its GPUs' names cost a string look-up per bucket per part.
        hourly = _tag_parts(hourly, narrow[GPU], parts)
    produced = False
    for i, (offset, length) in enumerate(parts):
        part_keep = keep.slice(offset, length)
        last_part = i == len(parts) - 1
        if not part_keep.any() and (produced or not last_part):
            continue
        if whole:
            part_dense = dense
        else:
            part_hourly = hourly if len(parts) == 1 else hourly.filter(pl.col("_part") == i).drop("_part")
            part_dense = dense_grid(part_hourly, grid, data_end=data_end, max_silence=max_silence, starts=starts)
        first = int(kept_before[offset]) if length else 0
        n_kept = int(part_keep.sum())
        yield _assemble(
            part_dense,
            part_keep,
            peers.slice(first, n_kept),
            facts.slice(first, n_kept),
            xid,
            first_seen,
            spec,
            rows_per_chunk=rows_per_chunk,
        )
        produced = True


def _tag_parts(hourly: pl.DataFrame, grid_gpus: pl.Series, parts: Sequence[tuple[int, int]]) -> pl.DataFrame:
    """`hourly` with `_part`, the part of the grid its GPU is in (`grid_gpus` is the grid's GPU
    column, `parts` its slices). Adding a column shares the others' memory, so a part's buckets
    are then one integer filter away, and only one part is ever copied at a time."""
    part_id = pl.concat(
        [pl.repeat(i, length, dtype=pl.Int32, eager=True) for i, (_, length) in enumerate(parts)], how="vertical"
    )
    part_of = pl.DataFrame({GPU: grid_gpus, "_part": part_id}).unique(GPU, keep="first")
    return hourly.with_columns(
        pl.col(GPU).replace_strict(part_of[GPU], part_of["_part"], default=None, return_dtype=pl.Int32).alias("_part")
    )


def _assemble(
    dense: pl.DataFrame,
    keep: pl.Series,
    peers: pl.DataFrame,
    facts: pl.DataFrame,
    xid: pl.DataFrame,
    first_seen: pl.DataFrame,
    spec: FeatureSpec,
    *,
    rows_per_chunk: int | None,
) -> pl.DataFrame:
    """The feature frame of the kept rows of `dense` (whole GPUs): window and XID features in
    chunks of whole GPUs, beside the identity columns, the peer features and the labels."""
    pieces: list[pl.DataFrame] = []
    for offset, length in _gpu_slices(dense[GPU], rows_per_chunk):
        part, part_keep = dense.slice(offset, length), keep.slice(offset, length)
        keys = part.select(GPU, "ts")
        wf = window_features(part, spec.grid, spec.windows, first_seen=first_seen, keep=part_keep, dtype=FEATURE_DTYPE)
        chunk_xid = xid.join(keys.select(GPU).unique(), on=GPU, how="semi")
        xf = xid_features(
            keys,
            chunk_xid,
            spec.grid,
            spec.windows,
            since_cap=spec.xid_since_cap,
            keep=part_keep,
            dtype=FEATURE_DTYPE,
        )
        pieces.append(pl.concat([wf, xf.drop(GPU, "ts")], how="horizontal"))
    features = pl.concat(pieces, how="vertical") if len(pieces) > 1 else pieces[0]
    ids = dense.filter(keep).select([c for c in ID_COLUMNS if c in dense.columns])
    # The parts have the rows of `dense` in its order (checked: a silent misalignment would be the
    # worst kind of bug), so they are placed side by side.
    for frame in (features, peers):
        if not frame.select(GPU, "ts").equals(ids.select(GPU, "ts")):
            raise AssertionError("feature frames are not aligned with the grid; this is a bug in features")
    if facts.height != ids.height:
        raise AssertionError("labels are not aligned with the grid; this is a bug in features")
    frame = pl.concat(
        [ids, features.drop(GPU, "ts"), peers.drop(GPU, "ts"), facts],
        how="horizontal",
    )
    names = [c for c in frame.columns if c not in ID_COLUMNS and c not in LABEL_COLUMNS]
    return frame.select(
        *[
            pl.col(c).cast(ID_DTYPES[c]) if c in frame.columns else pl.lit(None, dtype=ID_DTYPES[c]).alias(c)
            for c in ID_COLUMNS
        ],
        *[pl.col(c).cast(FEATURE_DTYPE) for c in names],
        *[pl.col(c).cast(LABEL_DTYPES[c]) for c in LABEL_COLUMNS],
    )  # sorted by (gpu_uuid, ts): the order of the dense grid


def _gpu_slices(gpus: pl.Series, rows_per_chunk: int | None) -> list[tuple[int, int]]:
    """(offset, length) slices of a column sorted by GPU: whole GPUs, about `rows_per_chunk`
    rows each (a GPU with more rows is a slice of its own); one slice when None."""
    if rows_per_chunk is None or gpus.len() <= rows_per_chunk:
        return [(0, gpus.len())]
    run_lengths = gpus.rle().struct.field("len").to_list()
    slices, offset, length = [], 0, 0
    for n in run_lengths:
        if length and length + n > rows_per_chunk:
            slices.append((offset, length))
            offset, length = offset + length, 0
        length += n
    slices.append((offset, length))
    return slices


def _prepare_repairs(repairs: pl.DataFrame | pa.Table | None) -> pl.DataFrame | None:
    if repairs is None:
        return None
    frame = _as_frame(repairs)
    missing = [c for c in ("ts", "old_gpu_uuid") if c not in frame.columns]
    if missing:
        raise ValueError(f"repairs: missing required columns {missing}; got {frame.columns}")
    return _normalise_ts(frame, ["ts"], "repairs")


# -- the features dataset -----------------------------------------------------------------------


def _metadata() -> dict[bytes, bytes]:
    return {
        b"gpufail.dataset": FEATURES_DATASET.encode(),
        b"gpufail.features_schema_version": str(FEATURES_SCHEMA_VERSION).encode(),
        b"gpufail.presampled_fraction": str(PRESAMPLED_FRACTION).encode(),
    }


def write_features(store: Store, table: pl.DataFrame, *, threads: int = WRITE_THREADS) -> list[str]:
    """Append a feature frame to the store's `features` dataset: one new file per UTC date of
    `ts`, through `Store.write_owned` (hidden temporary name, then rename), so readers never
    see a partial file. The frame is validated first. Returns the paths written.

    Each file is two row groups: the rows a retrain draws at up to `PRESAMPLED_FRACTION` of
    the negatives (and every positive) first, then the rest, each group in (gpu_uuid, ts) order
    with statistics on label and `_sample_key`, so that a retrain's filter skips the rest by
    its statistics. Censored rows go by their key as if negative, so that no key in the rest is
    low. The files of different dates are written by `threads` threads at once: pyarrow's
    Parquet writer encodes one file on one core, and encoding is most of writing."""
    validate_features(table)
    if table.height == 0:
        return []
    if not _sorted_by_gpu_then_time(table):
        table = table.sort(GPU, "ts")
    keys = sample_keys(table[GPU], table["ts"])
    rest = pl.Series("_rest", ~drawn(table["label"].fill_null(0).to_numpy(), keys, PRESAMPLED_FRACTION))
    table = table.with_columns(pl.Series(SAMPLE_KEY, keys))
    day = table["ts"].dt.date()
    # Each file's two groups are filtered out of the frame, which keeps its (gpu_uuid, ts) order:
    # a masked copy per group costs about one copy of the frame, where sorting the rows into file
    # order and gathering every column (rechunked first) cost two, the gather a random one. Each
    # thread filters its own date's groups, so no more than `threads` dates are copied at once.
    # Dictionary-encoding only the string columns: trying it on 280 float columns made
    # writing 2.5x slower for no gain.
    dictionary = [c for c in ID_COLUMNS if table.schema[c] == pl.String]
    metadata = _metadata()

    def write_one(one_day: date) -> str:
        on_day = day == one_day
        # Two groups in every file, the first for the drawn rows, even when one is empty.
        groups = [table.filter(on_day & ~rest), table.filter(on_day & rest)]
        pieces = [g.to_arrow(compat_level=pl.CompatLevel.oldest()) for g in groups]
        return store.write_owned(
            FEATURES_DATASET,
            one_day,
            [p.replace_schema_metadata({**(p.schema.metadata or {}), **metadata}) for p in pieces],
            use_dictionary=dictionary,
            # Statistics only where a reader filters (time, GPU, place, the training draw):
            # min/max of 400 float columns cost ~15% of writing and no reader uses them.
            write_statistics=[*ID_COLUMNS, "label", SAMPLE_KEY],
        )

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        futures = [pool.submit(write_one, one_day) for one_day in day.unique().sort()]
        # Every write finishes (each file is whole or absent) before the first error is raised.
        return [f.result() for f in futures]


def _sorted_by_gpu_then_time(frame: pl.DataFrame) -> bool:
    """Whether the rows are in (gpu_uuid, ts) order (a store build's flush always is)."""
    if frame.height < 2:
        return True
    gpu, ts = frame[GPU], frame["ts"]
    earlier_gpu, earlier_ts = gpu.slice(0, frame.height - 1), ts.slice(0, frame.height - 1)
    later_gpu, later_ts = gpu.slice(1), ts.slice(1)
    return bool(((earlier_gpu < later_gpu) | ((earlier_gpu == later_gpu) & (earlier_ts < later_ts))).all())


def feature_files(
    store: Store, first_day: date | None = None, last_day: date | None = None, *, verify: bool = False
) -> list[str]:
    """Visible part files of the features dataset dated within [first_day, last_day]; `verify`
    (for readers of their rows): each file's checksum checked first (`Store.verify`)."""
    return store.files(FEATURES_DATASET, first_day, last_day, verify=verify)


def features_shape(store: Store) -> tuple[int, int]:
    """(rows, columns) of the whole features dataset, from the files' Parquet footers: nothing
    but the footers is read, so a caller can tell what reading it all would take."""
    files = feature_files(store)
    if not files:
        return 0, 0
    dataset = ds.dataset(files, format="parquet", filesystem=store.fs)
    rows = sum(fragment.metadata.num_rows for fragment in dataset.get_fragments())
    return rows, len(dataset.schema)


def read_features(
    store: Store,
    start: datetime | None = None,
    end: datetime | None = None,
    columns: Sequence[str] | None = None,
) -> pl.DataFrame:
    """Feature rows with start <= ts < end (all when omitted), sorted by (ts, gpu_uuid). Only
    the date partitions overlapping the range are opened. A file that does not read is named."""
    frame = _collect(scan_features(store, start, end, columns), store, *_day_range(start, end))
    return _sorted_column_by_column(frame, ["ts", GPU])


def _day_range(start: datetime | None, end: datetime | None) -> tuple[date | None, date | None]:
    first_day = _utc(start).date() if start is not None else None
    last_day = (_utc(end) - timedelta(microseconds=1)).date() if end is not None else None
    return first_day, last_day


def _collect(frame: pl.LazyFrame, store: Store, first_day: date | None, last_day: date | None) -> pl.DataFrame:
    """`frame.collect()`; when reading fails, the error names the feature file at fault (the
    reader's own message does not: "parquet: File out of specification")."""
    try:
        return frame.collect()
    except READ_ERRORS as exc:
        _raise_named(exc, store, first_day, last_day)


READ_ERRORS = (pl.exceptions.PolarsError, pa.ArrowException, OSError)
"""What polars and pyarrow raise for a file they cannot read."""


def _raise_named(exc: BaseException, store: Store, first_day: date | None, last_day: date | None) -> NoReturn:
    bad = unreadable_feature_file(store, first_day, last_day)
    if bad is None:
        raise exc
    raise StoreError(unreadable_message(*bad)) from exc


def unreadable_feature_file(
    store: Store, first_day: date | None = None, last_day: date | None = None
) -> tuple[str, str] | None:
    """The first feature file dated within the days that does not read whole (footer and every
    page), and why; None when all of them read. Reads every file: for error messages only."""
    for path in feature_files(store, first_day, last_day):
        try:
            with store.fs.open(path, "rb") as fh:
                pq.ParquetFile(fh).read()
        except (pa.ArrowException, OSError, ValueError) as exc:
            return path, f"{type(exc).__name__}: {exc}"
    return None


def unreadable_message(path: str, why: str) -> str:
    day = _day_of(path)
    return (
        f"{path}: not a readable feature file ({why}); rebuild its day with "
        f"gpufail features --start {day} --end {day + timedelta(days=1)} --overwrite"
    )


def scan_features(
    store: Store,
    start: datetime | None = None,
    end: datetime | None = None,
    columns: Sequence[str] | None = None,
) -> pl.LazyFrame:
    """`read_features` as a polars LazyFrame in file order, for readers that take a range a few
    grid times at a time (a held-out window is 2.2M rows x 420 columns on the paper fleet)."""
    files = feature_files(store, *_day_range(start, end), verify=True)
    if not files:
        return pl.LazyFrame(schema={**ID_DTYPES, **LABEL_DTYPES})
    if store.is_local:
        # polars read these files 2.5x faster than pyarrow's dataset reader (see _read_telemetry).
        # Files written before the stored training key (SAMPLE_KEY) lack it: a later file's
        # column the first file lacks is left out rather than an error.
        lf = pl.scan_parquet(files, hive_partitioning=False, extra_columns="ignore")
    else:
        lf = pl.scan_pyarrow_dataset(ds.dataset(files, format="parquet", filesystem=store.fs))
    if start is not None:
        lf = lf.filter(pl.col("ts") >= pl.lit(_utc(start), dtype=TS_DTYPE))
    if end is not None:
        lf = lf.filter(pl.col("ts") < pl.lit(_utc(end), dtype=TS_DTYPE))
    if columns is None:
        try:
            names = lf.collect_schema().names()
        except READ_ERRORS as exc:
            _raise_named(exc, store, *_day_range(start, end))
        return lf.select([c for c in names if c != SAMPLE_KEY])
    return lf.select(list(dict.fromkeys(["ts", GPU, *columns])))


def read_newest_grid_time(store: Store) -> pl.DataFrame:
    """The feature rows of the newest grid time (what scoring the fleet as it is now needs),
    sorted by gpu_uuid; empty when there are no features. Only the newest day's files are
    opened, and of them only these rows are decoded past the time column: reading the whole
    day (750k rows x 420 columns on the paper fleet) to keep one hour in 24 was most of the
    nightly scoring step's memory."""
    days = store.dates(FEATURES_DATASET)
    if not days:
        return scan_features(store).collect()
    day = scan_features(store, start=datetime.combine(days[-1], datetime.min.time(), tzinfo=UTC))
    newest = _collect(day.select(pl.col("ts").max()), store, days[-1], days[-1]).item()
    rows = _collect(day.filter(pl.col("ts") == pl.lit(newest, dtype=TS_DTYPE)), store, days[-1], days[-1])
    return _sorted_column_by_column(rows, ["ts", GPU])


def _sorted_column_by_column(frame: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    """`frame.sort(by)`, gathering one column at a time and letting go of each source column as
    it goes: sorting the 3-day held-out window of the paper fleet (4 GB) whole peaked at 12 GB
    and took 12.7 s; this way 4.9 GB and 8.8 s. Each column is put in one piece first (a frame
    read from many files is in many, and gathering from those was several times slower). A
    narrow frame (the label keys of 20M rows) sorts faster whole: 5.0 s against 5.6 s."""
    if frame.width <= 8:
        return frame.sort(by)
    # (pl.arg_sort_by on two columns took 100 s for 20M keys where sorting them took 4 s.)
    order = frame.select(by).with_row_index("_row").sort(by)["_row"]
    return pl.DataFrame([frame.drop_in_place(name).rechunk().gather(order) for name in list(frame.columns)])


# -- building over a store ----------------------------------------------------------------------


@dataclass
class _ShardResult:
    """What one shard of a block wrote."""

    rows: int = 0
    positives: int = 0
    censored: int = 0
    gpus: set[str] = field(default_factory=set)
    files: list[str] = field(default_factory=list)

    def add(self, frame: pl.DataFrame) -> None:
        self.rows += frame.height
        self.positives += int((frame["label"] == 1).sum())
        self.censored += frame["label"].null_count()
        self.gpus.update(frame[GPU].unique().to_list())

    def add_to(self, summary: FeatureBuildSummary, gpus: set[str]) -> None:
        summary.rows += self.rows
        summary.positives += self.positives
        summary.censored += self.censored
        summary.files_written += self.files
        gpus.update(self.gpus)


@dataclass
class FeatureBuildSummary:
    rows: int = 0
    gpus: int = 0
    positives: int = 0
    censored: int = 0
    telemetry_rows_read: int = 0
    blocks: int = 0  # time blocks of days, each built shard by shard
    shards: int = 0  # shards of whole nodes the fleet was built in
    files_written: list[str] = field(default_factory=list)
    files_replaced: int = 0
    days_kept: int = 0  # complete and up to date already: not rebuilt
    leftovers_removed: int = 0  # files of days an interrupted build left partial
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
            + (f"; {self.days_kept} days already built kept" if self.days_kept else "")
            + (f"; {self.leftovers_removed} files of an interrupted build removed" if self.leftovers_removed else "")
        )


def nothing_to_build(manifest: FeatureManifest, plan: BuildPlan, start: datetime, end: datetime) -> str:
    """Every day asked for is built and up to date: say so, with the range the files cover."""
    files = manifest.kept_files(plan.kept)
    removed = f"; removed {len(plan.partial)} files an interrupted build left" if plan.partial else ""
    return (
        f"features: {files} files already cover {start.date()}..{(end - timedelta(days=1)).date()}, every day "
        f"asked for, built from the data as it is now{removed}; pass overwrite=True (gpufail features "
        "--overwrite) to rebuild them"
    )


def _day_start(moment: datetime) -> datetime:
    m = _utc(moment)
    return datetime(m.year, m.month, m.day, tzinfo=UTC)


_ID_COLS = ["ts", "cluster", "node", "gpu_index", "pci_bus_id", GPU]


def _day_of(path: str) -> date:
    return date.fromisoformat(path.rsplit("/date=", 1)[1].split("/", 1)[0])


def _read_telemetry(
    store: Store, start: datetime, end: datetime, *, nodes: tuple[str, str] | None = None
) -> pl.DataFrame:
    """Telemetry rows with start <= ts < end (and node in the closed range `nodes`). On a local
    store the files (schema-checked by `Store.dataset`) are read with polars, which read the
    simulator's 60 day files 6x faster than pyarrow's dataset reader on these machines; other
    filesystems go through `Store.read`."""
    if not store.is_local:
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
    # In one piece: the scan returns a column in as many chunks as it read row groups (142 for a
    # paper fleet-day), and gathering rows from a chunked column was ~8x slower (2.2 s against
    # 0.25 s for the day's frame, plus 0.25 s to rechunk it).
    return lf.collect().rechunk()


def _scan_presence(store: Store, *, progress: bool) -> tuple[pl.DataFrame, dict[date, int]]:
    """GPU presence over all telemetry, and the number of rows per day partition."""
    from tqdm.auto import tqdm

    if store.is_local:
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


def _last_rows(frame: pl.DataFrame) -> pl.DataFrame:
    """The latest row of each GPU."""
    return frame.filter(pl.col("ts") == pl.col("ts").max().over(GPU)).unique(GPU, keep="last", maintain_order=True)


class _BucketStream:
    """Raw telemetry, one UTC day at a time, turned into complete grid buckets.

    The bucket labelled b holds the samples in (b - grid, b], so a day file's last partial
    bucket also needs the next file's first instant: rows after the day's last complete bucket
    are held back for the next day. The last sample of each GPU is carried too, as the baseline
    of its counter increases and sample spacing (so a counter increase across midnight is
    counted exactly as in an all-history build)."""

    def __init__(self, grid: timedelta, max_gap: timedelta) -> None:
        self.grid, self.max_gap = grid, max_gap
        self.held: pl.DataFrame | None = None  # raw rows after the last complete bucket
        self.context: pl.DataFrame | None = None  # the last aggregated sample per GPU
        self.cut: datetime | None = None

    def day(self, raw: pl.DataFrame, day_end: datetime) -> pl.DataFrame:
        """Buckets completed by the raw rows of the day ending at `day_end` (exclusive)."""
        cut = grid_floor(day_end - timedelta(microseconds=1), self.grid)
        frames = [f for f in (self.held, raw) if f is not None and f.height]
        # Not rechunked here: the day's rows come in one piece (`_read_telemetry`), and the
        # concatenation with the context below makes one piece of everything once.
        pending = pl.concat(frames, how="vertical_relaxed") if len(frames) > 1 else (frames[0] if frames else raw)
        is_now = pending.select(pl.col("ts") <= pl.lit(cut, dtype=TS_DTYPE)).to_series()
        self.held = pending.filter(~is_now)
        if not is_now.any():
            return hourly_aggregate(pending.clear(), self.grid, max_gap=self.max_gap)
        if self.context is None and len(frames) == 1:
            merged = pending.filter(is_now)  # one file's rows: usually in (gpu, ts) order already
        else:
            # The context, the held rows and the day's rows together are out of order: their
            # rows up to the cut are put in order by sorting two narrow keys and one gather
            # (filtering, concatenating, then sorting the 36-column frame took 40% of
            # aggregating a day). `hourly_aggregate` checks the order (a hash collision).
            if self.context is not None:
                pending = pl.concat(
                    [self.context.select(pending.columns), pending], how="vertical_relaxed", rechunk=True
                )
                is_now = pl.concat([pl.repeat(True, self.context.height, eager=True), is_now])
            order = (
                pl.DataFrame({"_h": pending[GPU].hash(), "ts": pending["ts"], "_now": is_now})
                .with_row_index("_i")
                .filter("_now")
                .sort("_h", "ts", maintain_order=True)["_i"]
            )
            merged = pending[order]
        buckets = hourly_aggregate(merged, self.grid, max_gap=self.max_gap)
        if self.cut is not None:
            buckets = buckets.filter(pl.col("ts") > pl.lit(self.cut, dtype=TS_DTYPE))  # the context's buckets
        latest = _last_rows(merged)
        self.context = latest.filter(pl.col("ts") > pl.lit(cut - self.max_gap, dtype=TS_DTYPE))
        self.cut = cut
        return buckets


@dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """How `build_features_from_store` runs: its memory bounds, threads and progress bar. None of
    them changes a feature value (the settings that do are the `FeatureSpec`)."""

    rows_per_chunk: int = 250_000
    """Grid rows of whole GPUs whose window and XID features are computed at once."""
    rows_per_part: int | None = 500_000
    """Grid rows of whole GPUs whose wide bucket statistics are held at once (None: all)."""
    max_buckets_in_memory: int = 4_000_000
    """Grid buckets a shard of whole nodes holds: more, and the fleet is built in shards."""
    block_days: int = 14
    """Days built together: the lookback before them is read once per block."""
    flush_rows: int = 300_000
    """Finished rows written at once."""
    workers: int = 1
    """Shards of a block built at once, on threads (they share the memory bounds)."""
    read_ahead: bool = True
    """Read and aggregate the next block's days while a block is built."""
    write_ahead: bool = True
    """Write finished rows on a thread of their own while the next rows are computed."""
    scratch: str | None = None
    """Folder for the shards' temporary files (default: the system's temporary folder)."""
    progress: bool = True

    def __post_init__(self) -> None:
        if self.block_days < 1:
            raise ValueError(f"block_days: expected at least 1, got {self.block_days}")
        if self.workers < 1:
            raise ValueError(f"workers: expected at least 1, got {self.workers}")


def build_features_from_store(
    store: Store,
    spec: FeatureSpec | None = None,
    options: BuildOptions | None = None,
    *,
    start: datetime | None = None,
    end: datetime | None = None,
    overwrite: bool = False,
) -> FeatureBuildSummary:
    """Build and write the `features` dataset with the settings of `spec` (default: the
    default spec) for grid times in [start, end), widened to whole UTC days (so every date
    partition is complete). Default: all telemetry in the store. `options` say how (memory
    bounds, threads; `BuildOptions`).

    Labels look as far past `end` as the store's data goes (the data end is the last telemetry
    sample in the store), so building yesterday's features today labels them as well as today's
    data allows; rows whose horizon is not yet observed are censored (null) and are filled by a
    later rebuild.

    Two passes, bounded memory. Pass 1 reads only identity columns (GPU presence: first/last
    sample per GPU, for `gpu_age_h`, lost-GPU labels and XID resolution, and the data end); XID
    events and repair records are read whole (they are small) and give the failure episodes.
    Pass 2 reads raw telemetry one day partition at a time, from the longest window before
    `start` on, aggregates it to grid buckets once (`_BucketStream`), and computes the fleet
    median per GPU model of each grid time (the one feature that needs the whole fleet). The
    days are emitted in time blocks of `block_days`: a block's features need its buckets and
    the trailing window before it. When the whole fleet's buckets for a block and its window
    would exceed `max_buckets_in_memory` rows, the fleet is split into shards of whole nodes
    (`features.shards`), whose buckets wait in temporary files and are built one shard at a
    time. Within a shard, the wide columns exist for parts of whole GPUs of about
    `rows_per_part` grid rows (`iter_features_from_buckets`; all at once when None), computed in
    chunks of about `rows_per_chunk`; finished rows are written every `flush_rows`. Every row
    equals what an all-history in-memory build gives (up to floating-point rounding).

    With `read_ahead`, the next block's days are read and aggregated while a block is built
    (on a thread of its own); with one shard in memory those buckets count against
    `max_buckets_in_memory` too. With `write_ahead`, a shard's finished rows are written on a
    thread of their own while it computes the next (one flush in flight). `workers` shards of
    a block are built at once, on threads (polars, pyarrow and the compiled kernels release the
    GIL); they share the memory budget, so each holds a shard of `max_buckets_in_memory /
    workers` buckets and parts of `rows_per_part / workers` rows.

    Days already built are kept (`features.manifest`): only the days no build completed (a
    build killed half-way), and those whose labels the data has moved on from, are built; when
    there are none, the build is refused unless `overwrite=True`, which rebuilds every day
    asked for. A rebuilt day's old files are removed once its block is complete. The dataset
    records the spec it was built with (`features.manifest`); a build with another spec is
    refused unless it rebuilds every day (`FeatureManifest.use_spec`).
    """
    from tqdm.auto import tqdm

    began = time.perf_counter()
    spec = spec or FeatureSpec()
    options = options or BuildOptions()
    grid, max_silence, block_days = spec.grid, spec.max_silence, options.block_days
    workers, rows_per_part, flush_rows = options.workers, options.rows_per_part, options.flush_rows
    summary = FeatureBuildSummary()

    # Pass 1: presence (identity columns only) over the whole store: labels and lost-GPU
    # detection look past `end` as far as the data goes.
    presence, day_rows = _scan_presence(store, progress=options.progress)
    if presence.height == 0:
        summary.seconds = time.perf_counter() - began
        return summary
    data_end = _utc(presence["last_ts"].max())  # type: ignore[arg-type]
    summary.data_end = data_end

    xid = resolve_xid_gpus(read_xid_events(store), presence)
    repairs = _prepare_repairs(store.read("repairs")) if store.exists("repairs") else None
    episodes = episodes_for(
        xid,
        presence,
        failure_xids=spec.failure_xids,
        merge_window=spec.merge_window,
        data_end=data_end,
        lost_after=spec.lost_after,
        repairs=repairs,
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

    # What is complete stays (a build killed half-way left some days partial: those are rebuilt).
    manifest = FeatureManifest.load(store)
    manifest.use_spec(spec, emit_start, emit_end, overwrite=overwrite)
    plan = manifest.plan(emit_start, emit_end, data_end=data_end, settle=settle_time(spec), overwrite=overwrite)
    manifest.remove(plan.partial)
    summary.leftovers_removed, summary.days_kept = len(plan.partial), len(plan.kept)
    if not plan.runs:
        raise FeaturesExistError(nothing_to_build(manifest, plan, emit_start, emit_end))

    # Buckets a row at t needs: the longest window, and the GPU's last bucket while it is silent.
    lookback = max(max(spec.windows), max_silence + grid)
    one_day = timedelta(days=1)
    # A shard carries a block and its trailing window (plus the day a window's start falls in).
    carried_days = block_days + -(-lookback // one_day) + 1
    per_day = one_day // grid
    # The workers share the memory budget: each builds a shard and a part of a share of it.
    budget = options.max_buckets_in_memory // workers
    shards = shard_map(presence, gpu_buckets=carried_days * per_day, max_buckets=budget)
    ahead_days = carried_days + (block_days if options.read_ahead else 0)
    if shards[SHARD].n_unique() <= 1 and presence[GPU].n_unique() * ahead_days * per_day > budget:
        # One shard keeps its buckets in memory, and the next block's days, read while a block
        # is built, come on top: when both do not fit, the buckets wait on disk in shards.
        shards = shard_map(presence, gpu_buckets=ahead_days * per_day, max_buckets=budget)
    if rows_per_part is not None:
        rows_per_part = max(1, rows_per_part // workers)
    gpus: set[str] = set()

    stop = threading.Event()  # set when the build fails: the block being built stops too

    def build_shard(shard: int, block_start: datetime, block_end: datetime, fleet: pl.DataFrame | None) -> _ShardResult:
        """One shard's rows of a block, written in flushes of about `flush_rows`."""
        result = _ShardResult()
        hourly = buckets.take(shard, block_start - lookback, block_end)
        if hourly is None:
            return result
        parts = iter_features_from_buckets(
            hourly,
            xid if buckets.count == 1 else xid.join(hourly.select(GPU).unique(), on=GPU, how="semi"),
            spec,
            data_end=data_end,
            repairs=repairs,
            presence=presence,
            episodes=episodes,
            emit_start=block_start,
            emit_end=block_end,
            rows_per_chunk=options.rows_per_chunk,
            rows_per_part=rows_per_part,
            model_medians=fleet,
        )
        del hourly  # the generator holds the shard's buckets only while it runs
        pending: list[pl.DataFrame] = []
        # A flush is written on a thread of its own while the next part is computed: the shard
        # waited on its writes for a third of its time, with a core often idle (`write_ahead`).
        # One flush at a time is written, so at most two flushes are held.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="features-write") as writer:
            writing: Future[list[str]] | None = None

            def wait_for_write() -> None:
                nonlocal writing
                if writing is not None:
                    result.files += writing.result()  # a failed write stops the shard here
                    writing = None

            def flush() -> None:
                nonlocal writing, pending
                frame = pl.concat(pending, how="vertical")
                pending = []
                wait_for_write()
                writing = writer.submit(write_features, store, frame)
                if not options.write_ahead:
                    wait_for_write()

            for frame in parts:
                if stop.is_set():
                    raise _Stopped
                if frame.height == 0:
                    continue
                result.add(frame)
                pending.append(frame)
                if sum(f.height for f in pending) >= flush_rows:
                    flush()
            if pending:
                flush()
            wait_for_write()
        return result

    def emit(block_start: datetime, block_end: datetime, fleet: pl.DataFrame | None) -> None:
        summary.blocks += 1
        label = f"block {block_start.date()}..{(block_end - one_day).date()}"
        done = 0
        bar.set_postfix_str(f"{label}, shards 0/{buckets.count}")
        with ThreadPoolExecutor(max_workers=max(1, min(workers, buckets.count))) as pool:
            futures = [pool.submit(build_shard, shard, block_start, block_end, fleet) for shard in range(buckets.count)]
            written: list[str] = []
            try:
                for future in as_completed(futures):
                    result = future.result()
                    result.add_to(summary, gpus)
                    written += result.files
                    done += 1
                    bar.set_postfix_str(f"{label}, shards {done}/{buckets.count}")
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        # Every shard wrote its files: the block's days are complete, and the files they replace go.
        block_days = [(block_start + i * one_day).date() for i in range((block_end - block_start) // one_day)]
        manifest.complete(block_days, written, data_end)
        for day in block_days:
            manifest.remove(plan.replaced.get(day, []))
            summary.files_replaced += len(plan.replaced.get(day, []))

    # A block is built on a thread of its own while this one reads and aggregates the next
    # block's days (`read_ahead`): reading was a quarter of the build, with the other core
    # mostly idle (30-day paper store: 311 s at 8.6 GB without, 276 s at 11.5 GB with). One
    # block is built at a time (its shards hold the memory budget), so the reading waits for
    # the block before to finish before it hands over the next. Each run of consecutive days to
    # build is read from its own lookback on, as a build of just those days: the same rows.
    for emit_start, emit_end in plan.runs:
        first_read = max(_day_start(emit_start - lookback), _day_start(first_data))
        days = [first_read + i * one_day for i in range((emit_end - first_read) // one_day)]
        days = [d for d in days if d.date() in day_rows or d >= emit_start]
        # Blocks of at most `block_days`, as even as possible: a short last block would pay for a
        # whole lookback to emit a day or two.
        emit_days = (emit_end - emit_start) // one_day
        n_blocks = -(-emit_days // block_days)
        block_ends = {emit_start + (emit_days * (i + 1) // n_blocks) * one_day for i in range(n_blocks)}

        buckets = ShardedBuckets(shards, scratch=options.scratch)
        summary.shards = buckets.count
        stream = _BucketStream(grid, max_silence)
        medians: list[pl.DataFrame] = []  # the fleet median per GPU model of each grid time read
        bar = tqdm(total=len(days), desc="features: build", unit="day", disable=not options.progress)

        building: Future[None] | None = None
        emitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="features-block")
        try:
            block_start = emit_start
            for day in days:
                if building is not None and building.done():
                    building.result()  # a failed block stops the reading at once
                raw: pl.DataFrame | None
                if day.date() in day_rows:
                    raw = _read_telemetry(store, day, day + one_day)
                else:
                    # No telemetry that day: the last bucket held back from the day before is still
                    # complete now, and the block ending today needs it.
                    raw = None if stream.held is None else stream.held.clear()
                if raw is not None:
                    summary.telemetry_rows_read += raw.height
                    day_buckets = stream.day(raw, day + one_day)
                    del raw
                    if day_buckets.height:
                        medians.append(model_medians(day_buckets, grid))
                        buckets.add(day.date(), day_buckets)
                if day + one_day in block_ends:
                    block_end = day + one_day
                    # No buckets since the last block (a telemetry outage): no means to compare, so
                    # the shards' own (empty) medians are the fleet's.
                    fleet = (
                        pl.concat(medians, how="vertical_relaxed").filter(
                            pl.col("ts").is_between(
                                pl.lit(block_start, dtype=TS_DTYPE), pl.lit(block_end, dtype=TS_DTYPE)
                            )
                        )
                        if medians
                        else None
                    )
                    medians = []
                    if building is not None:
                        building.result()
                    # Keep only the trailing window this block needs.
                    buckets.forget(block_start - lookback)
                    building = emitter.submit(emit, block_start, block_end, fleet)
                    if not options.read_ahead:
                        building.result()
                    block_start = block_end
                bar.update(1)
            if building is not None:
                building.result()
        except BaseException:
            stop.set()  # the block being built stops at its next part; its files so far stay unlisted
            raise
        finally:
            emitter.shutdown(wait=True)
            bar.close()
            buckets.close()
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
