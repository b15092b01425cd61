"""`gpufail features` (the stored aggregates) killed with SIGKILL at its write boundaries and after random
delays (`tests.faults.kill_points`), then run again without --overwrite.

Right after a kill, readers see each day's buckets and presence whole as a build completed
them, or not at all. After the rerun the stored aggregates are exactly a clean build's, every
file reads, no hidden file is left, the manifest names exactly the files there, and the features
computed from them are the clean build's. Half the trials rebuild a built store (--overwrite),
where a kill must leave each day's old files or its new ones, never both and never neither.
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

from features.aggregates import BUCKETS, MANIFEST, PRESENCE, read_buckets, read_presence
from features.on_demand import features_on_demand
from ingest.store import Store
from tests.cli import gpufail
from tests.faults import kill_points
from tests.synthetic import synthetic_telemetry, synthetic_xids

pytestmark = pytest.mark.slow

T0 = datetime(2026, 1, 5, tzinfo=UTC)
KILLS = 4
DELAYS = 1
SEED = 31
ENV: dict[str, str | None] = {k: None for k in os.environ if k.startswith("GPUFAIL_")} | {
    "GPUFAIL_FEATURES__WINDOWS": '["1h", "6h", "24h"]',
}
EVERYTHING = (T0 - timedelta(days=1), T0 + timedelta(days=10))


def command(root: Path, *extra: str) -> list[str]:
    return ["features", "--data", str(root), "--quiet", *extra]


def stored(root: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    store = Store.open(str(root))
    return read_buckets(store, *EVERYTHING).sort("gpu_uuid", "ts"), read_presence(store)


@pytest.fixture(scope="module")
def telemetry_store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fleet") / "data"
    tel = synthetic_telemetry(12, 96, interval=timedelta(minutes=15), gpus_per_node=4, start=T0, seed=13)
    store = Store.create(str(root))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", synthetic_xids(tel, per_gpu_day=0.5, seed=13).to_arrow())
    return root


@pytest.fixture(scope="module")
def built(telemetry_store, tmp_path_factory) -> tuple[Path, tuple[pl.DataFrame, pl.DataFrame], list[kill_points.Kill]]:
    """A clean build (its root and what it stored), and the kills of a first build."""
    root = tmp_path_factory.mktemp("clean") / "data"
    shutil.copytree(telemetry_store, root)
    kills = kill_points.plan(command(root), KILLS, SEED, env=ENV, delays=DELAYS)
    return root, stored(root), kills


def assert_whole_days(root: Path, expected: tuple[pl.DataFrame, pl.DataFrame]) -> None:
    """What a reader sees: each day's buckets whole as the clean build has them, or absent."""
    buckets, _ = stored(root)
    assert buckets.select("gpu_uuid", "ts").is_duplicated().sum() == 0
    clean = expected[0]
    for (day,), rows in buckets.group_by(pl.col("ts").dt.date()):
        assert_frame_equal(rows.sort("gpu_uuid", "ts"), clean.filter(pl.col("ts").dt.date() == day))


def assert_clean_build(root: Path, expected: tuple[pl.DataFrame, pl.DataFrame]) -> None:
    buckets, presence = stored(root)
    assert_frame_equal(buckets, expected[0])
    assert_frame_equal(presence, expected[1])
    store = Store.open(str(root))
    files = store.files(BUCKETS) + store.files(PRESENCE)
    for path in files:  # whole files only
        pq.read_metadata(path)
    listed = {f for day in store.read_state(MANIFEST)["days"].values() for f in day["files"]}
    assert {str(Path(f).relative_to(store.root)) for f in files} == listed
    assert kill_points.hidden_files(root) == []


def killed_then_rerun(
    root: Path, kill: kill_points.Kill, expected: tuple[pl.DataFrame, pl.DataFrame], *extra: str
) -> None:
    status, _ = kill_points.run(command(root, *extra), kill=kill, env=ENV)
    assert status == -signal.SIGKILL or (kill.after_s is not None and status == 0), kill
    assert_whole_days(root, expected)
    status, _ = kill_points.run(command(root, *extra), env=ENV)
    assert status in (0, 2), kill  # 2: the kill came after the end, nothing was left to build
    assert_clean_build(root, expected)


def test_a_rerun_after_kill_9_gives_exactly_the_clean_aggregates(built, telemetry_store, tmp_path):
    clean_root, expected, kills = built

    def trial(i: int) -> Path:
        root = tmp_path / f"kill-{i}"
        shutil.copytree(telemetry_store, root)
        killed_then_rerun(root, kills[i], expected)
        return root

    with ThreadPoolExecutor(max_workers=2) as pool:
        roots = list(pool.map(trial, range(len(kills))))
    again = gpufail(*command(roots[0]), env=ENV)  # type: ignore[arg-type]
    assert again.returncode == 0 and again.stdout.startswith("features: up to date: ")
    # The features computed from a rerun's aggregates are the clean build's.
    assert_frame_equal(features_on_demand(Store.open(str(roots[0]))), features_on_demand(Store.open(str(clean_root))))


def test_a_rebuild_killed_at_any_point_keeps_each_day_old_or_new(built, tmp_path):
    clean_root, expected, _ = built
    plan_root = tmp_path / "plan"
    shutil.copytree(clean_root, plan_root)
    kills = kill_points.plan(command(plan_root, "--overwrite"), KILLS, SEED + 1, env=ENV, delays=DELAYS)

    def trial(i: int) -> None:
        root = tmp_path / f"kill-{i}"
        shutil.copytree(clean_root, root)
        killed_then_rerun(root, kills[i], expected, "--overwrite")

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(trial, range(len(kills))))
