"""Alarm-level evaluation: what an operator receives from a score.

One definition (docs/evaluation.md, "Alarms"):

- a GPU's **episode** is its service between failures: it ends at a failure of the GPU (the
  rows after it start the next) or at a gap in its rows (out of service). An episode raises at
  most **one alarm**: a GPU that stays risky is not a new alarm each day;
- an alarm is **right within W** when its GPU fails within W after it; a failure is **caught
  within W** when its GPU alarmed within W before it. W is the label horizon and `long_horizon`
  (72 h), reported side by side for precision and recall alike. An alarm whose W reaches past
  what the data knows is left out of that precision unless it was right.

Two ways to raise alarms from a score:

- a **threshold** (`AlarmFrame.alarms`): an episode alarms at its first row at or above it. An
  episode's alarm does not depend on the threshold beyond whether its highest score reaches
  it, so the number of alarms is the number of episodes whose highest score reaches the
  threshold; `threshold_for_budget` finds the lowest threshold within a volume exactly from the
  sorted episode maxima;
- a **daily quota** (`quota_alarms`): at the end of each day the riskiest GPUs not already
  alarmed in their episode are alarmed, as many as the budget allows by then (budget x GPU-days
  so far / 1,000, so 0.5 a day is one every second day). Every scorer then raises the same
  number of alarms on the same rows: the comparison at equal volume.

Per operating point (`alarm_metrics`): the volume (alarms per 1,000 GPU-days: rows x grid step
/ 1 day), precision and recall within each window, the lead time from the alarm, and per lead
time of `LEAD_TIMES_H` the share of failures alarmed at least that long before (among those at
least that long after the period's start); per failure mode; the counts per day from which
paired intervals are drawn (`models.power`), and percentile bootstrap intervals over days.
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

_NO_FAILURE = np.iinfo(np.int64).max
_DAY_NS = pd.Timedelta(days=1).value
_HOUR_NS = pd.Timedelta(hours=1).value


@dataclass(frozen=True)
class AlarmRules:
    """The two windows an alarm and a failure are judged in; durations in the configuration's
    grammar."""

    horizon: DurationLike
    """The label horizon: the first window."""
    long_horizon: DurationLike = "72h"
    """The second window: early alarms that are right count here."""

    def windows(self) -> tuple[pd.Timedelta, pd.Timedelta]:
        return as_timedelta(self.horizon, "horizon"), as_timedelta(self.long_horizon, "long_horizon")


class AlarmFrame:
    """The labelled rows of one period (a test period or a validation slice), sorted by GPU and
    time once and cut into episodes, so that many scores are turned into alarms cheaply.

    `failures` (gpu_uuid, failure_ts): every failure the data knows, from all rows (including
    those after the period), to judge alarms and end episodes; `known_until`: the last time the
    data can show a failure; `failure_modes` (gpu_uuid, ts, mode): the ground truth that names
    each failure's mode (`models.evaluate.attach_modes`); `start`: the period's first grid time
    (its days count from there)."""

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
        self.horizon, self.long_horizon = rules.windows()
        self.start = prepared["ts"].min() if start is None else start
        self.prepared = prepared
        ns = prepared["ts"].to_numpy(dtype="datetime64[ns]").astype(np.int64)
        gpu = pd.factorize(prepared["gpu_uuid"])[0]
        self.order = np.lexsort((ns, gpu))
        self.gpu, self.ns = gpu[self.order], ns[self.order]
        times = np.unique(ns)
        self.step_ns = int(np.diff(times).min()) if len(times) > 1 else _HOUR_NS
        self.uuid = prepared["gpu_uuid"].to_numpy()[self.order].astype(str)
        own = episode_table(prepared, np.zeros(len(prepared), dtype=bool))[["gpu_uuid", "failure_ts"]]
        self.episodes = own.reset_index(drop=True)
        """The failures of the period (its labelled rows announce them), in time order."""
        self.modes = attach_modes(self.episodes, failure_modes)
        known = failures if failures is not None else own
        self.failures = known.assign(gpu_uuid=known["gpu_uuid"].astype(str)).sort_values("failure_ts")
        self.known_until = prepared["ts"].max() if known_until is None else known_until
        self.next_failure = self._next_failures()
        """Per sorted row, the time (ns) of its GPU's next failure after it (`_NO_FAILURE`: none known)."""
        same_gpu = np.r_[False, self.gpu[1:] == self.gpu[:-1]]
        continues = same_gpu & np.r_[False, np.diff(self.ns) <= self.step_ns]
        # A failure between two rows of a GPU (their next failures differ) ends the episode too.
        continues &= np.r_[False, self.next_failure[1:] == self.next_failure[:-1]]
        self.episode_start = ~continues
        self.episode = np.cumsum(self.episode_start) - 1
        self.n_episodes = int(self.episode[-1]) + 1
        self.day = ((self.ns - self.start.value) // _DAY_NS).astype(np.int64)
        self.n_days = int(self.day.max()) + 1
        self.gpu_days = len(prepared) * self.step_ns / _DAY_NS
        self.gpu_days_by_day = np.bincount(self.day, minlength=self.n_days) * (self.step_ns / _DAY_NS)

    def _next_failures(self) -> np.ndarray:
        failure_ns = (
            pd.to_datetime(self.failures["failure_ts"], utc=True).to_numpy(dtype="datetime64[ns]").astype(np.int64)
        )
        rows = pd.DataFrame({"gpu_uuid": self.uuid, "ts": self.ns, "_row": np.arange(len(self.ns))})
        known = pd.DataFrame({"gpu_uuid": self.failures["gpu_uuid"].to_numpy(dtype=str), "failure": failure_ns}).assign(
            _failure=np.arange(len(failure_ns))
        )
        merged = pd.merge_asof(
            rows.sort_values("ts"),
            known.sort_values("failure"),
            left_on="ts",
            right_on="failure",
            by="gpu_uuid",
            direction="forward",
            allow_exact_matches=False,
        )
        out = np.full(len(self.ns), _NO_FAILURE, dtype=np.int64)
        found = merged["_failure"].notna().to_numpy()
        # By index into the failures, not the merged (float, when some rows have none) times.
        out[merged["_row"].to_numpy()[found]] = failure_ns[merged["_failure"].to_numpy()[found].astype(np.int64)]
        return out

    def sorted_values(self, values: Any) -> np.ndarray:
        """`values` (one per labelled row, in the frame's order) in the frame's sorted order."""
        array = np.asarray(values)
        if array.shape != (len(self.prepared),):
            raise InputError(f"alarms: expected one value per labelled row ({len(self.prepared)}), got {array.shape}")
        return array[self.order]

    def alarms(self, above: np.ndarray) -> np.ndarray:
        """Alarm rows (sorted order) from `above` (sorted order): each episode's first row above."""
        above = np.asarray(above, dtype=bool)
        rows = np.flatnonzero(above)
        first = rows[np.r_[True, self.episode[rows[1:]] != self.episode[rows[:-1]]]] if len(rows) else rows
        alarm = np.zeros(len(above), dtype=bool)
        alarm[first] = True
        return alarm

    def episode_maxima(self, values: np.ndarray) -> np.ndarray:
        """The highest of `values` (sorted order) in each episode (NaN counts as -inf)."""
        clean = np.where(np.isnan(values), -np.inf, values)
        return np.maximum.reduceat(clean, np.flatnonzero(self.episode_start))

    def allowed(self, budget: float, gpu_days: float) -> int:
        """The most alarms `budget` (per 1,000 GPUs per day) allows over `gpu_days`."""
        return math.floor(budget * gpu_days / 1000.0 + 1e-9)

    def rate(self, alarms: np.ndarray) -> float:
        """Alarms per 1,000 GPU-days."""
        return float(alarms.sum() / self.gpu_days * 1000.0)


def _check_budget(budget: float) -> None:
    if not budget > 0:
        raise InputError(f"alarm budget: expected a positive number of alarms per 1,000 GPUs per day, got {budget!r}")


def threshold_for_budget(frame: AlarmFrame, scores: Any, budget: float) -> tuple[float, float]:
    """(threshold, alarms per 1,000 GPU-days it gives on `frame`): the lowest threshold among
    the frame's scores whose alarm volume on `frame` (a validation slice) is at most `budget`.
    Inf (no alarm) when even the highest score alarms too often.

    Exact: a threshold t raises one alarm per episode whose highest score is at least t, so
    with the maxima sorted, the n allowed alarms are the n highest, and the threshold is the
    lowest score above the next one (equal maxima alarm together or not at all)."""
    _check_budget(budget)
    values = frame.sorted_values(np.asarray(scores, dtype=np.float64))
    finite = np.sort(values[np.isfinite(values)])
    if len(finite) == 0:
        return math.inf, 0.0
    maxima = np.sort(frame.episode_maxima(values))[::-1]
    maxima = maxima[np.isfinite(maxima)]
    allowed = frame.allowed(budget, frame.gpu_days)
    if allowed >= len(maxima):
        threshold = float(finite[0])
    else:
        # The lowest score strictly above the highest maximum that must not alarm.
        above = np.searchsorted(finite, maxima[allowed], side="right")
        if above == len(finite):
            return math.inf, 0.0
        threshold = float(finite[above])
    n_alarms = int((maxima >= threshold).sum())
    return threshold, n_alarms / frame.gpu_days * 1000.0


def quota_alarms(frame: AlarmFrame, scores: Any, budget: float, *, sorted_input: bool = False) -> np.ndarray:
    """Alarm rows (sorted order) of a daily quota of `budget` alarms per 1,000 GPUs per day: at
    each day's last grid time, the GPUs in service then (a row at it) and not alarmed in their
    episode are ranked by their highest score that day (their rows of the episode up to then,
    NaN lowest) and the first ones are alarmed at that grid time, as many as bring the alarms
    so far to the budget times the GPU-days so far (carried over: a budget below one a day
    alarms every few days). The same number of alarms for every scorer (while GPUs remain)."""
    _check_budget(budget)
    values = np.asarray(scores, dtype=np.float64)
    values = values if sorted_input else frame.sorted_values(values)
    values = np.where(np.isnan(values), -np.inf, values)
    # Groups: one episode's rows within one day (contiguous in the sorted order).
    key_change = np.r_[True, (frame.episode[1:] != frame.episode[:-1]) | (frame.day[1:] != frame.day[:-1])]
    starts = np.flatnonzero(key_change)
    last_row = np.r_[starts[1:] - 1, len(values) - 1]
    best = np.maximum.reduceat(values, starts)
    group_day = frame.day[starts]
    group_episode = frame.episode[starts]
    review = np.full(frame.n_days, np.iinfo(np.int64).min)
    np.maximum.at(review, frame.day, frame.ns)
    in_service = frame.ns[last_row] == review[group_day]
    cumulative = np.cumsum(frame.gpu_days_by_day)
    alarmed = np.zeros(frame.n_episodes, dtype=bool)
    alarm = np.zeros(len(values), dtype=bool)
    raised = 0
    in_day_order = np.argsort(group_day, kind="stable")
    for groups in np.split(in_day_order, np.flatnonzero(np.diff(group_day[in_day_order])) + 1):
        day = int(group_day[groups[0]])
        room = frame.allowed(budget, float(cumulative[day])) - raised
        if room <= 0:
            continue
        eligible = groups[in_service[groups] & ~alarmed[group_episode[groups]]]
        chosen = eligible[np.argsort(-best[eligible], kind="stable")[:room]]
        alarmed[group_episode[chosen]] = True
        alarm[last_row[chosen]] = True
        raised += len(chosen)
    return alarm


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


def _share(num: np.ndarray, den: np.ndarray) -> float | None:
    return _num(num.sum() / den.sum()) if den.sum() else None


WINDOW_KEYS = {"": "horizon", "_long": "long_horizon"}
"""Suffix of each window's figures in `alarm_metrics`: "" the label horizon, "_long" the second."""


def alarm_metrics(frame: AlarmFrame, alarm: Any, *, samples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Every figure of one operating point from its alarm rows (`alarm`: sorted order, from
    `AlarmFrame.alarms` or `quota_alarms`). See the module docstring."""
    alarm = np.asarray(alarm, dtype=bool)
    table = alarm_table(frame, alarm)
    outcomes = failure_outcomes(frame, table)
    n_days = frame.n_days

    def per_day(days: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        return np.bincount(days, weights=weights, minlength=n_days).astype(float)

    def ci(num: np.ndarray, den: np.ndarray, scale: float = 1.0) -> list[float | None]:
        low, high = bootstrap_ci(np.column_stack([num, den]), _pooled, samples=samples, seed=seed)
        return [None if low is None else low * scale, None if high is None else high * scale]

    alarm_day, fail_day = table["day"].to_numpy(), outcomes["day"].to_numpy()
    counts: dict[str, np.ndarray] = {"alarms": per_day(alarm_day), "failures": per_day(fail_day)}
    out: dict[str, Any] = {
        "n_alarms": len(table),
        "gpu_days": frame.gpu_days,
        "alarms_per_1000_gpu_days": frame.rate(alarm),
        "n_alarmed_gpus": int(table["gpu_uuid"].nunique()),
        "n_failures": len(outcomes),
    }
    for suffix in WINDOW_KEYS:
        hit, known = table[f"hit{suffix}"].to_numpy(dtype=float), table[f"known{suffix}"].to_numpy(dtype=float)
        caught = outcomes[f"caught{suffix}"].to_numpy(dtype=float)
        counts[f"known{suffix}"] = per_day(alarm_day, known)
        counts[f"hits{suffix}"] = per_day(alarm_day, hit * known)
        counts[f"caught{suffix}"] = per_day(fail_day, caught)
        out[f"n_alarms_known{suffix}"] = int(known.sum())
        out[f"n_hits{suffix}"] = int((hit * known).sum())
        out[f"precision{suffix}"] = _share(counts[f"hits{suffix}"], counts[f"known{suffix}"])
        out[f"precision{suffix}_ci"] = ci(counts[f"hits{suffix}"], counts[f"known{suffix}"])
        out[f"n_caught{suffix}"] = int(caught.sum())
        out[f"recall{suffix}"] = _share(caught, np.ones(len(caught)))
        out[f"recall{suffix}_ci"] = ci(counts[f"caught{suffix}"], counts["failures"])
    leads = outcomes.loc[outcomes["caught_long"], "lead_h"].to_numpy(dtype=float)
    caught_long = outcomes["caught_long"].to_numpy()
    out.update(
        {
            "alarms_per_1000_gpu_days_ci": ci(counts["alarms"], frame.gpu_days_by_day, 1000.0),
            "lead_time_h_median": _num(np.median(leads)) if len(leads) else None,
            "lead_time_h_median_ci": list(
                bootstrap_ci(leads, np.median, samples=samples, seed=seed) if len(leads) > 1 else (None, None)
            ),
            "alarmed_before_h": lead_shares(outcomes),
            "by_mode": {
                mode: {
                    "n_failures": int(mask.sum()),
                    **{
                        f"{key}{suffix}": value
                        for suffix in WINDOW_KEYS
                        for key, value in (
                            ("n_caught", int(outcomes[f"caught{suffix}"].to_numpy()[mask].sum())),
                            (
                                "recall",
                                _num(outcomes[f"caught{suffix}"].to_numpy()[mask].mean()) if mask.any() else None,
                            ),
                        )
                    },
                    "lead_time_h_median": _num(np.median(outcomes.loc[mask & caught_long, "lead_h"]))
                    if (mask & caught_long).any()
                    else None,
                    "alarmed_before_h": lead_shares(outcomes.loc[mask]),
                }
                for mode in sorted(set(frame.modes))
                for mask in [(frame.modes == mode).to_numpy()]
            },
            "by_day": {"alarms": counts["alarms"].astype(int).tolist(), "hits": counts["hits"].astype(int).tolist()},
            "day_counts": {name: values.astype(int).tolist() for name, values in counts.items()},
        }
    )
    return out


def alarm_table(frame: AlarmFrame, alarm: np.ndarray) -> pd.DataFrame:
    """One row per alarm (alarm: sorted order): row (its sorted position), gpu_uuid, ts, day,
    next_failure of its GPU (from every known failure; NaT: none), and per window whether it is
    right (`hit`, `hit_long`) and whether the data reaches that far (`known`, `known_long`:
    an alarm whose window reaches past the data counts only when it was right)."""
    rows = np.flatnonzero(alarm)
    next_ns = frame.next_failure[rows]
    has_next = next_ns != _NO_FAILURE
    until = np.where(has_next, next_ns - frame.ns[rows], _NO_FAILURE)
    table = pd.DataFrame(
        {
            "row": rows,
            "gpu_uuid": frame.uuid[rows],
            "ts": pd.to_datetime(frame.ns[rows], utc=True),
            "day": frame.day[rows],
            "next_failure": pd.to_datetime(np.where(has_next, next_ns, np.iinfo(np.int64).min), utc=True),
            "until_h": np.where(has_next, until / _HOUR_NS, np.inf),
        }
    )
    known_until = pd.Timestamp(frame.known_until).value
    for suffix, window in zip(WINDOW_KEYS, (frame.horizon, frame.long_horizon), strict=True):
        hit = has_next & (until <= window.value)
        table[f"hit{suffix}"] = hit
        table[f"known{suffix}"] = hit | (frame.ns[rows] + window.value <= known_until)
    return table


def failure_outcomes(frame: AlarmFrame, table: pd.DataFrame) -> pd.DataFrame:
    """One row per failure of the period (`frame.episodes`, in its order): day, since_start_h
    (hours from the period's start), lead_h (hours from its GPU's first alarm within the long
    window before it), and per window whether an alarm of its GPU came within it before the
    failure (`caught`, `caught_long`)."""
    episodes = frame.episodes.copy()
    failure_ts = pd.to_datetime(episodes["failure_ts"], utc=True)
    episodes["day"] = ((failure_ts - frame.start) // pd.Timedelta(days=1)).clip(0, frame.n_days - 1).to_numpy()
    episodes["since_start_h"] = ((failure_ts - frame.start) / pd.Timedelta(hours=1)).to_numpy()
    episodes["lead_h"] = np.nan
    right = table.loc[table["hit_long"], ["gpu_uuid", "next_failure", "until_h"]]
    first = np.full(len(episodes), np.nan)
    last = np.full(len(episodes), np.nan)
    if len(right) and len(episodes):
        key = pd.MultiIndex.from_arrays(
            [episodes["gpu_uuid"].astype(str).to_numpy(), failure_ts.to_numpy(dtype="datetime64[ns]")]
        )
        by_failure = right.assign(next_failure=right["next_failure"].to_numpy(dtype="datetime64[ns]")).groupby(
            ["gpu_uuid", "next_failure"]
        )["until_h"]
        # An episode has one alarm; a GPU back from a gap has another, the same failure ahead.
        first = by_failure.max().reindex(key).to_numpy(dtype=float)
        last = by_failure.min().reindex(key).to_numpy(dtype=float)
    episodes["lead_h"] = first
    for suffix, window in zip(WINDOW_KEYS, (frame.horizon, frame.long_horizon), strict=True):
        episodes[f"caught{suffix}"] = last <= window / pd.Timedelta(hours=1)
    return episodes


def lead_shares(outcomes: pd.DataFrame, lead_times_h: Sequence[int] = LEAD_TIMES_H) -> dict[str, Any]:
    """Per lead time h: the share of failures with an alarm at least h hours before (within the
    long window), among the failures at least h hours after the period's start, and how many
    those are."""
    out = {}
    for h in lead_times_h:
        eligible = outcomes["since_start_h"].to_numpy() >= h
        alarmed = (outcomes["lead_h"].to_numpy(dtype=float) >= h) & eligible
        out[str(h)] = {
            "n_failures": int(eligible.sum()),
            "share": _num(alarmed.sum() / eligible.sum()) if eligible.any() else None,
        }
    return out
