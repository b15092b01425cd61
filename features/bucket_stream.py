"""Raw telemetry, one UTC day at a time, turned into complete grid buckets (`BucketStream`): how
the features build (`features.runner`) and the stored aggregates (`features.aggregates`) read
telemetry, so that both aggregate it exactly alike."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

import polars as pl

from features.labels import GPU
from features.schema import TS_DTYPE
from features.windows import RUN, grid_floor, hourly_aggregate, sorted_by_gpu_and_time


class BucketStream:
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
        return self.take(raw, day_end)()

    def take(self, raw: pl.DataFrame, day_end: datetime) -> Callable[[], pl.DataFrame]:
        """Take in the raw rows of the day ending at `day_end` (exclusive): the rows held back
        and each GPU's last sample move on to the next day now, and the aggregation of the
        buckets these rows complete is returned, to be run later on any thread, so that the
        next day can be taken in while it runs."""
        cut = grid_floor(day_end - timedelta(microseconds=1), self.grid)
        frames = [f for f in (self.held, raw) if f is not None and f.height]
        # Not rechunked here: the day's rows come in one piece (`inputs.read_telemetry`), and the
        # concatenation with the context below makes one piece of everything once.
        pending = pl.concat(frames, how="vertical_relaxed") if len(frames) > 1 else (frames[0] if frames else raw)
        is_now = pending.select(pl.col("ts") <= pl.lit(cut, dtype=TS_DTYPE)).to_series()
        self.held = pending.filter(~is_now)
        grid, max_gap = self.grid, self.max_gap
        if not is_now.any():
            empty = pending.clear()
            return lambda: hourly_aggregate(empty, grid, max_gap=max_gap)
        if self.context is None and len(frames) == 1:
            merged = pending.filter(is_now)  # one file's rows: usually in (gpu, ts) order already
        else:
            # The context, the held rows and the day's rows, each in time order per GPU and each
            # later than the one before, so a stable sort on the GPU alone puts them in (gpu, ts)
            # order: one narrow key sorted and one gather of the wide frame (sorting the
            # 36-column frame on (gpu, ts) took 40% of aggregating a day).
            if self.context is not None:
                pending = pl.concat(
                    [self.context.select(pending.columns), pending], how="vertical_relaxed", rechunk=True
                )
                is_now = pl.concat([pl.repeat(True, self.context.height, eager=True), is_now])
            order = (
                pl.DataFrame({"_h": pending[GPU].hash(), "_now": is_now})
                .with_row_index("_i")
                .filter("_now")
                .sort("_h", maintain_order=True)["_i"]
            )
            merged = pending[order]
        # In (gpu, ts) order from here on (a file out of order, or a hash collision, is sorted),
        # so each GPU's latest sample is its last row.
        merged = sorted_by_gpu_and_time(merged).drop(RUN)
        after = self.cut  # the context's buckets, complete the day before, are left out
        latest = merged.filter(pl.col(GPU).is_last_distinct())
        self.context = latest.filter(pl.col("ts") > pl.lit(cut - max_gap, dtype=TS_DTYPE))
        self.cut = cut

        def aggregate() -> pl.DataFrame:
            buckets = hourly_aggregate(merged, grid, max_gap=max_gap)
            return buckets if after is None else buckets.filter(pl.col("ts") > pl.lit(after, dtype=TS_DTYPE))

        return aggregate
