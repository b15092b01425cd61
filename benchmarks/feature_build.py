"""Speed of `build_features` on synthetic telemetry (a measurement, not a test).

    .venv/bin/python -m benchmarks.feature_build --gpus 128 --hours 130     # ~1M telemetry rows

prints telemetry rows per second for the whole in-memory build (aggregation, windows, XIDs,
peers, labels), and, on the same frame in the same run, for a straightforward pandas
implementation of the window statistics alone (`pandas_window_baseline`: groupby-rolling over
every raw sample, then the rows at the grid times), the approach gpufail does not take. The
synthetic frame (`tests.synthetic`) has every catalogue metric at one sample a minute, 8 GPUs a
node, a few XIDs; it exercises the code, it does not model failures.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any

import polars as pl

from tests.synthetic import START, synthetic_telemetry, synthetic_xids


def bench_build(n_gpus: int = 128, hours: float = 130, *, repeat: int = 3, seed: int = 0) -> dict[str, float]:
    """Build features for a synthetic frame `repeat` times; return the best telemetry rows/s
    and the sizes involved."""
    from features.build import build_features

    telemetry = synthetic_telemetry(n_gpus, hours, seed=seed)
    xids = synthetic_xids(telemetry, seed=seed)
    best = float("inf")
    rows_out = 0
    for _ in range(repeat):
        began = time.perf_counter()
        out = build_features(telemetry, xids)
        best = min(best, time.perf_counter() - began)
        rows_out = out.height
    return {
        "telemetry_rows": float(telemetry.height),
        "feature_rows": float(rows_out),
        "feature_columns": float(out.width),
        "seconds": best,
        "rows_per_s": telemetry.height / best,
    }


def pandas_window_baseline(telemetry: pl.DataFrame, windows: tuple[str, ...] = ("1h", "6h", "24h", "7d")) -> Any:
    """The straightforward pandas way: per GPU, time-based rolling windows over every raw sample
    (mean, max, min, std per gauge; reset-robust increase per counter), then the last row in each
    hour as that hour's features. Computes only the window statistics (a subset of what
    `build_features` computes); returns a pandas frame indexed by (gpu_uuid, hour). For
    comparison only."""
    import warnings

    import pandas as pd

    from ingest.schema import metric_columns

    have = set(telemetry.columns)
    gauges = [c for c in metric_columns("gauge") if c in have]
    counters = [c for c in metric_columns("counter") if c in have]
    frame = telemetry.select("gpu_uuid", "ts", *gauges, *counters).to_pandas()
    frame = frame.sort_values(["gpu_uuid", "ts"]).set_index("ts")
    by_gpu = frame.groupby("gpu_uuid", sort=False)
    steps = by_gpu[counters].diff()
    frame[counters] = steps.where(steps >= 0, frame[counters]).fillna(0)  # a drop is a reset
    parts = []
    with warnings.catch_warnings():
        # Multi-statistic rolling frames are fragmented; pandas says so on every concat.
        warnings.simplefilter("ignore", pd.errors.PerformanceWarning)
        for w in windows:
            # "7d" as hours: pandas is deprecating the lower-case day unit.
            length = pd.Timedelta(hours=int(pd.Timedelta(w.replace("d", "D")).total_seconds() // 3600))
            rolling = frame.groupby("gpu_uuid", sort=False).rolling(length)
            stats = rolling[gauges].agg(["mean", "max", "min", "std"])
            stats.columns = ["_".join([*pair, w]) for pair in stats.columns.to_list()]
            increase = rolling[counters].sum().add_suffix(f"_increase_{w}")
            parts += [stats, increase]
        features = pd.concat(parts, axis=1).reset_index()
        features["hour"] = features["ts"].dt.ceil("h")
        return features.groupby(["gpu_uuid", "hour"], sort=False).last()


def bench_compare(n_gpus: int = 32, hours: float = 130, *, seed: int = 0) -> dict[str, float]:
    """`build_features` and `pandas_window_baseline` on the same frame, once each."""
    from features.build import build_features

    telemetry = synthetic_telemetry(n_gpus, hours, seed=seed)
    xids = synthetic_xids(telemetry, seed=seed)
    began = time.perf_counter()
    build_features(telemetry, xids)
    ours = time.perf_counter() - began
    began = time.perf_counter()
    pandas_window_baseline(telemetry)
    theirs = time.perf_counter() - began
    return {
        "telemetry_rows": float(telemetry.height),
        "gpufail_rows_per_s": telemetry.height / ours,
        "pandas_rows_per_s": telemetry.height / theirs,
    }


def bench_store(
    n_gpus: int,
    days: int,
    *,
    interval: timedelta = timedelta(minutes=15),
    buckets_in_memory: int = 4_000_000,
    seed: int = 0,
) -> dict[str, float]:
    """The whole store build (Parquet read to features written) on a synthetic fleet written
    day by day into a temporary local store (generated a day at a time, so the fleet can be
    larger than memory). Run it in its own process to read its peak memory."""
    import shutil
    import tempfile

    from features.runner import BuildOptions, build_features_from_store
    from ingest.store import Store

    root = tempfile.mkdtemp(prefix="gpufail-features-bench-")
    try:
        store = Store.create(root)
        rows = 0
        for day in range(days):
            tel = synthetic_telemetry(n_gpus, 24, interval=interval, start=START + timedelta(days=day), seed=seed + day)
            store.write("telemetry", tel.to_arrow())
            store.write("xid_events", synthetic_xids(tel, seed=seed + day).to_arrow())
            rows += tel.height
            del tel
        began, cpu = time.perf_counter(), time.process_time()
        summary = build_features_from_store(
            store, options=BuildOptions(max_buckets_in_memory=buckets_in_memory, progress=False)
        )
        seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "telemetry_rows": float(rows),
        "feature_rows": float(summary.rows),
        "blocks": float(summary.blocks),
        "seconds": seconds,
        # CPU seconds of all threads: on a shared machine wall time also measures the neighbours.
        "cpu_seconds": cpu,
        "rows_per_s": rows / seconds,
        "rows_per_cpu_s": rows / cpu,
        "peak_rss_mb": _peak_rss_mb(),
    }


def _peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports KiB, macOS bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=128)
    parser.add_argument("--hours", type=float, default=130)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pandas", action="store_true", help="Also time the pandas baseline on a 32-GPU frame.")
    parser.add_argument(
        "--store-days",
        type=int,
        default=0,
        help="Instead: the whole store build over this many days of 15-minute samples.",
    )
    parser.add_argument("--buckets-in-memory", type=int, default=4_000_000, help="The store build's bucket budget.")
    args = parser.parse_args()
    if args.store_days:
        r = bench_store(args.gpus, args.store_days, buckets_in_memory=args.buckets_in_memory)
        print(
            f"store build: {int(r['telemetry_rows']):,} telemetry rows ({args.gpus:,} GPUs x {args.store_days} days, 15-minute samples)"
            f" -> {int(r['feature_rows']):,} feature rows in {int(r['blocks'])} blocks, {r['seconds']:.1f} s:"
            f" {r['rows_per_s']:,.0f} telemetry rows/s; {r['cpu_seconds']:.1f} CPU s ({r['rows_per_cpu_s']:,.0f} rows per"
            f" CPU second); peak RSS {r['peak_rss_mb']:,.0f} MB"
        )
        return
    r = bench_build(args.gpus, args.hours, repeat=args.repeat)
    print(
        f"{int(r['telemetry_rows']):,} telemetry rows -> {int(r['feature_rows']):,} x {int(r['feature_columns'])} features "
        f"in {r['seconds']:.2f} s: {r['rows_per_s']:,.0f} telemetry rows/s (best of {args.repeat}, "
        f"{pl.thread_pool_size()} polars threads)"
    )
    if args.pandas:
        c = bench_compare(32, args.hours)
        print(
            f"same run, {int(c['telemetry_rows']):,} rows: gpufail build (all features) {c['gpufail_rows_per_s']:,.0f} rows/s, "
            f"pandas groupby-rolling (window statistics only) {c['pandas_rows_per_s']:,.0f} rows/s"
        )


if __name__ == "__main__":
    main()
