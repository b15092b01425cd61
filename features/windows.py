"""Resampling to the time grid and trailing-window features: pure functions of polars frames.

Time (docs/features.md). Scoring happens at grid times t (multiples of `grid` since the
Unix epoch, UTC). The bucket labelled t holds the samples with `t - grid < ts <= t`: a sample
exactly at t belongs to t, one at t + 1 us to t + grid. A window W at t is the `W / grid` buckets
ending at t, i.e. the data in `(t - W, t]`. Nothing at t ever reads a timestamp after t, which is
what `tests/features/test_leakage.py` checks.

Pipeline (features are needed only at grid times, so aggregate raw samples to the grid first,
then compute windows over buckets: ~60x fewer rows at one sample a minute):

1. `hourly_aggregate` - raw samples -> one row per (gpu_uuid, bucket) with mergeable bucket
   statistics (count, mean, variance, max, min, last, counter increase, ...).
2. `dense_grid` - every grid time from a GPU's first bucket until its telemetry has been silent
   for `max_silence` (or the data ends), so trailing windows are fixed numbers of rows and
   silence shows up as empty buckets.
3. `window_features` (here), `features.xids.xid_features`, `features.peers.peer_features`.

Choices, so that a reader need not reverse-engineer them:

- Gauges: NaN readings are missing readings, like nulls. Per window mean, max, min and
  standard deviation over the *samples* in the window (exact, combined from per-bucket count,
  mean and variance), and `slope`: the least-squares slope of the bucket means on time, in the
  metric's unit per hour (windows longer than the grid; null with fewer than two buckets).
  `<m>_last`: the latest reading at or before t.
- Counters: increase over the window, robust to resets: each sample adds `value - previous` when
  the value did not drop, and `value` when it did (a volatile counter restarts from 0 after a
  driver reload, so the new value is what accrued since). The increase across a telemetry gap
  longer than `max_gap` is not counted (the baseline restarts): this keeps every feature a
  function of at most `max(windows) + max_gap` of history. `<m>_rate_<w>`: the increase per
  hour the GPU was in service within the window (its age when younger than the window).
  `<counter>_last`, the latest reading (for lifetime counters such as
  `ecc_dbe_aggregate_total` the level itself is the signal).
- "Last" readings look back at most the longest window (a reading older than that is no
  longer "last"), so that a build that carries only that much history gives the same values.
- Flags: the window maximum (was the flag ever raised in the window).
- Bitmasks: the fraction of samples in the window with any bit of a named group set
  (`BITMASK_GROUPS`).
- Telemetry health: `telemetry_missing_frac_<w>` = 1 - samples / (min(W, GPU age) / expected
  interval), clipped to [0, 1], where the expected interval is the median over the longest
  window of the per-bucket mean spacing between consecutive samples (causal: only spacings up
  to t); 1 when the window has no sample. `telemetry_since_last_h`: hours from the last sample
  at or before t to t. A GPU younger than a window is not counted as missing its samples.
- Static: `gpu_age_h`, hours since the GPU (uuid) was first seen; `gpu_model`, `driver`,
  `node` and `gpu_index` (the slot) are identity columns of the frame.
- XID history and peers have their own modules: `features.xids`, `features.peers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Literal

import numpy as np
import polars as pl

from features import rolling, runs
from features.schema import TS_DTYPE, window_label
from features.spec import DEFAULT_GRID, DEFAULT_MAX_SILENCE, DEFAULT_WINDOWS
from ingest.schema import metric_catalogue

GPU = "gpu_uuid"
HOUR_US = 3_600_000_000
# polars 2 runs lazy queries on the streaming engine by default; for these in-memory frames the
# in-memory engine was ~2x faster (benchmarks.feature_build, 1M rows).
ENGINE: Literal["in-memory"] = "in-memory"

# Identity columns carried per bucket (the latest value in the bucket).
BUCKET_ID_COLUMNS = ("cluster", "node", "gpu_index", "pci_bus_id", "gpu_model", "driver")

# NVML clock-event (throttle) reason bits (nvml.h, nvmlClocksEventReason*). The hardware and
# thermal groups mean the board itself held its clocks down, which is what precedes failures;
# the software power cap is routine under heavy load but worth separating from it.
BITMASK_GROUPS: dict[str, dict[str, int]] = {
    "clock_event_reasons": {
        "hw_slowdown": 0x8 | 0x20 | 0x40 | 0x80,  # HwSlowdown | SwThermal | HwThermal | HwPowerBrake
        "sw_power_cap": 0x4,
    },
}


# -- helpers -------------------------------------------------------------------------------------


def _us(delta: timedelta) -> int:
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def check_grid(grid: timedelta, windows: Sequence[timedelta]) -> list[int]:
    """Window lengths in buckets; every window must be a positive multiple of the grid."""
    g = _us(grid)
    if g <= 0:
        raise ValueError(f"grid must be positive, got {grid!r}")
    if not windows:
        raise ValueError("expected at least one window, got none")
    sizes = []
    for w in windows:
        if _us(w) <= 0 or _us(w) % g:
            raise ValueError(f"window {w!r} must be a positive multiple of the grid {grid!r}")
        sizes.append(_us(w) // g)
    if len({window_label(w) for w in windows}) != len(windows):
        raise ValueError(f"windows must be distinct, got {[window_label(w) for w in windows]}")
    return sizes


def grid_time(ts: pl.Expr, grid: timedelta) -> pl.Expr:
    """The grid time labelling the bucket that holds `ts`: the smallest multiple of `grid` that
    is >= ts (so bucket (t - grid, t] is labelled t)."""
    g = _us(grid)
    return (((ts.dt.epoch("us") - 1) // g + 1) * g).cast(TS_DTYPE)


def grid_steps(ts: pl.Series, grid: timedelta) -> np.ndarray:
    """Grid times as whole grid steps since the epoch (int64): what aligns the window sums'
    blocks (`features.rolling.KeptRows`) to time rather than to a frame's first row."""
    return (ts.dt.epoch("us") // _us(grid)).to_numpy()


def grid_floor(moment: datetime, grid: timedelta) -> datetime:
    """The last grid time at or before `moment` (a timezone-aware datetime)."""
    epoch_us = int(pl.Series([moment]).cast(TS_DTYPE).dt.epoch("us")[0])
    g = _us(grid)
    return pl.Series([(epoch_us // g) * g]).cast(TS_DTYPE)[0]


def bitmask_groups(column: str) -> dict[str, int]:
    """The named bit groups of a bitmask metric: NVML's for its own; for one of the user's
    (`[metrics.<name>]`, whose bits gpufail cannot name) one group, `any`: any bit set."""
    return BITMASK_GROUPS.get(column, {"any": -1})


def present_metrics(columns: Sequence[str]) -> dict[str, list[str]]:
    """Catalogue metric columns present in a frame, by kind, in catalogue order. Features are
    built for the metrics a frame has, so a frame from a collector that lacks a metric (or a test
    frame) still works; a store frame has them all."""
    have = set(columns)
    kinds: dict[str, list[str]] = {"gauge": [], "counter": [], "flag": [], "bitmask": []}
    for m in metric_catalogue():
        if m.column in have:
            kinds[m.kind].append(m.column)
    return kinds


# The bucket column that tells `window_features` a metric of each kind was aggregated.
_MARKER = {"gauge": "count", "counter": "last", "flag": "max", "bitmask": "count"}


def aggregated_metrics(columns: Sequence[str], grid: timedelta) -> dict[str, list[str]]:
    """Catalogue metrics present in a frame of bucket aggregates (`hourly_aggregate` output)."""
    have, sfx = set(columns), grid_suffix(grid)
    kinds: dict[str, list[str]] = {"gauge": [], "counter": [], "flag": [], "bitmask": []}
    for m in metric_catalogue():
        if f"{m.column}_{_MARKER[m.kind]}{sfx}" in have:
            kinds[m.kind].append(m.column)
    return kinds


def grid_frame_columns(grid: timedelta) -> list[str]:
    """The bucket columns `window_features` reads from its grid frame (beside gpu_uuid, ts and
    last_sample_ts): the sampling interval's rolling median and the first sample. Every other
    bucket column it reads through `features.rolling.BucketArrays`, from the buckets."""
    return [f"sample_interval_s{grid_suffix(grid)}", "first_sample_ts"]


def grid_suffix(grid: timedelta) -> str:
    return "_" + window_label(grid)


# -- 1. raw samples -> grid buckets -------------------------------------------------------------


RUN = "_run"
"""The per-GPU run id `sorted_by_gpu_and_time` adds (0, 1, ... in row order)."""


def _in_order(run: pl.Expr) -> pl.Expr:
    """Whether the rows are in GPU and time order, given each row's GPU run id `run`."""
    return (run.max() + 1 == pl.col(GPU).n_unique()) & (
        (pl.col("ts").diff() >= timedelta(0)) | (run != run.shift(1))
    ).all()


def in_gpu_and_time_order(df: pl.DataFrame) -> bool:
    """Whether each GPU's rows of `df` are together and in time order (the GPUs in any order).
    Telemetry is usually stored that way (each day file GPU by GPU), and checking is ~20x
    cheaper than sorting 30 columns."""
    return df.height == 0 or bool(df.select(_in_order(pl.col(GPU).rle_id())).item())


def sorted_by_gpu_and_time(df: pl.DataFrame) -> pl.DataFrame:
    """`df` with each GPU's rows together and in time order (the GPUs in any order), with a
    `RUN` id per GPU; sorted only when it is not so already (`in_gpu_and_time_order`)."""
    df = df.with_columns(pl.col(GPU).rle_id().alias(RUN))
    if df.height == 0 or df.select(_in_order(pl.col(RUN))).item():
        return df
    # Sorting on a 64-bit hash of the uuid is ~1.5x faster than on the string; a (practically
    # impossible) collision would interleave two GPUs, which the check sees. (The run id is
    # replaced, not dropped first: dropping a column of a frame read in pieces copies it whole.)
    df = df.sort(pl.col(GPU).hash(), "ts").with_columns(pl.col(GPU).rle_id().alias(RUN))
    if df.select(_in_order(pl.col(RUN))).item():
        return df
    return df.sort([GPU, "ts"]).with_columns(pl.col(GPU).rle_id().alias(RUN))


def hourly_aggregate(
    telemetry: pl.DataFrame | pl.LazyFrame,
    grid: timedelta = DEFAULT_GRID,
    *,
    max_gap: timedelta = DEFAULT_MAX_SILENCE,
) -> pl.DataFrame:
    """One row per (gpu_uuid, grid time `ts`) that has at least one sample in `(ts - grid, ts]`.

    Columns (`<g>` is the grid label, e.g. `1h`): `gpu_uuid`, `ts`, the identity columns
    (latest in the bucket), `n_samples_<g>`, `first_sample_ts`, `last_sample_ts`, `sample_interval_s_<g>` (mean
    spacing to the previous sample of the GPU, spacings longer than `max_gap` ignored; null
    when the bucket has none); per gauge
    `<m>_count_<g>` (non-null samples), `_mean_`, `_max_`, `_min_`, `_last_`, `_var_` (sample
    variance, ddof=1); per counter `<m>_last_<g>` and `<m>_increase_<g>` (reset-robust, see the
    module notes; null when the bucket has no reading); per flag `<m>_max_<g>`; per bitmask group
    `<m>_<group>_n_<g>` (samples with a bit of the group set) and `<m>_count_<g>`.
    Sorted by (gpu_uuid, ts).
    """
    df = telemetry.collect() if isinstance(telemetry, pl.LazyFrame) else telemetry
    names = df.columns
    kinds = present_metrics(names)
    sfx = grid_suffix(grid)
    gap_us = _us(max_gap)

    # A frame with a `RUN` column comes from `sorted_by_gpu_and_time` (the store build's stream
    # puts each shard in order itself, for the last samples it carries to the next day).
    if RUN not in names:
        df = sorted_by_gpu_and_time(df)
    run = pl.col(RUN)
    ts_us = pl.col("ts").dt.epoch("us")
    prev_ok = (run == run.shift(1)) & ((ts_us - ts_us.shift(1)) <= gap_us)
    sample_cols: list[pl.Expr] = [
        # A NaN reading (telemetry imported from elsewhere may have them) is a missing reading:
        # counted as a value it would spoil the bucket and every later window sum of the GPU.
        *(pl.col(g).fill_nan(None) for g in kinds["gauge"]),
        grid_time(pl.col("ts"), grid).alias("_t"),
        pl.when(prev_ok).then((ts_us - ts_us.shift(1)) / 1e6).alias("_dt_s"),
    ]
    for b in kinds["bitmask"]:
        for group, mask in bitmask_groups(b).items():
            sample_cols.append(((pl.col(b) & mask) != 0).cast(pl.Int32).alias(f"_bm_{b}_{group}"))

    df = df.lazy().with_columns(sample_cols).collect(engine=ENGINE)
    # Rows are sorted by (gpu, ts), so each bucket is a contiguous run of rows (`features.runs`).
    buckets = runs.Runs.where_changed(df[RUN], df["_t"])
    out: list[pl.Series] = [runs.first(df[GPU], buckets), runs.first(df["_t"], buckets).alias("ts")]
    out += [runs.last(df[c], buckets) for c in BUCKET_ID_COLUMNS if c in names]
    out += [
        pl.Series(f"n_samples{sfx}", buckets.lengths, dtype=pl.Int32),
        runs.first(df["ts"], buckets).alias("first_sample_ts"),
        runs.last(df["ts"], buckets).alias("last_sample_ts"),
        # Mean spacing; gaps inside one bucket inflate it, and the rolling median over buckets
        # in `window_features` discards those buckets. Null (not NaN) where no spacing is known,
        # so that the median skips it: a NaN there made a young GPU's missing fraction NaN.
        runs.gauge(df["_dt_s"], buckets)["mean"].alias(f"sample_interval_s{sfx}"),
    ]
    for g in kinds["gauge"]:
        stats = runs.gauge(df[g], buckets)
        out += [stats[s].alias(f"{g}_{s}{sfx}") for s in ("count", "mean", "max", "min", "last", "var")]
    ts_all, gpu_all = df["ts"].dt.epoch("us").to_numpy(), df[RUN].to_numpy()
    for c in kinds["counter"]:
        # Null for a bucket without a reading: "no reading" stays apart from "no errors".
        stats = runs.counter(df[c], ts_all, gpu_all, buckets, gap_us)
        out += [stats["last"].alias(f"{c}_last{sfx}"), stats["increase"].alias(f"{c}_increase{sfx}")]
    for f in kinds["flag"]:
        out.append(runs.integers(df[f], buckets)["max"].alias(f"{f}_max{sfx}"))
    for b in kinds["bitmask"]:
        groups = bitmask_groups(b)
        if groups:
            out.append(runs.integers(df[b], buckets)["count"].alias(f"{b}_count{sfx}"))
        for group in groups:
            out.append(
                runs.integers(df[f"_bm_{b}_{group}"], buckets)["total"].cast(pl.Int32).alias(f"{b}_{group}_n{sfx}")
            )
    return pl.DataFrame(out)


# -- 2. dense grid --------------------------------------------------------------------------------


def dense_grid(
    hourly: pl.DataFrame,
    grid: timedelta,
    *,
    data_end: datetime,
    max_silence: timedelta = DEFAULT_MAX_SILENCE,
    starts: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """Every grid time from each GPU's first bucket to `min(last bucket + max_silence,
    data_end)`, left-joined with the bucket aggregates. Identity columns and `last_sample_ts`
    are carried forward into empty buckets (they describe the GPU as last seen). Sorted by
    (gpu_uuid, ts).

    `starts` (gpu_uuid, `_start`) moves a GPU's first grid time back to `_start` when that is
    earlier: a frame that holds only the recent part of the history starts each GPU's grid
    where the frame starts, as an all-history grid has rows there even while the GPU was
    silent (an XID logged in that silence must still count in later windows)."""
    end_cap = grid_floor(data_end, grid)
    silence_steps = _us(max_silence) // _us(grid)
    spans = hourly.lazy().group_by(GPU).agg(pl.col("ts").min().alias("_first"), pl.col("ts").max().alias("_last"))
    if starts is not None:
        spans = spans.join(starts.lazy().select(GPU, "_start"), on=GPU, how="left").with_columns(
            pl.min_horizontal("_first", "_start").alias("_first")
        )
    spans = spans.with_columns(
        pl.min_horizontal(
            pl.col("_last") + pl.duration(microseconds=silence_steps * _us(grid)),
            pl.lit(end_cap, dtype=TS_DTYPE),
        ).alias("_end")
    ).filter(pl.col("_first") <= pl.col("_end"))
    # Spans sorted by GPU, exploded in order: the grid comes out sorted by (gpu_uuid, ts)
    # without sorting the wide frame.
    grid_us = _us(grid)
    spans_sorted = (
        spans.sort(GPU)
        .with_columns(((pl.col("_end") - pl.col("_first")).dt.total_microseconds() // grid_us + 1).alias("_n"))
        .with_columns((pl.col("_n").cum_sum() - pl.col("_n")).alias("_offset"))
        .collect(engine=ENGINE)
    )
    keys = spans_sorted.select(
        GPU, pl.datetime_ranges("_first", "_end", interval=grid, closed="both").alias("ts")
    ).explode("ts")
    source = _grid_sources(hourly, spans_sorted, keys.height, grid_us)
    carried = [c for c in (*BUCKET_ID_COLUMNS, "last_sample_ts") if c in hourly.columns]
    if source is None:  # a (GPU, time) in two buckets: the join gives each its grid row
        joined = keys.lazy().join(hourly.lazy(), on=[GPU, "ts"], how="left", maintain_order="left")
    else:
        # Each bucket's grid row is its GPU's offset plus its steps from the GPU's first grid
        # time: the columns are gathered by it, where a join on (uuid, time) hashed every key of
        # a grid tens of millions of rows long (most of a label pass over a month of a fleet).
        others = hourly.drop(GPU, "ts")
        gathered = [keys] if others.width == 0 else [keys, others.select(pl.all().gather(source))]
        joined = pl.concat(gathered, how="horizontal").lazy()
    return (
        joined.with_columns(pl.col(GPU).rle_id().alias("_g"))
        .with_columns(pl.col(c).forward_fill().over("_g") for c in carried)
        .drop("_g")
        .collect(engine=ENGINE)
    )


def _grid_sources(hourly: pl.DataFrame, spans: pl.DataFrame, rows: int, grid_us: int) -> pl.Series | None:
    """Per grid row of `dense_grid` (`rows` of them, from `spans`: per GPU, sorted, `_first`,
    `_end` and its first row `_offset`), the row of `hourly` bucketed there, null where none is;
    None when two buckets have one (GPU, grid time). A bucket off its GPU's span (after the
    data's end) or off the grid has no row."""
    placed = (
        hourly.lazy()
        .select(GPU, "ts")
        .with_row_index("_row")
        .join(spans.lazy().select(GPU, "_first", "_end", "_offset"), on=GPU, how="inner")
        .with_columns((pl.col("ts") - pl.col("_first")).dt.total_microseconds().alias("_since"))
        .filter(
            (pl.col("ts") >= pl.col("_first")) & (pl.col("ts") <= pl.col("_end")) & (pl.col("_since") % grid_us == 0)
        )
        .select("_row", (pl.col("_offset") + pl.col("_since") // grid_us).alias("_at"))
        .collect(engine=ENGINE)
    )
    source = np.full(rows, -1, np.int64)
    source[placed["_at"].to_numpy()] = placed["_row"].to_numpy()
    empty = source < 0
    if rows - int(empty.sum()) < placed.height:  # fewer grid rows filled than buckets placed
        return None
    series = pl.Series("_source", source)
    return series.set(pl.Series(empty), None) if empty.any() else series


# -- 3. window features ---------------------------------------------------------------------------

# Rolling expressions run per GPU over `_gid`, an integer id of the GPU's run of rows in a frame
# sorted by (gpu_uuid, ts): partitioning on an integer was ~1.5x faster than on the uuid string.
GID = "_gid"


def gpu_run_id() -> pl.Expr:
    """`_gid`: an integer per GPU in a frame sorted by gpu_uuid."""
    return pl.col(GPU).rle_id().alias(GID)


class WindowSums:
    """Sums of per-row quantities over the last k rows of each GPU, for several k at once, at
    the kept rows of a dense grid (sorted by (gpu_uuid, ts), every grid time present, so "the
    last k rows" is the window of k grid steps).

    `add` names a quantity, a bucket column or its readings; `at` reduces each to the window
    sums `_<name>_<w>` at the kept rows (`features.rolling.trailing_sums`, reading the buckets
    through each grid row's). A sum's rounding depends only on the rows of its window, so
    neither appending later data nor starting the frame elsewhere changes a value.
    """

    def __init__(self, sizes: Sequence[int], labels: Sequence[str]) -> None:
        self.sizes = list(sizes)
        self.labels = list(labels)
        self.quantities: list[tuple[str, str, bool]] = []

    def add(self, name: str, column: str, *, readings: bool = False) -> None:
        """Columns `_<name>_<w>`: the sum of the bucket column `column` (nulls count as 0) over
        each window; with `readings`, how many buckets of the window have a value."""
        self.quantities.append((name, column, readings))

    def at(self, buckets: rolling.BucketArrays, kept: rolling.KeptRows) -> list[pl.Series]:
        """The window sums at the kept rows."""
        out: list[pl.Series] = []
        for name, column, readings in self.quantities:
            sums = rolling.trailing_sums(buckets, column, kept, self.sizes, readings=readings)
            out += [pl.Series(f"_{name}_{wl}", s) for wl, s in zip(self.labels, sums, strict=True)]
        return out


def kept_frame(frame: pl.DataFrame, columns: Sequence[str], keep: pl.Series | None) -> pl.DataFrame:
    """`columns` of `frame` at the kept rows (all when `keep` is None)."""
    narrow = frame.select(columns)
    return narrow if keep is None else narrow.filter(keep)


def window_extremes(
    buckets: rolling.BucketArrays,
    items: Sequence[tuple[str, str, Literal["max", "min"]]],
    sizes: Sequence[int],
    labels: Sequence[str],
    kept: rolling.KeptRows,
) -> list[pl.Series]:
    """Columns `_<name>_<w>` at the kept rows: the max (or min) of each item's column over the
    last k rows of each GPU (`features.rolling.trailing_extremes`; exact, null without a reading
    in the window)."""
    out: list[pl.Series] = []
    for name, column, how in items:
        extremes = rolling.trailing_extremes(buckets, column, kept, sizes, how)
        out += [s.alias(f"_{name}_{wl}") for s, wl in zip(extremes, labels, strict=True)]
    return out


def window_features(
    dense: pl.DataFrame,
    grid: timedelta = DEFAULT_GRID,
    windows: Sequence[timedelta] = DEFAULT_WINDOWS,
    *,
    first_seen: pl.DataFrame | None = None,
    keep: pl.Series | None = None,
    dtype: type[pl.DataType] | pl.DataType = pl.Float64,
    buckets: rolling.BucketArrays | None = None,
    source: np.ndarray | None = None,
) -> pl.DataFrame:
    """Telemetry window features on a dense grid (from `dense_grid`, sorted by (gpu_uuid, ts)):
    `gpu_uuid`, `ts`, then `gpu_age_h`, `telemetry_since_last_h`, `telemetry_missing_frac_<w>`;
    per gauge `<m>_last` and per window `<m>_mean_<w>`, `_max_`, `_min_`, `_std_`, `_slope_`
    (windows longer than the grid); per counter `<m>_last` and per window `<m>_increase_<w>`,
    `<m>_rate_<w>`; per flag `<m>_max_<w>`; per bitmask group `<m>_<group>_frac_<w>`. All
    Float64 here; `build_features` casts to Float32. Module notes give the definitions.

    `first_seen` (gpu_uuid, first_ts) gives the GPU's true first sample when `dense` holds only
    part of its history; by default the first bucket's first sample is used. `keep` (a boolean
    per row of `dense`) returns only those rows, `dtype` is the features' type: both applied
    before the (wide) result is materialised, which saves copying it.

    `buckets` and `source`: the bucket rows of `dense`'s GPUs, and per row of `dense` the row of
    its bucket there (-1 for none). The window kernels then read their columns from `buckets`,
    and `dense` needs only gpu_uuid, ts, last_sample_ts and `grid_frame_columns`; by default
    they read `dense`'s own.
    """
    sizes = check_grid(grid, windows)
    sfx = grid_suffix(grid)
    if buckets is None:
        buckets, source = rolling.BucketArrays(dense), None
    kinds = aggregated_metrics(buckets.frame.columns, grid)
    labels = [window_label(w) for w in windows]
    k_max = max(sizes)
    grid_h = _us(grid) / HOUR_US

    # Stage 1: sums per window (temporary columns `_<quantity>_<w>`).
    sums = WindowSums(sizes, labels)
    sums.add("n", f"n_samples{sfx}")
    # Gauges' mean, standard deviation and slope come from their bucket counts, means and
    # variances (`features.rolling.gauge_moments`), after stage 1.
    for c in kinds["counter"]:
        sums.add(f"{c}_inc", f"{c}_increase{sfx}")
        sums.add(f"{c}_readings", f"{c}_increase{sfx}", readings=True)
    for b in kinds["bitmask"]:
        groups = bitmask_groups(b)
        if groups:
            sums.add(f"{b}_n", f"{b}_count{sfx}")
        for group in groups:
            sums.add(f"{b}_{group}", f"{b}_{group}_n{sfx}")
    interval = (
        pl.col(f"sample_interval_s{sfx}").rolling_median(k_max, min_samples=1).over(GID)
        if k_max > 1
        else pl.col(f"sample_interval_s{sfx}")
    )
    # The GPU's first sample: looked up at the kept rows only when given (a string look-up per
    # row of the whole frame cost as much as a window statistic), else from the frame's buckets.
    first_here = [] if first_seen is not None else [pl.col("first_sample_ts").min().over(GID).alias("_first")]
    # "Last" readings look back at most the longest window, so that every feature depends on a
    # bounded stretch of history (what lets the store build carry only that much).
    last_limit = max(k_max - 1, 0)
    # Everything here needs the rows before a kept row; stage 2 only the row itself.
    frame = (
        dense.lazy()
        .with_columns(gpu_run_id())
        .with_columns(interval.alias("_interval_s"), *first_here)
        .collect(engine=ENGINE)
    )
    kept = rolling.KeptRows(frame[GPU], keep, grid_steps(frame["ts"], grid), source)
    moments: list[pl.Series] = []
    for g in kinds["gauge"]:
        per_window = rolling.gauge_moments(buckets, f"{g}_count{sfx}", f"{g}_mean{sfx}", f"{g}_var{sfx}", kept, sizes)
        for wl, (mean_w, std_w, slope_w) in zip(labels, per_window, strict=True):
            moments += [
                mean_w.alias(f"_{g}_mean_{wl}"),
                std_w.alias(f"_{g}_std_{wl}"),
                slope_w.alias(f"_{g}_slope_{wl}"),
            ]
    extremes: list[tuple[str, str, Literal["max", "min"]]] = []
    for g in kinds["gauge"]:
        extremes += [(f"{g}_mx", f"{g}_max{sfx}", "max"), (f"{g}_mn", f"{g}_min{sfx}", "min")]
    extremes += [(f"{f}_mx", f"{f}_max{sfx}", "max") for f in kinds["flag"]]
    carried = [GPU, "ts", "last_sample_ts", "_interval_s", *(c for c in ("_first",) if c in frame.columns)]
    lasts = [
        rolling.trailing_last(buckets, f"{m}_last{sfx}", kept, last_limit).alias(f"_last_{m}")
        for m in (*kinds["gauge"], *kinds["counter"])
    ]
    lf = (
        kept_frame(frame, carried, keep)
        .with_columns(
            *sums.at(buckets, kept), *moments, *window_extremes(buckets, extremes, sizes, labels, kept), *lasts
        )
        .lazy()
    )
    del frame
    if first_seen is not None:
        lf = lf.with_columns(
            pl.col(GPU)
            .replace_strict(first_seen[GPU], first_seen["first_ts"], default=None, return_dtype=TS_DTYPE)
            .alias("_first")
        )

    # Stage 2: the features.
    out: list[pl.Expr] = []
    first = pl.col("_first")
    age_h = (pl.col("ts") - first).dt.total_microseconds() / HOUR_US
    out.append(age_h.alias("gpu_age_h"))
    out.append(
        ((pl.col("ts") - pl.col("last_sample_ts")).dt.total_microseconds() / HOUR_US).alias("telemetry_since_last_h")
    )
    for w, wl in zip(windows, labels, strict=True):
        # A GPU younger than the window is not missing the samples from before it existed.
        expected = pl.min_horizontal(pl.lit(w.total_seconds()), age_h * 3600) / pl.col("_interval_s")
        out.append(
            pl.when(pl.col(f"_n_{wl}") == 0)
            .then(1.0)
            .otherwise((1.0 - pl.col(f"_n_{wl}") / expected).clip(0.0, 1.0))
            .alias(f"telemetry_missing_frac_{wl}")
        )
    for g in kinds["gauge"]:
        out.append(pl.col(f"_last_{g}").alias(f"{g}_last"))
        for k, wl in zip(sizes, labels, strict=True):
            out += [
                pl.col(f"_{g}_mean_{wl}").alias(f"{g}_mean_{wl}"),
                pl.col(f"_{g}_mx_{wl}").alias(f"{g}_max_{wl}"),
                pl.col(f"_{g}_mn_{wl}").alias(f"{g}_min_{wl}"),
                pl.col(f"_{g}_std_{wl}").alias(f"{g}_std_{wl}"),
            ]
            if k > 1:
                # Per grid step there; per hour here.
                out.append((pl.col(f"_{g}_slope_{wl}") / grid_h).alias(f"{g}_slope_{wl}"))
    for c in kinds["counter"]:
        out.append(pl.col(f"_last_{c}").alias(f"{c}_last"))
        for w, wl in zip(windows, labels, strict=True):
            # No reading of the counter in the window: the increase is unknown, not 0.
            increase = pl.when(pl.col(f"_{c}_readings_{wl}") > 0).then(pl.col(f"_{c}_inc_{wl}"))
            # Per hour the GPU was in service within the window (at least one grid step).
            hours = pl.min_horizontal(pl.lit(w.total_seconds() / 3600), age_h).clip(lower_bound=grid_h)
            out += [increase.alias(f"{c}_increase_{wl}"), (increase / hours).alias(f"{c}_rate_{wl}")]
    for f in kinds["flag"]:
        out += [pl.col(f"_{f}_mx_{wl}").alias(f"{f}_max_{wl}") for wl in labels]
    for b in kinds["bitmask"]:
        for group in bitmask_groups(b):
            for wl in labels:
                nb = pl.col(f"_{b}_n_{wl}")
                out.append(pl.when(nb > 0).then(pl.col(f"_{b}_{group}_{wl}") / nb).alias(f"{b}_{group}_frac_{wl}"))
    return select_rows(lf, out, None, dtype)


def select_rows(
    lf: pl.LazyFrame, features: list[pl.Expr], keep: pl.Series | None, dtype: type[pl.DataType] | pl.DataType
) -> pl.DataFrame:
    """gpu_uuid, ts and `features` cast to `dtype`, for the rows where `keep` is true."""
    columns: list[str | pl.Expr] = [GPU, "ts", *[e.cast(dtype) for e in features]]
    if keep is None:
        return lf.select(columns).collect(engine=ENGINE)
    return (
        lf.with_columns(keep.alias("_keep"))
        .select(*columns, "_keep")
        .filter("_keep")
        .drop("_keep")
        .collect(engine=ENGINE)
    )
