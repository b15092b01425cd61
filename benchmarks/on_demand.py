"""Features on demand against the materialised table, on one store (a measurement, not a test).

    .venv/bin/python -m benchmarks.on_demand --data DATA     # a store with both forms built

DATA needs `gpufail features` (the table) and `gpufail features --aggregates` (the stored
aggregates) built; `make bench` runs this on the demo after its pipeline. Prints, from one
run: the bytes on disk of each form, and the seconds each reader takes from the table and on
demand, for what each consumer asks for: the newest grid time (scoring, serving readiness, the
fleet facts computed first, nothing cached), the training draw at 10% of the negatives over all
days, and a 6-day test window (evaluation).
"""

from __future__ import annotations

import argparse
import os
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
    from features import on_demand
    from features.aggregates import BUCKETS, PRESENCE
    from features.dataset import FEATURES_DATASET, drawn_rows, read_features, read_newest_grid_time
    from ingest.store import Store

    store = Store.open(data)
    figures: dict[str, float] = {
        "features_bytes": _bytes(store, FEATURES_DATASET),
        "aggregates_bytes": _bytes(store, BUCKETS, PRESENCE),
    }
    table_s, newest = _seconds(lambda: read_newest_grid_time(store))
    ts = newest["ts"].max()
    on_demand._FACTS.clear()  # serving readiness: a process that has computed nothing yet
    demand_s, got = _seconds(lambda: on_demand.features_on_demand(store, ts, ts + US))
    assert got.height == newest.height
    figures |= {"newest_gpus": newest.height, "newest_table_s": table_s, "newest_on_demand_s": demand_s}

    days = store.dates(FEATURES_DATASET)
    first = datetime.combine(days[0], datetime.min.time(), tzinfo=UTC)
    table_s, table = _seconds(lambda: drawn_rows(store, first, ts + US, 0.1))
    demand_s, got = _seconds(lambda: on_demand.features_on_demand(store, first, ts + US, rows=on_demand.drawn(0.1)))
    assert got.height == table.height
    figures |= {"draw_rows": table.height, "draw_table_s": table_s, "draw_on_demand_s": demand_s}

    start = ts - timedelta(days=6) + timedelta(hours=1)
    table_s, table = _seconds(lambda: read_features(store, start, ts + US))
    demand_s, got = _seconds(lambda: on_demand.features_on_demand(store, start, ts + US))
    assert got.height == table.height
    figures |= {"window_rows": table.height, "window_table_s": table_s, "window_on_demand_s": demand_s}
    figures["days"] = len(days)
    return figures


def markdown_lines(f: dict[str, float]) -> list[str]:
    """The figures as bullet lines for bench.md."""
    ratio = f["features_bytes"] / f["aggregates_bytes"] if f["aggregates_bytes"] else float("nan")
    return [
        f"- on disk: features table {f['features_bytes'] / 1e6:,.1f} MB, stored aggregates (buckets and presence) "
        f"{f['aggregates_bytes'] / 1e6:,.1f} MB ({ratio:.1f}x smaller)",
        f"- newest grid time ({f['newest_gpus']:,.0f} GPUs): table {f['newest_table_s']:.2f} s, on demand "
        f"{f['newest_on_demand_s']:.2f} s (fleet facts included)",
        f"- training draw, 10% of negatives over {f['days']:.0f} days ({f['draw_rows']:,.0f} rows): table "
        f"{f['draw_table_s']:.2f} s, on demand {f['draw_on_demand_s']:.2f} s",
        f"- 6-day test window ({f['window_rows']:,.0f} rows): table {f['window_table_s']:.2f} s, on demand "
        f"{f['window_on_demand_s']:.2f} s",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a store with the features table and the stored aggregates")
    args = parser.parse_args()
    print("\n".join(markdown_lines(bench_on_demand(args.data))))


if __name__ == "__main__":
    main()
