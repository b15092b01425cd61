"""Reductions over runs of rows (features.runs) give what polars' grouped aggregations give."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_series_equal

from features import runs

NAN = float("nan")


def _runs_of(lengths: list[int]) -> tuple[runs.Runs, pl.Series]:
    group = pl.Series("g", np.repeat(np.arange(len(lengths)), lengths))
    return runs.Runs.where_changed(group), group


def _assert_as_polars_aggregates(stats: dict[str, pl.Series], s: pl.Series, group: pl.Series, **tolerance) -> None:
    """Each statistic equals polars' grouped aggregation of the same name over the runs."""
    x = pl.col(s.name)
    polars_of = {
        "count": x.count().cast(pl.Int32),
        "total": x.sum(),
        "mean": x.mean(),
        "max": x.max(),
        "min": x.min(),
        "last": x.last(ignore_nulls=True),
        "var": x.var(),
    }
    expected = (
        pl.DataFrame({"g": group, s.name: s})
        .group_by("g", maintain_order=True)
        .agg(polars_of[name].alias(name) for name in stats)
    )
    for name, got in stats.items():
        assert_series_equal(got, expected[name], check_names=False, **tolerance)


def test_runs_start_where_any_key_changes():
    gpu = pl.Series(["a", "a", "a", "b", "b", "c"])
    bucket = pl.Series([1, 1, 2, 2, 2, 2])
    found = runs.Runs.where_changed(gpu, bucket)
    assert found.starts.tolist() == [0, 2, 3, 5]
    assert found.lengths.tolist() == [2, 1, 2, 1]
    assert len(runs.Runs.where_changed(pl.Series([], dtype=pl.String))) == 0


def test_a_first_run_that_does_not_start_at_row_zero_is_refused():
    with pytest.raises(ValueError, match="start at row 0"):
        runs.Runs(np.array([1, 3]), 5)


def test_gauge_statistics_equal_polars_with_nulls_nan_and_large_steady_readings():
    rng = np.random.default_rng(7)
    lengths = [5] + [int(n) for n in rng.integers(1, 8, size=400)]
    n = sum(lengths)
    as_list: list[float | None] = rng.normal(50.0, 10.0, n).tolist()
    for i in rng.choice(n, 150, replace=False):
        as_list[i] = None
    for i in rng.choice(n, 20, replace=False):
        as_list[i] = NAN
    # Runs with only nulls, only NaN, and one NaN beside a number.
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for i in range(starts[5], starts[5] + lengths[5]):
        as_list[i] = None
    for i in range(starts[9], starts[9] + lengths[9]):
        as_list[i] = NAN
    # A memory gauge near 80,000 MiB that barely moves: its spread must survive.
    as_list[:5] = (80_000.0 + rng.normal(0, 0.01, 5)).tolist()
    found, group = _runs_of(lengths)
    x = pl.Series("x", as_list, dtype=pl.Float64)
    stats = runs.gauge(x, found)
    assert set(stats) == {"count", "mean", "max", "min", "last", "var"}
    _assert_as_polars_aggregates(stats, x, group, rel_tol=1e-9, abs_tol=1e-12)
    assert stats["mean"][5] is None and np.isnan(stats["max"][9])
    assert 0.0 < stats["var"][0] < 1e-3  # the steady 80,000 MiB run


def test_a_float32_gauge_is_read_as_float64():
    found, _ = _runs_of([2, 1])
    stats = runs.gauge(pl.Series("t", [40.5, 41.5, 60.25], dtype=pl.Float32), found)
    assert stats["mean"].to_list() == [41.0, 60.25]
    assert stats["var"].to_list() == [0.5, None]
    assert stats["count"].dtype == pl.Int32


def test_integer_statistics_equal_polars_with_nulls():
    rng = np.random.default_rng(3)
    lengths = [int(n) for n in rng.integers(1, 6, size=300)]
    n = sum(lengths)
    values: list[int | None] = rng.integers(-5, 1_000_000, n).tolist()
    for i in rng.choice(n, 200, replace=False):
        values[i] = None
    values[0 : lengths[0]] = [None] * lengths[0]  # a run without a value
    found, group = _runs_of(lengths)
    s = pl.Series("c", values, dtype=pl.Int64)
    stats = runs.integers(s, found)
    assert set(stats) == {"count", "total", "max", "last"}
    _assert_as_polars_aggregates(stats, s, group)
    assert stats["total"][0] == 0 and stats["max"][0] is None


def test_integer_statistics_keep_a_narrow_dtype_and_refuse_floats():
    found, _ = _runs_of([2, 2])
    stats = runs.integers(pl.Series("f", [0, 1, None, 0], dtype=pl.Int8), found)
    assert stats["max"].dtype == pl.Int8 and stats["max"].to_list() == [1, 0]
    with pytest.raises(TypeError, match="f: expected an integer column"):
        runs.integers(pl.Series("f", [0.5, 1.0, 2.0, 3.0]), found)


def test_first_and_last_rows_of_each_run():
    found, _ = _runs_of([3, 1, 2])
    s = pl.Series("node", ["n1", None, "n2", "n3", "n4", None])
    assert runs.first(s, found).to_list() == ["n1", "n3", "n4"]
    assert runs.last(s, found).to_list() == ["n2", "n3", None]


def test_no_runs_give_empty_columns_of_the_right_type():
    found = runs.Runs(np.empty(0, np.int64), 0)
    assert runs.gauge(pl.Series("x", [], dtype=pl.Float32), found)["mean"].dtype == pl.Float64
    assert runs.integers(pl.Series("c", [], dtype=pl.Int64), found)["total"].len() == 0
    assert runs.last(pl.Series("s", [], dtype=pl.String), found).len() == 0


def test_a_counter_increase_takes_its_baseline_from_the_gpus_previous_recent_reading():
    # GPU 0: buckets [10, 12] [null, 15] [3] (a reset after 15: 3 accrued) [20 after a long gap];
    # GPU 1 starts at 100: its first reading is a baseline, not an increase of 100 - 20.
    values = pl.Series("c", [10, 12, None, 15, 3, 20, 100, 101], dtype=pl.Int64)
    minute = 60_000_000
    ts = np.array([0, 1, 2, 3, 4, 300, 0, 1], dtype=np.int64) * minute
    gpu = np.array([0, 0, 0, 0, 0, 0, 1, 1], dtype=np.uint32)
    buckets = runs.Runs(np.array([0, 2, 4, 5, 6]), 8)
    stats = runs.counter(values, ts, gpu, buckets, max_gap_us=60 * minute)
    assert stats["increase"].to_list() == [2, 3, 3, 0, 1]
    assert stats["last"].to_list() == [12, 15, 3, 20, 101]
    empty = runs.counter(pl.Series("c", [None, None], dtype=pl.Int32), ts[:2], gpu[:2], runs.Runs([0], 2), minute)
    assert empty["increase"].to_list() == [None] and empty["last"].dtype == pl.Int32
    with pytest.raises(TypeError, match="c: expected an integer column"):
        runs.counter(pl.Series("c", [1.0]), ts[:1], gpu[:1], runs.Runs([0], 1), minute)
