"""`gpufail ingest kernel-log` under faults: kill -9 at random points, a full disk, a read-only
store, a copied or moved data root. After each, with the fault gone, running the command again
must give exactly the rows of a clean run: nothing lost, nothing counted twice, no corrupt or
stray file, and any failure is one line naming the path, never a traceback."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from ingest.simulator.run import simulate
from ingest.store import Store
from tests.cli import gpufail, gpufail_env
from tests.faults.mounts import fill_leaving, free_bytes, remount, tmpfs

SEED = 20260105
KILLS = 12
# Each killed run is a fresh interpreter (a few CPU seconds of imports): about a minute on two
# free cores, several on a machine shared with other work.
KILL_TEST_BUDGET_S = 900
# Log files per commit in the runs that are killed: the small fleet's 28 logs make 10 commits,
# so most kill points fall between a commit's first file and its state.
BATCH = 3

# Runs `gpufail ingest kernel-log --data ROOT` and counts the store's write operations (files
# opened for writing, Parquet row groups, renames, removals, fsyncs); with FAULT_KILL_AT=n it
# sends itself SIGKILL just before the n-th, so each kill point is reproducible.
_CHILD = r"""
import os, signal, sys
import fsspec.implementations.local as local
import pyarrow.parquet as pq
import ingest.kernel_log_ingest as ingest_module

ingest_module.COMMIT_FILES = int(os.environ["FAULT_BATCH"])
kill_at = int(os.environ["FAULT_KILL_AT"])
count = 0

def point():
    global count
    count += 1
    if count == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

def counted(function, mode_at=None):
    def wrapper(*args, **kwargs):
        mode = kwargs.get("mode", args[mode_at] if mode_at is not None and len(args) > mode_at else "rb")
        if mode_at is None or any(c in mode for c in "wax+"):
            point()
        return function(*args, **kwargs)
    return wrapper

local.LocalFileSystem.open = counted(local.LocalFileSystem.open, mode_at=2)
local.LocalFileSystem.mv = counted(local.LocalFileSystem.mv)
local.LocalFileSystem.rm = counted(local.LocalFileSystem.rm)
pq.ParquetWriter.write_table = counted(pq.ParquetWriter.write_table)
os.fsync = counted(os.fsync)

from gpufail.cli import main
sys.argv = ["gpufail", "ingest", "kernel-log", "--data", sys.argv[1]]
try:
    main()
finally:
    print(f"fault-ops: {count}", file=sys.stderr)
"""


@dataclass(frozen=True)
class CleanRun:
    rows: pl.DataFrame
    ops: int  # store write operations of the run (kill points)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small simulated data root: telemetry of 28 nodes over 10 days, one kernel log each."""
    root = tmp_path_factory.mktemp("fleet") / "root"
    simulate(root, "demo", seed=3, progress=False, nodes=24, days=10, sample_interval_s=3600, flood_lines=(5, 20))
    return root


@pytest.fixture(scope="module")
def clean(fleet: Path, tmp_path_factory: pytest.TempPathFactory) -> CleanRun:
    root = copy_root(fleet, tmp_path_factory.mktemp("clean") / "root")
    done = run_child(root, kill_at=0)
    assert done.returncode == 0, done.stderr
    ops = int(done.stderr.rsplit("fault-ops: ", 1)[1].split()[0])
    return CleanRun(xid_rows(root), ops)


def copy_root(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, symlinks=True)
    return target


def run_child(root: Path, kill_at: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(root)], env=child_env(kill_at), capture_output=True, text=True, timeout=120
    )


def child_env(kill_at: int) -> dict[str, str]:
    return gpufail_env({"FAULT_BATCH": str(BATCH), "FAULT_KILL_AT": str(kill_at)})


def xid_rows(root: Path) -> pl.DataFrame:
    store = Store.open(str(root))
    if not store.exists("xid_events"):
        return pl.DataFrame()
    frame = pl.from_arrow(store.read("xid_events"))
    assert isinstance(frame, pl.DataFrame)
    return frame.sort(frame.columns, nulls_last=True)


def assert_same_rows(root: Path, expected: pl.DataFrame) -> None:
    got = xid_rows(root)
    assert got.height == expected.height, f"{got.height} rows, a clean run has {expected.height}"
    assert got.equals(expected)


def assert_whole_and_tidy(root: Path) -> None:
    """Every Parquet file of the dataset reads whole (page checksums verified); nothing
    hidden (temporary or uncommitted) is left behind."""
    folder = root / "xid_events"
    for path in folder.rglob("*.parquet"):
        pq.read_table(path, page_checksum_verification=True)
    hidden = sorted(str(p.relative_to(root)) for p in root.rglob(".*"))
    assert hidden == []


