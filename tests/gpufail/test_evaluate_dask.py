"""`gpufail evaluate` with `[dask] scheduler = "local"` runs the walk-forward's fits and scoring
on a LocalCluster and writes the figures it writes in one process."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gpufail.cli import cli
from tests.cli import without_outside_config
from tests.models import demo_features_store

QUICK = """
[model]
monotone_increasing = []
calibration_window = "1d"

[evaluate]
test_days = 2.0
train_window = "3d"
retrain_every = "1d"
negative_fraction = 0.2
bootstrap_samples = 20
jobs = 1

[[evaluate.contenders]]
name = "lightgbm static"
kind = "lightgbm"
mode = "static"
params = { n_estimators = 20, n_jobs = 1 }

[[evaluate.contenders]]
name = "lightgbm sliding"
kind = "lightgbm"
mode = "sliding"
params = { n_estimators = 20, n_jobs = 1 }
"""


@pytest.fixture(autouse=True)
def no_outside_config(monkeypatch, tmp_path):
    without_outside_config(monkeypatch, tmp_path)


def _evaluate(data: str, config, report) -> dict:
    result = CliRunner().invoke(
        cli, ["--config", str(config), "evaluate", "--data", data, "--report", str(report), "--quiet"]
    )
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return json.loads((report / "metrics.json").read_text())


def test_evaluate_on_a_local_dask_cluster_writes_the_figures_of_one_process(tmp_path, monkeypatch):
    import models.walk_forward as wf

    data = demo_features_store(str(tmp_path / "data")).root
    alone, on_dask = tmp_path / "alone.toml", tmp_path / "dask.toml"
    alone.write_text(QUICK)
    on_dask.write_text(QUICK + '\n[dask]\nscheduler = "local"\nn_workers = 2\n')
    one = _evaluate(data, alone, tmp_path / "one")
    ran: list[str] = []
    real = wf._Runner._on_dask

    def recorded(self, run, tasks):
        ran.append(run.__name__)
        return real(self, run, tasks)

    monkeypatch.setattr(wf._Runner, "_on_dask", recorded)
    two = _evaluate(data, on_dask, tmp_path / "two")
    assert ran == ["_run_fit", "_score_day"]  # the fits, then the days, as tasks of the cluster
    assert len(one["fits"]) > 2
    for key in ("fits", "scores", "alarms", "calibration", "claims", "test"):
        assert two[key] == one[key], key
