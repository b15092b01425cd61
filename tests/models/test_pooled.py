"""The comparison pooled over fleets: summed counts, pooled paired intervals, and refusals of
reports that cannot be pooled."""

from __future__ import annotations

import copy

import pytest

from ingest.errors import InputError
from models.calibration import wilson_interval
from models.pooled import pool_fleets, pooled_calibration, pooled_markdown
from tests.models.test_comparison import rule_run


def test_two_fleets_pool_their_counts_and_narrow_the_interval():
    one = rule_run()
    pooled = pool_fleets({"a": one, "b": copy.deepcopy(one)}, samples=300)
    alone = pool_fleets({"a": one}, samples=300)
    for budget, entry in pooled["budgets"].items():
        quota = one["alarms"]["quota"][budget]
        for name, point in entry["points"].items():
            mine = quota["points"][name]
            assert point["n_alarms"] == 2 * mine["n_alarms"]
            assert point["n_caught_long"] == 2 * mine["n_caught_long"]
            if mine["precision"] is not None:
                assert point["precision"] == pytest.approx(mine["precision"])
        assert entry["volume_ratio"] == pytest.approx(1.0)
        assert entry["comparisons"]
        for pair, c in entry["comparisons"].items():
            single = alone["budgets"][budget]["comparisons"][pair]["precision"]
            if c["precision"]["difference"] is not None and single["se"] is not None:
                assert c["precision"]["difference"] == pytest.approx(single["difference"])
                assert c["precision"]["se"] < single["se"]  # twice the days: a smaller standard error
    matched = one["alarms"]["matched"]["60"]["points"]["lgb sliding"]
    assert pooled["matched"]["60"]["points"]["lgb sliding"]["n_alarms"] == 2 * matched["n_alarms"]
    text = pooled_markdown(pooled)
    assert "## Thresholds matched on the test scores, 60 alarms per 1,000 GPUs per day" in text
    assert "# The comparison pooled over 2 fleets (a, b)" in text
    assert "| lgb sliding - heuristic |" in text


def test_reports_that_cannot_be_pooled_are_refused_with_the_fleet_named():
    one = rule_run()
    old = copy.deepcopy(one)
    del old["alarms"]["quota"]
    with pytest.raises(InputError, match="old's metrics have no daily quota"):
        pool_fleets({"new": one, "old": old})
    other = copy.deepcopy(one)
    other["alarms"]["quota"] = {"5": other["alarms"]["quota"]["60"]}
    with pytest.raises(InputError, match="other has budgets"):
        pool_fleets({"one": one, "other": other})
    with pytest.raises(InputError, match="at least one fleet"):
        pool_fleets({})


def test_calibration_pools_the_fleets_rows_as_the_gpus_they_come_from():
    one = rule_run()
    pooled = pool_fleets({"a": one, "b": copy.deepcopy(one)}, samples=50)
    in_use = one["plan"]["calibration"]
    for name, figures in one["calibration"].items():
        alone, both = figures["high_risk"], pooled["calibration"][name][in_use]
        assert (both["n_rows"], both["n_groups"]) == (2 * alone["n_rows"], 2 * alone["n_groups"])
        assert set(pooled["calibration"][name]) == {in_use, *figures["methods"]}
        if alone["n_rows"]:
            assert both["mean_risk"] == pytest.approx(alone["mean_risk"])
            assert both["effective_rows"] == pytest.approx(2 * alone["effective_rows"])
            assert both["observed_ci"][1] - both["observed_ci"][0] <= alone["observed_ci"][1] - alone["observed_ci"][0]
    assert "## Calibration: the rows at risk >= 0.5, over fleets" in pooled_markdown(pooled)


def _fleet(n_rows, n_groups, effective, mean, positives, verdict):
    check = {
        "n_rows": n_rows,
        "n_groups": n_groups,
        "effective_rows": effective,
        "n_positives": positives,
        "mean_risk": mean,
        "observed_rate": positives / n_rows,
        "tolerance": 0.1,
        "verdict": verdict,
    }
    return {"plan": {"calibration": "platt"}, "calibration": {"m": {"high_risk": check, "methods": {}}}}


def test_fleets_off_in_opposite_directions_pool_within_but_count_as_outside():
    # One fleet's high-risk rows fail more often than their risk says, the other's less.
    fleets = {"a": _fleet(300, 100, 100.0, 0.6, 270, "outside"), "b": _fleet(300, 100, 100.0, 0.8, 150, "outside")}
    both = pooled_calibration(fleets)["m"]["platt"]
    assert both["mean_risk"] == pytest.approx(0.7) and both["observed_rate"] == pytest.approx(0.7)
    assert both["observed_ci"] == pytest.approx(list(wilson_interval(0.7 * 200, 200)))  # GPUs, not 600 rows
    assert both["verdict"] == "within" and both["n_fleets_within"] == 0
    text = "\n".join(_calibration_rows(both))
    assert "| 0/2 | a 0.600 / 0.900 outside; b 0.800 / 0.500 outside |" in text
    # A report from before the GPUs were counted counts its rows.
    older = _fleet(50, 5, 5.0, 0.7, 35, "too few rows")
    del older["calibration"]["m"]["high_risk"]["n_groups"], older["calibration"]["m"]["high_risk"]["effective_rows"]
    mixed = pooled_calibration({"a": fleets["a"], "old": older})["m"]["platt"]
    assert mixed["effective_rows"] == 150.0 and "n_groups" not in mixed


def _calibration_rows(entry):
    from models.pooled import _calibration_lines

    return _calibration_lines({"m": {"platt": entry}})
