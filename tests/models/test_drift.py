"""Drift events found in the features (driver rollouts, new nodes) and the precision of each
scorer before and after the ones inside the test period."""

from __future__ import annotations

import pandas as pd
import pytest

from models.drift import before_after, drift_events, driver_rollouts, new_nodes

START = pd.Timestamp("2026-01-01", tz="UTC")


def fleet(n_nodes: int = 4, hours: int = 24 * 6, rollout_h: dict[int, int] | None = None, join_h=None):
    """Hourly rows of `n_nodes` nodes; node i runs the new driver from `rollout_h[i]`, and
    joins at `join_h[i]` (default: from the start)."""
    rollout_h, join_h = rollout_h or {}, join_h or {}
    rows = []
    for node in range(n_nodes):
        for h in range(join_h.get(node, 0), hours):
            new = node in rollout_h and h >= rollout_h[node]
            rows.append({"ts": START + pd.Timedelta(hours=h), "node": f"n{node}", "driver": "550" if new else "535"})
    return pd.DataFrame(rows)


def test_a_driver_rollout_starts_at_its_first_row_and_reaches_half_when_half_the_rows_run_it():
    frame = fleet(rollout_h={0: 50, 1: 60, 2: 70})
    (event,) = driver_rollouts(frame)
    assert event["what"] == "driver 550"
    assert pd.Timestamp(event["start"]) == START + pd.Timedelta(hours=50)
    assert pd.Timestamp(event["half"]) == START + pd.Timedelta(hours=60)  # 2 of 4 nodes
    assert event["final_share"] == pytest.approx(0.75)
    # the drivers already there at the first grid time are no event
    assert driver_rollouts(fleet()) == []
    assert driver_rollouts(fleet().drop(columns="driver")) == []


def test_nodes_that_join_later_together_are_new_hardware_and_single_ones_are_not():
    frame = fleet(n_nodes=6, join_h={3: 80, 4: 81, 5: 40})
    (event,) = new_nodes(frame)
    assert event["n_nodes"] == 2 and pd.Timestamp(event["start"]) == START + pd.Timedelta(hours=80)
    assert [e["kind"] for e in drift_events(fleet(n_nodes=6, rollout_h={0: 10}, join_h={3: 80, 4: 81}))] == [
        "driver rollout",
        "new nodes",
    ]


def test_precision_before_and_after_an_event_in_the_test_period_splits_at_its_first_day():
    test_start, test_end = START + pd.Timedelta(days=2), START + pd.Timedelta(days=6)
    events = [
        {"kind": "driver rollout", "what": "driver 550", "start": (START + pd.Timedelta(days=4, hours=3)).isoformat()},
        {"kind": "new nodes", "what": "2 nodes join", "start": (START + pd.Timedelta(days=1)).isoformat()},
    ]
    daily = {"static": [0.5, 0.3, None, 0.1], "sliding": [0.2, 0.2, 0.4, 0.6]}
    alarms = {"static": {"alarms": [2, 2, 1, 3], "hits": [1, 1, 0, 0]}}
    inside, outside = before_after(events, test_start, test_end, daily, alarms)
    assert not outside["in_test"] and "scorers" not in outside
    assert inside["in_test"] and inside["day"] == 2
    static = inside["scorers"]["static"]
    assert static["precision_at_k"] == {"before": pytest.approx(0.4), "after": pytest.approx(0.1)}
    assert static["alarm_precision"] == {
        "before": pytest.approx(0.5),
        "n_alarms_before": 4,
        "after": 0.0,
        "n_alarms_after": 4,
    }
    assert inside["scorers"]["sliding"]["precision_at_k"] == {"before": pytest.approx(0.2), "after": pytest.approx(0.5)}
    assert "alarm_precision" not in inside["scorers"]["sliding"]
