"""Compile the feature kernels into numba's cache ahead of use: `python -m gpufail.precompile`.

Every process that computes features takes its compiled kernels (`features.runs.compiled`) from
numba's cache, or compiles them when the cache has none: about 4 s of a fresh process reading the
newest hour of a 31k-GPU fleet. A container starts with an empty cache, and runs as a user who
cannot write beside the installed sources (numba's default place for it), so every fresh pod, a
serving replica or a nightly run, paid it. The image runs this at build with `NUMBA_CACHE_DIR`
set and ships that folder (`Dockerfile`).

It runs each command that computes features on a small simulated fleet, so that every kernel is
compiled for the column types the store holds: the stored aggregates' build, the materialised
table's, and the readers' newest hour (few kept rows), a training draw (many) and the labels.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from datetime import datetime, timedelta
from pathlib import Path

from features.on_demand import drawn, features_on_demand, newest_on_demand
from ingest.store import Store


def _gpufail(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "gpufail.cli", *args], check=True, stdout=subprocess.DEVNULL)


def precompile(folder: Path) -> None:
    """Build a small fleet in `folder` and compute its features every way the commands do."""
    data = str(folder / "data")
    _gpufail("simulate", "--out", data, "--preset", "demo", "--days", "9", "--nodes", "2", "--quiet")
    _gpufail("ingest", "kernel-log", "--data", data)
    _gpufail("features", "--data", data, "--materialise", "--quiet")
    _gpufail("features", "--data", data, "--quiet")
    store = Store.open(data)
    newest_on_demand(store)
    end: datetime = features_on_demand(store, labels_only=True, ids=False)["ts"].max()  # type: ignore[assignment]
    features_on_demand(store, end - timedelta(days=2), end, rows=drawn(0.1))


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="gpufail-precompile-") as folder:
        precompile(Path(folder))


if __name__ == "__main__":
    main()
