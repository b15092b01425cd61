"""Raw telemetry, one UTC day at a time, turned into complete grid buckets (`BucketStream`): how
the features build (`features.runner`) and the stored aggregates (`features.aggregates`) read
telemetry, so that both aggregate it exactly alike."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

import polars as pl

from features.labels import GPU
from features.runs import gpu_slices
from features.schema import TS_DTYPE
from features.windows import RUN, grid_floor, hourly_aggregate, in_gpu_and_time_order, sorted_by_gpu_and_time

SHARD_ROWS = 1_000_000
"""Rows of whole GPUs aggregated at once: a paper fleet's day (2.8M rows, 0.85 GB) is taken in
shards, so that the copies made to put its rows in order are a shard's, not the day's."""


class BucketStream:
    """Raw telemetry, one UTC day at a time, turned into complete grid buckets.

    The bucket labelled b holds the samples in (b - grid, b], so a day file's last partial
    bucket also needs the next file's first instant: rows after the day's last complete bucket
    are held back for the next day. The last sample of each GPU is carried too, as the baseline
    of its counter increases and sample spacing (so a counter increase across midnight is
    counted exactly as in an all-history build)."""

    def __init__(self, grid: timedelta, max_gap: timedelta, *, shard_rows: int | None = None) -> None:
        self.grid, self.max_gap = grid, max_gap
        self.shard_rows = SHARD_ROWS if shard_rows is None else shard_rows
        self.held: pl.DataFrame | None = None  # raw rows after the last complete bucket
        self.context: pl.DataFrame | None = None  # the last aggregated sample per GPU
        self.cut: datetime | None = None

    def day(
        self,
        raw: pl.DataFrame,
        day_end: datetime,
        *,
        before_last: Callable[[], None] | None = None,
        each_shard: Callable[[pl.DataFrame], None] | None = None,
    ) -> pl.DataFrame:
        """Buckets completed by the raw rows of the day ending at `day_end` (exclusive), in
        shards of whole GPUs of about `shard_rows` rows. Each shard's rows are put after the
        samples carried from the day before (its GPUs' held rows and last sample), aggregated,
        and the buckets up to the day's last complete one kept: the bucket that the rows after
        it begin is aggregated again, whole, with the next day.

        Takes the columns of `raw` (it is left empty), and lets go of each shard's rows once it
        is aggregated: a paper fleet's day is 0.85-1 GB, held to the end of the day beside its
        buckets, the next day being read and the day before being written. `each_shard` is given
        each shard's rows first (every row of the day once, whole GPUs at a time: the store build
        takes the day's GPU presence from them). `before_last` is called once, before the day's
        last shard is aggregated (at the end when there is none): the store build starts reading
        the next day then, so that its rows are not held beside the whole of this day's
        aggregation."""
        rows = pl.DataFrame([raw.drop_in_place(n) for n in list(raw.columns)])
        cut = grid_floor(day_end - timedelta(microseconds=1), self.grid)
        carried = [f for f in (self.context, self.held) if f is not None and f.height]
        before = pl.concat([f.select(rows.columns) for f in carried], how="vertical_relaxed") if carried else None
        # Usually only a check: a day file holds its rows GPU by GPU. (Adding the run id and
        # dropping it again copied the day's rows into one piece: a paper day's 0.85 GB.)
        if not in_gpu_and_time_order(rows):
            rows = sorted_by_gpu_and_time(rows).drop(RUN)
        shards = gpu_slices(rows[GPU], self.shard_rows) if rows.height else []
        silent = None if before is None else before.join(rows.select(GPU).unique(), on=GPU, how="anti")
        # The shards share the day's pieces (one per row group read): a piece is let go once the
        # shards that have rows in it are.
        parts = [rows.slice(offset, length) for offset, length in shards]
        empty = rows.clear()
        del rows
        later = pl.col("ts") > pl.lit(cut, dtype=TS_DTYPE)
        # Each GPU's last sample up to the cut: rows are in time order within a GPU.
        last_kept = ~later & ((pl.col(GPU) != pl.col(GPU).shift(-1)) | later.shift(-1)).fill_null(True)
        buckets, latest, held = [], [], []

        def next_shard() -> pl.DataFrame:
            part = parts.pop(0)
            if each_shard is not None:
                each_shard(part)
            held.append(part.filter(later))
            return _after_carried(part, before)

        def aggregate(merged: pl.DataFrame) -> None:
            # In (gpu, ts) order from here on (the GPUs silent today come from two carried
            # frames; a file out of order is sorted), with the run id `hourly_aggregate` uses.
            merged = sorted_by_gpu_and_time(merged)
            # The buckets after the day's last complete one, and those of the day before, out:
            # one filter, one copy of the shard's buckets.
            kept = ~later if self.cut is None else ~later & (pl.col("ts") > pl.lit(self.cut, dtype=TS_DTYPE))
            buckets.append(hourly_aggregate(merged, self.grid, max_gap=self.max_gap).filter(kept))
            latest.append(merged.filter(last_kept).drop(RUN))

        # A shard at a time, then the GPUs silent this day (their held rows still complete their
        # first bucket): each shard's rows are copied into one piece, so only one shard's copies
        # are alive at once.
        pieces: list[Callable[[], pl.DataFrame]] = [next_shard] * len(parts)
        if silent is not None and silent.height:
            pieces.append(lambda: silent)
        for i, piece in enumerate(pieces):
            if before_last is not None and i == len(pieces) - 1:
                before_last()
            aggregate(piece())
        if before_last is not None and not pieces:
            before_last()
        self.held = pl.concat(held, how="vertical") if held else empty
        recent = pl.col("ts") > pl.lit(cut - self.max_gap, dtype=TS_DTYPE)
        self.context = pl.concat(latest, how="vertical_relaxed").filter(recent) if latest else None
        self.cut = cut
        if not buckets:
            return hourly_aggregate(empty, self.grid, max_gap=self.max_gap)
        return pl.concat(buckets, how="vertical_relaxed") if len(buckets) > 1 else buckets[0]


def _after_carried(part: pl.DataFrame, before: pl.DataFrame | None) -> pl.DataFrame:
    """A shard's rows (whole GPUs) after the samples carried from the day before for their GPUs
    (`before`), in one piece, GPU by GPU."""
    ahead = None if before is None else before.join(part.select(GPU).unique(), on=GPU, how="semi")
    if ahead is None or ahead.height == 0:
        return part.rechunk()
    # The carried samples come before the part's rows in time, GPU by GPU, so a stable sort on
    # the GPU alone puts them in (gpu, ts) order: a sort and a gather (sorting the rows on
    # (gpu, ts) took 40% of aggregating a day).
    merged = pl.concat([ahead, part], how="vertical_relaxed", rechunk=True)
    return merged[merged.select(pl.arg_sort_by(pl.col(GPU).hash(), maintain_order=True)).to_series()]
