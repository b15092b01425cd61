"""`benchmarks.calibration_freshness`: the served model of the fresh scheme is a calibration
window and a horizon younger than the aged one's, and both are judged on the same unseen rows."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from benchmarks.calibration_freshness import figures, main
from tests.models import demo_features_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return demo_features_store(str(tmp_path_factory.mktemp("freshness-bench") / "data"))


def test_the_fresh_model_is_a_calibration_window_younger_and_both_are_judged_on_unseen_rows(store, tmp_path, capsys):
    config = tmp_path / "gpufail.toml"
    config.write_text(
        '[model]\nmonotone_increasing = []\ntrain_window = "3d"\ncalibration_window = "2d"\nmax_negatives_per_positive = 20\n'
        "params = { n_estimators = 20, n_jobs = 1 }\n"
    )
    main(["--data", store.root, "--holdout-days", "2", "--config", str(config)])
    out = json.loads(capsys.readouterr().out)
    fresh, aged = out["fresh"], out["aged"]
    assert out["positives"] > 0 and out["rows"] > out["positives"]
    # The fresh model's newest label is one horizon and one grid step before the held-out
    # window; the aged one's a calibration window and a horizon earlier still.
    horizon_h = fresh["age_h"] - 1
    assert horizon_h > 0 and aged["age_h"] == pytest.approx(fresh["age_h"] + 48 + horizon_h)
    for scheme in (fresh, aged):
        assert 0 < scheme["average_precision"] <= 1 and 0 <= scheme["ece"] < 0.1
        assert scheme["top_ties"]["n_rows"] >= 1
        high = scheme["high_risk"]  # (this small fleet has no rows >= 0.5: GPUs counted below)
        assert high["n_groups"] <= high["n_rows"] and high["effective_rows"] <= high["n_rows"]


class _AtRisk:
    """A model whose every risk is 0.6: the figures are what is tested, not the fit."""

    train_end = pd.Timestamp("2026-01-01", tz="UTC")

    def predict_risk(self, held):
        return np.full(len(held), 0.6)


def test_its_high_risk_interval_counts_the_gpus_the_rows_come_from():
    # 40 hours at risk 0.6 of four GPUs that all failed: too few GPUs to say "outside".
    held = pd.DataFrame({"label": np.ones(40), "gpu_uuid": np.repeat([f"GPU-{i}" for i in range(4)], 10)})
    held.loc[0, "label"] = 0.0  # (both classes, for average precision)
    high = figures(_AtRisk(), held, pd.Timestamp("2026-01-02", tz="UTC"))["high_risk"]
    assert (high["n_rows"], high["n_groups"]) == (40, 4)
    assert high["effective_rows"] <= 4 and high["verdict"] == "too few rows"
