"""`gpufail features --materialise` (the features table) killed with SIGKILL at its write boundaries and after random delays
(`tests.faults.kill_points`), then run again without --overwrite.

Right after a kill, readers (training, scoring, evaluation read through the store) see every
day whole as a build completed it, or not at all. After the rerun the features dataset holds
exactly the rows of a clean build, every file reads, no hidden file is left, and the manifest
names exactly the files there. Half the trials rebuild a built store (--overwrite), where a
kill must leave each day's old rows or its new ones, never both and never neither.
"""

from __future__ import annotations

import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from polars.testing import assert_frame_equal

from features.dataset import read_features
from ingest.store import Store
from tests.cli import gpufail
from tests.faults import kill_points
from tests.synthetic import synthetic_telemetry, synthetic_xids

pytestmark = pytest.mark.slow

T0 = datetime(2026, 1, 5, tzinfo=UTC)
KILLS = 4
DELAYS = 1
SEED = 25
# Four blocks of a day, each built in several shards (a small bucket budget), so that a day is
# written as several files: a kill between them leaves it partial. One shard at a time, no
# reading or writing ahead: the kill points come in the same order in every run.
ENV: dict[str, str | None] = {k: None for k in os.environ if k.startswith("GPUFAIL_")} | {
    "GPUFAIL_FEATURES__WINDOWS": '["1h", "6h", "24h"]',
    "GPUFAIL_FEATURES__BLOCK_DAYS": "1",
    "GPUFAIL_FEATURES__BUCKETS_IN_MEMORY": "800",
    "GPUFAIL_FEATURES__WORKERS": "1",
    "GPUFAIL_FEATURES__READ_AHEAD": "false",
    "GPUFAIL_FEATURES__WRITE_AHEAD": "false",
}


def features_command(root: Path, *extra: str) -> list[str]:
    return ["features", "--materialise", "--data", str(root), "--quiet", *extra]


@pytest.fixture(scope="module")
def telemetry_store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fleet") / "data"
    tel = synthetic_telemetry(16, 96, interval=timedelta(minutes=15), gpus_per_node=4, start=T0, seed=11)
    store = Store.create(str(root))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", synthetic_xids(tel, per_gpu_day=0.5, seed=11).to_arrow())
    return root


@pytest.fixture(scope="module")
def built(telemetry_store, tmp_path_factory) -> tuple[Path, pl.DataFrame, list[kill_points.Kill]]:
    """A clean build (its root and rows), and the kills of a first build."""
    root = tmp_path_factory.mktemp("clean") / "data"
    shutil.copytree(telemetry_store, root)
    kills = kill_points.plan(features_command(root), KILLS, SEED, env=ENV, delays=DELAYS)
    return root, read_features(Store.open(str(root))), kills


def rows_by_day(rows: pl.DataFrame) -> dict[object, pl.DataFrame]:
    return {day: rows.filter(pl.col("ts").dt.date() == day) for day in rows["ts"].dt.date().unique().to_list()}


def assert_whole_days(root: Path, expected: pl.DataFrame) -> None:
    """What a reader sees: days whole as the clean build has them, or absent."""
    seen = read_features(Store.open(str(root)))
    assert seen.select("gpu_uuid", "ts").is_duplicated().sum() == 0
    clean = rows_by_day(expected)
    for day, rows in rows_by_day(seen).items():
        assert_frame_equal(rows, clean[day], check_exact=False, rel_tol=1e-5, abs_tol=1e-4)


def assert_clean_build(root: Path, expected: pl.DataFrame) -> None:
    store = Store.open(str(root))
    rows = read_features(store)
    assert rows.select("gpu_uuid", "ts").is_duplicated().sum() == 0
    assert_frame_equal(rows, expected, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)
    files = store.files("features")
    for path in files:  # whole files only
        pq.read_metadata(path)
    listed = {f for day in store.read_state("features")["days"].values() for f in day["files"]}
    assert {str(Path(f).relative_to(store.path("features"))) for f in files} == listed
    assert kill_points.hidden_files(root) == []


def killed_then_rerun(root: Path, kill: kill_points.Kill, expected: pl.DataFrame, *extra: str) -> int:
    """Kill a build of `root` as planned, check what a reader sees then, run it again to the end
    and check the result; returns the rerun's status (2: nothing left to build)."""
    status, _ = kill_points.run(features_command(root, *extra), kill=kill, env=ENV)
    assert status == -signal.SIGKILL or (kill.after_s is not None and status == 0), kill
    assert_whole_days(root, expected)
    status, _ = kill_points.run(features_command(root, *extra), env=ENV)
    assert status in (0, 2), kill  # 2: the kill came after the end, nothing was left to build
    assert_clean_build(root, expected)
    return status


def test_a_rerun_after_kill_9_gives_exactly_the_clean_rows(built, telemetry_store, tmp_path):
    _, expected, kills = built

    def trial(i: int) -> Path:
        root = tmp_path / f"kill-{i}"
        shutil.copytree(telemetry_store, root)
        killed_then_rerun(root, kills[i], expected)
        return root

    with ThreadPoolExecutor(max_workers=2) as pool:  # each trial is processes of its own
        roots = list(pool.map(trial, range(len(kills))))
    # A second rerun has nothing left to do and says what is there.
    again = gpufail(*features_command(roots[0]), env=ENV)  # type: ignore[arg-type]
    assert again.returncode == 0 and again.stdout.startswith("features: up to date: ")


def test_a_rebuild_killed_at_any_point_keeps_each_day_old_or_new_and_a_rerun_completes_it(built, tmp_path):
    clean_root, expected, _ = built
    plan_root = tmp_path / "plan"
    shutil.copytree(clean_root, plan_root)
    kills = kill_points.plan(features_command(plan_root, "--overwrite"), KILLS, SEED + 1, env=ENV, delays=DELAYS)

    def trial(i: int) -> None:
        root = tmp_path / f"kill-{i}"
        shutil.copytree(clean_root, root)
        # Old and new rows are equal: a day read twice or not at all is what would show.
        killed_then_rerun(root, kills[i], expected, "--overwrite")

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(trial, range(len(kills))))
