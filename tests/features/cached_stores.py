"""Small simulated stores for the tests of what one process keeps for the next (`DATA/_cache/`:
the fleet facts, the newest rows, the drawn days, the labels of a range)."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path

from features import on_demand
from features.aggregates import build_aggregates
from ingest.simulator.run import simulate
from ingest.store import Store
from tests.cli import gpufail


def simulated_store(root: Path, *, seed: int, nodes: int, days: int, last_day_built: bool = True) -> str:
    """A demo-preset fleet of `nodes` nodes over `days` days (15-minute samples), its kernel logs
    ingested and its aggregates built (all but the last day's unless `last_day_built`)."""
    simulate(root, "demo", seed=seed, progress=False, nodes=nodes, days=days, sample_interval_s=900, acceleration=80.0)
    assert gpufail("ingest", "kernel-log", "--data", str(root)).returncode == 0
    store = Store.open(str(root))
    last_day = store.dates("telemetry")[-1]
    build_aggregates(store, end=None if last_day_built else datetime.combine(last_day, datetime.min.time(), tzinfo=UTC))
    return str(root)


def uncached_copy(built: str, tmp_path: Path) -> Store:
    """A copy of the store `built` with nothing cached, opened by a process that has read nothing."""
    root = tmp_path / "data"
    shutil.copytree(built, root, ignore=shutil.ignore_patterns("_cache"))
    on_demand._FACTS.clear()
    return Store.open(str(root))
