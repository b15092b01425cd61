"""The comparison pooled over fleets: summed counts, pooled paired intervals, and refusals of
reports that cannot be pooled."""

from __future__ import annotations

import copy

import pytest

from ingest.errors import InputError
from models.pooled import pool_fleets, pooled_markdown
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
