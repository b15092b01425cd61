"""`gpufail compact` killed with SIGKILL at its write boundaries and after random delays
(`tests.faults.kill_points`), then run again.

Right after a kill, readers see every row exactly once (each day's old files or its new ones,
never both, never neither). After the rerun the store reads exactly as a clean compaction left
it: the same files' rows in the same order, one file per day, nothing hidden left behind.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import polars as pl
import pytest

from ingest.store import Store
from tests.faults import kill_points
from tests.ingest.test_compact import collector_like, rows

pytestmark = pytest.mark.slow

KILLS = 8
DELAYS = 2
SEED = 48


def ended_first(kill: kill_points.Kill, passed: int) -> bool:
    """Whether a run that exited by itself ended before `kill` could land: after a delay longer
    than the run, or before its point (a run may pass fewer points than the clean run counted:
    the first write of a file object whose id a freed one had is not counted)."""
    return kill.after_s is not None or (kill.point is not None and passed < kill.point)


def command(root: Path) -> list[str]:
    return ["compact", "--data", str(root), "--settle", "0s"]


def per_file(root: Path) -> list[pl.DataFrame]:
    """Each file readers see, its rows in stored order (names aside: they are random)."""
    store = Store.open(str(root))
    frames = [
        pl.read_parquet(path)
        for dataset in ("telemetry", "xid_events", "collector_runs")
        for path in store.files(dataset)
    ]
    return sorted(frames, key=lambda f: (f.columns[0], str(f.row(0))))


@pytest.fixture(scope="module")
def spread(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A store as collectors leave it (`collector_like`), its root."""
    return collector_like(tmp_path_factory.mktemp("spread") / "root", nodes=3, hours=48, flush_rows=12).root


def test_a_rerun_after_kill_9_gives_exactly_the_clean_compaction(spread: str, tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    shutil.copytree(spread, clean)
    expected = {d: rows(Store.open(spread), d) for d in ("telemetry", "xid_events", "collector_runs")}
    kills = kill_points.plan(command(clean), KILLS, SEED, delays=DELAYS)
    clean_files = per_file(clean)
    assert len(clean_files) == 6  # per dataset: two days (XIDs and runs: one of a single file already)
    for i, kill in enumerate(kills):
        root = tmp_path / f"kill-{i}"
        shutil.copytree(spread, root)
        status, passed = kill_points.run(command(root), kill=kill)
        assert status == -signal.SIGKILL or (status == 0 and ended_first(kill, passed)), kill
        store = Store.open(str(root))
        for dataset, frame in expected.items():
            assert rows(store, dataset).equals(frame), (kill, dataset)
        status, _ = kill_points.run(command(root))
        assert status == 0, kill
        for dataset, frame in expected.items():
            assert rows(Store.open(str(root)), dataset).equals(frame), (kill, dataset)
        got = per_file(root)
        assert len(got) == len(clean_files) and all(a.equals(b) for a, b in zip(got, clean_files, strict=True)), kill
        assert kill_points.hidden_files(root) == [], kill
        shutil.rmtree(root)
