"""`gpufail features` killed with SIGKILL at random points, then run again without --overwrite.

The points are the build's writes: before and after each flush of feature files (one file per
flush here: a day per block) and each save of the manifest (`features.manifest`), counted in
the child, which kills itself there (a real kill -9: no `finally`, no flush). After the rerun the features dataset must hold exactly the rows of a
clean build, every file must read, and the manifest must name exactly the files there.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from polars.testing import assert_frame_equal

from features.build import read_features
from ingest.store import Store
from tests.cli import gpufail, gpufail_env
from tests.synthetic import synthetic_telemetry, synthetic_xids

pytestmark = pytest.mark.slow

T0 = datetime(2026, 1, 5, tzinfo=UTC)
KILLS = 12
SEED = 25
POINTS = 2 * (4 * 4 + 5)
# Four blocks of a day, each built in several shards (a small bucket budget), so that a day is
# written as several files: a kill between them leaves it partial.
ENV = {
    "GPUFAIL_FEATURES__WINDOWS": '["1h", "6h", "24h"]',
    "GPUFAIL_FEATURES__BLOCK_DAYS": "1",
    "GPUFAIL_FEATURES__BUCKETS_IN_MEMORY": "400",
}

_CHILD = """
import os, signal, sys, threading
import features.build
from features.manifest import FeatureManifest

kill_at, seen, lock = int(os.environ["KILL_AT"]), [0], threading.Lock()

def point():
    with lock:
        seen[0] += 1
        if seen[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

def counted(real):
    def write(*args, **kwargs):
        point()
        out = real(*args, **kwargs)
        point()
        return out
    return write

features.build.write_features = counted(features.build.write_features)
FeatureManifest._save = counted(FeatureManifest._save)
from gpufail.cli import main
sys.argv = ["gpufail", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def telemetry_store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fleet") / "data"
    tel = synthetic_telemetry(16, 96, interval=timedelta(minutes=15), gpus_per_node=4, start=T0, seed=11)
    store = Store.create(str(root))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", synthetic_xids(tel, per_gpu_day=0.5, seed=11).to_arrow())
    return root


@pytest.fixture(scope="module")
def clean(telemetry_store, tmp_path_factory) -> tuple[pl.DataFrame, int]:
    """The clean build's rows, and how many kill points a build passes."""
    root = tmp_path_factory.mktemp("clean") / "data"
    shutil.copytree(telemetry_store, root)
    import features.build
    from features.manifest import FeatureManifest

    calls, lock = [0], threading.Lock()

    def counted(real):
        def write(*args, **kwargs):
            with lock:
                calls[0] += 1
            return real(*args, **kwargs)

        return write

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(features.build, "write_features", counted(features.build.write_features))
        mp.setattr(FeatureManifest, "_save", counted(FeatureManifest._save))
        assert gpufail("features", "--data", str(root), "--quiet", env=ENV).returncode == 0
    return read_features(Store.open(str(root))), 2 * calls[0]


def kill_points() -> list[int]:
    # Drawn over the clean build's points (checked below): 4 days x 4 shards of flushes, and 5
    # saves of the manifest (at the start and after each day's block), a point before and
    # after each.
    return sorted(random.Random(SEED).sample(range(1, POINTS + 1), KILLS))


def test_the_points_are_those_of_a_clean_build(clean):
    rows, points = clean
    assert rows.height > 0 and points == POINTS


@pytest.mark.parametrize("kill_at", kill_points())
def test_a_rerun_after_kill_9_gives_exactly_the_clean_rows(kill_at, clean, telemetry_store, tmp_path):
    expected, _ = clean
    root = tmp_path / "data"
    shutil.copytree(telemetry_store, root)
    env = gpufail_env(ENV | {"KILL_AT": str(kill_at)})
    killed = subprocess.run(
        [sys.executable, "-c", _CHILD, "features", "--data", str(root), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert killed.returncode == -9, killed.stderr

    assert gpufail("features", "--data", str(root), "--quiet", env=ENV).returncode == 0

    store = Store.open(str(root))
    rows = read_features(store)
    assert rows.select("gpu_uuid", "ts").is_duplicated().sum() == 0
    assert_frame_equal(rows, expected, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)
    files = store.files("features")
    for path in files:  # whole files only
        pq.read_metadata(path)
    listed = {f for day in store.read_state("features")["days"].values() for f in day["files"]}
    assert {str(Path(f).relative_to(store.path("features"))) for f in files} == listed
    # A second rerun has nothing left to do and says what is there.
    assert gpufail("features", "--data", str(root), "--quiet", env=ENV).returncode == 2
