"""Features on demand against the materialised table, on one store (a measurement, not a test).

    .venv/bin/python -m benchmarks.on_demand --data DATA
    .venv/bin/python -m benchmarks.on_demand --data DATA --serving

`--serving` measures serving readiness alone, in fresh processes (`serving_readiness`): the
features of the newest grid time computed on load, first with nothing cached (the fleet facts
and the rows are computed and cached on disk, `features.facts_cache`, `features.newest_cache`),
then with the fleet facts cached, then with the rows cached (a replica that starts after
another); it needs only the stored aggregates, and writes only those two cache files.

DATA needs `gpufail features` (the stored aggregates) and `gpufail features --materialise` (the
table); `make bench` runs this on the demo after its pipeline. Prints, from one run: the bytes
on disk of each form, and the seconds each consumer's read takes on demand (`features.dataset`,
as the commands read) and from the table (the table's files scanned directly, as the readers
did before the aggregates): the newest grid time (scoring, serving readiness; the fleet facts
computed first, nothing cached; then again, its rows cached), the training draw at 10% of the
negatives over all days (nothing cached; then again, its days cached), and
a 6-day test window (evaluation).
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

US = timedelta(microseconds=1)


def _seconds(run: Callable[[], Any]) -> tuple[float, Any]:
    began = time.perf_counter()
    out = run()
    return time.perf_counter() - began, out


def _bytes(store: Any, *datasets: str) -> int:
    return sum(os.path.getsize(p) for d in datasets for p in store.files(d))


def bench_on_demand(data: str) -> dict[str, float]:
    import polars as pl

    from features import on_demand
    from features.aggregates import BUCKETS, PRESENCE
    from features.dataset import FEATURES_DATASET, computed, drawn_rows, read_features, read_newest_grid_time
    from features.facts_cache import cache_path
    from features.newest_cache import ROWS_FILE
    from features.sample_key import SAMPLE_KEY, key_threshold
    from ingest.store import Store

    store = Store.open(data)
    assert computed(store), f"{data}: no stored aggregates; run gpufail features first"
    table = pl.scan_parquet(store.files(FEATURES_DATASET), hive_partitioning=False)
    figures: dict[str, float] = {
        "features_bytes": _bytes(store, FEATURES_DATASET),
        "aggregates_bytes": _bytes(store, BUCKETS, PRESENCE),
    }
    newest_ts = table.select(pl.col("ts").max()).collect().item()
    table_s, newest = _seconds(lambda: table.filter(pl.col("ts") == newest_ts).collect())
    on_demand._FACTS.clear()  # serving readiness: a process that has computed nothing yet
    for cached in (cache_path(store), ROWS_FILE.path(store)):
        if os.path.exists(cached):
            os.remove(cached)
    demand_s, got = _seconds(lambda: read_newest_grid_time(store))
    assert got.height == newest.height, (got.height, newest.height)
    cached_s, again = _seconds(lambda: read_newest_grid_time(store))
    assert again.equals(got)
    figures |= {
        "newest_gpus": newest.height,
        "newest_table_s": table_s,
        "newest_on_demand_s": demand_s,
        "newest_cached_s": cached_s,
    }

    first = datetime.combine(store.dates(FEATURES_DATASET)[0], datetime.min.time(), tzinfo=UTC)
    end = newest_ts + US
    draw = (pl.col("label") == 1) | ((pl.col("label") == 0) & (pl.col(SAMPLE_KEY) < key_threshold(0.1)))
    table_s, rows = _seconds(lambda: table.filter(draw).collect())
    for path in glob.glob(os.path.join(store.path("_cache"), "drawn-*.bin")):
        os.remove(path)
    demand_s, got = _seconds(lambda: drawn_rows(store, first, end, 0.1))
    assert got.height == rows.height, (got.height, rows.height)
    cached_s, again = _seconds(lambda: drawn_rows(store, first, end, 0.1))
    assert again.equals(got)
    figures |= {
        "draw_rows": rows.height,
        "draw_table_s": table_s,
        "draw_on_demand_s": demand_s,
        "draw_cached_s": cached_s,
    }

    start = newest_ts - timedelta(days=6) + timedelta(hours=1)
    window = pl.col("ts").is_between(start, newest_ts)
    table_s, rows = _seconds(lambda: table.filter(window).collect())
    demand_s, got = _seconds(lambda: read_features(store, start, end))
    assert got.height == rows.height, (got.height, rows.height)
    figures |= {"window_rows": rows.height, "window_table_s": table_s, "window_on_demand_s": demand_s}
    figures["days"] = len(store.dates(FEATURES_DATASET))
    return figures


# `import gpufail` first, as every `gpufail` command (the server's included) starts: it sets the
# allocator polars runs with (`gpufail.polars_allocator_settings`).
_NEWEST_CHILD = """
import resource, sys, time
began = time.perf_counter()
import gpufail
from features.dataset import read_newest_grid_time
from ingest.store import Store
rows = read_newest_grid_time(Store.open(sys.argv[1]))
seconds = time.perf_counter() - began
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(rows.height, rows.width, round(seconds, 2), round(peak_mb))
"""


def newest_in_a_fresh_process(data: str) -> dict[str, float]:
    """`read_newest_grid_time` in a new interpreter: its rows and columns, the seconds from
    the first import to the rows, and the process's peak memory (MB)."""
    out = subprocess.run([sys.executable, "-c", _NEWEST_CHILD, data], capture_output=True, text=True, check=True)
    rows, columns, seconds, peak_mb = out.stdout.split()[-4:]
    return {"gpus": int(rows), "columns": int(columns), "seconds": float(seconds), "peak_mb": float(peak_mb)}


