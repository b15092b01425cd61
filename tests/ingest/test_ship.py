"""`gpufail ship`: a collector's node-local spool moved to the fleet's data root, each part file
exactly once, whatever point it is killed at; the spool keeps a day of shipped files."""

from __future__ import annotations

import shutil
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pytest

from ingest.journal import Journal
from ingest.ship import ship
from ingest.store import Store
from tests.cli import gpufail
from tests.conftest import make_rows
from tests.faults import kill_points
from tests.faults.test_compact_faults import ended_first
from tests.ingest.test_compact import T0, collector_like, rows

DATASETS = ("telemetry", "xid_events", "collector_runs")
NOW = T0 + timedelta(days=2, hours=3)
"""A clock a day after the spool's data: its first day ended more than a day's keep before,
its second did not."""


def spool_of(root: Path) -> Store:
    return collector_like(root, nodes=1, hours=48, flush_rows=24)


def read_all(store: Store) -> dict[str, pl.DataFrame]:
    return {d: rows(store, d) for d in DATASETS}


def assert_same(a: dict[str, pl.DataFrame], b: dict[str, pl.DataFrame]) -> None:
    for dataset in DATASETS:
        assert a[dataset].equals(b[dataset]), dataset


def test_every_committed_file_reaches_the_data_root_once(tmp_path: Path) -> None:
    spool = spool_of(tmp_path / "spool")
    expected = read_all(spool)
    root = Store.create(str(tmp_path / "root"))
    first = ship(spool, root, "n0", now=NOW, batch_files=5)
    assert first.files == sum(len(spool.files(d)) for d in DATASETS) + first.removed_from_spool
    assert first.commits == -(-first.files // 5)
    assert_same(read_all(root), expected)
    # File names, and so their checksums, are kept.
    assert {Path(p).name for p in root.files("telemetry")} >= {Path(p).name for p in spool.files("telemetry")}
    again = ship(spool, root, "n0", now=NOW)
    assert again.files == 0 and again.commits == 0
    assert_same(read_all(root), expected)


def test_the_spool_keeps_a_day_of_shipped_files_and_never_ships_them_twice(tmp_path: Path) -> None:
    spool = spool_of(tmp_path / "spool")
    expected = read_all(spool)
    root = Store.create(str(tmp_path / "root"))
    first_day, second_day = spool.dates("telemetry")
    summary = ship(spool, root, "n0", now=NOW)
    assert summary.removed_from_spool > 0
    assert spool.dates("telemetry") == [second_day]  # the collector maps XIDs from the day before
    # New rows after the shipped ones were removed: only they are shipped.
    late = make_rows("xid_events", [NOW], xid=48, node="n0")
    spool.write("xid_events", late)
    later = ship(spool, root, "n0", now=NOW + timedelta(days=2))
    assert later.files == 1
    assert spool.files("telemetry") == [] and root.dates("telemetry") == [first_day, second_day]
    for dataset in ("telemetry", "collector_runs"):
        assert rows(root, dataset).equals(expected[dataset]), dataset
    assert rows(root, "xid_events").height == expected["xid_events"].height + 1
    state = root.read_state("ship-n0")
    assert state is not None and state["shipped"] == []


def test_a_file_the_collector_is_still_committing_waits_for_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = Store.create(str(tmp_path / "spool"))
    root = Store.create(str(tmp_path / "root"))
    finish = Journal._finish
    # A collector killed after its commit, before renaming its file: readers count the file under
    # its hidden name; the shipper leaves it to the collector.
    monkeypatch.setattr(Journal, "_finish", lambda self, record: None)
    spool.write("xid_events", make_rows("xid_events", [T0], xid=79, node="n0"))
    monkeypatch.setattr(Journal, "_finish", finish)
    assert len(spool.files("xid_events")) == 1
    summary = ship(spool, root, "n0", now=NOW)
    assert summary.files == 0 and summary.waiting == 1 and not root.files("xid_events")
    assert "1 still being committed by the collector" in summary.line("spool", "root")
    spool.write("xid_events", make_rows("xid_events", [T0 + timedelta(hours=1)], xid=79, node="n0"))  # finishes it
    assert ship(spool, root, "n0", now=T0).files == 2
    assert rows(root, "xid_events").equals(rows(spool, "xid_events"))


def test_the_users_metrics_reach_the_data_root_before_their_rows(tmp_path: Path) -> None:
    from ingest.user_metrics import record_metrics, recorded_metrics, user_metric

    spool = Store.create(str(tmp_path / "spool"))
    record_metrics(spool, (user_metric("smart_5_raw", "counter", "sectors", valid_min=0),))
    spool.write("xid_events", make_rows("xid_events", [T0], xid=79, node="n0"))
    root = Store.create(str(tmp_path / "root"))
    ship(spool, root, "n0", now=NOW)
    assert [m.column for m in recorded_metrics(root)] == ["smart_5_raw"]


def test_an_object_store_data_root(tmp_path: Path) -> None:
    spool = spool_of(tmp_path / "spool")
    expected = read_all(spool)
    root = Store.create(f"memory://ship-{time.monotonic_ns()}")
    ship(spool, root, "n0", now=T0)
    for dataset in DATASETS:
        got = pl.DataFrame(root.read(dataset))
        assert got.sort(got.columns).equals(expected[dataset]), dataset


@pytest.mark.slow
def test_a_rerun_after_kill_9_ships_each_file_exactly_once(tmp_path: Path) -> None:
    source = spool_of(tmp_path / "source").root
    expected = read_all(Store.open(source))

    def args(i: int | str) -> list[str]:
        return ["ship", "--spool", str(tmp_path / f"spool-{i}"), "--data", str(tmp_path / f"root-{i}"), "--node", "n0"]

    shutil.copytree(source, tmp_path / "spool-clean")
    kills = kill_points.plan(args("clean"), 8, 48, delays=2)
    assert_same(read_all(Store.open(str(tmp_path / "root-clean"))), expected)
    for i, kill in enumerate(kills):
        shutil.copytree(source, tmp_path / f"spool-{i}")
        status, passed = kill_points.run(args(i), kill=kill)
        assert status == -signal.SIGKILL or (status == 0 and ended_first(kill, passed)), kill
        if (tmp_path / f"root-{i}" / "gpufail.json").exists():
            seen = read_all(Store.open(str(tmp_path / f"root-{i}")))
            for dataset in DATASETS:  # nothing twice, ever
                assert seen[dataset].is_duplicated().sum() == 0, (kill, dataset)
        status, _ = kill_points.run(args(i))
        assert status == 0, kill
        assert_same(read_all(Store.open(str(tmp_path / f"root-{i}"))), expected)
        assert kill_points.hidden_files(tmp_path / f"root-{i}") == [], kill


def test_ship_through_the_command_line_reports_and_refuses_a_missing_spool(tmp_path: Path) -> None:
    spool_of(tmp_path / "spool")
    itself = gpufail("ship", "--spool", str(tmp_path / "spool"), "--data", str(tmp_path / "spool") + "/")
    assert itself.returncode == 2 and "is the data root itself" in itself.stderr
    assert Store.open(str(tmp_path / "spool")).files("telemetry")
    ran = gpufail("ship", "--spool", str(tmp_path / "spool"), "--data", str(tmp_path / "root"), "--node", "n0")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("ship: ") and f"to {tmp_path / 'root'}" in ran.stdout
    missing = gpufail("ship", "--spool", str(tmp_path / "nowhere"), "--data", str(tmp_path / "root"))
    assert missing.returncode == 2 and "nowhere" in missing.stderr and missing.stderr.count("\n") == 1


def test_a_collector_writing_to_a_spool_then_shipped(tmp_path: Path) -> None:
    """The documented path: `collect --data SPOOL` on the node, `ship` to the data root."""
    log = tmp_path / "kern.log"
    log.write_text("Jan  5 10:00:00 n0 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n")
    env = {
        "GPUFAIL_COLLECT__KERNEL_LOG_SOURCE": "files",
        "GPUFAIL_COLLECT__KERNEL_LOG_PATHS": f'["{log}"]',
        "GPUFAIL_COLLECT__LISTEN": "",
    }
    spool, root = str(tmp_path / "spool"), str(tmp_path / "root")
    ran = gpufail("collect", "--data", spool, "--source", "kernel-log", "--once", "--node", "n0", env=env)
    assert ran.returncode == 0, ran.stderr
    ran = gpufail("ship", "--spool", spool, "--data", root, "--node", "n0", "--keep", "3650d")
    assert ran.returncode == 0, ran.stderr
    shipped = rows(Store.open(root), "xid_events")
    assert shipped.height == 1 and shipped["xid"].to_list() == [79]
    assert shipped.equals(rows(Store.open(spool), "xid_events"))
    assert not (Path(root) / "_state" / "collect-n0.json").exists()  # the cursor stays on the node
    assert datetime(2026, 1, 1, tzinfo=UTC) < shipped["ts"][0]


def test_ship_every_interval_waits_for_the_spool_retries_and_stops_on_sigterm(tmp_path: Path) -> None:
    import subprocess

    from tests.cli import GPUFAIL

    spool, root = tmp_path / "spool", tmp_path / "root"
    process = subprocess.Popen(
        [*GPUFAIL, "ship", "--spool", str(spool), "--data", str(root), "--node", "n0", "--every", "1s"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        expected = read_all(spool_of(tmp_path / "made"))
        time.sleep(4)  # the command starts, and tries at least once on a spool that is not there yet
        (tmp_path / "made").rename(spool)  # the collector's first flush, at once
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (root / "gpufail.json").exists() and read_all(Store.open(str(root)))["telemetry"].height:
                break
            time.sleep(0.5)
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, err
    assert f"ship: failed, trying again in 1s: data root '{spool}' does not exist" in err
    assert "ship: " in out and " files (" in out
    assert_same(read_all(Store.open(str(root))), expected)
