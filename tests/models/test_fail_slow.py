"""The fail_slow alarm class (models/fail_slow.py) and its report section."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from models.fail_slow import fail_slow_alarms, fail_slow_report
from models.report_fail_slow import fail_slow_section

T0 = pd.Timestamp("2026-02-01", tz="UTC")


def fleet(slow_from: dict[str, int], hours: int = 48, deficit: float = 0.1) -> pd.DataFrame:
    """Three nodes of 8 loaded H100s, hourly; `slow_from[gpu]` the hour a GPU turns slow."""
    rows = []
    for h in range(hours):
        for node in ("a", "b", "c"):
            for i in range(8):
                gpu = f"{node}{i}"
                slow = deficit if gpu in slow_from and h >= slow_from[gpu] else 0.0
                rows.append(
                    {
                        "ts": T0 + pd.Timedelta(hours=h),
                        "cluster": "c",
                        "node": node,
                        "gpu_uuid": gpu,
                        "gpu_model": "H100",
                        "sm_clock_mhz_mean_24h": 1400 * (1 - slow),
                        "sm_clock_mhz_max_24h": 1420 * (1 - slow),
                        "power_w_mean_24h": 600 * (1 - slow),
                        "util_gpu_pct_mean_24h": 90.0,
                        "util_gpu_pct_max_24h": 99.0,
                    }
                )
    return pd.DataFrame(rows)


def test_an_alarm_is_the_first_time_a_gpu_reaches_the_threshold_and_it_rearms_below_it():
    frame = fleet({"a3": 10})
    alarms = fail_slow_alarms(frame)
    assert alarms["gpu_uuid"].tolist() == ["a3"]
    assert alarms["ts"].iloc[0] == T0 + pd.Timedelta(hours=10)
    # Falls back (repaired) and turns slow again: a second alarm.
    back = frame.copy()
    healed = (back["gpu_uuid"] == "a3") & back["ts"].between(T0 + pd.Timedelta(hours=20), T0 + pd.Timedelta(hours=29))
    back.loc[healed, ["sm_clock_mhz_mean_24h", "sm_clock_mhz_max_24h"]] = [1400.0, 1420.0]
    assert fail_slow_alarms(back)["ts"].tolist() == [T0 + pd.Timedelta(hours=10), T0 + pd.Timedelta(hours=30)]


def test_the_report_judges_alarms_against_the_truth_when_it_is_known():
    frame = fleet({"a3": 10, "b5": 30}, deficit=0.1)
    # c1 is slow by only 2%: under the threshold, a miss.
    c1 = frame["gpu_uuid"] == "c1"
    frame.loc[c1, "sm_clock_mhz_mean_24h"] *= 0.98
    frame.loc[c1, "sm_clock_mhz_max_24h"] *= 0.98
    truth = pd.DataFrame(
        {
            "gpu_uuid": ["a3", "b5", "c1", "a0"],
            "fail_slow_since": [T0 + pd.Timedelta(hours=10), T0 + pd.Timedelta(hours=30), T0, None],
        }
    )
    report = fail_slow_report(frame, truth)
    assert report["n_alarms"] == 2 and report["n_gpus_alarmed"] == 2
    assert report["n_slow_gpus"] == 3 and report["n_caught"] == 2
    assert report["precision"] == 1.0 and report["recall"] == pytest.approx(2 / 3)
    assert report["delay_h_median"] == 0.0
    assert report["alarms_per_1000_gpu_days"] == pytest.approx(1000 * 2 / (24 * 48 / 24))
    lines = "\n".join(fail_slow_section({"fail_slow": report}))
    assert "## Fail-slow GPUs" in lines and "precision 100.0%" in lines and "| a3 | a |" in lines
    # Without the truth: counts only.
    plain = fail_slow_report(frame)
    assert "precision" not in plain and plain["n_alarms"] == 2
    assert fail_slow_section({}) == []
    assert np.isfinite(plain["top"][0]["score"])
