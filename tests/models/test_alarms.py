"""Alarms: when a score raises one, how precise and early they are, and operating points chosen
on rows before the test period."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ingest.errors import InputError
from models.alarms import AlarmFrame, AlarmRules, alarm_metrics, threshold_for_budget, tie_fractions, tie_gap, untied
from models.evaluate import episode_recall

T0 = pd.Timestamp("2026-01-01", tz="UTC")


def fleet(n_gpus: int, hours: int, horizon_h: float, failures: dict[int, float]) -> pd.DataFrame:
    """Hourly rows of `n_gpus` GPUs; GPU g of `failures` fails at that hour (mid-hour) and has no
    rows after it; labels and time_to_failure_h as the feature build writes them."""
    parts = []
    for g in range(n_gpus):
        t = np.arange(hours, dtype=float)
        fail = failures.get(g, np.inf)
        t = t[t < fail]
        ttf = fail - t
        parts.append(
            pd.DataFrame(
                {
                    "ts": T0 + pd.to_timedelta(t, unit="h"),
                    "gpu_uuid": f"GPU-{g:03d}",
                    "label": (ttf <= horizon_h).astype(float),
                    "time_to_failure_h": np.where(ttf <= horizon_h, ttf, np.nan),
                }
            )
        )
    return pd.concat(parts, ignore_index=True).sort_values(["ts", "gpu_uuid"], ignore_index=True)


def test_an_alarm_is_a_first_crossing_rearmed_by_falling_back_or_the_quiet_period():
    frame = fleet(2, 48, 24, {})
    above = np.zeros(len(frame), dtype=bool)
    hour = ((frame["ts"] - T0) / pd.Timedelta(hours=1)).to_numpy()
    a, b = (frame["gpu_uuid"] == "GPU-000").to_numpy(), (frame["gpu_uuid"] == "GPU-001").to_numpy()
    above[a & ((hour <= 3) | (hour >= 5))] = True  # crosses at 0, falls at 4, crosses at 5, stays
    above[b & (hour == 10)] = True
    quiet = AlarmFrame(frame, AlarmRules(horizon="24h", quiet_period="24h"))
    alarms = quiet.alarms(quiet.sorted_values(above))
    raised = sorted(zip(quiet.uuid[alarms], (quiet.ns[alarms] - T0.value) // 3_600_000_000_000, strict=True))
    assert raised == [("GPU-000", 0), ("GPU-000", 5), ("GPU-000", 29), ("GPU-001", 10)]
    never = AlarmFrame(frame, AlarmRules(horizon="24h", quiet_period=None))
    assert int(never.alarms(never.sorted_values(above)).sum()) == 3  # no reminder at 29
    # A gap in a GPU's rows (out of service) ends its time above: back in service, a new alarm.
    gapped = frame.loc[~(a & (hour == 20))]
    flags = above[~(a & (hour == 20))]
    g = AlarmFrame(gapped, AlarmRules(horizon="24h", quiet_period=None))
    assert int(g.alarms(g.sorted_values(flags)).sum()) == 4


def test_a_precursor_60_hours_ahead_reports_a_lead_time_of_60_hours_not_24():
    horizon = 24
    failures = {3: 200.5}  # GPU 3 fails mid-hour 200
    frame = fleet(40, 240, horizon, failures)
    hour = ((frame["ts"] - T0) / pd.Timedelta(hours=1)).to_numpy()
    score = np.where((frame["gpu_uuid"] == "GPU-003").to_numpy() & (hour >= 140), 0.9, 0.01)
    rules = AlarmRules(horizon=f"{horizon}h", quiet_period=None)
    metrics = alarm_metrics(AlarmFrame(frame, rules), score >= 0.5, samples=50)
    assert (metrics["n_alarms"], metrics["n_failures"], metrics["n_caught"]) == (1, 1, 1)
    assert metrics["lead_time_h_median"] == pytest.approx(60.5)  # from the first alarm, at hour 140
    # The alarm came 60 h early: wrong at the 24 h horizon, right at 72 h.
    assert metrics["precision"] == 0.0 and metrics["precision_long"] == 1.0
    shares = metrics["alarmed_before_h"]
    assert [shares[h]["share"] for h in ("1", "6", "24", "72")] == [1.0, 1.0, 1.0, 0.0]
    # The ranking metric's lead time sees only rows inside the label horizon: capped at 24 h.
    assert episode_recall(frame.assign(score=score), threshold=0.5)["lead_time_h_median"] == pytest.approx(23.5)
    # Reminders every 24 h while it stays above: the last one, 12.5 h ahead, is right at 24 h too.
    reminded = alarm_metrics(AlarmFrame(frame, AlarmRules(horizon="24h")), score >= 0.5, samples=50)
    assert reminded["n_alarms"] == 3 and reminded["precision"] == pytest.approx(1 / 3)
    assert reminded["lead_time_h_median"] == pytest.approx(60.5)


def test_volume_precision_recall_and_gpu_days_by_hand():
    frame = fleet(10, 96, 24, {1: 50.5, 2: 80.5})
    hour = ((frame["ts"] - T0) / pd.Timedelta(hours=1)).to_numpy()
    gpu = frame["gpu_uuid"].to_numpy()
    # GPU 1 alarmed 10 h before its failure (right); GPU 5 twice on day 0 (wrong); GPU 2 never.
    above = ((gpu == "GPU-001") & (hour == 40)) | ((gpu == "GPU-005") & np.isin(hour, [3, 6]))
    m = alarm_metrics(AlarmFrame(frame, AlarmRules(horizon="24h", quiet_period=None)), above, samples=100)
    assert m["n_alarms"] == 3 and m["precision"] == pytest.approx(1 / 3)
    gpu_days = len(frame) / 24
    assert m["gpu_days"] == pytest.approx(gpu_days)
    assert m["alarms_per_1000_gpu_days"] == pytest.approx(3 / gpu_days * 1000)
    # Per distinct GPU and day: GPU 5 on day 0 once (wrong), GPU 1 on day 1 (right).
    assert m["n_gpu_days_alarmed"] == 2 and m["precision_gpu_day"] == 0.5
    assert (m["n_failures"], m["n_caught"], m["recall"]) == (2, 1, 0.5)
    assert m["lead_time_h_median"] == pytest.approx(10.5)
    low, high = m["precision_ci"]
    assert low <= m["precision"] <= high


def test_the_budget_threshold_is_the_lowest_within_budget():
    frame = fleet(100, 72, 24, {})
    rng = np.random.default_rng(0)
    scores = rng.random(len(frame))
    slice_ = AlarmFrame(frame, AlarmRules(horizon="24h"))
    gpu_days = len(frame) / 24
    for budget in (1.0, 20.0, 200.0):
        threshold, rate = threshold_for_budget(slice_, scores, budget)
        assert rate <= budget
        assert rate == pytest.approx(slice_.rate(slice_.alarms(slice_.sorted_values(scores >= threshold))))
        # One notch lower and the budget is exceeded.
        lower = np.max(scores[scores < threshold])
        assert slice_.rate(slice_.alarms(slice_.sorted_values(scores >= lower))) > budget
        assert rate > budget - 1000 * 3 / gpu_days  # within a few alarms of the budget
    # Ties at the top that already exceed the budget: no threshold alarms within it.
    assert threshold_for_budget(slice_, np.ones(len(frame)), 1.0) == (np.inf, 0.0)
    with pytest.raises(InputError, match="alarm budget"):
        threshold_for_budget(slice_, scores, 0)


def test_broken_ties_let_a_count_valued_score_meet_a_small_budget_without_reordering_distinct_counts():
    frame = fleet(100, 72, 24, {})
    slice_ = AlarmFrame(frame, AlarmRules(horizon="24h"))
    # A count: most rows 0, a fifth of them tied at 1, a few at 2 and 3.
    counts = np.where(np.arange(len(frame)) % 5 == 0, 1.0, 0.0)
    counts[::97] = 2.0
    counts[::389] = 3.0
    budget = 20.0
    tied_threshold, _ = threshold_for_budget(slice_, counts, budget)
    assert tied_threshold == np.inf  # the top tie class alone is over budget
    gap = tie_gap(counts)
    assert gap == 0.5
    broken = untied(counts, tie_fractions(frame), gap)
    # Equal counts are now ordered, different counts keep their order, reproducibly.
    assert len(np.unique(broken)) == len(broken)
    order = np.argsort(broken, kind="stable")
    assert np.all(np.diff(counts[order]) >= 0)
    assert np.array_equal(broken, untied(counts, tie_fractions(frame), gap))
    threshold, rate = threshold_for_budget(slice_, broken, budget)
    assert np.isfinite(threshold) and budget / 2 < rate <= budget
    # The order among ties does not depend on the row order of the frame.
    shuffled = frame.sample(frac=1.0, random_state=1)
    again = untied(counts[shuffled.index.to_numpy()], tie_fractions(shuffled), gap)
    assert np.array_equal(again, broken[shuffled.index.to_numpy()])
    assert tie_gap(np.array([4.0, 4.0, np.nan])) == 0.0
