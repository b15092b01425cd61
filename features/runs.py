"""Reductions over contiguous runs of rows: the grid buckets of telemetry sorted by (gpu, time).

`hourly_aggregate` reduces raw samples to one row per (GPU, grid bucket). Sorted telemetry puts
each bucket's samples in one contiguous run of a few rows (4 at one sample every 15 minutes and
hourly buckets), so a day of a 32k-GPU fleet is ~785k runs. polars' grouped aggregations pay a
fixed cost per group and column, which dominates when groups are that small: a day's 100
bucket statistics took 5.5 s, and numpy's `ufunc.reduceat` (one pass per statistic) still 3.5 s.
Here one compiled pass (numba) over a column's rows computes all its statistics at once.
numba is imported and the kernels loaded (compiled once, then from its on-disk cache) on the
first reduction, not on import: reading features to train or score does not pay for it.

The functions take polars Series and return polars Series with one value per run, null where
polars' aggregation gives null: no non-null value in the run (fewer than two for the variance).
NaN readings count as values, as in polars, except in the maximum and minimum, which skip them
unless the run has nothing else (as polars' `max` and `min` do).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
import polars as pl

log = logging.getLogger(__name__)


class Runs:
    """Runs of rows starting at `starts` (increasing offsets, the first 0) in `n` rows."""

    def __init__(self, starts: np.ndarray, n: int) -> None:
        self.starts = np.asarray(starts, dtype=np.int64)
        if n and (len(self.starts) == 0 or self.starts[0] != 0):
            raise ValueError("runs: the first run must start at row 0")
        self.ends = np.append(self.starts[1:], n).astype(np.int64) if len(self.starts) else self.starts
        self.lengths = self.ends - self.starts

    @classmethod
    def where_changed(cls, *keys: pl.Series) -> Runs:
        """A run per stretch of rows where no key changes (keys without nulls)."""
        n = len(keys[0]) if keys else 0
        changed = np.zeros(max(n - 1, 0), dtype=bool)
        for key in keys:
            values = key.to_physical().to_numpy()
            changed |= values[1:] != values[:-1]
        return cls(np.concatenate([[0], np.flatnonzero(changed) + 1]) if n else np.empty(0, np.int64), n)

    def __len__(self) -> int:
        return len(self.starts)


def first(s: pl.Series, runs: Runs) -> pl.Series:
    """The first row's value of each run (null or not)."""
    return s.gather(runs.starts)


def last(s: pl.Series, runs: Runs) -> pl.Series:
    """The last row's value of each run (null or not)."""
    return s.gather(runs.ends - 1)


def _valid(s: pl.Series) -> np.ndarray:
    return s.is_not_null().to_numpy() if s.null_count() else np.ones(len(s), dtype=np.bool_)


def _series(name: str, values: np.ndarray, dtype: pl.DataType | type[pl.DataType], present: np.ndarray) -> pl.Series:
    """A Series of `values`, null where `present` is false."""
    series = pl.Series(name, values, dtype=dtype)
    return series if present.all() else series.set(pl.Series(~present), None)


def _gauge_runs(values, valid, starts, ends, count, mean, high, low, latest, var):  # type: ignore[no-untyped-def]
    for r in range(starts.shape[0]):
        n, total = 0, 0.0
        hi, lo, numbers, newest = -np.inf, np.inf, False, np.nan
        for i in range(starts[r], ends[r]):
            if valid[i]:
                v = values[i]
                n += 1
                total += v
                newest = v
                if v == v:  # not NaN
                    numbers = True
                    hi = max(hi, v)
                    lo = min(lo, v)
        count[r] = n
        m = total / n if n else np.nan
        mean[r] = m
        high[r] = hi if numbers else np.nan
        low[r] = lo if numbers else np.nan
        latest[r] = newest
        # Two passes over the run: deviations from its mean, so a large steady reading (a
        # memory gauge near 80,000 MiB) keeps its small spread.
        squares = 0.0
        for i in range(starts[r], ends[r]):
            if valid[i]:
                d = values[i] - m
                squares += d * d
        var[r] = squares / (n - 1) if n > 1 else np.nan


@cache
def compiled(kernel: Callable[..., None]) -> Any:
    """`kernel` compiled by numba, cached on disk across processes in the first folder numba can
    write (`NUMBA_CACHE_DIR`, beside the sources, the user's cache folder). Where there is none
    (a read-only image without a writable cache volume) it is compiled in each process: seconds
    at the first use, instead of the command failing."""
    import numba

    try:
        return numba.njit(cache=True, nogil=True)(kernel)
    except RuntimeError as exc:
        if "no locator available" not in str(exc):
            raise
        _without_cache_note()
        return numba.njit(nogil=True)(kernel)


@cache
def _without_cache_note() -> None:
    log.warning(
        "numba: no writable cache folder (NUMBA_CACHE_DIR=%s, the sources' folder, the home's cache); "
        "the feature kernels are compiled in this process, not cached",
        os.environ.get("NUMBA_CACHE_DIR", "unset"),
    )


