"""`benchmarks.feature_build`: each measurement runs and reports its sizes and rates; the pandas
baseline it compares against computes the same window statistics as gpufail."""

from __future__ import annotations

import polars as pl

from benchmarks.feature_build import bench_build, bench_compare, bench_store, pandas_window_baseline
from features.build import build_features
from tests.features import NO_XIDS, at, every, samples
from tests.pandas_arrow import polars_from_pandas


def test_bench_reports_a_rate():
    result = bench_build(8, 10, repeat=1)
    assert result["telemetry_rows"] == 8 * 600
    assert result["rows_per_s"] > 0


def test_the_pandas_baseline_computes_the_same_window_statistics():
    # Samples on whole minutes, so each hour's last sample sits exactly at its grid time and the
    # baseline's per-sample windows end where gpufail's do.
    times = every(at(0, 1), at(30))
    temps = [50.0 + (i % 17) for i in range(len(times))]
    ecc = [i // 7 if i < 900 else (i - 900) // 7 for i in range(len(times))]  # a reset at 15:00
    tel = samples(times, temp_gpu_c=temps, ecc_sbe_volatile_total=ecc)
    ours = build_features(tel, NO_XIDS).filter(pl.col("ts") >= at(7))
    theirs = pandas_window_baseline(tel, ("1h", "6h")).reset_index()
    theirs = polars_from_pandas(
        theirs[["hour", "temp_gpu_c_mean_6h", "temp_gpu_c_std_1h", "ecc_sbe_volatile_total_increase_6h"]]
    )
    joined = ours.join(theirs.rename({"hour": "ts"}).with_columns(pl.col("ts").dt.cast_time_unit("us")), on="ts")
    assert joined.height == ours.height == 24
    for a, b in [
        ("temp_gpu_c_mean_6h", "temp_gpu_c_mean_6h_right"),
        ("temp_gpu_c_std_1h", "temp_gpu_c_std_1h_right"),
        ("ecc_sbe_volatile_total_increase_6h", "ecc_sbe_volatile_total_increase_6h_right"),
    ]:
        assert (joined[a] - joined[b]).abs().max() < 1e-3, a


def test_bench_store_builds_a_synthetic_store_end_to_end():
    result = bench_store(8, 2)
    assert result["telemetry_rows"] == 8 * 2 * 96
    assert result["feature_rows"] > 0 and result["rows_per_s"] > 0
    assert result["cpu_seconds"] > 0 and result["rows_per_cpu_s"] > 0 and result["blocks"] >= 1
    assert result["peak_rss_mb"] > 10


def test_bench_compare_reports_both_rates():
    result = bench_compare(8, 10)
    assert result["telemetry_rows"] == 8 * 600
    assert result["gpufail_rows_per_s"] > 0 and result["pandas_rows_per_s"] > 0
