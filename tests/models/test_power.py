"""Paired differences pooled over fleets, and the words a difference earns: higher or lower only
outside zero, "no difference" only when the interval is narrow, "not shown" when it is wide."""

from __future__ import annotations

import numpy as np
import pytest

from models.power import EQUIVALENCE_MARGIN, compare_points, paired_difference, verdict


def days(hits: list[int], alarms: list[int]) -> np.ndarray:
    return np.column_stack([hits, alarms]).astype(float)


def fleet(rng: np.random.Generator, n_days: int, per_day: int, p_first: float, p_second: float):
    alarms = np.full(n_days, per_day)
    return days(rng.binomial(per_day, p_first, n_days), alarms), days(rng.binomial(per_day, p_second, n_days), alarms)


def test_the_point_difference_pools_every_fleets_counts():
    a1, b1 = days([1, 2], [2, 2]), days([0, 1], [2, 2])
    a2, b2 = days([3, 3, 0], [4, 4, 4]), days([2, 2, 2], [4, 4, 4])
    out = paired_difference([(a1, b1), (a2, b2)], samples=200, seed=0)
    assert out["difference"] == pytest.approx((1 + 2 + 3 + 3) / 16 - (0 + 1 + 2 + 2 + 2) / 16)
    low, high = out["ci"]
    assert low <= out["difference"] <= high
    assert out["detectable"] == pytest.approx(2.8006 * out["se"], rel=1e-3)


def test_small_fleets_do_not_show_a_difference_that_pooling_them_does():
    rng = np.random.default_rng(1)
    fleets = [fleet(rng, 14, 1, 0.7, 0.45) for _ in range(8)]
    alone = [paired_difference([f], samples=500, seed=0) for f in fleets]
    pooled = paired_difference(fleets, samples=500, seed=0)
    # Each fleet alone (14 alarms a side) is too small: wide intervals, "not shown" (none of them
    # narrow enough to say "no difference"); pooled, the gain is shown with a smaller detectable one.
    assert all(a["verdict"] in ("not shown", "higher") for a in alone)
    assert sum(a["verdict"] == "not shown" for a in alone) >= 3
    assert pooled["verdict"] == "higher" and pooled["ci"][0] > 0
    assert pooled["detectable"] < min(a["detectable"] for a in alone)


def test_no_difference_needs_a_narrow_interval_around_zero():
    rng = np.random.default_rng(2)
    many = [fleet(rng, 30, 40, 0.5, 0.5) for _ in range(4)]
    out = paired_difference(many, samples=500, seed=0)
    assert out["verdict"] == "no difference"
    assert -EQUIVALENCE_MARGIN <= out["ci"][0] <= 0 <= out["ci"][1] <= EQUIVALENCE_MARGIN
    few = paired_difference([fleet(rng, 5, 1, 0.5, 0.5)], samples=500, seed=0)
    assert few["verdict"] == "not shown"  # the same truth, too few alarms to say so


def test_verdict_words():
    assert verdict(0.01, 0.3) == "higher"
    assert verdict(-0.3, -0.01) == "lower"
    assert verdict(-0.05, 0.08) == "no difference"
    assert verdict(-0.05, 0.25) == "not shown"
    assert verdict(None, None) == "not shown"
    assert verdict(-0.05, 0.08, half_width=0.15) == "not shown"


def test_a_few_alarms_all_right_on_both_sides_are_not_a_precise_difference():
    a, b = days([1, 1, 0], [1, 1, 0]), days([1, 0, 1], [1, 0, 1])  # 2 of 2 against 2 of 2
    out = paired_difference([(a, b)], samples=200, seed=0)
    assert out["difference"] == 0.0 and out["ci"] == [0.0, 0.0]
    assert out["verdict"] == "not shown" and out["detectable"] > 0.5
    one = paired_difference([(days([1, 0], [1, 0]), days([0, 1], [0, 1]))], samples=100, seed=0)
    assert one["detectable"] == 1.0  # one alarm a side: no difference could be found


def test_a_side_without_alarms_or_days_gives_no_figures_and_mismatched_days_are_refused():
    empty = paired_difference([(days([0, 0], [0, 0]), days([1, 0], [2, 1]))], samples=100, seed=0)
    assert empty["difference"] is None and empty["verdict"] == "not shown"
    assert paired_difference([], samples=100, seed=0)["difference"] is None
    with pytest.raises(ValueError, match="same days"):
        paired_difference([(days([1, 0], [1, 1]), days([1], [1]))], samples=10, seed=0)


def test_compare_points_reads_both_windows_of_precision_and_recall_from_the_day_counts():
    def point(hits, known, hits_long, caught, failures):
        return {
            "day_counts": {
                "hits": hits,
                "known": known,
                "hits_long": hits_long,
                "known_long": known,
                "caught": caught,
                "caught_long": caught,
                "failures": failures,
            }
        }

    first = point([2, 1], [2, 2], [2, 2], [1, 1], [2, 2])
    second = point([1, 0], [2, 2], [1, 1], [0, 1], [2, 2])
    out = compare_points([first], [second], samples=100, seed=0)
    assert out["precision"]["difference"] == pytest.approx(3 / 4 - 1 / 4)
    assert out["precision_long"]["difference"] == pytest.approx(1 - 2 / 4)
    assert out["recall"]["difference"] == pytest.approx(2 / 4 - 1 / 4)
