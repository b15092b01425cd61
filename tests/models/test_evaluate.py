import json
from functools import cache

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import roc_auc_score

from ingest.errors import InputError
from models.evaluate import (
    baseline_scores,
    episode_recall,
    evaluate_holdout,
    failure_episodes,
    precision_at_k,
    write_report,
)
from models.split import time_split
from models.train import train_model
from tests.models import ONE_THREAD, demo_frame, make_synthetic_frame

T0 = pd.Timestamp("2026-01-01", tz="UTC")


def at(hour: float) -> pd.Timestamp:
    return T0 + pd.Timedelta(hours=hour)


def test_precision_at_k_by_hand():
    rows = [
        # t0: top 2 are a (1) and b (0) -> 1/2
        (0, "a", 0.9, 1), (0, "b", 0.8, 0), (0, "c", 0.1, 1), (0, "d", 0.05, 0),
        # t1: no failures -> 0/2, and it counts in the mean
        (1, "a", 0.2, 0), (1, "b", 0.7, 0), (1, "c", 0.6, 0), (1, "d", 0.1, 0),
        # t2: one labelled row (the rest censored) -> 1 pick, 1 hit
        (2, "a", 0.5, 1), (2, "b", 0.9, None), (2, "c", 0.8, None), (2, "d", 0.7, None),
    ]  # fmt: skip
    frame = pd.DataFrame(rows, columns=["hour", "gpu_uuid", "score", "label"])
    frame["ts"] = at(0) + pd.to_timedelta(frame["hour"], unit="h")
    frame["label"] = frame["label"].astype("Int8")
    result = precision_at_k(frame, 2)
    assert result["precision_at_k_mean"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert result["precision_at_k_pooled"] == pytest.approx(2 / 5)
    assert result["n_times"] == 3 and result["n_times_with_positive"] == 2


def test_ties_are_broken_at_random_not_by_name():
    n = 400
    frame = pd.DataFrame(
        {
            "ts": np.repeat([at(h) for h in range(n)], 2),
            "gpu_uuid": ["a", "b"] * n,
            "label": [1, 0] * n,
            "score": 0.0,
        }
    )
    assert 0.4 < precision_at_k(frame, 1)["precision_at_k_mean"] < 0.6


def lead_time_frame(with_ttf: bool = True) -> pd.DataFrame:
    """GPU g fails at 10:30, GPU h at 20:30, GPU n never; horizon 6h, hourly grid 0..22."""
    rows = []
    for hour in range(23):
        for gpu, fail_at in [("g", 10.5), ("h", 20.5), ("n", None)]:
            if fail_at is not None and hour > fail_at:
                continue  # a failed GPU stops reporting
            ttf = None if fail_at is None else fail_at - hour
            label = 1 if ttf is not None and ttf <= 6 else 0
            if gpu == "g":
                # in the top 1 from 07:00, above 0.5 from 06:00
                score = {5: 0.3, 6: 0.55, 7: 0.95, 8: 0.96, 9: 0.97, 10: 0.98}.get(hour, 0.1)
            elif gpu == "h":
                score = 0.6  # above 0.5 during its horizon, never top 1 (n scores 0.9)
            else:
                score = 0.9 if hour >= 14 else 0.5
            rows.append((at(hour), gpu, score, label, ttf if with_ttf else None))
    frame = pd.DataFrame(rows, columns=["ts", "gpu_uuid", "score", "label", "time_to_failure_h"])
    frame["label"] = frame["label"].astype("Int8")
    return frame


def test_episode_recall_and_lead_time_by_hand():
    frame = lead_time_frame()
    episodes = failure_episodes(frame)
    assert episodes["gpu_uuid"].tolist() == ["g", "h"]
    assert episodes["failure_ts"].tolist() == [at(10.5), at(20.5)]
    at_k = episode_recall(frame, k=1)
    assert at_k == {"n_episodes": 2, "n_caught": 1, "recall": 0.5, "lead_time_h_median": 3.5}
    at_threshold = episode_recall(frame, threshold=0.5)
    # g first at 06:00 (4.5 h ahead), h from its first positive row, 14:00 (6.5 h ahead).
    assert at_threshold == {"n_episodes": 2, "n_caught": 2, "recall": 1.0, "lead_time_h_median": 5.0}


def test_lead_time_without_time_to_failure_uses_the_last_positive_row():
    at_k = episode_recall(lead_time_frame(with_ttf=False), k=1)
    assert at_k["n_episodes"] == 2 and at_k["n_caught"] == 1
    assert at_k["lead_time_h_median"] == 3.0  # 10:00 (last positive row) - 07:00


def test_episode_recall_needs_k_or_threshold():
    with pytest.raises(InputError):
        episode_recall(lead_time_frame())


def test_heuristic_baseline_sums_xid_counts_and_ecc_increases():
    frame = pd.DataFrame(
        {
            "xid_count_24h": [1.0, None, 0.0],
            "xid_count_1h": [0.0, 2.0, 0.0],
            "ecc_dbe_volatile_total_increase_24h": [0.0, 0.0, 5.0],
            "ecc_sbe_volatile_total": [100.0, 100.0, 100.0],  # no "increase": not used
            "temp_gpu_c": [90.0, 10.0, 50.0],
        }
    )
    scores = baseline_scores(frame)
    assert scores["heuristic"].tolist() == [1.0, 2.0, 5.0]
    assert baseline_scores(frame.drop(columns=frame.columns[:3]))["heuristic"].tolist() == [0.0, 0.0, 0.0]
    assert np.array_equal(scores["random"], baseline_scores(frame)["random"])  # fixed seed


@cache
def holdout(kind: str) -> dict:
    params = {} if kind == "logistic" else ONE_THREAD
    return evaluate_holdout(
        demo_frame(), kind=kind, horizon="12h", test_days=4, top_k=5, train_window="5d", params=params
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lightgbm", "xgboost", "logistic"])
def test_every_model_beats_the_random_baseline_on_a_later_window(kind):
    metrics = holdout(kind)
    model, random = metrics["scores"]["model"], metrics["scores"]["random"]
    assert metrics["test"]["n_positives"] >= 50
    assert model["precision_at_k_mean"] >= random["precision_at_k_mean"] + 0.04
    assert model["precision_at_k_mean"] >= 4 * random["precision_at_k_mean"]
    assert model["roc_auc"] > 0.85 and random["roc_auc"] < 0.65
    assert model["precision_at_k_mean"] <= metrics["scores"]["oracle"]["precision_at_k_mean"]
    # The gap: the last training label cannot see the test window.
    gap = pd.Timestamp(metrics["test"]["start"]) - pd.Timestamp(metrics["train"]["end"])
    assert gap > pd.Timedelta(hours=12)


def test_write_report(tmp_path):
    metrics = holdout("logistic")
    json_path, md_path = write_report(metrics, tmp_path / "report")
    assert json.loads(json_path.read_text())["scores"]["model"] == metrics["scores"]["model"]
    text = md_path.read_text()
    assert "| model |" in text and "| random |" in text and "| heuristic |" in text and "| oracle |" in text
    assert "xid_count_24h" in text
    assert not [p for p in (tmp_path / "report").iterdir() if p.name.startswith(".tmp")]


@pytest.mark.slow
def test_lightgbm_ranks_well_at_1_to_1000_and_the_trap_parameters_do_not():
    """PERFORMANCE.md: LightGBM with default regularisation was useless at 1:1000 imbalance."""
    frame = make_synthetic_frame(n_gpus=1000, fail_fraction=0.02, seed=0)
    labelled = frame["label"].dropna()
    assert 0.0005 < (labelled == 1).mean() < 0.002
    test_start = frame["ts"].max() - pd.Timedelta(hours=96)
    _, test = time_split(frame, test_start, "12h")
    test = test[test["label"].notna()]
    y = test["label"].to_numpy(dtype=int)

    def auc(**params):
        params = {**ONE_THREAD, **params}
        model = train_model(frame, kind="lightgbm", train_window="10d", horizon="12h", as_of=test_start, params=params)
        return roc_auc_score(y, model.predict_risk(test))

    chosen = auc()
    assert chosen > 0.9
    # The guard can fail: LightGBM's defaults for these two parameters do much worse here.
    assert auc(reg_lambda=0.0, min_child_weight=1e-3) < chosen - 0.05
