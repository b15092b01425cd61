"""`gpufail compact`: a settled day's part files rewritten as a few files of whole nodes in node
order, one journal commit per day; readers see every row once before, during and after."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from features.windows import in_gpu_and_time_order
from ingest.compact import compact
from ingest.errors import StoreError
from ingest.store import ROW_GROUP_SIZE, Store
from tests.cli import GPUFAIL, gpufail
from tests.conftest import make_rows
from tests.synthetic import synthetic_telemetry

T0 = datetime(2026, 1, 5, tzinfo=UTC)
LATER = T0 + timedelta(days=30)
"""A clock at which every day of the fleet below has settled."""


def collector_like(root: Path, *, nodes: int = 4, hours: float = 48, flush_rows: int = 24) -> Store:
    """A store as collectors leave it: each node's rows in many small files (one per flush),
    plus a few XID events and collector runs, each written alone."""
    store = Store.create(str(root))
    tel = synthetic_telemetry(nodes * 2, hours, interval=timedelta(minutes=30), gpus_per_node=2, start=T0, seed=4)
    for _, part in tel.group_by("node", maintain_order=True):
        for i in range(0, part.height, flush_rows):
            store.write("telemetry", part.slice(i, flush_rows).to_arrow())
    for h in (1, 5, 30):
        store.write("xid_events", make_rows("xid_events", [T0 + timedelta(hours=h)], xid=79, node=f"n{h}"))
        store.write("collector_runs", make_rows("collector_runs", [T0 + timedelta(hours=h)], node=f"n{h}", ok=True))
    return store


def rows(store: Store, dataset: str = "telemetry") -> pl.DataFrame:
    """What a reader gets, in a canonical order (the polars read path)."""
    frame = store.collect(store.scan(dataset), dataset)
    return frame.sort(frame.columns)


def test_a_day_becomes_few_files_of_whole_nodes_in_node_order_with_every_row_kept(tmp_path: Path) -> None:
    store = collector_like(tmp_path / "root")
    before = {d: rows(store, d) for d in ("telemetry", "xid_events", "collector_runs")}
    files_before = len(store.files("telemetry"))
    summary = compact(store, now=LATER, file_rows=200)
    for dataset, frame in before.items():
        assert rows(store, dataset).equals(frame), dataset
    assert summary.files_read["telemetry"] == files_before > 20
    after = store.files("telemetry")
    assert len(after) == summary.files_written["telemetry"] < files_before // 5
    assert summary.files_written["xid_events"] == 1 and summary.days["collector_runs"] == 1
    nodes_seen: list[set[str]] = []
    for path in after:
        frame = pl.read_parquet(path)
        assert frame.height <= 200 or frame["node"].n_unique() == 1
        assert frame.equals(frame.sort("cluster", "node", "gpu_uuid", "ts"))
        assert in_gpu_and_time_order(frame)
        meta = pq.ParquetFile(path).metadata
        assert all(meta.row_group(i).num_rows <= ROW_GROUP_SIZE for i in range(meta.num_row_groups))
        nodes_seen.append(set(frame["node"]))
    # Whole nodes: no node is split between two files of a day.
    by_day: dict[str, Counter[str]] = {}
    for path, nodes in zip(after, nodes_seen, strict=True):
        by_day.setdefault(path.split("/date=")[1][:10], Counter()).update(nodes)
    assert all(count == 1 for day in by_day.values() for count in day.values())


def test_a_day_of_more_files_than_a_read_holds_is_read_a_batch_at_a_time_into_the_same_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A frame read from many files keeps a chunk per file and column: a day of a large fleet's
    # collectors is read a few thousand files at a time, into the same files as in one read.
    import ingest.compact as compaction

    whole, batched = collector_like(tmp_path / "whole"), collector_like(tmp_path / "batched")
    compact(whole, ["telemetry"], now=LATER, file_rows=200)
    monkeypatch.setattr(compaction, "READ_FILES", 3)
    summary = compact(batched, ["telemetry"], now=LATER, file_rows=200)
    assert summary.files_read["telemetry"] > 3 * 5
    # The files by their first rows (their names are random).
    written = [
        sorted((pl.read_parquet(path) for path in store.files("telemetry")), key=lambda f: f.row(0))
        for store in (whole, batched)
    ]
    assert len(written[0]) == len(written[1]) == 4
    assert all(a.equals(b) for a, b in zip(*written, strict=True))


def test_a_second_run_changes_nothing(tmp_path: Path) -> None:
    store = collector_like(tmp_path / "root")
    compact(store, now=LATER, file_rows=200)
    files = store.files("telemetry")
    assert len(files) == 4  # two files of whole nodes a day
    again = compact(store, now=LATER, file_rows=200)
    assert again.days == {} and again.line().startswith("compact: nothing to compact")
    assert store.files("telemetry") == files


def test_the_day_still_being_written_is_left_alone_until_it_settles(tmp_path: Path) -> None:
    store = collector_like(tmp_path / "root")
    last = store.dates("telemetry")[-1]
    day_end = datetime(last.year, last.month, last.day, tzinfo=UTC) + timedelta(days=1)
    untouched = store.files("telemetry", last, last)
    summary = compact(store, ["telemetry"], settle=timedelta(hours=6), now=day_end + timedelta(hours=5))
    assert store.files("telemetry", last, last) == untouched and len(untouched) > 1
    assert summary.unsettled == [f"telemetry {last}"] and summary.days == {"telemetry": 1}
    compact(store, ["telemetry"], settle=timedelta(hours=6), now=day_end + timedelta(hours=6))
    assert len(store.files("telemetry", last, last)) == 1


def test_files_committed_while_a_day_is_compacted_are_kept_and_taken_in_next_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ingest.compact as compaction

    store = collector_like(tmp_path / "root")
    late = synthetic_telemetry(2, 1, interval=timedelta(minutes=30), start=T0 + timedelta(hours=3), seed=9)
    late = late.with_columns(pl.lit("late-node").alias("node"))
    expected = pl.concat([rows(store), late]).sort(late.columns)
    groups = compaction._node_groups

    def with_a_collector_flushing_meanwhile(*args, **kwargs):  # type: ignore[no-untyped-def]
        yield from groups(*args, **kwargs)
        if not (tmp_path / "flushed").exists():
            (tmp_path / "flushed").touch()
            store.write("telemetry", late.to_arrow())

    monkeypatch.setattr(compaction, "_node_groups", with_a_collector_flushing_meanwhile)
    compact(store, ["telemetry"], now=LATER)
    assert rows(store).equals(expected)
    assert len(store.files("telemetry", T0.date(), T0.date())) == 2  # the compacted file and the late one
    monkeypatch.setattr(compaction, "_node_groups", groups)
    compact(store, ["telemetry"], now=LATER)
    assert rows(store).equals(expected) and len(store.files("telemetry", T0.date(), T0.date())) == 1


def test_a_corrupt_part_file_stops_compaction_naming_it_and_nothing_changes(tmp_path: Path) -> None:
    store = collector_like(tmp_path / "root")
    bad = Path(store.files("telemetry")[3])
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x08
    bad.write_bytes(bytes(data))
    listing = sorted(p.relative_to(tmp_path) for p in (tmp_path / "root").rglob("*.parquet"))
    with pytest.raises(StoreError, match=f"{bad}: corrupt file"):
        compact(store, ["telemetry"], now=LATER)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "root").rglob("*.parquet")) == listing


def test_replaced_files_linger_for_readers_that_listed_them_then_go(tmp_path: Path) -> None:
    store = collector_like(tmp_path / "root")
    on_disk = sorted((tmp_path / "root" / "telemetry").rglob("part-*.parquet"))
    expected = rows(store)
    compact(store, ["telemetry"], now=LATER)  # the default grace
    for path in on_disk:
        assert path.exists()  # a reader that listed it before the commit can still open it
        assert pl.read_parquet(path).height > 0
    assert rows(store).equals(expected) and len(store.files("telemetry")) == 2
    assert (tmp_path / "root" / "_state" / "compact-telemetry.inflight").exists()
    compact(store, ["telemetry"], now=LATER, linger=timedelta(0))  # after the grace
    assert not any(path.exists() for path in on_disk)
    assert not (tmp_path / "root" / "_state" / "compact-telemetry.inflight").exists()
    assert rows(store).equals(expected)


def test_lingering_files_of_one_day_stay_hidden_while_the_next_day_is_compacted(tmp_path: Path) -> None:
    store = collector_like(tmp_path / "root")
    expected = rows(store)
    first, second = store.dates("telemetry")
    compact(store, ["telemetry"], now=LATER, last_day=first)
    compact(store, ["telemetry"], now=LATER, first_day=second)
    # The second commit's record carries the first day's lingering files.
    assert rows(store).equals(expected) and len(store.files("telemetry")) == 2


def test_an_object_store_root_is_compacted_through_the_same_journal() -> None:
    store = Store.create(f"memory://compact-{time.monotonic_ns()}")
    times = [T0 + timedelta(minutes=10 * i) for i in range(12)]
    for i, moment in enumerate(times):
        store.write("xid_events", make_rows("xid_events", [moment], xid=43, node=f"n{i % 3}"))
    before = pl.DataFrame(store.read("xid_events")).sort("ts")
    compact(store, ["xid_events"], now=LATER)
    assert len(store.files("xid_events")) == 1
    assert pl.DataFrame(store.read("xid_events")).sort("ts").equals(before)


def test_an_unknown_dataset_is_one_line_naming_it(tmp_path: Path) -> None:
    collector_like(tmp_path / "root", hours=2)
    ran = gpufail("compact", "--data", str(tmp_path / "root"), "--dataset", "telemetri")
    assert ran.returncode == 2 and ran.stderr.count("\n") == 1
    assert "compact: unknown dataset 'telemetri'" in ran.stderr


def test_the_command_takes_its_settle_time_from_the_option_else_the_configuration(tmp_path: Path) -> None:
    yesterday = datetime.now(UTC).date() - timedelta(days=1)
    store = Store.create(str(tmp_path / "root"))
    for h in range(3):
        moment = datetime(yesterday.year, yesterday.month, yesterday.day, h, tzinfo=UTC)
        store.write("xid_events", make_rows("xid_events", [moment], xid=79, node="n0"))
    data = ["--data", str(tmp_path / "root"), "--dataset", "xid_events"]
    waiting = gpufail("compact", *data, env={"GPUFAIL_STORE__COMPACT_SETTLE": "2d"})
    assert waiting.returncode == 0 and f"left until settled: xid_events {yesterday}" in waiting.stdout
    bad = gpufail("compact", *data, "--settle", "soon")
    assert bad.returncode == 2 and bad.stderr.startswith("gpufail: error: --settle: ")
    done = gpufail("compact", *data, "--settle", "0s", env={"GPUFAIL_STORE__COMPACT_SETTLE": "2d"})
    assert done.returncode == 0 and done.stdout.startswith("compact: xid_events 3 files -> 1 "), done.stdout


def test_the_command_reports_what_it_did(tmp_path: Path) -> None:
    collector_like(tmp_path / "root")
    ran = gpufail("compact", "--data", str(tmp_path / "root"), "--start", "2026-01-05", "--end", "2026-01-06")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("compact: telemetry ") and "telemetry 16 files -> 1 (384 rows, 1 day)" in ran.stdout
    assert len(Store.open(str(tmp_path / "root")).files("telemetry", date(2026, 1, 6), date(2026, 1, 6))) > 1
    as_json = gpufail("compact", "--data", str(tmp_path / "root"), "--json")
    facts = json.loads(as_json.stdout)
    assert facts["command"] == "compact" and facts["days"] == {"telemetry": 1} and facts["unsettled"] == []


def test_readers_during_compaction_see_every_row_exactly_once(tmp_path: Path) -> None:
    """Readers in this process (both read paths) while `gpufail compact` runs in another."""
    store = collector_like(tmp_path / "root", nodes=6, hours=72, flush_rows=12)
    expected = rows(store)
    keys = expected.select("gpu_uuid", "ts")
    reads: list[float] = []
    problems: list[str] = []
    done = threading.Event()

    def read_again_and_again(path: str) -> None:
        reader = Store.open(str(tmp_path / "root"))
        while not done.is_set():
            started = time.monotonic()
            try:
                if path == "polars":
                    got = reader.collect(reader.scan("telemetry", columns=["gpu_uuid", "ts"]), "telemetry")
                else:
                    got = pl.DataFrame(reader.read("telemetry", columns=["gpu_uuid", "ts"]))
            except Exception as exc:
                problems.append(f"{path}: {type(exc).__name__}: {exc}")
                continue
            if not got.sort("gpu_uuid", "ts").equals(keys.sort("gpu_uuid", "ts")):
                problems.append(f"{path}: {got.height} rows, {got.is_duplicated().sum()} repeated")
            reads.append(started)

    readers = [threading.Thread(target=read_again_and_again, args=(p,)) for p in ("polars", "pyarrow")]
    for reader in readers:
        reader.start()
    marker = tmp_path / "root" / "_state" / "compact-telemetry.inflight"
    try:
        process = subprocess.Popen(
            [*GPUFAIL, "compact", "--data", str(tmp_path / "root"), "--dataset", "telemetry", "--settle", "0s"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        first_commit = None
        while process.poll() is None:
            if first_commit is None and marker.exists():
                first_commit = time.monotonic()
            time.sleep(0.002)
        ended = time.monotonic()
        _, err = process.communicate()
    finally:
        done.set()
        for reader in readers:
            reader.join()
    assert process.returncode == 0, err
    assert problems == []
    # Reads that began while days were still being compacted (the first day's commit is done).
    assert first_commit is not None
    assert sum(first_commit <= t <= ended for t in reads) >= 3, (len(reads), first_commit, ended)
    assert len(store.files("telemetry")) == 3 and rows(store).equals(expected)
