"""The stored form of the features: per GPU-bucket aggregates, what cannot be recomputed cheaply.

A feature row reads the buckets of the longest window before it (`features.plan.lookback`), and
every window feature is a function of those buckets (`features.windows`); the labels, the XID
features and the peer features need only small datasets and the buckets' means. So the store
keeps the buckets (`features.windows.hourly_aggregate` of the raw telemetry: counts, means,
variances, extremes, last readings, counter increases with resets handled, bitmask counts),
and the window features are computed when asked (`features.on_demand`), for the rows asked.

Two datasets, committed together by the journal `buckets` (`features.manifest`, as the features
build commits its days: a day is whole or absent whatever point a build is killed at, complete
days are kept, the spec is recorded):

- `buckets`: one row per (gpu_uuid, grid time) with at least one sample, in the date partition
  of its grid time. The bucket labelled t holds the samples in (t - grid, t], so a day's
  buckets come from that day's telemetry and the last sample before it (the baseline of a
  counter increase and of the sample spacing): they equal what the features build aggregates.
  A day's file is in node order (cluster, node, gpu_uuid, ts), in row groups of
  `BUCKET_ROW_GROUP_ROWS`: a reader of a shard of whole nodes (`features.on_demand` at a large
  fleet's scale) decodes only the row groups whose node statistics overlap its nodes.
- `bucket_presence`: `features.labels.gpu_presence` of each day's telemetry (where and when each
  GPU reported, per slot). The fleet facts (labels, lost GPUs, XID resolution) are computed
  from it and the small datasets, exactly as the features build computes them from telemetry.

A day is built again once the data moves past it if it was built before its end (its telemetry
was still arriving).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial

import polars as pl
import pyarrow as pa

from features.bucket_stream import BucketStream
from features.column_sort import sorted_column_by_column
from features.inputs import read_telemetry, utc
from features.labels import GPU, combine_presence, gpu_presence
from features.manifest import AGGREGATES_MANIFEST, BuildPlan, FeatureManifest, open_manifest, recorded_spec
from features.plan import ONE_DAY, FeatureBuildSummary, Written, day_start, days_in, plan_build, silent_sources
from features.schema import TS_DTYPE
from features.spec import FeatureSpec
from ingest.journal import Staging
from ingest.schema import metric_catalogue
from ingest.store import Store

BUCKETS = "buckets"
PRESENCE = "bucket_presence"
MANIFEST = AGGREGATES_MANIFEST
"""The journal (and state, `_state/buckets.json`) that commits both datasets."""
SCHEMA_VERSION = 1

BUCKET_ROW_GROUP_ROWS = 65_536
"""Rows per row group of a day's buckets: about 340 nodes of 8 GPUs. Smaller groups prune a
shard's read more finely and cost more per-group overhead; at the paper fleet's size a shard
holds thousands of nodes."""
NODE_ORDER = ("cluster", "node", GPU, "ts")

_METADATA = {b"gpufail.dataset": BUCKETS.encode(), b"gpufail.buckets_schema_version": str(SCHEMA_VERSION).encode()}


@contextmanager
def open_aggregates(store: Store) -> Iterator[FeatureManifest]:
    """The manifest of the stored aggregates, holding its journal until the block ends."""
    with open_manifest(store, MANIFEST, (BUCKETS, PRESENCE)) as manifest:
        yield manifest


def aggregates_spec(store: Store) -> FeatureSpec | None:
    """The spec the stored aggregates were built with (None: none built)."""
    return recorded_spec(store, MANIFEST)


def has_aggregates(store: Store) -> bool:
    """Whether the store has stored aggregates (a build completed at least one day)."""
    return store.read_state(MANIFEST) is not None and bool(store.dates(PRESENCE) or store.dates(BUCKETS))


def _narrowed(buckets: pl.DataFrame) -> pl.DataFrame:
    """The buckets as stored: a gauge's extremes and last reading are samples, so they are
    stored in the sample's own type (Float32 for gpufail's gauges), which loses nothing and
    halves them; means and variances are computed, and stay Float64."""
    float32 = {m.column for m in metric_catalogue() if m.kind == "gauge" and m.arrow_type == pa.float32()}
    schema = buckets.schema  # built anew on every access: once, not per column
    return buckets.with_columns(
        pl.col(c).cast(pl.Float32)
        for c, dtype in schema.items()
        if dtype == pl.Float64 and c.rsplit("_", 2)[0] in float32 and c.rsplit("_", 2)[1] in _SAMPLED
    )


_SAMPLED = ("max", "min", "last")


def write_day(staging: Staging, day: datetime, buckets: pl.DataFrame, presence: pl.DataFrame) -> list[str]:
    """One day's files (hidden until the manifest commits them): its buckets, in node order
    (`NODE_ORDER`) and row groups of `BUCKET_ROW_GROUP_ROWS`, and its presence. Takes the columns
    of `buckets` (it is left empty): they are narrowed (`_narrowed`) and put in order a few at a
    time, so that the day is not held three times over (as built, sorted and narrowed) beside the
    next day being aggregated."""
    stored = buckets
    if buckets.height:
        stored = sorted_column_by_column(buckets, [c for c in NODE_ORDER if c in buckets.columns], each=_narrowed)
    written = []
    for dataset, frame in ((BUCKETS, stored), (PRESENCE, presence)):
        if frame.height:
            whole = frame.to_arrow(compat_level=pl.CompatLevel.oldest())
            whole = whole.replace_schema_metadata({**(whole.schema.metadata or {}), **_METADATA})
            step = BUCKET_ROW_GROUP_ROWS if dataset == BUCKETS else whole.num_rows
            # Each table of the sequence starts a row group of the file (`Store.write_owned`).
            table = [whole.slice(i, step) for i in range(0, whole.num_rows, step)]
            schema = frame.schema
            floats = [c for c, dtype in schema.items() if dtype in (pl.Float32, pl.Float64)]
            written.append(
                staging.write_owned(
                    dataset,
                    day.date(),
                    table,
                    # Statistics only where a reader filters: time, GPU, place. Floats' bytes split
                    # by significance, then zstd: 38% smaller than the store's default (snappy,
                    # dictionaries), for a file read many times and written once.
                    write_statistics=[c for c in ("ts", GPU, "cluster", "node") if c in frame.columns],
                    compression="zstd",
                    use_dictionary=[c for c, dtype in schema.items() if dtype == pl.String],
                    use_byte_stream_split=floats,
                )
            )
    return written


def read_buckets(
    store: Store,
    after: datetime,
    before: datetime,
    *,
    columns: Sequence[str] | None = None,
    where: pl.Expr | None = None,
) -> pl.DataFrame:
    """Stored buckets with after < ts < before (and `where`), `columns` only (all when None).

    Columns keep their stored types: a gauge's extremes and last reading are Float32
    (`_narrowed`), and the window kernels that read them (`features.rolling`) take them to
    Float64 themselves, exactly. Cast here, every float of a read (a week of the fleet for the
    newest hour) was copied at twice the bytes, then gathered onto the grid at twice the bytes:
    serving readiness on the paper fleet took 1-2 s longer and peaked 0.5 GB higher."""
    start = utc(after) + timedelta(microseconds=1)
    frame = store.scan(BUCKETS, start, utc(before), where=where, schema={GPU: pl.String(), "ts": TS_DTYPE})
    if columns is not None:
        frame = frame.select(list(columns))
    return store.collect(frame, BUCKETS, start, utc(before)).rechunk()


def read_presence(store: Store) -> pl.DataFrame:
    """GPU presence over all the stored days (`labels.combine_presence` of each day's)."""
    if not store.dates(PRESENCE):
        return combine_presence([])
    return combine_presence([store.collect(store.scan(PRESENCE), PRESENCE)])


@dataclass
class AggregatesSummary(FeatureBuildSummary):
    """What a build of the stored aggregates did: `buckets` written, and the feature rows of the
    days built as a reader gets them (`rows`, `positives`, `censored`, their label sources)."""

    buckets: int = 0

    def _headline(self, rate: float) -> str:
        return (
            f"features: {self.rows:,} rows for {self.gpus:,} GPUs ({self.positives:,} positive, {self.censored:,} "
            f"censored), computed when read from {self.buckets:,} GPU-hour aggregates built from "
            f"{self.telemetry_rows_read:,} telemetry rows in {self.seconds:.1f} s ({rate:,.0f} rows/s); "
            f"{len(self.files_written)} files written, {self.files_replaced} replaced"
            + (f"; {self.days_kept} days already built kept" if self.days_kept else "")
            + (f"; {self.leftovers_removed} files of an interrupted build removed" if self.leftovers_removed else "")
        )


def _telemetry_span(store: Store) -> tuple[list[datetime], datetime] | None:
    """The days with telemetry and the data end (the last sample), read from the last day only."""
    days = [day_start(datetime(d.year, d.month, d.day)) for d in store.dates("telemetry")]
    if not days:
        return None
    last = days[-1]
    data_end = store.collect(
        store.scan("telemetry", last, last + ONE_DAY, columns=["ts"]).select(pl.col("ts").max()), "telemetry"
    ).item()
    return days, utc(data_end)


def _same_buckets(built: FeatureSpec, wanted: FeatureSpec) -> bool:
    """Whether aggregates built with `built` are those `wanted` would build."""
    return (built.grid, built.max_silence) == (wanted.grid, wanted.max_silence)


def build_aggregates(
    store: Store,
    spec: FeatureSpec | None = None,
    *,
    start: datetime | None = None,
    end: datetime | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> AggregatesSummary:
    """Aggregate the store's telemetry to the stored buckets (and presence) for the whole UTC days
    of [start, end) (default: all telemetry), with the grid and silence of `spec` (default: the
    default spec), which the dataset records: a spec of the same grid and silence is recorded
    over the one there without building anything again (the buckets are the same; the features
    computed from them follow the spec), another one needs `overwrite`. Days already built are kept, as the features
    build keeps its days (`features.manifest`): complete days stay unless `overwrite`, a day
    built before its telemetry ended is built again once the data has moved on, and a build with
    nothing to do is a `FeaturesExistError`. Each day is committed on its own, so a killed build
    loses at most the day it was writing.

    Each run of consecutive days is read from `max_silence` and one grid step before it, so that
    its first buckets' counter increases and sample spacings have the sample before them."""

    began = time.perf_counter()
    spec = spec or FeatureSpec()
    summary = AggregatesSummary()
    with open_aggregates(store) as manifest:
        planned = plan_aggregates(store, manifest, spec, summary, start=start, end=end, overwrite=overwrite)
        if planned is None:
            return summary.timed(began)
        have = set(planned.days_with_data)
        for run_start, run_end in planned.plan.runs:
            first_read = max(day_start(run_start - spec.grid - spec.max_silence), planned.days_with_data[0])
            days = [d for d in days_in(first_read, run_end) if d in have or d >= run_start]
            _build_run(store, manifest, planned.plan, spec, days, have, run_start, planned.data_end, summary, progress)
        gpus = count_built_rows(store, spec, planned.plan.runs, summary)
    return summary.timed(began, gpus)


@dataclass(frozen=True)
class AggregatesPlan:
    """What a build of the stored aggregates does (`plan_aggregates`)."""

    plan: BuildPlan
    days_with_data: list[datetime]
    """The midnights of the days that have telemetry."""
    data_end: datetime


def plan_aggregates(
    store: Store,
    manifest: FeatureManifest,
    spec: FeatureSpec,
    summary: AggregatesSummary,
    *,
    start: datetime | None,
    end: datetime | None,
    overwrite: bool,
) -> AggregatesPlan | None:
    """The plan of a build of the whole UTC days of [start, end) (`build_aggregates`, or its Dask
    runner `features.distributed.build_aggregates_distributed`); None when there is no telemetry
    there. A spec of the same grid and silence as the recorded one is recorded first."""
    span = _telemetry_span(store)
    if span is None:
        return None
    days_with_data, data_end = span
    summary.data_end = data_end
    emit_start = day_start(max(utc(start), days_with_data[0]) if start is not None else days_with_data[0])
    last = min(utc(end) - timedelta(microseconds=1), data_end) if end is not None else data_end
    emit_end = day_start(last) + ONE_DAY
    if emit_start >= emit_end:
        return None
    summary.start, summary.end = emit_start, emit_end
    if manifest.spec is not None and manifest.spec != spec and _same_buckets(manifest.spec, spec):
        # The buckets depend on the grid and the silence alone: features of the new settings
        # are computed from the same files, so the days stay and the spec is recorded.
        manifest.record_spec(spec)
    plan = plan_build(
        manifest, spec, summary, emit_start, emit_end, data_end=data_end, overwrite=overwrite, settle=timedelta(0)
    )
    return AggregatesPlan(plan, days_with_data, data_end)


def _build_run(
    store: Store,
    manifest: FeatureManifest,
    plan: BuildPlan,
    spec: FeatureSpec,
    days: list[datetime],
    have: set[datetime],
    run_start: datetime,
    data_end: datetime,
    summary: AggregatesSummary,
    progress: bool,
) -> None:
    """One run of consecutive days to build: telemetry read from `days[0]` (the days in `have`
    have some), buckets written from `run_start` on, each day committed on its own, in order."""
    from tqdm.auto import tqdm

    def commit(day: datetime, buckets: pl.DataFrame, presence: pl.DataFrame) -> None:
        staging = manifest.staging()
        built = buckets.height  # write_day takes the frame's columns
        written = write_day(staging, day, buckets, presence)
        replaced = plan.replaced.get(day.date(), [])
        manifest.complete([day.date()], written, data_end, replaced=replaced)
        summary.buckets += built
        summary.files_written += [staging.visible(p) for p in written]
        summary.files_replaced += len(replaced)

    stream = BucketStream(spec.grid, spec.max_silence)
    # Three stages overlap: the next day's telemetry is read on one thread and the day before's
    # files encoded and committed on another (Parquet reading and writing run outside the GIL)
    # while this one aggregates a day. The next day is read while the day's last shard is
    # aggregated (`BucketStream.day`'s `before_last`), after the day before is written: read
    # from the day's start, both were held at once beside the day. Days are committed in order,
    # one at a time, so a killed build still loses at most the day being written. (Aggregating
    # on a third thread as well was faster, but held a third day of telemetry in memory.)
    with (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="aggregates-read") as reader,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="aggregates-write") as writer,
    ):
        reads: dict[datetime, Future[pl.DataFrame]] = {}

        def read(day: datetime | None) -> None:
            if day is not None and day in have and day not in reads:
                reads[day] = reader.submit(read_telemetry, store, day, day + ONE_DAY, one_piece=False)

        read(days[0] if days else None)
        writing: Future[None] | None = None
        for i, day in enumerate(tqdm(days, desc="features: aggregates", unit="day", disable=not progress)):
            read_following = partial(read, days[i + 1] if i + 1 < len(days) else None)
            # The day's GPU presence, from its rows a shard at a time (`BucketStream.day` takes
            # the day's rows and lets go of each shard's once aggregated; a GPU is in one shard).
            presences: list[pl.DataFrame] = []
            raw: pl.DataFrame | None = None
            if day in have:
                raw = reads.pop(day).result()
            elif stream.held is not None:
                # No telemetry that day: the bucket held back from the day before is complete now.
                raw = stream.held.clear()
            if raw is None:
                buckets = pl.DataFrame()
                read_following()
            else:
                each_shard = partial(_add_presence, presences)
                buckets = stream.day(raw, day + ONE_DAY, before_last=read_following, each_shard=each_shard)
            del raw
            if day < run_start:
                continue  # read for the samples before the run's first bucket only
            presence = pl.concat(presences, how="vertical").sort(GPU, "first_ts") if presences else pl.DataFrame()
            summary.telemetry_rows_read += int(sum(p["n_samples"].sum() for p in presences))
            if writing is not None:
                writing.result()  # the day before is committed (or its error raised) first
            writing = writer.submit(commit, day, buckets, presence)
        if writing is not None:
            writing.result()


