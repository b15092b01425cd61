"""The local runner of a feature build over a store (`build_features_from_store`): the plan of
`features.plan`, carried out in time blocks of days, each built in shards of whole nodes on
threads of this process, bounded in memory. `features.distributed` runs the same plan on Dask.

It reads telemetry one day partition at a time with enough lookback that every emitted row
equals what an all-history build would give, turns it into grid buckets (`BucketStream`),
builds each shard of a block with the pure build (`features.build.iter_features_from_buckets`)
and writes the `features` dataset (`features.dataset.write_features`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime

import polars as pl

from features.bucket_stream import BucketStream
from features.build import iter_features_from_buckets
from features.dataset import write_features
from features.fail_slow import model_clocks
from features.inputs import read_telemetry, scan_presence
from features.labels import GPU
from features.manifest import FeatureManifest, holding_manifest
from features.peers import model_medians
from features.plan import (
    ONE_DAY,
    FeatureBuildSummary,
    Written,
    day_start,
    days_in,
    finish_days,
    lookback,
    plan_store_build,
    silent_sources,
)
from features.schema import TS_DTYPE
from features.shards import SHARD, ShardedBuckets, shard_map
from features.spec import FeatureSpec
from ingest.journal import Staging
from ingest.store import Store


class _Stopped(Exception):
    """A block's build was told to stop because the build failed elsewhere."""


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


@holding_manifest
def build_features_from_store(
    store: Store,
    manifest: FeatureManifest,
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
    `start` on, aggregates it to grid buckets once (`BucketStream`), and computes the fleet
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
    asked for. A block's files stay hidden until its commit, which also removes the old files of
    the days it rebuilt. The dataset records the spec it was built with (`features.manifest`);
    a build with another spec is refused unless it rebuilds every day
    (`FeatureManifest.use_spec`).
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
    presence, day_rows = scan_presence(store)
    build = plan_store_build(store, manifest, spec, presence, summary, start=start, end=end, overwrite=overwrite)
    if build is None:
        return summary.timed(began)
    facts, plan = build.facts, build.plan
    xid, data_end = facts.xid, facts.data_end
    back = lookback(spec)
    # A shard carries a block and its trailing window (plus the day a window's start falls in).
    carried_days = block_days + -(-back // ONE_DAY) + 1
    per_day = ONE_DAY // grid
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

    def shard_xid(hourly: pl.DataFrame) -> pl.DataFrame:
        return xid if buckets.count == 1 else xid.join(hourly.select(GPU).unique(), on=GPU, how="semi")

    def shard_clocks(shard: int, block_start: datetime, block_end: datetime) -> pl.DataFrame | None:
        """What the fail-slow model peers' medians of a block are taken over, of one shard."""
        hourly = buckets.take(shard, block_start - back, block_end)
        if hourly is None:
            return None
        clocks = iter_features_from_buckets(
            hourly,
            shard_xid(hourly),
            spec,
            **facts.build_inputs(),
            emit_start=block_start,
            emit_end=block_end,
            rows_per_part=rows_per_part,
            fail_slow_clocks_only=True,
        )
        return next(clocks)

    def build_shard(
        shard: int,
        block_start: datetime,
        block_end: datetime,
        fleet: pl.DataFrame | None,
        slow: pl.DataFrame | None,
        staging: Staging,
    ) -> Written:
        """One shard's rows of a block, written in flushes of about `flush_rows` (hidden until
        the block's commit)."""
        result = Written()
        hourly = buckets.take(shard, block_start - back, block_end)
        if hourly is None:
            return result
        parts = iter_features_from_buckets(
            hourly,
            shard_xid(hourly),
            spec,
            **facts.build_inputs(),
            emit_start=block_start,
            emit_end=block_end,
            rows_per_chunk=options.rows_per_chunk,
            rows_per_part=rows_per_part,
            model_medians=fleet,
            fail_slow_medians=slow,
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
                writing = writer.submit(write_features, staging, frame)
                if not options.write_ahead:
                    wait_for_write()

            for frame in parts:
                if stop.is_set():
                    raise _Stopped
                if frame.height == 0:
                    continue
                result.add(frame, facts.episodes)
                pending.append(frame)
                if sum(f.height for f in pending) >= flush_rows:
                    flush()
            if pending:
                flush()
            wait_for_write()
        return result

    def emit(block_start: datetime, block_end: datetime, fleet: pl.DataFrame | None) -> None:
        summary.blocks += 1
        label = f"block {block_start.date()}..{(block_end - ONE_DAY).date()}"
        done = 0
        bar.set_postfix_str(f"{label}, shards 0/{buckets.count}")
        staging = manifest.staging()
        with ThreadPoolExecutor(max_workers=max(1, min(workers, buckets.count))) as pool:
            slow = None
            if buckets.count > 1 and spec.fail_slow_label is not None:
                # The fail-slow model peers are the fleet's: every shard's first (a shard's own
                # are its GPUs of the model, as in a build of one shard).
                found = pool.map(lambda shard: shard_clocks(shard, block_start, block_end), range(buckets.count))
                slow = model_clocks([c for c in found if c is not None])
            futures = [
                pool.submit(build_shard, shard, block_start, block_end, fleet, slow, staging)
                for shard in range(buckets.count)
            ]
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
        # Every shard wrote its files: the block's days are complete, and the files they replace
        # go, in one commit.
        finish_days(manifest, plan, [d.date() for d in days_in(block_start, block_end)], written, data_end, summary)

    # A block is built on a thread of its own while this one reads and aggregates the next
    # block's days (`read_ahead`): reading was a quarter of the build, with the other core
    # mostly idle (30-day paper store: 311 s at 8.6 GB without, 276 s at 11.5 GB with). One
    # block is built at a time (its shards hold the memory budget), so the reading waits for
    # the block before to finish before it hands over the next. Each run of consecutive days to
    # build is read from its own lookback on, as a build of just those days: the same rows.
    for emit_start, emit_end in plan.runs:
        first_read = max(day_start(emit_start - back), day_start(facts.first_data))
        days = days_in(first_read, emit_end)
        days = [d for d in days if d.date() in day_rows or d >= emit_start]
        # Blocks of at most `block_days`, as even as possible: a short last block would pay for a
        # whole lookback to emit a day or two.
        emit_days = (emit_end - emit_start) // ONE_DAY
        n_blocks = -(-emit_days // block_days)
        block_ends = {emit_start + (emit_days * (i + 1) // n_blocks) * ONE_DAY for i in range(n_blocks)}

        buckets = ShardedBuckets(shards, scratch=options.scratch)
        summary.shards = buckets.count
        stream = BucketStream(grid, max_silence)
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
                    raw = read_telemetry(store, day, day + ONE_DAY)
                else:
                    # No telemetry that day: the last bucket held back from the day before is still
                    # complete now, and the block ending today needs it.
                    raw = None if stream.held is None else stream.held.clear()
                if raw is not None:
                    summary.telemetry_rows_read += raw.height
                    day_buckets = stream.day(raw, day + ONE_DAY)
                    del raw
                    if day_buckets.height:
                        medians.append(model_medians(day_buckets, grid))
                        buckets.add(day.date(), day_buckets)
                if day + ONE_DAY in block_ends:
                    block_end = day + ONE_DAY
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
                    buckets.forget(block_start - back)
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
    summary.warnings += silent_sources(facts, summary)
    return summary.timed(began, gpus)
