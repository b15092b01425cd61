"""`gpufail ingest kernel-log` under faults: kill -9 at its write boundaries and after random
delays (`tests.faults.kill_points`), a full disk, a read-only store, a copied or moved data root.
After each, with the fault gone, running the command again must give exactly the rows of a
clean run: nothing lost, nothing counted twice, no corrupt or stray file, and any failure is
one line naming the path, never a traceback."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from ingest.simulator.run import simulate
from ingest.store import Store
from tests.cli import Result, gpufail
from tests.faults import kill_points
from tests.faults.mounts import fill_leaving, free_bytes, remount, tmpfs

SEED = 20260105
KILLS = 12
DELAYS = 2
# Log files per commit in the runs that are killed: the small fleet's 28 logs make 10 commits,
# so most kill points fall between a commit's first file and its state.
BATCH = 3


def small_batches() -> None:
    """In the killed runs' process: commit `BATCH` log files at a time."""
    import ingest.kernel_log_import

    ingest.kernel_log_import.COMMIT_FILES = BATCH


@dataclass(frozen=True)
class CleanRun:
    rows: pl.DataFrame
    kills: list[kill_points.Kill]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small simulated data root: telemetry of 28 nodes over 10 days, one kernel log each."""
    root = tmp_path_factory.mktemp("fleet") / "root"
    simulate(root, "demo", seed=3, progress=False, nodes=24, days=10, sample_interval_s=3600, flood_lines=(5, 20))
    return root


@pytest.fixture(scope="module")
def clean(fleet: Path, tmp_path_factory: pytest.TempPathFactory) -> CleanRun:
    root = copy_root(fleet, tmp_path_factory.mktemp("clean") / "root")
    kills = kill_points.plan(ingest_command(root), KILLS, SEED, env=CLEAN_ENV, setup=small_batches, delays=DELAYS)
    return CleanRun(xid_rows(root), kills)


CLEAN_ENV: dict[str, str | None] = {k: None for k in os.environ if k.startswith("GPUFAIL_")}


def ingest_command(root: Path) -> list[str]:
    return ["ingest", "kernel-log", "--data", str(root)]


def copy_root(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, symlinks=True)
    return target


def ingest(root: Path) -> Result:
    """`gpufail ingest kernel-log` of `root`'s logs, in this process."""
    return gpufail(*ingest_command(root))


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
def test_kill_9_at_write_boundaries_then_a_rerun_gives_the_rows_of_a_clean_run(
    fleet: Path,
    clean: CleanRun,
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    # Every fourth trial is killed again while finishing what the first kill left.
    second = {trial: rng.randint(1, 30) for trial in range(3, len(clean.kills), 4)}

    def kill(trial: int) -> Path:
        root = copy_root(fleet, tmp_path / f"trial-{trial}")
        planned = clean.kills[trial]
        status, _ = kill_points.run(ingest_command(root), kill=planned, env=CLEAN_ENV, setup=small_batches)
        assert status == -signal.SIGKILL or (planned.after_s is not None and status == 0), planned
        if trial in second:
            again = kill_points.Kill(point=second[trial])
            status, _ = kill_points.run(ingest_command(root), kill=again, env=CLEAN_ENV, setup=small_batches)
            assert status in (0, -signal.SIGKILL), f"{planned}, then {again}"
        return root

    # The killed runs are processes of their own: two at a time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        roots = list(pool.map(kill, range(len(clean.kills))))
    for planned, root in zip(clean.kills, roots, strict=True):
        ran = ingest(root)
        status, err = ran.returncode, ran.stderr
        assert status == 0, f"{planned}: {err}"
        assert_same_rows(root, clean.rows)
        assert_whole_and_tidy(root)


def test_a_full_disk_then_space_freed_and_a_rerun_gives_the_rows_of_a_clean_run(
    fleet: Path,
    clean: CleanRun,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ingest.kernel_log_import as module

    monkeypatch.setattr(module, "COMMIT_FILES", BATCH)
    source_bytes = sum(p.stat().st_size for p in fleet.rglob("*") if p.is_file())
    with tmpfs(tmp_path / "disk", source_bytes + (8 << 20)) as disk:
        # What a clean run adds to the disk, in the file system's own accounting.
        root = copy_root(fleet, disk / "root")
        before = free_bytes(disk)
        assert ingest(root).returncode == 0
        needed = before - free_bytes(disk)
        for fraction in (0.0, 0.15, 0.35, 0.55, 0.75, 0.95):
            shutil.rmtree(root)
            root = copy_root(fleet, disk / "root")
            filler = fill_leaving(disk, int(needed * fraction))
            ran = ingest(root)
            status, err = ran.returncode, ran.stderr
            assert status == 2, f"{fraction:.0%} of the space needed: {err}"
            assert_one_line_error(err, root, "No space left on device")
            assert "free space there and run again" in err
            filler.unlink()
            ran = ingest(root)
            status, err = ran.returncode, ran.stderr
            assert status == 0, err
            assert_same_rows(root, clean.rows)
            assert_whole_and_tidy(root)


def test_a_read_only_store_is_one_line_naming_the_path(fleet: Path, tmp_path: Path) -> None:
    source_bytes = sum(p.stat().st_size for p in fleet.rglob("*") if p.is_file())
    with tmpfs(tmp_path / "disk", source_bytes + (4 << 20)) as disk:
        root = copy_root(fleet, disk / "root")
        remount(disk, "ro")
        ran = ingest(root)
        assert ran.returncode == 2
        assert_one_line_error(ran.stderr, root, "Read-only file system")
        remount(disk, "rw")


def test_a_copied_or_moved_data_root_re_reads_nothing(
    fleet: Path,
    clean: CleanRun,
    tmp_path: Path,
) -> None:
    first = copy_root(fleet, tmp_path / "first")
    assert ingest(first).returncode == 0
    copied = copy_root(first, tmp_path / "copied")
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    first.rename(moved)
    for root in (copied, moved):
        ran = ingest(root)
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
    assert ingest(root).returncode == 0
    write_version_1_state(root)
    copied = copy_root(root, tmp_path / "copied")
    for where in (root, copied):
        ran = ingest(where)
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