def gauge(s: pl.Series, runs: Runs) -> dict[str, pl.Series]:
    """A gauge's statistics per run: count (Int32), and Float64 mean, max, min, last (the last
    non-null reading) and var (sample variance, ddof=1)."""
    k = len(runs)
    count = np.empty(k, np.int64)
    mean, high, low, latest, var = (np.empty(k, np.float64) for _ in range(5))
    values = s.cast(pl.Float64).fill_null(0.0).to_numpy()
    compiled(_gauge_runs)(values, _valid(s), runs.starts, runs.ends, count, mean, high, low, latest, var)
    some = count > 0
    return {
        "count": pl.Series(s.name, count, dtype=pl.Int32),
        "mean": _series(s.name, mean, pl.Float64, some),
        "max": _series(s.name, high, pl.Float64, some),
        "min": _series(s.name, low, pl.Float64, some),
        "last": _series(s.name, latest, pl.Float64, some),
        "var": _series(s.name, var, pl.Float64, count > 1),
    }


def _integer_runs(values, valid, starts, ends, count, total, high, latest):  # type: ignore[no-untyped-def]
    for r in range(starts.shape[0]):
        n, s, hi, newest = 0, 0, np.iinfo(np.int64).min, 0
        for i in range(starts[r], ends[r]):
            if valid[i]:
                v = values[i]
                n += 1
                s += v
                hi = max(hi, v)
                newest = v
        count[r], total[r], high[r], latest[r] = n, s, hi, newest


def integers(s: pl.Series, runs: Runs) -> dict[str, pl.Series]:
    """An integer column's statistics per run, nulls skipped: count (Int32), total (Int64; 0
    for a run without a value, as polars' `sum`), and in the column's dtype max and last (the
    last non-null value), null for a run without a value."""
    if not s.dtype.is_integer():
        raise TypeError(f"{s.name}: expected an integer column, got {s.dtype}")
    k = len(runs)
    count, total, high, latest = (np.empty(k, np.int64) for _ in range(4))
    values = s.cast(pl.Int64).fill_null(0).to_numpy()
    compiled(_integer_runs)(values, _valid(s), runs.starts, runs.ends, count, total, high, latest)
    some = count > 0
    return {
        "count": pl.Series(s.name, count, dtype=pl.Int32),
        "total": pl.Series(s.name, total, dtype=pl.Int64),
        "max": _series(s.name, high, pl.Int64, some).cast(s.dtype),
        "last": _series(s.name, latest, pl.Int64, some).cast(s.dtype),
    }


def _counter_runs(values, valid, ts, gpu, starts, ends, max_gap, count, last, increase):  # type: ignore[no-untyped-def]
    have_previous, previous, previous_gpu, previous_ts = False, 0, -1, 0
    for r in range(starts.shape[0]):
        n, total, newest = 0, 0, 0
        for i in range(starts[r], ends[r]):
            if not valid[i]:
                continue
            v = values[i]
            # The baseline: the GPU's previous reading, if recent enough; otherwise the reading
            # itself (nothing is known to have accrued before it).
            recent = have_previous and previous_gpu == gpu[i] and ts[i] - previous_ts <= max_gap
            base = previous if recent else v
            total += v - base if v >= base else v  # a drop is a reset: the new value accrued since
            n += 1
            newest = v
            have_previous, previous, previous_gpu, previous_ts = True, v, gpu[i], ts[i]
        count[r], last[r], increase[r] = n, newest, total


def counter(s: pl.Series, ts_us: np.ndarray, gpu: np.ndarray, runs: Runs, max_gap_us: int) -> dict[str, pl.Series]:
    """A counter's last reading and reset-robust increase per run (module notes of
    `features.windows`): each reading adds its difference from the GPU's previous non-null
    reading (`gpu`: an integer per row, `ts_us`: microseconds) when that came at most
    `max_gap_us` before it and the counter did not drop, the reading itself after a drop, and
    nothing when there is no recent previous reading. Rows must be sorted by (gpu, time), the
    runs within one GPU each; a run's first reading takes its baseline from the run before.
    Both are null for a run without a reading, in the column's dtype."""
    if not s.dtype.is_integer():
        raise TypeError(f"{s.name}: expected an integer column, got {s.dtype}")
    k = len(runs)
    count, last, increase = (np.empty(k, np.int64) for _ in range(3))
    values = s.cast(pl.Int64).fill_null(0).to_numpy()
    compiled(_counter_runs)(values, _valid(s), ts_us, gpu, runs.starts, runs.ends, max_gap_us, count, last, increase)
    some = count > 0
    return {
        "last": _series(s.name, last, pl.Int64, some).cast(s.dtype),
        "increase": _series(s.name, increase, pl.Int64, some),
    }


def gpu_slices(gpus: pl.Series, rows_per_chunk: int | None) -> list[tuple[int, int]]:
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
