"""Alarm-level evaluation: what an operator receives from a score and a threshold.

A ranking metric at a fixed K hides the operating point (docs/evaluation.md). Here a score becomes
*alarms*: a GPU raises an alarm at the first grid time its score reaches the threshold (or its
flag is set, for a rule or the paper's intersection); it is re-armed when its score falls back
below the threshold, or, while it stays above, once `quiet_period` has passed since its last
alarm (0: only falling back re-arms). A gap in a GPU's rows (it was out of service) also ends
its time above.

Per operating point (`alarm_metrics`):

- volume: alarms per 1,000 GPU-days (the test rows are GPU-grid-times, so GPU-days are rows x
  grid step / 1 day);
- alarm precision: the share of alarms whose GPU fails within the label horizon after it (the
  alarm row's label), and within `long_horizon` (72 h by default), so that correct early
  alarms show as such (an alarm whose long window reaches past what the data knows is left out
  of that figure); and per distinct GPU and day (a GPU alarmed on a day counts once, a hit when
  any of its alarms that day is);
- failure recall: the share of the test period's failures with an alarm of that GPU in the
  `lookback` before it; lead time from the *first* such alarm, not capped by the label
  horizon; and per lead time of `LEAD_TIMES_H` (1, 6, 24, 72 h), the share of failures with an
  alarm at least that long before, among the failures at least that long after the test
  period's start (only those could have had one);
- the same per failure mode; percentile bootstrap intervals over days (alarms and failures
  grouped by the day they fall on), over failures for the lead time.

Operating points are chosen on rows before the test period (`threshold_for_budget`): the
lowest threshold whose alarm volume on the validation rows stays within a budget of alarms per
1,000 GPUs per day. Nothing of the test period enters the choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ingest.errors import InputError
from models.evaluate import attach_modes, bootstrap_ci, episode_table, prepare_scored
from models.split import DurationLike, as_timedelta

LEAD_TIMES_H = (1, 6, 24, 72)
DEFAULT_BUDGETS = (0.5, 1.0, 2.0, 5.0)
"""Alarms per 1,000 GPUs per day."""


@dataclass(frozen=True)
class AlarmRules:
    """How alarms are raised and judged; every duration in the configuration's grammar."""

    horizon: DurationLike
    """The label horizon: an alarm is correct when its GPU fails within it."""
    long_horizon: DurationLike = "72h"
    lookback: DurationLike = "7d"
    """A failure counts as alarmed when its GPU alarmed within this before it."""
    quiet_period: DurationLike | None = "24h"
    """While a GPU stays above the threshold, a new alarm after this long (None: never)."""

    def durations(self) -> tuple[pd.Timedelta, pd.Timedelta, pd.Timedelta, pd.Timedelta | None]:
        quiet = None if self.quiet_period in (None, 0, "0", "0s", "0h") else self.quiet_period
        return (
            as_timedelta(self.horizon, "horizon"),
            as_timedelta(self.long_horizon, "long_horizon"),
            as_timedelta(self.lookback, "lookback"),
            None if quiet is None else as_timedelta(quiet, "quiet_period"),
        )


