"""`gpufail simulate --nodes/--fail-slow` and what `gpufail evaluate --policy` needs before it
replays (the replay itself: tests/serving/test_replay.py and tests/test_pipeline.py)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from gpufail.cli.models import _policy_replay, _slow_truth
from gpufail.config import load_settings
from ingest.errors import GpufailError, InputError
from ingest.store import Store
from tests.cli import gpufail


def test_simulate_sizes_the_fleet_and_plants_fail_slow_gpus(tmp_path):
    out = tmp_path / "fleet"
    result = gpufail(
        "simulate",
        "--out",
        str(out),
        "--preset",
        "demo",
        "--nodes",
        "3",
        "--days",
        "2",
        "--fail-slow",
        "0.5",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    assert "on 3 nodes" in result.stdout and " jobs in " in result.stdout
    gpus = pq.read_table(out / "ground_truth" / "gpus.parquet").to_pandas()
    slow = gpus[gpus["fail_slow_since"].notna()]
    assert 3 <= len(slow) < len(gpus)
    assert slow["fail_slow_deficit"].between(0.05, 0.3).all()
    assert (gpus.loc[gpus["fail_slow_since"].isna(), "fail_slow_deficit"] == 0).all()
    truth = _slow_truth(str(out))
    assert list(truth.columns) == ["node", "until", "since", "deficit"] and len(truth) == len(slow)
    bad = gpufail("simulate", "--out", str(tmp_path / "x"), "--fail-slow", "2")
    assert bad.returncode != 0 and "Invalid value for '--fail-slow'" in bad.stderr


def test_evaluate_policy_needs_a_job_trace_and_the_failures(tmp_path):
    settings = load_settings()
    store = Store.create(str(tmp_path / "data"))
    with pytest.raises(InputError, match=r"jobs/trace.parquet: no job trace; `gpufail simulate` writes one"):
        _policy_replay(store, str(tmp_path / "data"), settings, "24h")
    simulated = tmp_path / "fleet"
    gpufail("simulate", "--out", str(simulated), "--preset", "demo", "--nodes", "2", "--days", "1", "--quiet")
    (tmp_path / "data" / "jobs").mkdir()
    (tmp_path / "data" / "jobs" / "trace.parquet").write_bytes((simulated / "jobs" / "trace.parquet").read_bytes())
    with pytest.raises(GpufailError, match="evaluate --policy needs the failures dataset"):
        _policy_replay(store, str(tmp_path / "data"), settings, "24h")
    assert _slow_truth(str(tmp_path / "data")) is None  # no ground truth: slowness unknown