def _add_presence(presences: list[pl.DataFrame], rows: pl.DataFrame) -> None:
    presences.append(gpu_presence(rows))


def count_built_rows(
    store: Store, spec: FeatureSpec, runs: list[tuple[datetime, datetime]], summary: AggregatesSummary
) -> set[str]:
    """The feature rows of the days built, as readers get them, counted in `summary` with their
    label sources and the warnings about sources that gave none; returns their GPUs. Labels
    alone: a few bucket columns, no feature."""
    from features.on_demand import iter_features_on_demand, missing_days, stored_fleet_facts

    missing = missing_days(store)
    if missing:
        summary.warnings.append(
            f"{len(missing)} days of telemetry ({missing[0]}..{missing[-1]}) have no aggregates: no feature row "
            "can be read until they are built (gpufail features without --start/--end)"
        )
        return set()
    facts = stored_fleet_facts(store, spec)
    if facts is None:
        return set()
    written = Written()
    for run_start, run_end in runs:
        # Part by part: the labels of a whole history (a paper fleet's 87M rows) at once would
        # take more memory than the build itself.
        for part in iter_features_on_demand(store, run_start, run_end, spec=spec, labels_only=True, ids=False):
            written.add(part, facts.episodes)
    gpus: set[str] = set()
    written.add_to(summary, gpus)
    summary.warnings += silent_sources(facts, summary)
    return gpus
