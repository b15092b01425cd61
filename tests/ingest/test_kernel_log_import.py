"""End-to-end tests of `ingest.kernel_log_import` on a temporary store: mapping bus ids to GPUs
(including a GPU replaced mid-log), never replaying a file, reading only appended lines,
rotated and gzipped files, and bad input."""

from __future__ import annotations

import gzip
import os
import re
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from ingest.errors import InputError, StoreError
from ingest.kernel_log_import import STATE_NAME, IngestSummary, ingest_kernel_logs, node_from_filename
from ingest.schema import telemetry_schema
from ingest.store import Store

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "kernel_log"
T0 = datetime(2026, 1, 5, tzinfo=UTC)
CLUSTER = "test-cluster"
NODE = "gpu-node-007"
WINDOW = timedelta(minutes=5)

BUS_A = "0000:18:00"  # slot 0: GPU-A0 until hour 10, then replaced by GPU-A1 from hour 12
BUS_B = "0000:2a:00"  # slot 1: GPU-B all day
BUS_UNKNOWN = "0000:99:00"  # not in telemetry


def telemetry_table(samples: list[tuple[datetime, str, int, str, str]]) -> pa.Table:
    """Telemetry rows (ts, node, gpu_index, gpu_uuid, pci_bus_id); metric columns null."""
    schema = telemetry_schema()
    n = len(samples)
    given = {
        "ts": [s[0] for s in samples],
        "cluster": [CLUSTER] * n,
        "node": [s[1] for s in samples],
        "gpu_index": [s[2] for s in samples],
        "gpu_uuid": [s[3] for s in samples],
        # telemetry comes from NVML, which prints the long form
        "pci_bus_id": [f"0000{s[4]}.0" for s in samples],
    }
    columns = [
        pa.array(given[f.name], f.type) if f.name in given else pa.nulls(n, f.type)  # metric columns: null
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    store = Store.create(str(tmp_path / "store"))
    samples = []
    for hour in range(0, 25):
        t = T0 + timedelta(hours=hour)
        if hour <= 10:
            samples.append((t, NODE, 0, "GPU-A0", BUS_A))
        if hour >= 12:
            samples.append((t, NODE, 0, "GPU-A1", BUS_A))
        samples.append((t, NODE, 1, "GPU-B", BUS_B))
        samples.append((t, "other-node", 0, "GPU-OTHER", BUS_A))  # same bus id on another node
    store.write("telemetry", telemetry_table(samples))
    return store


def iso(moment: datetime) -> str:
    """`dmesg --time-format=iso --decode` prefix: no host, so the node comes from the file."""
    return f"kern  :warn  : {moment:%Y-%m-%dT%H:%M:%S},{moment.microsecond:06d}+00:00 "


def xid_line(moment: datetime, bus: str, xid: int, text: str = "Graphics SM Warp Exception") -> str:
    return f"{iso(moment)}NVRM: Xid (PCI:{bus}): {xid}, pid='<unknown>', name=<unknown>, {text}\n"


def hours(h: float) -> datetime:
    return T0 + timedelta(hours=h)


def node_log() -> str:
    lines = [f"{iso(hours(0.5))}IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready\n"]
    lines += [xid_line(hours(1) + timedelta(seconds=s / 10), BUS_A, 13) for s in range(50)]  # flood: 1 incident
    lines.append(xid_line(hours(2), BUS_B, 94, "Contained ECC error."))
    lines.append(xid_line(hours(3), BUS_UNKNOWN, 31))
    lines.append(xid_line(hours(11), BUS_A, 79, "GPU has fallen off the bus."))  # between GPUs: last seen before
    lines.append(xid_line(hours(13), BUS_A, 48, "DBE"))  # the replacement GPU
    lines.append(xid_line(hours(-2), BUS_B, 63, "Row remapping pending"))  # before telemetry: first seen after
    lines.append(f"{iso(hours(14))}NVRM: GPU at PCI:{BUS_A}: GPU-c7a3e0d1-5b2f-4e88-9d61-0a4f3b2c1d00\n")
    lines.append(xid_line(hours(14), BUS_A, 45))  # the banner's UUID wins over telemetry's
    return "".join(lines)


def write(path: Path, text: str, *, mtime: datetime | None = None) -> Path:
    path.write_text(text, encoding="utf-8")
    if mtime is not None:
        os.utime(path, (mtime.timestamp(), mtime.timestamp()))
    return path


def events(store: Store) -> list[dict]:
    if not store.exists("xid_events"):
        return []
    return sorted(store.read("xid_events").to_pylist(), key=lambda r: (r["ts"], r["xid"]))


def ingest(store: Store, *paths: Path, **kwargs: object) -> IngestSummary:
    return ingest_kernel_logs(store, list(paths), cluster=CLUSTER, dedup_window=WINDOW, **kwargs)  # type: ignore[arg-type]


def test_events_are_mapped_to_the_gpu_in_the_slot_at_that_time(store: Store, tmp_path: Path) -> None:
    log = write(tmp_path / f"{NODE}.log", node_log())
    summary = ingest(store, log)
    rows = {r["xid"]: r for r in events(store)}
    assert sorted(rows) == [13, 31, 45, 48, 63, 79, 94]
    assert {(r["cluster"], r["node"], r["source"]) for r in rows.values()} == {(CLUSTER, NODE, f"file:{NODE}.log")}
    mapped = {xid: (r["gpu_index"], r["gpu_uuid"]) for xid, r in rows.items()}
    assert mapped == {
        13: (0, "GPU-A0"),  # inside GPU-A0's span
        94: (1, "GPU-B"),
        31: (None, None),  # bus id unknown to telemetry
        79: (0, "GPU-A0"),  # hour 11: GPU-A0 left at 10, GPU-A1 came at 12 -> the one seen before
        48: (0, "GPU-A1"),  # after the replacement
        63: (1, "GPU-B"),  # before any telemetry -> the first seen after
        45: (0, "GPU-c7a3e0d1-5b2f-4e88-9d61-0a4f3b2c1d00"),  # banner UUID wins; the slot still gives the index
    }
    flood = rows[13]
    assert flood["repeat_count"] == 50
    assert flood["ts"] == hours(1)
    assert flood["last_ts"] == hours(1) + timedelta(seconds=4.9)
    assert flood["pci_bus_id"] == BUS_A and flood["pid"] is None and flood["process"] is None
    assert summary.files == 1
    assert summary.lines == 58
    assert summary.xid_lines == 56
    assert summary.incidents == 7
    assert summary.unmapped == 1
    assert summary.unmapped_bus_ids == [f"{NODE} {BUS_UNKNOWN}"]
    assert summary.rejected == 0
    assert "7 incidents" in str(summary)


def test_gpu_last_seen_days_before_the_event_is_still_found(store: Store, tmp_path: Path) -> None:
    # Telemetry ends at hour 24; an XID five days later reads further back to find the GPU.
    log = write(tmp_path / f"{NODE}.log", xid_line(hours(24 * 5), BUS_B, 79, "GPU has fallen off the bus."))
    summary = ingest(store, log)
    (row,) = events(store)
    assert (row["gpu_index"], row["gpu_uuid"], summary.unmapped) == (1, "GPU-B", 0)


def test_files_of_one_run_keep_their_own_rows_and_gpus(store: Store, tmp_path: Path) -> None:
    # All files are mapped to GPUs in one pass, then split back per file: each file's rows must
    # come back with its own source and node, and a path given twice is read once.
    first = write(tmp_path / f"{NODE}.log", xid_line(hours(2), BUS_B, 94) + xid_line(hours(13), BUS_A, 48))
    second = write(tmp_path / "other-node.log", xid_line(hours(3), BUS_A, 13))
    summary = ingest(store, first, second, first)
    rows = [(r["source"], r["node"], r["xid"], r["gpu_uuid"]) for r in events(store)]
    assert rows == [
        (f"file:{NODE}.log", NODE, 94, "GPU-B"),
        ("file:other-node.log", "other-node", 13, "GPU-OTHER"),
        (f"file:{NODE}.log", NODE, 48, "GPU-A1"),
    ]
    assert (summary.files, summary.incidents, summary.unmapped) == (2, 3, 0)
    assert ingest(store, first, second).incidents == 0


def test_same_file_twice_writes_nothing_the_second_time(store: Store, tmp_path: Path) -> None:
    log = write(tmp_path / f"{NODE}.log", node_log())
    ingest(store, log)
    again = ingest(store, log)
    assert (again.files, again.lines, again.incidents) == (0, 0, 0)
    assert again.skipped_files == [str(log)]
    assert len(events(store)) == 7


def test_appended_lines_alone_are_ingested(store: Store, tmp_path: Path) -> None:
    log = write(tmp_path / f"{NODE}.log", node_log())
    ingest(store, log)
    with log.open("a", encoding="utf-8") as fh:
        fh.write(xid_line(hours(20), BUS_B, 74, "NVLink error"))
        fh.write(xid_line(hours(20) + timedelta(seconds=1), BUS_B, 74, "NVLink error"))
    summary = ingest(store, log)
    assert (summary.files, summary.lines, summary.xid_lines, summary.incidents) == (1, 2, 2, 1)
    rows = events(store)
    assert len(rows) == 8
    (nvlink,) = [r for r in rows if r["xid"] == 74]
    assert (nvlink["repeat_count"], nvlink["gpu_uuid"]) == (2, "GPU-B")
    assert ingest(store, log).incidents == 0


def test_line_numbers_continue_after_an_append(store: Store, tmp_path: Path) -> None:
    log = write(tmp_path / f"{NODE}.log", node_log())
    ingest(store, log)
    with log.open("a", encoding="utf-8") as fh:
        fh.write(f"{iso(hours(21))}NVRM: Xid (PCI:{BUS_B}): zz, broken\n")
    summary = ingest(store, log)
    assert summary.rejected == 1
    assert summary.rejected_examples == [f"{log}:59: Xid code 'zz' is not a number"]


def test_rewritten_file_is_read_again_from_the_start(store: Store, tmp_path: Path) -> None:
    log = write(tmp_path / f"{NODE}.log", node_log())
    ingest(store, log)
    write(log, xid_line(hours(22), BUS_B, 92, "High single-bit ECC error rate"))  # truncated and rewritten
    summary = ingest(store, log)
    assert (summary.lines, summary.incidents) == (1, 1)


def test_rotated_and_gzipped_copy_is_recognised_by_content(store: Store, tmp_path: Path) -> None:
    log = write(tmp_path / f"{NODE}.log", node_log())
    ingest(store, log)
    rotated = tmp_path / f"{NODE}.log.1.gz"
    with log.open("rb") as src, gzip.open(rotated, "wb") as dst:
        shutil.copyfileobj(src, dst)
    write(log, xid_line(hours(23), BUS_B, 95, "Uncontained ECC error."))  # the new, fresh log
    summary = ingest(store, rotated, log)
    assert summary.skipped_files == [str(rotated)]
    assert summary.incidents == 1
    assert sorted(r["xid"] for r in events(store)) == [13, 31, 45, 48, 63, 79, 94, 95]


def test_gzip_rotated_file_node_and_content(store: Store, tmp_path: Path) -> None:
    path = tmp_path / f"{NODE}.log.2.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write(xid_line(hours(2), BUS_B, 94, "Contained ECC error."))
    summary = ingest(store, path)
    (row,) = events(store)
    assert (row["node"], row["gpu_uuid"], row["source"]) == (NODE, "GPU-B", f"file:{path.name}")
    assert summary.incidents == 1


def test_host_of_the_line_wins_over_the_node_argument_and_mtime_gives_the_year(store: Store, tmp_path: Path) -> None:
    text = (
        f"Dec 31 23:59:00 other-node kernel: NVRM: Xid (PCI:{BUS_A}): 13, pid=7, name=python3, x\n"
        f"Jan 05 10:00:00 {NODE} kernel: NVRM: Xid (PCI:{BUS_B}): 94, pid=7, name=python3, Contained ECC error.\n"
    )
    log = write(tmp_path / "syslog", text, mtime=T0 + timedelta(hours=12))  # Jan 5 2026
    ingest(store, log, node="ignored-node")
    rows = events(store)
    assert [(r["ts"], r["node"], r["gpu_uuid"]) for r in rows] == [
        # before any telemetry of other-node: the GPU first seen after, in that node's slot
        (datetime(2025, 12, 31, 23, 59, tzinfo=UTC), "other-node", "GPU-OTHER"),
        (datetime(2026, 1, 5, 10, tzinfo=UTC), NODE, "GPU-B"),
    ]


def test_node_argument_for_formats_without_host(store: Store, tmp_path: Path) -> None:
    log = write(tmp_path / "dmesg.txt", xid_line(hours(2), BUS_B, 94))
    ingest(store, log, node=NODE)
    (row,) = events(store)
    assert (row["node"], row["gpu_index"]) == (NODE, 1)


def test_kmsg_needs_boot_time_else_its_xids_are_untimed(store: Store, tmp_path: Path) -> None:
    text = f"4,5021,7200000000,-;NVRM: Xid (PCI:{BUS_B}): 94, pid=1, name=python3, Contained ECC error.\n"
    log = write(tmp_path / f"{NODE}.log", text)
    untimed = ingest(store, log)
    assert (untimed.xid_lines, untimed.untimed, untimed.incidents) == (1, 1, 0)
    assert "boot time" in str(untimed)
    # nothing was written, so the file is not marked read: a run with the boot time gets it all
    timed = ingest(store, log, boot_time=T0)
    assert timed.incidents == 1
    (row,) = events(store)
    assert (row["ts"], row["gpu_uuid"]) == (hours(2), "GPU-B")


def test_ctime_log_in_a_time_zone(store: Store, tmp_path: Path) -> None:
    # 03:00 in Warsaw (CET, +1) is 02:00 UTC
    text = f"[Mon Jan  5 03:00:00 2026] NVRM: Xid (PCI:{BUS_B}): 94, pid=1, name=python3, Contained ECC error.\n"
    ingest(store, write(tmp_path / f"{NODE}.log", text), tz="Europe/Warsaw")
    (row,) = events(store)
    assert row["ts"] == hours(2)


def test_real_iso_dmesg_log(store: Store, tmp_path: Path) -> None:
    log = tmp_path / "h100-a.log"
    shutil.copy(FIXTURES / "gpud_dmesg.decode.iso.log", log)
    summary = ingest(store, log)
    rows = events(store)
    assert [(r["xid"], r["repeat_count"], r["node"], r["gpu_index"]) for r in rows] == [
        (13, 16, "h100-a", None),
        (43, 1, "h100-a", None),
    ]
    assert summary.lines == 24
    assert summary.unmapped == 2


def test_last_line_without_newline_is_read(store: Store, tmp_path: Path) -> None:
    log = write(tmp_path / f"{NODE}.log", xid_line(hours(2), BUS_B, 94).rstrip("\n"))
    assert ingest(store, log).incidents == 1


def test_missing_file_is_an_input_error_naming_it_and_nothing_is_ingested(store: Store, tmp_path: Path) -> None:
    good = write(tmp_path / f"{NODE}.log", node_log())
    missing = tmp_path / "nope" / "gpu-node-404.log"
    with pytest.raises(InputError, match=re.escape(str(missing))):
        ingest(store, good, missing)
    assert events(store) == []
    assert store.read_state(STATE_NAME) is None


def test_a_folder_is_not_a_log(store: Store, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a regular file"):
        ingest(store, tmp_path)


def test_binary_garbage_is_counted_not_fatal(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "core.log"
    path.write_bytes(bytes(range(256)) * 64 + b"\x00\xff\xfe\n" * 100)
    summary = ingest(store, path)
    assert summary.rejected > 0
    assert summary.incidents == 0
    assert events(store) == []


def test_unknown_time_zone_is_an_input_error(store: Store, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="Mars/Olympus"):
        ingest(store, write(tmp_path / "a.log", node_log()), tz="Mars/Olympus")


def test_store_without_telemetry_leaves_gpus_unmapped(tmp_path: Path) -> None:
    store = Store.create(str(tmp_path / "empty"))
    summary = ingest(store, write(tmp_path / f"{NODE}.log", node_log()))
    assert summary.incidents == 7 and summary.unmapped == 7
    assert {r["gpu_uuid"] for r in events(store)} == {None, "GPU-c7a3e0d1-5b2f-4e88-9d61-0a4f3b2c1d00"}


def test_a_folder_that_is_not_a_store_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(StoreError, match="not a gpufail dataset"):
        Store.open(str(tmp_path))


@pytest.mark.parametrize(
    ("name", "node"),
    [
        ("gpu-node-007.log", "gpu-node-007"),
        ("gpu-node-007.log.1", "gpu-node-007"),
        ("gpu-node-007.log.2.gz", "gpu-node-007"),
        ("gpu-node-007.gz", "gpu-node-007"),
        ("gpu-node-007.log-20260105", "gpu-node-007"),
        ("gpu-node-007", "gpu-node-007"),
        ("10.0.0.12.log", "10.0.0.12"),
    ],
)
def test_node_from_filename(name: str, node: str) -> None:
    assert node_from_filename(name) == node


def test_files_are_committed_in_batches_and_a_failed_batch_is_read_again(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ingest.kernel_log_import as module

    # Five node logs, two per batch: three writes (one file each, all events on one date), not five.
    logs = [write(tmp_path / f"node-{i}.log", xid_line(hours(2 + i), BUS_B, 94)) for i in range(5)]
    monkeypatch.setattr(module, "COMMIT_FILES", 2)
    real_write = Store.write_part
    calls = []

    def failing_third_write(self: Store, dataset: str, day: str, table: pa.Table, **kwargs: object) -> str:
        calls.append(table.num_rows)
        if len(calls) == 3:
            raise StoreError("disk full")
        return real_write(self, dataset, day, table, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Store, "write_part", failing_third_write)
    with pytest.raises(StoreError, match="disk full"):
        ingest(store, *logs)
    assert calls == [2, 2, 1]
    assert len(events(store)) == 4  # the first two batches are stored and recorded as read
    monkeypatch.setattr(Store, "write_part", real_write)
    again = ingest(store, *logs)
    assert (again.files, again.incidents) == (1, 1)  # only the failed batch's file is read again
    assert sorted(r["node"] for r in events(store)) == [f"node-{i}" for i in range(5)]
    assert len(list((tmp_path / "store" / "xid_events").rglob("*.parquet"))) == 3


def _many_logs(folder: Path) -> list[Path]:
    """Six node logs: the known node (mapped), five others (unmapped), one gzipped."""
    folder.mkdir()
    logs = [write(folder / f"{NODE}.log", node_log())]
    for i in range(5):
        text = "".join(xid_line(hours(2 + i) + timedelta(minutes=m), BUS_B, 94 + i % 2) for m in range(0, 60, 7))
        logs.append(write(folder / f"gpu-node-10{i}.log", text))
    with gzip.open(folder / "gpu-node-200.log.gz", "wt") as fh:
        fh.write(node_log())
    return [*logs, folder / "gpu-node-200.log.gz"]


def test_parsing_on_worker_processes_gives_the_rows_and_summary_of_one_process(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ingest.kernel_log_import as module

    monkeypatch.setattr(module, "PARALLEL_MIN_BYTES", 0)  # these few kilobytes go to the workers too
    pools: list[int] = []

    class CountedPool(module.ProcessPoolExecutor):  # type: ignore[name-defined, misc]
        def __init__(self, max_workers: int, **kwargs: object) -> None:
            pools.append(max_workers)
            super().__init__(max_workers, **kwargs)  # type: ignore[arg-type, call-overload]

    monkeypatch.setattr(module, "ProcessPoolExecutor", CountedPool)
    logs = _many_logs(tmp_path / "logs")
    other = Store.create(str(tmp_path / "other"))
    other.write("telemetry", store.read("telemetry"))
    one = ingest(store, *logs, workers=1)
    two = ingest(other, *logs, workers=2)
    assert pools == [2]  # the second run parsed on two processes, the first on none
    assert str(two) == str(one) and one.files == 7 and one.incidents > 7
    assert events(other) == events(store)
    # ... and the second run of either skips every file
    assert len(ingest(other, *logs, workers=2).skipped_files) == 7


def test_an_object_store_maps_events_to_the_same_gpus_as_a_local_one(store: Store, tmp_path: Path) -> None:
    # Local stores scan telemetry with polars; others read through pyarrow and fsspec.
    remote = Store.create(f"memory://kl-spans-{os.getpid()}")
    remote.write("telemetry", store.read("telemetry"))
    log = write(tmp_path / f"{NODE}.log", node_log())
    ingest(store, log)
    ingest(remote, log)
    local_rows, remote_rows = events(store), events(remote)
    assert [(r["xid"], r["gpu_uuid"], r["gpu_index"]) for r in remote_rows] == [
        (r["xid"], r["gpu_uuid"], r["gpu_index"]) for r in local_rows
    ]
    assert {r["gpu_uuid"] for r in local_rows} >= {"GPU-A0", "GPU-A1", "GPU-B"}


def test_logs_inside_the_root_are_named_relative_to_it_and_others_absolutely(store: Store, tmp_path: Path) -> None:
    inside = tmp_path / "store" / "raw" / "kernel-log" / f"{NODE}.log"
    inside.parent.mkdir(parents=True)
    write(inside, node_log())
    outside = write(tmp_path / "other-node.log", xid_line(hours(3), BUS_A, 13))
    ingest(store, inside, outside)
    state = store.read_state(STATE_NAME)
    assert state is not None and state["version"] == 2
    assert sorted(state["files"]) == sorted([f"raw/kernel-log/{NODE}.log", str(outside.resolve())])
    assert state["files"][f"raw/kernel-log/{NODE}.log"]["family"] == f"raw/kernel-log/{NODE}.log"
    # The root moves; the log outside it stays where it was: neither is read again.
    moved = tmp_path / "moved"
    (tmp_path / "store").rename(moved)
    again = ingest(Store.open(str(moved)), moved / "raw" / "kernel-log" / f"{NODE}.log", outside)
    assert (again.files, again.incidents) == (0, 0)


def test_a_state_of_an_unknown_version_is_refused_rather_than_everything_read_again(
    store: Store, tmp_path: Path
) -> None:
    log = write(tmp_path / f"{NODE}.log", node_log())
    store.write_state(STATE_NAME, {"version": 99, "files": {}})
    with pytest.raises(StoreError, match=r"kernel_log_ingest\.json: kernel-log state of version 99 is not understood"):
        ingest(store, log)
    assert events(store) == []
