"""The walk-forward comparison: contenders and baselines on the same test rows, and the claims
checked against the figures."""

from __future__ import annotations

import numpy as np
import pytest

from models.comparison import claims, evaluate_walk_forward
from models.walk_forward import Contender
from tests.models.walk_forward_cases import FAST, PLAN, small_frame


def test_evaluate_walk_forward_reports_contenders_and_baselines():
    frame = small_frame()
    contenders = [Contender("lgb sliding", "lightgbm", "sliding", FAST), Contender("lr static", "logistic", "static")]
    metrics = evaluate_walk_forward(frame, contenders, PLAN, top_k=["5", "3%", "expected"], bootstrap_samples=50)
    scores = metrics["scores"]
    assert set(scores) == {"lgb sliding", "lr static", "random", "heuristic", "oracle", "model"}
    assert "rule" not in scores and "no hardware-XID" in metrics["baselines"]["rule"]
    assert scores["model"]["name"] == "lgb sliding"  # no auto contender: the first one
    for name in ("lgb sliding", "lr static"):
        at = scores[name]["by_k"]["5"]
        assert at["precision_daily_mean"] > scores["random"]["by_k"]["5"]["precision_daily_mean"]
        assert at["precision_daily_mean"] <= scores["oracle"]["by_k"]["5"]["precision_daily_mean"]
        assert len(at["daily"]) == 3
    assert scores["oracle"]["by_k"]["expected"]["k_mean"] == max(1, round(metrics["expected_failures_per_day"]))
    claims = metrics["claims"]
    assert claims["best_static_single"] == "lr static"
    assert claims["best"] in ("lgb sliding", "lr static")


def test_claims_compare_the_retrained_ensemble_with_the_best_static_single_model():
    def scored(days):
        mean, std = float(np.mean(days)), float(np.std(days))
        daily = [{"precision": d} for d in days]
        return {"by_k": {"10": {"precision_daily_mean": mean, "precision_daily_std": std, "daily": daily}}}

    scores = {
        "s": scored([0.1, 0.3, 0.1, 0.3]),
        "p": scored([0.26, 0.32, 0.26, 0.32]),  # better every day, and steadier
        "oracle": scored([0.5, 0.5, 0.4, 0.4]),
    }
    contenders = [Contender("s", "lightgbm", "static"), Contender("p", "parallel", "sliding")]
    e = claims(scores, contenders, "10", samples=200)["sliding_ensemble"]
    assert (e["name"], e["static_single"]) == ("p", "s")
    assert e["gain"] == pytest.approx(0.09) and e["gain_ci"][0] > 0
    assert e["std_ratio"] == pytest.approx(0.03 / 0.1) and e["stability_target_met"]
    assert e["std_ratio_ci"][0] <= e["std_ratio"] <= e["std_ratio_ci"][1]
    assert e["static_of_oracle_halves"] == pytest.approx([0.4, 0.5])
    # Without a retrained ensemble there is no such claim.
    assert "sliding_ensemble" not in claims(scores, contenders[:1], "10", samples=50)
