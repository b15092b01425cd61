"""Backtests from the command line: `gpufail train --until` trains as of a cut-off (no label
looks past it) and `gpufail score --at` / `--start --end` score grid times after it."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pytest

from features.dataset import read_features
from ingest.failure_events import event_frame, write_failure_events
from ingest.store import Store
from tests.cli import gpufail
from tests.synthetic import synthetic_telemetry

START = datetime(2026, 3, 2, tzinfo=UTC)
CUTOFF = START + timedelta(days=7)
# The served model trains on every label up to the cut-off's last settled one (cut-off - 1 day);
# its calibration map comes from a fit that ends 2 days earlier, scoring those 2 days.
FAILURES = {
    "GPU-00000003": START + timedelta(days=2, hours=6),  # trained on by both fits
    "GPU-00000006": START + timedelta(days=5, hours=6),  # in the calibration slice, and trained on
    "GPU-00000011": START + timedelta(days=8, hours=6),  # after the cut-off
}
CONFIG = '[model]\ncalibration_window = "2d"\n'


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 GPUs over ten days, one sample every 10 minutes, two failure records: one early,
    one after the cut-off; features built over all of it, as a user builds them first."""
    root = tmp_path_factory.mktemp("backtest") / "data"
    store = Store.create(str(root))
    tel = synthetic_telemetry(16, 240, interval=timedelta(minutes=10), start=START, seed=5)
    store.write("telemetry", tel.to_arrow())
    node = dict(zip(tel["gpu_uuid"], tel["node"], strict=False))
    records = [
        {"ts": ts, "cluster": tel["cluster"][0], "node": node[gpu], "gpu_uuid": gpu, "source": "record"}
        for gpu, ts in FAILURES.items()
    ]
    write_failure_events(store, event_frame(records))
    (root.parent / "gpufail.toml").write_text(CONFIG)
    built = gpufail("features", "--data", str(root), "--quiet")
    assert built.returncode == 0, built.stderr
    return root


def run(fleet: Path, *args: str):
    return gpufail("--config", str(fleet.parent / "gpufail.toml"), *args)


def trained(line: str) -> tuple[int, datetime]:
    found = re.search(r"\(([\d,]+) positive\) from \S+ \S+ to (\d{4}-\d\d-\d\d \d\d:\d\d)", line)
    assert found, line
    return int(found[1].replace(",", "")), datetime.fromisoformat(found[2]).replace(tzinfo=UTC)


def test_train_until_keeps_every_label_before_the_cut_off(fleet: Path, tmp_path: Path) -> None:
    features = read_features(Store.open(str(fleet)), columns=["label"])
    positive = features.filter(pl.col("label") == 1)
    rows = {gpu: positive.filter(pl.col("gpu_uuid") == gpu).height for gpu in FAILURES}
    assert all(rows.values()), rows
    early, middle, late = rows.values()

    cut = run(fleet, "train", "--data", str(fleet), "--model-out", str(tmp_path / "cut"), "--until", CUTOFF.isoformat())
    assert cut.returncode == 0, cut.stderr
    positives, last_row = trained(cut.stdout)
    # Trained up to the newest label settled at the cut-off (cut-off - horizon), within one grid
    # step: calibration does not push it back, and no label looks past the cut-off.
    settled = CUTOFF - timedelta(days=1)
    assert settled - timedelta(hours=1) <= last_row <= settled
    assert positives == early + middle

    # Without the cut-off the newest windows hold the failure after it too.
    whole = run(fleet, "train", "--data", str(fleet), "--model-out", str(tmp_path / "all"))
    assert whole.returncode == 0, whole.stderr
    assert trained(whole.stdout)[0] == early + middle + late


def test_score_at_and_over_a_range_write_one_snapshot_per_grid_time(fleet: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    assert (
        run(fleet, "train", "--data", str(fleet), "--model-out", str(model), "--until", CUTOFF.isoformat()).returncode
        == 0
    )
    at = gpufail(
        "score", "--data", str(fleet), "--model", str(model), "--at", (CUTOFF + timedelta(minutes=30)).isoformat()
    )
    assert at.returncode == 0, at.stderr
    assert f"at {CUTOFF:%Y-%m-%d %H:%M}" in at.stdout  # the grid time 00:30 falls in

    ranged = gpufail(
        "score", "--data", str(fleet), "--model", str(model), "--json",
        "--start", CUTOFF.isoformat(), "--end", (CUTOFF + timedelta(days=1)).isoformat(),
    )  # fmt: skip
    assert ranged.returncode == 0, ranged.stderr
    facts = json.loads(ranged.stdout)
    # The two GPUs that failed before the cut-off (no repair record) are out of service.
    assert facts["grid_times"] == 24 and facts["rows"] == 24 * 14
    assert facts["replaced"] == 1  # the --at snapshot of 00:00, scored again
    predictions = Store.open(str(fleet)).read_owned("predictions")
    assert predictions is not None and len(set(predictions["ts"].to_pylist())) == 24

    outside = gpufail("score", "--data", str(fleet), "--model", str(model), "--at", "2027-01-01")
    assert outside.returncode == 2 and "no features at 2027-01-01 00:00 UTC" in outside.stderr
    both = gpufail("score", "--data", str(fleet), "--model", str(model), "--at", "2027-01-01", "--start", "2026-03-09")
    assert both.returncode == 2 and "give one or the other" in both.stderr


def test_model_params_in_the_configuration_reach_the_trained_model(fleet: Path, tmp_path: Path) -> None:
    from models.train import load_model

    config = tmp_path / "gpufail.toml"
    config.write_text(CONFIG + "params = { n_estimators = 7, num_leaves = 5 }\n")
    result = gpufail("--config", str(config), "train", "--data", str(fleet), "--model-out", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    params = load_model(str(tmp_path / "m")).params
    assert (params["n_estimators"], params["num_leaves"]) == (7, 5)
