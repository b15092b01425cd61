"""`gpufail.precompile` fills numba's cache with every kernel a feature read compiles: a fresh
process reading another fleet's newest hour and a training draw then compiles nothing (a
container's first read found an empty cache and spent seconds compiling)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ingest.simulator.run import simulate
from tests.cli import gpufail

ROOT = Path(__file__).parents[2]

_READ = """
import sys
from datetime import timedelta
from features.on_demand import drawn, features_on_demand, newest_on_demand
from ingest.store import Store
store = Store.open(sys.argv[1])
assert newest_on_demand(store).height
end = features_on_demand(store, labels_only=True, ids=False)["ts"].max()
assert features_on_demand(store, end - timedelta(days=3), end, rows=drawn(0.2)).height
"""


def _cache_entries(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*.nbc")}


@pytest.mark.slow
def test_a_read_after_precompile_compiles_no_kernel(tmp_path):
    cache = tmp_path / "numba-cache"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "gpufail.precompile"], env=env, check=True, cwd=ROOT)
    compiled = _cache_entries(cache)
    assert any("rolling._moments_kernel" in name for name in compiled), compiled
    # Another fleet than precompile's own (the paper preset's metrics and gaps) and its readers.
    data = tmp_path / "data"
    simulate(data, "paper", seed=3, progress=False, nodes=3, days=9, acceleration=60.0)
    assert gpufail("ingest", "kernel-log", "--data", str(data)).returncode == 0
    assert gpufail("features", "--data", str(data), "--quiet").returncode == 0
    before = _cache_entries(cache)
    subprocess.run([sys.executable, "-c", _READ, str(data)], env=env, check=True, cwd=ROOT)
    assert _cache_entries(cache) == before
