"""Readers while `gpufail features --overwrite` replaces the stored days (issue: `train` and
`score` exited with a vanished file). A reader lists the committed files, then opens them; the
rebuild's commit must not pull a listed file away in between: the replaced files linger for
readers (`ingest.journal.READER_GRACE_S`), and the next build after the grace deletes them."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pytest

from features.aggregates import MANIFEST
from features.dataset import read_features
from features.manifest import open_manifest
from ingest.journal import READER_GRACE_S
from ingest.store import Store
from tests.cli import gpufail
from tests.synthetic import synthetic_telemetry

pytestmark = pytest.mark.slow

T0 = datetime(2026, 1, 5, tzinfo=UTC)
DATASETS = ("buckets", "bucket_presence")


def built(root: Path) -> Store:
    store = Store.create(str(root))
    store.write(
        "telemetry", synthetic_telemetry(8, 3 * 144, interval=timedelta(minutes=10), start=T0, seed=3).to_arrow()
    )
    ran = gpufail("features", "--data", str(root), "--quiet")
    assert ran.returncode == 0, ran.stderr
    return store


def rebuild(root: Path) -> None:
    ran = gpufail("features", "--data", str(root), "--overwrite", "--quiet")
    assert ran.returncode == 0, ran.stderr


@pytest.mark.parametrize("dataset", DATASETS)
def test_files_listed_before_a_rebuild_still_open_after_its_commit(tmp_path: Path, dataset: str) -> None:
    store = built(tmp_path / "root")
    listed = store.files(dataset)  # a reader's listing, just before the rebuild commits
    before = pl.concat([pl.read_parquet(path) for path in listed])
    rebuild(tmp_path / "root")
    # The reader opens what it listed: every file is still there, with the rows it had.
    assert pl.concat([pl.read_parquet(path) for path in listed]).equals(before)
    # Readers that list after the commit see the new files only: the same rows, once each.
    after = pl.concat([pl.read_parquet(path) for path in store.files(dataset)])
    assert after.height == before.height


def test_the_next_build_after_the_grace_deletes_the_lingering_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = built(tmp_path / "root")
    rebuild(tmp_path / "root")
    visible = {Path(p) for p in store.files("buckets")}
    lingering = [p for p in (tmp_path / "root" / "buckets").rglob("*.parquet") if p not in visible]
    assert lingering  # the first build's files, kept for readers
    # The next build's journal, entered past the grace, deletes them.
    later = time.time() + READER_GRACE_S + 60
    monkeypatch.setattr(time, "time", lambda: later)
    with open_manifest(store, MANIFEST, DATASETS):
        pass
    assert not any(p.exists() for p in lingering)
    assert {Path(p) for p in store.files("buckets")} == visible


def test_readers_during_rebuilds_never_fail_and_see_every_row_once(tmp_path: Path) -> None:
    """`read_features` (what train, score and evaluate call) in a loop in this process while
    `gpufail features --overwrite` runs twice in another."""
    root = tmp_path / "root"
    built(root)
    expected = read_features(Store.open(str(root)), columns=["gpu_uuid", "ts"]).sort("gpu_uuid", "ts")
    problems: list[str] = []
    reads = 0
    done = threading.Event()

    def read_again_and_again() -> None:
        nonlocal reads
        while not done.is_set():
            try:
                got = read_features(Store.open(str(root)), columns=["gpu_uuid", "ts"])
            except Exception as exc:  # every failure is what the test reports
                problems.append(f"{type(exc).__name__}: {exc}")
                continue
            if not got.sort("gpu_uuid", "ts").equals(expected):
                problems.append(f"{got.height} rows where {expected.height} were expected")
            reads += 1

    reader = threading.Thread(target=read_again_and_again)
    reader.start()
    try:
        rebuild(root)
        rebuild(root)
    finally:
        done.set()
        reader.join()
    assert reads > 0
    assert not problems, problems[:3]