def forget_newest_rows(data: str) -> None:
    """Remove the newest rows' cache file (`features.newest_cache`): the next reader computes them."""
    from features.newest_cache import ROWS_FILE
    from ingest.store import Store

    path = ROWS_FILE.path(Store.open(data))
    if os.path.exists(path):
        os.remove(path)


def serving_readiness(data: str) -> dict[str, dict[str, float]]:
    """The newest grid time in a fresh process three times: with nothing cached (the fleet facts
    and the rows are computed, and cached), with the fleet facts cached (the rows computed: a
    replica after the store changed), then with the rows cached (a replica starting after
    another, or after `gpufail score`)."""
    from features.facts_cache import cache_path
    from ingest.store import Store

    path = cache_path(Store.open(data))
    if os.path.exists(path):
        os.remove(path)
    forget_newest_rows(data)
    figures = {"nothing cached": newest_in_a_fresh_process(data)}
    forget_newest_rows(data)
    figures["fleet facts cached"] = newest_in_a_fresh_process(data)
    figures["rows cached"] = newest_in_a_fresh_process(data)
    return figures


def serving_lines(figures: dict[str, dict[str, float]]) -> list[str]:
    return [
        f"- serving readiness, newest grid time in a fresh process ({f['gpus']:,.0f} GPUs x {f['columns']:,.0f} "
        f"columns), {how}: {f['seconds']:.2f} s, peak {f['peak_mb'] / 1024:.2f} GB"
        for how, f in figures.items()
    ]


def markdown_lines(f: dict[str, float]) -> list[str]:
    """The figures as bullet lines for bench.md."""
    ratio = f["features_bytes"] / f["aggregates_bytes"] if f["aggregates_bytes"] else float("nan")
    return [
        f"- on disk: features table {f['features_bytes'] / 1e6:,.1f} MB, stored aggregates (buckets and presence) "
        f"{f['aggregates_bytes'] / 1e6:,.1f} MB ({ratio:.1f}x smaller)",
        f"- newest grid time ({f['newest_gpus']:,.0f} GPUs): on demand {f['newest_on_demand_s']:.2f} s (fleet facts "
        f"included), its rows cached {f['newest_cached_s']:.2f} s, from the table {f['newest_table_s']:.2f} s",
        f"- training draw, 10% of negatives over {f['days']:.0f} days ({f['draw_rows']:,.0f} rows): on demand "
        f"{f['draw_on_demand_s']:.2f} s, its days cached {f['draw_cached_s']:.2f} s, from the table "
        f"{f['draw_table_s']:.2f} s",
        f"- 6-day test window ({f['window_rows']:,.0f} rows): on demand {f['window_on_demand_s']:.2f} s, from the "
        f"table {f['window_table_s']:.2f} s",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a store with the stored aggregates and the features table")
    parser.add_argument("--serving", action="store_true", help="serving readiness alone (the aggregates suffice)")
    args = parser.parse_args()
    if args.serving:
        print("\n".join(serving_lines(serving_readiness(args.data))))
        return
    print("\n".join(markdown_lines(bench_on_demand(args.data))))


if __name__ == "__main__":
    main()
