"""The walk-forward report: same data and seed give the same metrics.json; the Markdown and
plots say what the figures say; files are written atomically."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from functools import cache

import pandas as pd

from models.comparison import evaluate_walk_forward
from models.report import METRICS_FILE, PLOTS, REPORT_FILE, _baselines_text, metrics_json, write_walk_forward_report
from models.walk_forward import Contender, WalkForwardPlan
from tests.models import ONE_THREAD, make_synthetic_frame

PLAN = WalkForwardPlan(
    horizon="12h", test_days=3, train_window="4d", candidate_windows=("2d", "4d"), validation_window="1d",
    negative_fraction=0.3, seed=5, calibration_window="1d",
)  # fmt: skip
CONTENDERS = [
    Contender("lgb static", "lightgbm", "static", {"n_estimators": 20, **ONE_THREAD}),
    Contender("lr sliding", "logistic", "sliding"),
    Contender("lr auto", "logistic", "auto"),
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BUDGETS = (50.0, 200.0)
"""Alarms per 1,000 GPUs per day: a 100-GPU fleet's one-day validation slice holds few alarms."""


def fleet_frame() -> pd.DataFrame:
    """The synthetic frame with the columns the rule baseline reads: a memory XID in the last
    24 h rises before some failures (the rule's signal), and an uncorrectable ECC column."""
    frame = make_synthetic_frame(n_gpus=100, n_hours=24 * 10, horizon_h=12, fail_fraction=0.4, seed=2)
    frame = frame.rename(columns={"xid_count_24h": "xid_memory_count_24h"})
    frame["ecc_dbe_volatile_total_increase_24h"] = (frame["gpu_uuid"] == "GPU-00003").astype("float32")
    return frame


@cache
def metrics() -> dict:
    return evaluate_walk_forward(
        fleet_frame(), CONTENDERS, PLAN, top_k=["5", "expected"], bootstrap_samples=100, budgets=BUDGETS
    )


def test_same_data_and_seed_give_a_byte_identical_metrics_json_apart_from_the_timestamp(tmp_path):
    again = evaluate_walk_forward(
        fleet_frame(), CONTENDERS, PLAN, top_k=["5", "expected"], bootstrap_samples=100, budgets=BUDGETS
    )
    first, _ = write_walk_forward_report(metrics(), tmp_path / "a", generated_at=datetime(2026, 1, 1, tzinfo=UTC))
    second, _ = write_walk_forward_report(again, tmp_path / "b", generated_at=datetime(2026, 2, 2, tzinfo=UTC))
    a, b = first.read_text().splitlines(), second.read_text().splitlines()
    assert a[1].strip().startswith('"generated_at"') and a[1] != b[1]
    assert a[2:] == b[2:]
    # A different seed draws other negatives and other bootstrap days: the figures move.
    other = evaluate_walk_forward(
        fleet_frame(), CONTENDERS, WalkForwardPlan(**{**PLAN.__dict__, "seed": 6}), top_k=["5"], bootstrap_samples=100
    )
    assert metrics_json(other, datetime(2026, 1, 1, tzinfo=UTC)) != first.read_text()


def test_metrics_json_keeps_what_gpufail_summary_reads(tmp_path):
    json_path, _ = write_walk_forward_report(metrics(), tmp_path)
    data = json.loads(json_path.read_text())
    assert data["top_k"] == "5"
    assert {"start", "end", "n_gpus"} <= set(data["test"])
    for name in ("model", "random", "rule", "heuristic", "oracle", "lr auto"):
        entry = data["scores"][name]
        assert {"precision_at_k_pooled", "n_caught_at_k", "n_episodes", "lead_time_h_median_at_k"} <= set(entry)
    assert data["scores"]["model"]["name"] == "lr auto"
    assert data["scores"]["rule"]["flagged"]["flags_per_grid_time_mean"] > 0


