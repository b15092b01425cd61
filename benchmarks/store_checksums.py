"""What the store's checksums cost (a measurement, not a test).

    .venv/bin/python -m benchmarks.store_checksums demo-data            # its whole telemetry
    .venv/bin/python -m benchmarks.store_checksums demo-data --days 10

The telemetry of the given data root is first rewritten by this gpufail's store into a
temporary one, so that every file carries both checksums (files written before them have
neither). Then, best of `REPEATS`, in CPU and wall seconds:

- write: the same rows written with and without Parquet page checksums;
- read, as local readers do: polars over the files, as `features` and the kernel-log ingest
  read telemetry, without verification (before) and after `Store.verify` (the whole-file
  CRC-32, once per process: what a local read now costs);
- read through pyarrow, as remote stores are read: without and with page checksum
  verification.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import polars as pl
import pyarrow.dataset as ds
import pyarrow.parquet as pq

import ingest.store as store_module
from ingest.store import Store

REPEATS = 3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store_checksums", description=__doc__.split("\n")[0])
    parser.add_argument("data", help="a data root with telemetry (e.g. `make demo`'s demo-data)")
    parser.add_argument("--days", type=int, default=None, help="only the first DAYS days of telemetry")
    args = parser.parse_args(argv)
    source = Store.open(args.data)
    days = source.dates("telemetry")[: args.days]
    if not days:
        raise SystemExit(f"{args.data}: no telemetry to read")
    work = Path(tempfile.mkdtemp(prefix="gpufail-store-bench-"))
    try:
        _run(source, days, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, datetime.min.time(), tzinfo=UTC)
    return start, start + timedelta(days=1)


def _run(source: Store, days: list[date], work: Path) -> None:
    tables = [source.scan("telemetry", *_day_bounds(day)).collect().to_arrow() for day in days]
    store = Store.create(str(work / "root"))
    files = [store.write_partition("telemetry", day, table) for day, table in zip(days, tables, strict=True)]
    size = sum(Path(f).stat().st_size for f in files)
    rows = sum(t.num_rows for t in tables)
    print(f"{len(files)} telemetry files, {rows:,} rows, {size / 1e6:,.1f} MB (snappy), best of {REPEATS}")

    plain = work / "plain"
    plain.mkdir()

    def write(checksums: bool) -> Callable[[], object]:
        return lambda: [
            pq.write_table(
                t, plain / f"{i}.parquet", compression="snappy", row_group_size=1_000_000, write_page_checksum=checksums
            )
            for i, t in enumerate(tables)
        ]

    def verify() -> None:
        store_module._VERIFIED.clear()  # as in a fresh process
        for f in files:
            store.verify(f)

    def polars_read() -> object:
        return pl.scan_parquet(files, hive_partitioning=False).collect()

    def polars_read_verified() -> object:
        verify()
        return polars_read()

    def pyarrow_read(checked: bool) -> Callable[[], object]:
        options = ds.ParquetFragmentScanOptions(page_checksum_verification=checked)
        fmt = ds.ParquetFileFormat(default_fragment_scan_options=options)
        return lambda: ds.dataset(files, format=fmt).to_table()

    results = [
        ("write, no page checksums", _best(write(False))),
        ("write, page checksums", _best(write(True))),
        ("verify: whole-file CRC-32 alone", _best(verify)),
        ("polars read, unverified (before)", _best(polars_read)),
        ("polars read after Store.verify (now)", _best(polars_read_verified)),
        ("pyarrow read, pages unverified", _best(pyarrow_read(False))),
        ("pyarrow read, page checksums verified", _best(pyarrow_read(True))),
    ]
    for name, (cpu, wall) in results:
        print(f"  {name:40s} {cpu:7.2f} s CPU {wall:7.2f} s wall  {size / 1e6 / wall:8,.0f} MB/s (wall)")


def _best(step: Callable[[], object]) -> tuple[float, float]:
    best = (float("inf"), float("inf"))
    for _ in range(REPEATS):
        cpu, wall = time.process_time(), time.perf_counter()
        step()
        best = min(best, (time.process_time() - cpu, time.perf_counter() - wall), key=lambda t: t[1])
    return best


if __name__ == "__main__":
    main()
