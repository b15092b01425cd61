"""The `fail_slow` alarm class: GPUs that keep running slower than their peers (stragglers).

Apart from the failure alarms: a fail-slow GPU is not predicted to fail, it is already costing
every job it runs in (a synchronous job steps at its slowest GPU's pace). It is found by a rule
on its sustained deficit (`features.fail_slow`), not by the failure model:

- a **fail-slow alarm** is a GPU's first grid time with `fail_slow_score_<w>` at or above
  `threshold` (default 0.05: 5% slower than both its node and its model peers over the feature
  spec's `fail_slow_window` `<w>`, 24 h by default); it
  re-arms when the score falls back below the threshold;
- where the truth is known (a simulated fleet: `ground_truth/gpus.parquet`'s `fail_slow_since`),
  an alarm is **right** when its GPU had turned slow by then, a slow GPU is **caught** when it
  has an alarm in the test period at or after its onset, and the **delay** is from the onset (or
  the start of the period, if later) to its first right alarm.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from features.fail_slow import FAIL_SLOW_WINDOW, fail_slow_columns, fail_slow_score, needed_columns

DEFAULT_THRESHOLD = 0.05


def has_fail_slow_inputs(frame: pd.DataFrame, window: str = FAIL_SLOW_WINDOW) -> bool:
    """Whether `frame` has the fail-slow score of `window` (`features.fail_slow.fail_slow_score`)."""
    return fail_slow_columns(window)[-1] in frame.columns or all(c in frame.columns for c in needed_columns(window))


def fail_slow_alarms(
    frame: pd.DataFrame, threshold: float = DEFAULT_THRESHOLD, window: str = FAIL_SLOW_WINDOW
) -> pd.DataFrame:
    """One row per alarm: ts, cluster, node, gpu_uuid, score (the rows of `frame` at which a GPU's
    `fail_slow_score_<window>` reaches `threshold` from below, or from its first row)."""
    score = fail_slow_score(frame, window)
    if score is None:
        raise ValueError(f"fail-slow alarms: the frame has no {fail_slow_columns(window)[-1]} nor its inputs")
    scored = frame[["ts", "cluster", "node", "gpu_uuid"]].assign(score=score)
    scored = scored.assign(ts=pd.to_datetime(scored["ts"], utc=True)).sort_values(["gpu_uuid", "ts"], kind="stable")
    above = (scored["score"] >= threshold).to_numpy()
    same_gpu = (scored["gpu_uuid"] == scored["gpu_uuid"].shift()).to_numpy()
    before = np.r_[False, above[:-1]] & same_gpu
    return scored[above & ~before].reset_index(drop=True)


def fail_slow_report(
    test: pd.DataFrame,
    truth: pd.DataFrame | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    window: str = FAIL_SLOW_WINDOW,
) -> dict[str, Any]:
    """The alarm class's figures over the test rows (JSON-ready), on the features of `window`
    (the feature spec's, `FeatureSpec.fail_slow_label`); `truth`: gpu_uuid and
    `fail_slow_since` (null: never slow), as the simulator writes them."""
    alarms = fail_slow_alarms(test, threshold, window)
    gpu_days = len(test) * _grid_hours(test) / 24
    out: dict[str, Any] = {
        "threshold": threshold,
        "window": window,
        "n_alarms": len(alarms),
        "n_gpus_alarmed": int(alarms["gpu_uuid"].nunique()),
        "alarms_per_1000_gpu_days": float(1000 * len(alarms) / gpu_days) if gpu_days else None,
        "top": [
            {
                "gpu_uuid": str(gpu),
                "node": str(r["node"]),
                "first_alarm": pd.Timestamp(r["first_alarm"]).isoformat(),
                "score": float(r["score"]),
            }
            for gpu, r in alarms.groupby("gpu_uuid")
            .agg(node=("node", "first"), first_alarm=("ts", "min"), score=("score", "max"))
            .sort_values("score", ascending=False)
            .head(10)
            .iterrows()
        ],
    }
    if truth is None:
        return out
    since = pd.to_datetime(truth.set_index("gpu_uuid")["fail_slow_since"], utc=True)
    start, end = pd.to_datetime(test["ts"], utc=True).min(), pd.to_datetime(test["ts"], utc=True).max()
    tested = set(test["gpu_uuid"].astype(str))
    slow = since[since.notna() & (since <= end) & since.index.isin(tested)]
    onset = alarms["gpu_uuid"].map(since)
    right = (onset.notna() & (onset <= alarms["ts"])).to_numpy()
    first_right = alarms[right].groupby("gpu_uuid")["ts"].min()
    delays = [
        (first_right[g] - max(slow[g], start)) / pd.Timedelta(hours=1) for g in slow.index if g in first_right.index
    ]
    out |= {
        "n_slow_gpus": len(slow),
        "precision": float(right.mean()) if len(alarms) else None,
        "n_caught": len(delays),
        "recall": float(len(delays) / len(slow)) if len(slow) else None,
        "delay_h_median": float(np.median(delays)) if delays else None,
    }
    return out


def _grid_hours(test: pd.DataFrame) -> float:
    times = np.sort(pd.to_datetime(test["ts"], utc=True).unique())
    return float(np.min(np.diff(times)) / np.timedelta64(1, "h")) if len(times) > 1 else 1.0