class AlarmFrame:
    """The labelled rows of one period (a test period or a validation slice), sorted by GPU and
    time once, so that many scores and thresholds are turned into alarms cheaply.

    `failures` (gpu_uuid, failure_ts): every failure the data knows, from all rows (including
    those after the period), to judge alarms against the long horizon; `known_until`: the last
    time the data can show a failure; `failure_modes` (gpu_uuid, ts, mode): the ground truth
    that names each failure's mode (`models.evaluate.attach_modes`); `start`: the period's
    first grid time (its days count from there)."""

    def __init__(
        self,
        frame: Any,
        rules: AlarmRules,
        *,
        failures: pd.DataFrame | None = None,
        known_until: pd.Timestamp | None = None,
        start: pd.Timestamp | None = None,
        failure_modes: Any = None,
    ) -> None:
        prepared = prepare_scored(frame, np.zeros(len(frame)))
        if len(prepared) == 0:
            raise InputError("alarms: no labelled rows; expected a period with settled labels")
        self.rules = rules
        self.horizon, self.long_horizon, self.lookback, self.quiet = rules.durations()
        self.start = prepared["ts"].min() if start is None else start
        self.prepared = prepared
        ns = prepared["ts"].to_numpy(dtype="datetime64[ns]").astype(np.int64)
        gpu = pd.factorize(prepared["gpu_uuid"])[0]
        self.order = np.lexsort((ns, gpu))
        self.gpu, self.ns = gpu[self.order], ns[self.order]
        times = np.unique(ns)
        self.step_ns = int(np.diff(times).min()) if len(times) > 1 else pd.Timedelta(hours=1).value
        same_gpu = np.r_[False, self.gpu[1:] == self.gpu[:-1]]
        self.continues = same_gpu & np.r_[False, np.diff(self.ns) <= self.step_ns]
        self.label = prepared["label"].to_numpy()[self.order]
        self.day = ((self.ns - self.start.value) // pd.Timedelta(days=1).value).astype(np.int64)
        self.n_days = int(self.day.max()) + 1
        self.gpu_days = len(prepared) * self.step_ns / pd.Timedelta(days=1).value
        self.gpu_days_by_day = np.bincount(self.day, minlength=self.n_days) * (
            self.step_ns / pd.Timedelta(days=1).value
        )
        self.uuid = prepared["gpu_uuid"].to_numpy()[self.order]
        own = episode_table(prepared, np.zeros(len(prepared), dtype=bool))[["gpu_uuid", "failure_ts"]]
        self.episodes = own.reset_index(drop=True)
        self.modes = attach_modes(self.episodes, failure_modes)
        known = failures if failures is not None else own
        self.failures = known.assign(gpu_uuid=known["gpu_uuid"].astype(str)).sort_values("failure_ts")
        self.known_until = prepared["ts"].max() if known_until is None else known_until

    def sorted_values(self, values: Any) -> np.ndarray:
        """`values` (one per labelled row, in the frame's order) in the frame's sorted order."""
        array = np.asarray(values)
        if array.shape != (len(self.prepared),):
            raise InputError(f"alarms: expected one value per labelled row ({len(self.prepared)}), got {array.shape}")
        return array[self.order]

    def alarms(self, above: np.ndarray) -> np.ndarray:
        """Alarm rows (in sorted order) from `above` (sorted order): the start of each run of
        consecutive rows above, and, with a quiet period, every quiet period after it."""
        above = np.asarray(above, dtype=bool)
        starts = above & ~(np.r_[False, above[:-1]] & self.continues)
        if self.quiet is None:
            return starts
        run = np.cumsum(starts)
        # Each row's run start: the position of the last start at or before it (rows are in
        # GPU, then time order; rows not above are masked out below).
        start_at = np.maximum.accumulate(np.where(starts, np.arange(len(above)), 0))
        period = np.where(above, (self.ns - self.ns[start_at]) // self.quiet.value, -1)
        new_period = np.r_[True, (period[1:] != period[:-1]) | (run[1:] != run[:-1])]
        return above & (starts | new_period)

    def rate(self, alarms: np.ndarray) -> float:
        """Alarms per 1,000 GPU-days."""
        return float(alarms.sum() / self.gpu_days * 1000.0)


def threshold_for_budget(frame: AlarmFrame, scores: Any, budget: float) -> tuple[float, float]:
    """(threshold, alarms per 1,000 GPU-days it gives on `frame`): the lowest threshold whose
    alarm volume on `frame` (a validation slice) is at most `budget`. Inf (no alarm) when even
    the highest score alarms too often."""
    if not budget > 0:
        raise InputError(f"alarm budget: expected a positive number of alarms per 1,000 GPUs per day, got {budget!r}")
    values = frame.sorted_values(np.asarray(scores, dtype=np.float64))
    candidates = np.unique(values[np.isfinite(values)])
    if len(candidates) == 0:
        return math.inf, 0.0

    def rate_at(i: int) -> float:
        return frame.rate(frame.alarms(values >= candidates[i]))

    # The volume falls (almost always) as the threshold rises: the lowest index within budget.
    lo, hi = 0, len(candidates) - 1
    if rate_at(hi) > budget:
        return math.inf, 0.0
    while lo < hi:
        mid = (lo + hi) // 2
        if rate_at(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return float(candidates[lo]), rate_at(lo)


def tie_gap(scores: Any) -> float:
    """Half the smallest gap between distinct finite values of `scores` (a scorer's validation
    scores: the test period's must not move a threshold): the most a tie-break may add without
    reordering two different scores there. 0 when there are fewer than two distinct values."""
    values = np.unique(np.asarray(scores, dtype=np.float64))
    values = values[np.isfinite(values)]
    return float(np.diff(values).min() / 2.0) if len(values) > 1 else 0.0


def tie_fractions(rows: pd.DataFrame) -> np.ndarray:
    """Per row, a number in [0, 1) from a seeded hash of its (gpu_uuid, ts): the order `untied`
    gives equal scores. Computed once per frame and shared by every scorer of it."""
    hashed = pd.util.hash_pandas_object(rows[["gpu_uuid", "ts"]], index=False, hash_key=_TIE_HASH_KEY)
    return (hashed.to_numpy(dtype=np.uint64) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def untied(scores: Any, fractions: np.ndarray, gap: float) -> np.ndarray:
    """`scores` with ties broken: `gap` (`tie_gap`) times each row's hash fraction
    (`tie_fractions`) added, so rows with equal scores are ordered at random but reproducibly, and
    rows with different scores keep their order. A count-valued score (the heuristic, a
    counter feature) ties by the thousand at its top values; without this its threshold can
    only take whole tie classes, and at a small budget it raised no alarm at all, which made it
    impossible to compare at that budget. The hash is not the training draw's key (a seeded
    pandas hash), so the order is unrelated to which rows a model trained on. On the test
    period, two scores closer than the validation gap may swap: far below any figure's noise."""
    values = np.asarray(scores, dtype=np.float64)
    if gap <= 0 or len(values) == 0:
        return values
    return np.where(np.isfinite(values), values + gap * fractions, values)


_TIE_HASH_KEY = "gpufail-ties-001"  # 16 bytes, as pandas' hash key must be


def _pooled(per_day: np.ndarray) -> float:
    total = per_day[:, 1].sum()
    return float(per_day[:, 0].sum() / total) if total > 0 else math.nan


def _num(value: Any) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value


def alarm_metrics(
    frame: AlarmFrame, above: Any, *, samples: int = 1000, seed: int = 0, sorted_input: bool = False
) -> dict[str, Any]:
    """Every alarm figure of one operating point: `above` (one per labelled row; in the
    frame's sorted order with `sorted_input`) says where the score reaches the threshold or
    the flag is set. See the module docstring."""
    over = np.asarray(above, dtype=bool) if sorted_input else frame.sorted_values(np.asarray(above, dtype=bool))
    alarm = frame.alarms(over)
    table = alarm_table(frame, alarm)
    outcomes = failure_outcomes(frame, table)
    n_days = frame.n_days
    by_day = np.bincount(table["day"], minlength=n_days).astype(float)
    hits_by_day = np.bincount(table["day"], weights=table["hit"], minlength=n_days)
    long_ok = table["long_known"].to_numpy()
    long_hits = np.bincount(table["day"][long_ok], weights=table["hit_long"][long_ok], minlength=n_days)
    long_n = np.bincount(table["day"][long_ok], minlength=n_days).astype(float)
    gpu_day = table.groupby(["gpu_uuid", "day"])["hit"].max().reset_index()
    gd_hits = np.bincount(gpu_day["day"], weights=gpu_day["hit"], minlength=n_days)
    gd_n = np.bincount(gpu_day["day"], minlength=n_days).astype(float)
    caught = outcomes["caught"].to_numpy()
    fail_day = outcomes["day"].to_numpy()
    caught_by_day = np.bincount(fail_day, weights=caught, minlength=n_days)
    failures_by_day = np.bincount(fail_day, minlength=n_days).astype(float)
    leads = outcomes.loc[outcomes["caught"], "lead_h"].to_numpy(dtype=float)

    def ci(num: np.ndarray, den: np.ndarray, scale: float = 1.0) -> list[float | None]:
        low, high = bootstrap_ci(np.column_stack([num, den]), _pooled, samples=samples, seed=seed)
        return [None if low is None else low * scale, None if high is None else high * scale]

    n = len(table)
    out: dict[str, Any] = {
        "n_alarms": n,
        "gpu_days": frame.gpu_days,
        "alarms_per_1000_gpu_days": frame.rate(alarm),
        "alarms_per_1000_gpu_days_ci": ci(by_day, frame.gpu_days_by_day, 1000.0),
        "n_alarmed_gpus": int(table["gpu_uuid"].nunique()),
        "precision": _num(table["hit"].mean()) if n else None,
        "precision_ci": ci(hits_by_day, by_day),
        "n_alarms_long_known": int(long_ok.sum()),
        "precision_long": _num(table["hit_long"][long_ok].mean()) if long_ok.any() else None,
        "precision_long_ci": ci(long_hits, long_n),
        "n_gpu_days_alarmed": len(gpu_day),
        "precision_gpu_day": _num(gpu_day["hit"].mean()) if len(gpu_day) else None,
        "precision_gpu_day_ci": ci(gd_hits, gd_n),
        "n_failures": len(outcomes),
        "n_caught": int(caught.sum()),
        "recall": _num(caught.mean()) if len(outcomes) else None,
        "recall_ci": ci(caught_by_day, failures_by_day),
        "lead_time_h_median": _num(np.median(leads)) if len(leads) else None,
        "lead_time_h_median_ci": list(
            bootstrap_ci(leads, np.median, samples=samples, seed=seed) if len(leads) > 1 else (None, None)
        ),
        "alarmed_before_h": lead_shares(outcomes),
        "by_mode": {
            mode: {
                "n_failures": int(mask.sum()),
                "n_caught": int(caught[mask].sum()),
                "recall": _num(caught[mask].mean()) if mask.any() else None,
                "lead_time_h_median": _num(np.median(outcomes.loc[mask & caught, "lead_h"]))
                if (mask & caught).any()
                else None,
                "alarmed_before_h": lead_shares(outcomes.loc[mask]),
            }
            for mode in sorted(set(frame.modes))
            for mask in [(frame.modes == mode).to_numpy()]
        },
        "by_day": {"alarms": by_day.astype(int).tolist(), "hits": hits_by_day.astype(int).tolist()},
        "_day_counts": {
            "alarms": by_day,
            "hits": hits_by_day,
            "caught": caught_by_day,
            "failures": failures_by_day,
        },
    }
    return out


def alarm_table(frame: AlarmFrame, alarm: np.ndarray) -> pd.DataFrame:
    """One row per alarm (alarm: sorted order): gpu_uuid, ts, day, hit (its label: the GPU fails
    within the horizon), next failure of its GPU (from every known failure), hit_long and
    whether the long horizon is within what the data knows."""
    rows = np.flatnonzero(alarm)
    table = pd.DataFrame(
        {
            "gpu_uuid": frame.uuid[rows].astype(str),
            "ts": pd.to_datetime(frame.ns[rows], utc=True),
            "day": frame.day[rows],
            "hit": frame.label[rows] == 1,
        }
    )
    if len(table) == 0:
        return table.assign(next_failure=pd.Series(dtype="datetime64[ns, UTC]"), hit_long=False, long_known=False)
    failures = frame.failures.assign(
        failure_ts=pd.to_datetime(frame.failures["failure_ts"], utc=True).astype("datetime64[ns, UTC]")
    )
    table["_order"] = np.arange(len(table))
    merged = pd.merge_asof(
        table.sort_values("ts").assign(ts=lambda d: d["ts"].astype("datetime64[ns, UTC]")),
        failures.rename(columns={"failure_ts": "next_failure"}),
        left_on="ts",
        right_on="next_failure",
        by="gpu_uuid",
        direction="forward",
        allow_exact_matches=False,
    ).sort_values("_order")
    table["next_failure"] = merged["next_failure"].to_numpy()
    until_failure = pd.to_datetime(table["next_failure"], utc=True) - table["ts"]
    table["hit_long"] = (until_failure <= frame.long_horizon).fillna(False).to_numpy(dtype=bool)
    # A long window past what the data knows can hide its failure: left out unless it was a hit.
    table["long_known"] = ((table["ts"] + frame.long_horizon) <= frame.known_until).to_numpy() | table["hit_long"]
    return table.drop(columns="_order")


def failure_outcomes(frame: AlarmFrame, table: pd.DataFrame) -> pd.DataFrame:
    """One row per failure of the period (`frame.episodes`, in its order): day, caught (an alarm
    of its GPU within `lookback` before it), lead_h (from the first such alarm), and
    since_start_h (hours from the period's start to the failure)."""
    episodes = frame.episodes.copy()
    failure_ts = pd.to_datetime(episodes["failure_ts"], utc=True)
    episodes["day"] = ((failure_ts - frame.start) // pd.Timedelta(days=1)).clip(0, frame.n_days - 1).to_numpy()
    episodes["since_start_h"] = ((failure_ts - frame.start) / pd.Timedelta(hours=1)).to_numpy()
    if len(table) == 0 or len(episodes) == 0:
        return episodes.assign(caught=False, lead_h=np.nan)
    pairs = episodes.reset_index().merge(table[["gpu_uuid", "ts"]], on="gpu_uuid", how="inner")
    before = pd.to_datetime(pairs["failure_ts"], utc=True) - pairs["ts"]
    pairs = pairs.loc[((before > pd.Timedelta(0)) & (before <= frame.lookback)).to_numpy()]
    first = pairs.groupby("index")["ts"].min()
    failed_at = failure_ts.iloc[first.index].to_numpy(dtype="datetime64[ns]")
    lead = (failed_at - first.to_numpy(dtype="datetime64[ns]")) / np.timedelta64(1, "h")
    episodes["lead_h"] = np.nan
    episodes.loc[first.index, "lead_h"] = lead
    episodes["caught"] = episodes["lead_h"].notna()
    return episodes


def lead_shares(outcomes: pd.DataFrame, lead_times_h: Sequence[int] = LEAD_TIMES_H) -> dict[str, Any]:
    """Per lead time h: the share of failures with an alarm at least h hours before, among the
    failures at least h hours after the period's start, and how many those are."""
    out = {}
    for h in lead_times_h:
        eligible = outcomes["since_start_h"].to_numpy() >= h
        alarmed = (outcomes["lead_h"].to_numpy() >= h) & eligible
        out[str(h)] = {
            "n_failures": int(eligible.sum()),
            "share": _num(alarmed.sum() / eligible.sum()) if eligible.any() else None,
        }
    return out


def paired_difference_ci(a: np.ndarray, b: np.ndarray, *, samples: int, seed: int) -> tuple[float | None, float | None]:
    """Percentile bootstrap interval of pooled(a) - pooled(b) over the same resampled days:
    a and b are (hits, count) per day of two operating points on the same days."""
    paired = np.column_stack([a, b])

    def difference(days: np.ndarray) -> float:
        return _pooled(days[:, :2]) - _pooled(days[:, 2:])

    return bootstrap_ci(paired, difference, samples=samples, seed=seed)