def test_the_markdown_report_has_the_comparison_targets_modes_and_auto_choices(tmp_path):
    _, md_path = write_walk_forward_report(metrics(), tmp_path)
    text = md_path.read_text()
    for row in ("| lgb static | lightgbm, static |", "| lr auto | logistic, auto |", "| rule | baseline |"):
        assert row in text
    best = metrics()["claims"]["best"]
    assert f"Best configuration: **{best}**" in text
    assert "## Ranking at K = expected" in text
    # The decision sections lead with every scorer at the same volume (a daily quota), then the
    # thresholds from before the test with the volumes they realise, lead time per mode,
    # calibration with the primary's reliability table.
    quota_at = text.index("## Alarms at equal volume: a daily quota")
    assert quota_at < text.index("## Alarms at thresholds chosen before the test period")
    assert quota_at < text.index("## Ranking at K = 5")
    for budget in ("50", "200"):
        assert f"### Quota {budget} alarms per 1,000 GPUs per day (realised volumes within a factor 1.00)" in text
        assert f"### Budget {budget} alarms per 1,000 GPUs per day (" in text
    quota = metrics()["alarms"]["quota"]["50"]["points"]["lr auto"]
    assert f"| lr auto | {quota['n_alarms']} | {quota['alarms_per_1000_gpu_days']:.2f} | " in text
    assert "### Differences at the 50 quota, paired over the test days" in text
    matched_at = text.index("## Alarms at equal volume: thresholds matched on the test scores")
    assert quota_at < matched_at < text.index("## Alarms at thresholds chosen before the test period")
    assert "### Matched 200 alarms per 1,000 GPUs per day (realised volumes within a factor 1.00)" in text
    assert "| against the baselines | lr auto - heuristic | " in text
    assert "| retraining against the static model of the same kind |" not in text  # no static logistic
    point = metrics()["alarms"]["by_budget"]["200"]["lr auto"]
    assert f"| lr auto | {point['threshold']:.3g} | " in text
    assert "### At their own volume" in text and "| rule | own flags |" in text
    assert "## Lead time per failure mode (lr auto, daily quota of 200 alarms per 1,000 GPUs per day)" in text
    false_alarms = metrics()["alarms"]["false_alarms"]
    assert false_alarms["name"] == metrics()["claims"]["chosen_on_validation"]["name"]
    assert f"## Top false alarms of {false_alarms['name']} (quota 50 per 1,000 GPUs per day)" in text
    assert "## Calibration on the test period" in text and "Reliability of lr auto" in text
    ties = metrics()["calibration"]["lr auto"]["top_ties"]["n_rows"]
    assert "| verdict | rows at top risk |" in text
    assert any(line.startswith("| lr auto | ") and line.endswith(f" | {ties} |") for line in text.splitlines())
    assert "The calibration methods compared (`[model] calibration`, in use: platt)" in text
    beta = metrics()["calibration"]["lr auto"]["methods"]["beta"]
    assert f"| lr auto | beta | {beta['ece']:.4f} | " in text
    assert "## The paper's parallel ensemble at equal alarm volume" not in text  # no parallel contender
    # Every contender against the baselines, and the configuration chosen before the test.
    assert "## Against the baselines, alarm by alarm" in text and "### Minus the heuristic" in text
    assert "### Minus the rule, at its volume" in text
    chosen = metrics()["claims"]["chosen_on_validation"]["name"]
    assert "Chosen before the test period (the highest ROC-AUC on the validation slice, " in text
    assert f"**{chosen}**, which " in text
    assert "## Failure modes (K = 5)" in text
    auto_fits = [f for f in metrics()["fits"] if f["contender"] == "lr auto"]
    assert len(auto_fits) == 3
    for fit in auto_fits:
        assert f"lr auto at {fit['retrain_at']}: **{fit['train_window']}**" in text
    for name in PLOTS:
        assert f"]({name})" in text


def test_plots_are_png_and_nothing_temporary_is_left(tmp_path):
    out = tmp_path / "report"
    write_walk_forward_report(metrics(), out)
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert sorted(p.name for p in out.iterdir()) == sorted([METRICS_FILE, REPORT_FILE, *PLOTS])


def test_a_failed_write_leaves_the_previous_report_in_place(tmp_path, monkeypatch):
    out = tmp_path / "report"
    write_walk_forward_report(metrics(), out)
    before = (out / METRICS_FILE).read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("models.report.os.replace", broken)
    try:
        write_walk_forward_report(metrics(), out, generated_at=datetime(2030, 1, 1, tzinfo=UTC))
    except OSError:
        pass
    else:
        raise AssertionError("the broken write did not fail")
    assert (out / METRICS_FILE).read_bytes() == before
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp")]


def test_the_report_names_a_driver_rollout_inside_the_test_period_and_splits_precision_at_it(tmp_path):
    frame = fleet_frame()
    rollout = frame["ts"].max() - pd.Timedelta(days=2)  # the test period is the last 3 settled days
    frame["driver"] = frame["driver"].where(frame["ts"] < rollout, "560.10")
    out = evaluate_walk_forward(frame, CONTENDERS[:2], PLAN, top_k=["5"], bootstrap_samples=20, budgets=BUDGETS)
    (event,) = out["drift"]
    assert event["what"] == "driver 560.10" and event["in_test"] and event["day"] in (0, 1)
    assert set(event["scorers"]) >= {"lgb static", "lr sliding", "rule", "heuristic", "best_feature"}
    _, md_path = write_walk_forward_report(out, tmp_path)
    text = md_path.read_text()
    assert "## Drift in the test period" in text
    assert f"- driver 560.10 (driver rollout) from {rollout.isoformat()[:16].replace('T', ' ')}" in text
    assert f"inside the test period (day {event['day'] + 1} of {out['test']['n_days']})" in text
    static = event["scorers"]["lgb static"]["precision_at_k"]
    assert f"| lgb static | static | {100 * static['before']:.1f}% | {100 * static['after']:.1f}% |" in text
    # without the rollout: no event, and the report says so
    assert (
        "The features show no driver rollout and no new nodes."
        in write_walk_forward_report(metrics(), tmp_path / "plain")[1].read_text()
    )


def test_a_baseline_that_could_not_be_scored_is_named_with_the_reason():
    # An export without XID or ECC columns has no rule baseline; the report says so instead of
    # leaving the row out silently.
    metrics = {
        "scores": {"random": {}, "heuristic": {}},
        "baselines": {
            "random": "uniform scores (fixed seed)",
            "rule": "the features have no hardware-XID or uncorrectable-ECC columns",
            "heuristic": "sum of xid_count* and *ecc*increase* columns",
        },
    }
    lines = _baselines_text(metrics)
    assert "- rule: not scored: the features have no hardware-XID or uncorrectable-ECC columns" in lines
    assert "- random: uniform scores (fixed seed)" in lines
    assert _baselines_text({"scores": {}, "baselines": {}}) == []
