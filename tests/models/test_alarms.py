"""Alarms: when a score raises one, how precise and early they are, and operating points chosen
on rows before the test period."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ingest.errors import InputError
from models.alarms import (
    AlarmFrame,
    AlarmRules,
    alarm_metrics,
    quota_alarms,
    threshold_for_budget,
    tie_fractions,
    tie_gap,
    untied,
)
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


def hours_of(frame: pd.DataFrame) -> np.ndarray:
    return ((frame["ts"] - T0) / pd.Timedelta(hours=1)).to_numpy()


def raised(af: AlarmFrame, alarm: np.ndarray) -> list[tuple[str, int]]:
    return sorted(zip(af.uuid[alarm], (af.ns[alarm] - T0.value) // 3_600_000_000_000, strict=True))


def back_in_service(n_gpus: int, hours: int, horizon_h: float, gpu: int, fails_at: float, back_at: int) -> pd.DataFrame:
    """`fleet`, with GPU `gpu` failing at `fails_at` and reporting again (repaired, same GPU)
    from hour `back_at` on."""
    first = fleet(n_gpus, hours, horizon_h, {gpu: fails_at})
    later = fleet(n_gpus, hours, horizon_h, {})
    later = later.loc[(later["gpu_uuid"] == f"GPU-{gpu:03d}").to_numpy() & (hours_of(later) >= back_at)]
    return pd.concat([first, later], ignore_index=True).sort_values(["ts", "gpu_uuid"], ignore_index=True)


def test_one_alarm_per_gpu_episode_whether_the_risk_stays_up_falls_back_or_rises_again():
    frame = fleet(2, 48, 24, {})
    above = np.zeros(len(frame), dtype=bool)
    hour = hours_of(frame)
    a, b = (frame["gpu_uuid"] == "GPU-000").to_numpy(), (frame["gpu_uuid"] == "GPU-001").to_numpy()
    above[a & ((hour <= 3) | (hour >= 5))] = True  # crosses at 0, falls at 4, crosses at 5, stays
    above[b & (hour == 10)] = True
    af = AlarmFrame(frame, AlarmRules(horizon="24h"))
    assert raised(af, af.alarms(af.sorted_values(above))) == [("GPU-000", 0), ("GPU-001", 10)]
    # A gap in a GPU's rows (out of service) ends its episode: back in service, a new alarm.
    gapped = frame.loc[~(a & (hour == 20))]
    g = AlarmFrame(gapped, AlarmRules(horizon="24h"))
    assert raised(g, g.alarms(g.sorted_values(above[~(a & (hour == 20))]))) == [
        ("GPU-000", 0),
        ("GPU-000", 21),
        ("GPU-001", 10),
    ]


def test_a_failure_ends_the_episode_even_without_a_gap_in_the_rows():
    # GPU 0 fails mid-hour 30 and reports again from hour 31 (no missing grid time).
    frame = back_in_service(2, 72, 24, 0, 30.5, 31)
    hour = hours_of(frame)
    above = (frame["gpu_uuid"] == "GPU-000").to_numpy() & (hour >= 20)
    af = AlarmFrame(frame, AlarmRules(horizon="24h"))
    assert raised(af, af.alarms(af.sorted_values(above))) == [("GPU-000", 20), ("GPU-000", 31)]
    m = alarm_metrics(af, af.alarms(af.sorted_values(above)), samples=20)
    # The first is right (10.5 h ahead); the second has no failure ahead.
    assert (m["n_alarms"], m["n_hits"], m["n_caught"], m["n_failures"]) == (2, 1, 1, 1)


def test_a_precursor_60_hours_ahead_is_right_and_caught_within_72_h_not_within_24_h():
    horizon = 24
    frame = fleet(40, 240, horizon, {3: 200.5})  # GPU 3 fails mid-hour 200
    hour = hours_of(frame)
    score = np.where((frame["gpu_uuid"] == "GPU-003").to_numpy() & (hour >= 140), 0.9, 0.01)
    af = AlarmFrame(frame, AlarmRules(horizon=f"{horizon}h"))
    metrics = alarm_metrics(af, af.alarms(af.sorted_values(score >= 0.5)), samples=50)
    assert (metrics["n_alarms"], metrics["n_failures"]) == (1, 1)  # staying above: one alarm
    assert metrics["lead_time_h_median"] == pytest.approx(60.5)
    # One definition for both figures and both windows: wrong and missed within 24 h, right
    # and caught within 72 h.
    assert (metrics["precision"], metrics["recall"]) == (0.0, 0.0)
    assert (metrics["precision_long"], metrics["recall_long"]) == (1.0, 1.0)
    assert (metrics["n_caught"], metrics["n_caught_long"]) == (0, 1)
    shares = metrics["alarmed_before_h"]
    assert [shares[h]["share"] for h in ("1", "6", "24", "72")] == [1.0, 1.0, 1.0, 0.0]
    # The ranking metric's lead time sees only rows inside the label horizon: capped at 24 h.
    assert episode_recall(frame.assign(score=score), threshold=0.5)["lead_time_h_median"] == pytest.approx(23.5)


def test_volume_precision_recall_and_gpu_days_by_hand():
    frame = fleet(10, 96, 24, {1: 50.5, 2: 80.5})
    hour = hours_of(frame)
    gpu = frame["gpu_uuid"].to_numpy()
    # GPU 1 alarmed 10.5 h before its failure (right); GPU 5 at hours 3 and 6 (one episode: one
    # wrong alarm); GPU 2 never.
    above = ((gpu == "GPU-001") & (hour == 40)) | ((gpu == "GPU-005") & np.isin(hour, [3, 6]))
    af = AlarmFrame(frame, AlarmRules(horizon="24h"))
    m = alarm_metrics(af, af.alarms(af.sorted_values(above)), samples=100)
    assert m["n_alarms"] == 2 and m["precision"] == pytest.approx(1 / 2)
    gpu_days = len(frame) / 24
    assert m["gpu_days"] == pytest.approx(gpu_days)
    assert m["alarms_per_1000_gpu_days"] == pytest.approx(2 / gpu_days * 1000)
    assert (m["n_failures"], m["n_caught"], m["recall"]) == (2, 1, 0.5)
    assert m["lead_time_h_median"] == pytest.approx(10.5)
    low, high = m["precision_ci"]
    assert low <= m["precision"] <= high
    # The counts per day the paired intervals draw from add up to the figures.
    days = m["day_counts"]
    assert (sum(days["alarms"]), sum(days["hits"]), sum(days["caught"]), sum(days["failures"])) == (2, 1, 1, 2)


def test_an_alarm_whose_window_reaches_past_the_data_is_judged_only_when_right():
    frame = fleet(4, 96, 24, {})
    hour = hours_of(frame)
    gpu = frame["gpu_uuid"].to_numpy()
    # GPU 0 alarms at hour 50 (72 h reach past the data's 95 h: not judged within 72 h, judged
    # within 24 h); GPU 1 alarms at hour 10 (judged in both, wrong in both).
    above = ((gpu == "GPU-000") & (hour == 50)) | ((gpu == "GPU-001") & (hour == 10))
    af = AlarmFrame(frame, AlarmRules(horizon="24h"))
    m = alarm_metrics(af, af.alarms(af.sorted_values(above)), samples=20)
    assert (m["n_alarms_known"], m["n_alarms_known_long"]) == (2, 1)
    assert (m["precision"], m["precision_long"]) == (0.0, 0.0)


def brute_force_threshold(af: AlarmFrame, scores: np.ndarray, budget: float) -> float:
    """The lowest candidate threshold within budget, every candidate tried."""
    values = af.sorted_values(scores)
    for candidate in np.unique(values):
        if af.rate(af.alarms(values >= candidate)) <= budget:
            return float(candidate)
    return np.inf


def test_the_budget_threshold_is_the_lowest_within_budget_found_exactly():
    # GPUs that fail and come back: episodes end at failures as well as at the end of the rows.
    frame = back_in_service(30, 72, 24, 4, 30.5, 31)
    rng = np.random.default_rng(0)
    af = AlarmFrame(frame, AlarmRules(horizon="24h"))
    gpu_days = len(frame) / 24
    for draw in range(3):
        scores = rng.random(len(frame)) ** (1 + draw)
        for budget in (10.0, 100.0, 400.0):
            threshold, rate = threshold_for_budget(af, scores, budget)
            assert threshold == brute_force_threshold(af, scores, budget)
            assert rate <= budget
            assert rate == pytest.approx(af.rate(af.alarms(af.sorted_values(scores >= threshold))))
            if threshold > scores.min():
                lower = np.max(scores[scores < threshold])  # one notch lower exceeds the budget
                assert af.rate(af.alarms(af.sorted_values(scores >= lower))) > budget
                assert rate > budget - 1000 / gpu_days  # within one alarm of the budget
            else:
                assert rate == pytest.approx(1000 * af.n_episodes / gpu_days)  # every episode, within budget
    # Ties at the top that already exceed the budget: no threshold alarms within it.
    assert threshold_for_budget(af, np.ones(len(frame)), 1.0) == (np.inf, 0.0)
    with pytest.raises(InputError, match="alarm budget"):
        threshold_for_budget(af, scores, 0)


def test_a_daily_quota_alarms_the_riskiest_gpus_not_yet_alarmed_at_the_budget_for_every_scorer():
    frame = fleet(200, 24 * 10, 24, {7: 100.5})
    af = AlarmFrame(frame, AlarmRules(horizon="24h"))
    rng = np.random.default_rng(3)
    budget = 2.5  # 0.5 a day on 200 GPUs: one alarm every second day
    counts = set()
    for _ in range(3):
        alarm = quota_alarms(af, rng.random(len(frame)), budget)
        counts.add(int(alarm.sum()))
        # At most one alarm per GPU episode, each at a day's last grid time.
        assert len(set(af.episode[alarm])) == int(alarm.sum())
        assert set((af.ns[alarm] - T0.value) // 3_600_000_000_000 % 24) == {23}
    # 10 days x 0.5, less GPU 7's missing days: the same volume whatever the score.
    assert counts == {int(budget * af.gpu_days / 1000)} == {4}
    # The riskiest GPU that day first: GPU 7's precursor from hour 80 makes it the first alarm.
    hour, gpu = hours_of(frame), frame["gpu_uuid"].to_numpy()
    score = np.where((gpu == "GPU-007") & (hour >= 80), 0.9, 0.01) + 0.001 * rng.random(len(frame))
    alarm = quota_alarms(af, score, budget)
    assert ("GPU-007", 95) in raised(af, alarm)
    m = alarm_metrics(af, alarm, samples=20)
    assert (m["n_caught"], m["n_hits"]) == (1, 1)
    # A day's choice sees nothing after that day's review: later scores change later alarms only.
    changed = np.where(hour > 5 * 24, rng.random(len(frame)), score)
    again = quota_alarms(af, changed, budget)
    before = af.ns < (T0 + pd.Timedelta(days=5)).value
    assert np.array_equal(again[before], alarm[before])
    with pytest.raises(InputError, match="alarm budget"):
        quota_alarms(af, score, -1.0)


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