@pytest.mark.slow
@pytest.mark.timeout(KILL_TEST_BUDGET_S)
def test_kill_9_at_random_points_then_a_rerun_gives_the_rows_of_a_clean_run(
    fleet: Path,
    clean: CleanRun,
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    points = sorted(rng.sample(range(1, clean.ops + 1), KILLS))
    # Every fourth trial is killed again while finishing what the first kill left.
    second_points = {trial: rng.randint(1, max(1, clean.ops // 3)) for trial in range(3, KILLS, 4)}

    def kill(trial: int) -> Path:
        root = copy_root(fleet, tmp_path / f"trial-{trial}")
        killed = run_child(root, points[trial])
        assert killed.returncode == -signal.SIGKILL, f"kill point {points[trial]} of {clean.ops}: {killed.stderr}"
        if trial in second_points:
            again = run_child(root, second_points[trial])
            assert again.returncode in (0, -signal.SIGKILL), again.stderr
        return root

    # The killed runs are processes of their own: two at a time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        roots = list(pool.map(kill, range(KILLS)))
    for kill_at, root in zip(points, roots, strict=True):
        ran = gpufail("ingest", "kernel-log", "--data", str(root))
        status, _, err = ran.returncode, ran.stdout, ran.stderr
        assert status == 0, f"kill point {kill_at}: {err}"
        assert_same_rows(root, clean.rows)
        assert_whole_and_tidy(root)


@pytest.mark.slow
@pytest.mark.timeout(KILL_TEST_BUDGET_S)
def test_kill_9_from_outside_while_files_are_being_written(
    fleet: Path,
    clean: CleanRun,
    tmp_path: Path,
) -> None:
    # As an operator would: SIGKILL at a moment, not at a chosen operation.
    rng = random.Random(SEED + 1)
    for trial in range(2):
        root = copy_root(fleet, tmp_path / f"trial-{trial}")
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(root)], env=child_env(kill_at=0), stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 60
        while child.poll() is None and not (root / "xid_events").exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.2))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        ran = gpufail("ingest", "kernel-log", "--data", str(root))
        status, _, err = ran.returncode, ran.stdout, ran.stderr
        assert status == 0, err
        assert_same_rows(root, clean.rows)
        assert_whole_and_tidy(root)


def test_a_full_disk_then_space_freed_and_a_rerun_gives_the_rows_of_a_clean_run(
    fleet: Path,
    clean: CleanRun,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ingest.kernel_log_ingest as module

    monkeypatch.setattr(module, "COMMIT_FILES", BATCH)
    source_bytes = sum(p.stat().st_size for p in fleet.rglob("*") if p.is_file())
    with tmpfs(tmp_path / "disk", source_bytes + (8 << 20)) as disk:
        # What a clean run adds to the disk, in the file system's own accounting.
        root = copy_root(fleet, disk / "root")
        before = free_bytes(disk)
        assert gpufail("ingest", "kernel-log", "--data", str(root)).returncode == 0
        needed = before - free_bytes(disk)
        for fraction in (0.0, 0.15, 0.35, 0.55, 0.75, 0.95):
            shutil.rmtree(root)
            root = copy_root(fleet, disk / "root")
            filler = fill_leaving(disk, int(needed * fraction))
            ran = gpufail("ingest", "kernel-log", "--data", str(root))
            status, _, err = ran.returncode, ran.stdout, ran.stderr
            assert status == 2, f"{fraction:.0%} of the space needed: {err}"
            assert_one_line_error(err, root, "No space left on device")
            assert "free space there and run again" in err
            filler.unlink()
            ran = gpufail("ingest", "kernel-log", "--data", str(root))
            status, _, err = ran.returncode, ran.stdout, ran.stderr
            assert status == 0, err
            assert_same_rows(root, clean.rows)
            assert_whole_and_tidy(root)


def test_a_read_only_store_is_one_line_naming_the_path(fleet: Path, tmp_path: Path) -> None:
    source_bytes = sum(p.stat().st_size for p in fleet.rglob("*") if p.is_file())
    with tmpfs(tmp_path / "disk", source_bytes + (4 << 20)) as disk:
        root = copy_root(fleet, disk / "root")
        remount(disk, "ro")
        ran = gpufail("ingest", "kernel-log", "--data", str(root))
        status, _, err = ran.returncode, ran.stdout, ran.stderr
        assert status == 2
        assert_one_line_error(err, root, "Read-only file system")
        remount(disk, "rw")


def test_a_copied_or_moved_data_root_re_reads_nothing(
    fleet: Path,
    clean: CleanRun,
    tmp_path: Path,
) -> None:
    first = copy_root(fleet, tmp_path / "first")
    assert gpufail("ingest", "kernel-log", "--data", str(first)).returncode == 0
    copied = copy_root(first, tmp_path / "copied")
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    first.rename(moved)
    for root in (copied, moved):
        ran = gpufail("ingest", "kernel-log", "--data", str(root))
        status, out, err = ran.returncode, ran.stdout, ran.stderr
        assert status == 0, err
        assert "-> 0 incidents" in out
        assert_same_rows(root, clean.rows)


def test_a_state_of_the_old_format_is_understood_in_place_and_in_a_copy(
    fleet: Path,
    clean: CleanRun,
    tmp_path: Path,
) -> None:
    root = copy_root(fleet, tmp_path / "root")
    assert gpufail("ingest", "kernel-log", "--data", str(root)).returncode == 0
    write_version_1_state(root)
    copied = copy_root(root, tmp_path / "copied")
    for where in (root, copied):
        ran = gpufail("ingest", "kernel-log", "--data", str(where))
        status, out, err = ran.returncode, ran.stdout, ran.stderr
        assert status == 0, err
        assert "-> 0 incidents" in out
        assert_same_rows(where, clean.rows)


def write_version_1_state(root: Path) -> None:
    """The state as gpufail wrote it before version 2: every file named by its absolute path."""
    path = root / "_state" / "kernel_log_ingest.json"
    state = json.loads(path.read_text())
    base = root.resolve()
    files = {}
    for key, entry in state["files"].items():
        absolute = key if key.startswith("/") else str(base / key)
        family = entry["family"] if entry["family"].startswith("/") else str(base / entry["family"])
        files[absolute] = {**entry, "family": family}
    path.write_text(json.dumps({"version": 1, "seq": state["seq"], "files": files}))


def assert_one_line_error(err: str, root: Path, reason: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("gpufail: error: "), err
    assert str(root) in lines[0], err
    assert reason in lines[0], err
