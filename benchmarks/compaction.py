"""Files per day and the feature build's read of a day, before and after `gpufail compact`, on a
day of many simulated collectors (a measurement, not a test).

    flock /tmp/gpufail-heavy.lock .venv/bin/python -m benchmarks.compaction --nodes 1000

Each of `--nodes` collectors (8 GPUs each) flushes every `--flush` (the collector's default,
five minutes) one telemetry part file holding its GPUs' samples since the last flush, one every
`--interval`. The files are written as a finished collector commit leaves them (visible names,
the store's compression, page checksums and CRC-32 in the name); the journal's own cost is not
part of what is measured. Then, in this process, with the page cache warm for both:

- read before: `features.inputs.read_telemetry` of the day (what the stored aggregates build
  reads per day: the listing, the CRC-32 of every file, the polars read), with the store's
  record of verified files cleared first, as in a fresh process;
- compact: `ingest.compact.compact` of the day (the nightly's step);
- read after: the same read of the compacted day; the rows are checked to be the same.

`--no-read-before`: skip the read before, for a day too large to read uncompacted in this
machine's memory (a frame read from many files keeps a chunk per file and column, about 40 KB a
telemetry file); the rows after are then counted against those written.
"""

from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import time
import uuid
import zlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

import ingest.store as store_module
from features.inputs import read_telemetry
from ingest.compact import compact
from ingest.store import COMPRESSION, Store, conform
from tests.synthetic import synthetic_telemetry

DAY = datetime(2026, 1, 5, tzinfo=UTC)
GPUS_PER_NODE = 8


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compaction", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--hours", type=float, default=24.0, help="hours of the day the collectors write")
    parser.add_argument("--flush", type=float, default=5.0, help="minutes between a collector's flushes")
    parser.add_argument("--interval", type=float, default=5.0, help="minutes between a GPU's samples")
    parser.add_argument("--work", default=None, help="folder for the data root (default: a temporary one)")
    parser.add_argument("--no-read-before", action="store_true", help="skip the read of the uncompacted day")
    args = parser.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpufail-compaction-bench-"))
    try:
        _run(work / "root", args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(root: Path, args: argparse.Namespace) -> None:
    store = Store.create(str(root))
    began = time.perf_counter()
    files, rows = _write_collectors(store, args)
    print(
        f"{args.nodes} collectors x {args.hours:g} h, a flush every {args.flush:g} min, a sample every "
        f"{args.interval:g} min: {files:,} telemetry files, {rows:,} rows written in {time.perf_counter() - began:.0f} s",
        flush=True,
    )
    end = DAY + timedelta(days=1)
    listed = len(store.files("telemetry", DAY.date(), DAY.date()))
    if args.no_read_before:
        before = None
        print(f"before: {listed:,} files; read_telemetry of the day not run (--no-read-before)", flush=True)
    else:
        before_s, before = _timed_read(store, end)
        print(f"before: {listed:,} files; read_telemetry of the day {before_s:.1f} s wall", flush=True)
    began = time.perf_counter()
    summary = compact(store, ["telemetry"], settle=timedelta(0), now=end)
    compact_s = time.perf_counter() - began
    print(f"{summary.line()} ({compact_s:.1f} s wall)", flush=True)
    listed = len(store.files("telemetry", DAY.date(), DAY.date()))
    after_s, after = _timed_read(store, end)
    if before is None:
        check = f"rows: {after.height:,} of the {rows:,} written"
    else:
        check = f"same rows: {before.sort('gpu_uuid', 'ts').equals(after.sort('gpu_uuid', 'ts'))}"
    print(f"after: {listed:,} files; read_telemetry of the day {after_s:.2f} s wall; {check}", flush=True)


def _timed_read(store: Store, end: datetime) -> tuple[float, pl.DataFrame]:
    store_module._VERIFIED.clear()  # as in a fresh process
    began = time.perf_counter()
    frame = read_telemetry(store, DAY, end)
    return time.perf_counter() - began, frame


def _write_collectors(store: Store, args: argparse.Namespace) -> tuple[int, int]:
    """The part files the collectors' flushes leave, node by node."""
    folder = Path(store.path("telemetry", f"date={DAY.date()}"))
    folder.mkdir(parents=True, exist_ok=True)
    flush = timedelta(minutes=args.flush)
    files = rows = 0
    for first in range(0, args.nodes, 50):
        n = min(50, args.nodes - first)
        tel = synthetic_telemetry(
            n * GPUS_PER_NODE,
            args.hours,
            interval=timedelta(minutes=args.interval),
            gpus_per_node=GPUS_PER_NODE,
            start=DAY,
            seed=first,
        )
        tel = tel.with_columns(
            ("node-" + ((pl.col("node").str.extract(r"(\d+)$").cast(pl.Int64) + first).cast(pl.String))).alias("node"),
            (pl.col("gpu_uuid") + f"-{first}").alias("gpu_uuid"),
        )
        flushes = ((pl.col("ts") - pl.lit(DAY)).dt.total_microseconds() // int(flush.total_seconds() * 1e6)).alias(
            "_flush"
        )
        ordered = tel.with_columns(flushes).sort("node", "_flush", "ts")
        # One part per (node, flush): slices of the batch, put in the store's schema once (doing
        # it part by part was most of the time of writing a day's 288,000 files).
        sizes = ordered.group_by("node", "_flush", maintain_order=True).len()["len"].to_list()
        batch = conform(ordered.drop("_flush").to_arrow(), "telemetry").combine_chunks()
        offset = 0
        for size in sizes:
            table = batch.slice(offset, size)
            offset += size
            buffer = io.BytesIO()
            pq.write_table(table, buffer, compression=COMPRESSION, write_page_checksum=True)
            data = buffer.getvalue()
            name = f"part-{uuid.uuid4().hex}-crc32-{zlib.crc32(data):08x}.parquet"
            (folder / name).write_bytes(data)
            files += 1
            rows += table.num_rows
    return files, rows


if __name__ == "__main__":
    main()
