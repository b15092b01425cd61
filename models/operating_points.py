"""The walk-forward comparison at its operating points: every scorer turned into alarms
(`models.alarms`) at thresholds chosen on the validation slice before the test period, and the
paper's parallel ensemble at its own alarm volume against each single model cut to the same
volume.

Operating points (`alarm_comparison`):

- `budgets`: for each budget of alarms per 1,000 GPUs per day, each scorer's threshold is the
  lowest whose volume on the validation slice stays within it (`threshold_for_budget`). The
  contenders are thresholded on their calibrated risk (a probability, so one threshold means
  the same for every retrain's model), the baselines on their own scores;
- `natural`: scorers that flag rather than score, at the volume their flags give: the rule
  baseline and the parallel contenders' intersection (`models.ensemble.intersection_flags`);
- `equal_volume`: per parallel contender, its validation volume is the budget of every single
  contender (threshold chosen on the validation slice again), and the test figures of each
  pair are compared with paired bootstrap intervals over days: alarm precision (within the
  horizon) and failure recall.

The test period's labels enter the figures only, never a threshold (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from models.alarms import (
    AlarmFrame,
    AlarmRules,
    alarm_metrics,
    paired_difference_ci,
    threshold_for_budget,
    tie_fractions,
    tie_gap,
    untied,
)
from models.evaluate import failure_episodes, heuristic_scores, random_scores, rule_columns, rule_flags
from models.kinds import SINGLE_KINDS
from models.walk_forward import Contender, WalkForwardResult


def _public(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if not k.startswith("_")}


def alarm_comparison(
    history: pd.DataFrame,
    result: WalkForwardResult,
    contenders: Sequence[Contender],
    rules: AlarmRules,
    budgets: Sequence[float],
    *,
    failure_modes: Any = None,
    samples: int = 1000,
    seed: int = 0,
    extra_scorers: dict[str, tuple[Any, Any]] | None = None,
) -> dict[str, Any]:
    """The `alarms` section of the comparison's metrics (see the module docstring).
    `history`: ts, gpu_uuid, label, time_to_failure_h of every row (the failures the data
    knows, also after the test period, judge the long horizon). `extra_scorers`: more
    baselines, name -> (test scores, validation scores), thresholded as the heuristic is."""
    known = failure_episodes(history)
    last = pd.to_datetime(history["ts"], utc=True).max()
    test = AlarmFrame(
        result.test, rules, failures=known, known_until=last, start=result.test_start, failure_modes=failure_modes
    )
    assert result.validation is not None
    validation = AlarmFrame(result.validation, rules, failures=known, known_until=last)
    test_ties, validation_ties = tie_fractions(result.test), tie_fractions(result.validation)
    scorers = {
        name: _untied(pair, test_ties, validation_ties)
        for name, pair in {**_scorers(result, contenders, seed), **(extra_scorers or {})}.items()
    }

    def at_threshold(name: str, threshold: float, budget: float | None, validation_rate: float) -> dict[str, Any]:
        test_scores, _ = scorers[name]
        figures = alarm_metrics(test, test_scores >= threshold, samples=samples, seed=seed)
        # No threshold (inf): even the highest score alarms more often than the budget allows.
        shown = float(threshold) if np.isfinite(threshold) else None
        return {"budget": budget, "threshold": shown, "validation_rate": validation_rate, **figures}

    by_budget: dict[str, dict[str, Any]] = {}
    for budget in budgets:
        row = {}
        for name, (_, validation_scores) in scorers.items():
            threshold, rate = threshold_for_budget(validation, validation_scores, budget)
            row[name] = at_threshold(name, threshold, budget, rate)
        by_budget[_key(budget)] = row

    natural: dict[str, dict[str, Any]] = {}
    flags = _flags(result, seed)
    for name, (test_flags, validation_flags) in flags.items():
        rate = validation.rate(validation.alarms(validation.sorted_values(validation_flags)))
        figures = alarm_metrics(test, test_flags, samples=samples, seed=seed)
        natural[name] = {"budget": None, "threshold": None, "validation_rate": rate, **figures}

    equal: dict[str, Any] = {}
    singles = [c.name for c in contenders if c.kind in SINGLE_KINDS]
    for c in contenders:
        if c.name not in flags or not singles:
            continue
        volume = natural[c.name]["validation_rate"]
        pairs = {}
        for single in singles:
            _, validation_scores = scorers[single]
            threshold, rate = threshold_for_budget(validation, validation_scores, volume) if volume > 0 else (np.inf, 0)
            cut = at_threshold(single, threshold, volume, rate)
            pairs[single] = {**_public(cut), **_differences(natural[c.name], cut, samples, seed)}
        equal[c.name] = {"volume": volume, "ensemble": _public(natural[c.name]), "singles": pairs}

    versus = _versus_baselines(by_budget, natural, contenders, validation, at_threshold, scorers, samples, seed)

    return {
        "rules": {
            "horizon_h": test.horizon / pd.Timedelta(hours=1),
            "long_horizon_h": test.long_horizon / pd.Timedelta(hours=1),
            "lookback_h": test.lookback / pd.Timedelta(hours=1),
            "quiet_period_h": None if test.quiet is None else test.quiet / pd.Timedelta(hours=1),
        },
        "budgets": [float(b) for b in budgets],
        "validation": {
            "start": result.validation["ts"].min().isoformat(),
            "end": result.validation["ts"].max().isoformat(),
            "n_rows": len(result.validation),
            "gpu_days": validation.gpu_days,
        },
        "test_gpu_days": test.gpu_days,
        "by_budget": {b: {n: _public(m) for n, m in row.items()} for b, row in by_budget.items()},
        "natural": {n: _public(m) for n, m in natural.items()},
        "equal_volume": equal,
        "versus_baselines": versus,
    }


THRESHOLDED_BASELINES = ("heuristic", "best_feature")
"""The baselines each contender is compared with at every budget (the rule, which flags, at its
own volume)."""


def _versus_baselines(
    by_budget: dict[str, dict[str, Any]],
    natural: dict[str, dict[str, Any]],
    contenders: Sequence[Contender],
    validation: AlarmFrame,
    at_threshold: Any,
    scorers: dict[str, tuple[Any, Any]],
    samples: int,
    seed: int,
) -> dict[str, Any]:
    """Each contender minus each baseline, alarm precision and failure recall with paired
    bootstrap intervals over the test days: at every budget against the thresholded baselines
    (`THRESHOLDED_BASELINES`), and against the rule at the rule's own validation volume (each
    contender's threshold chosen on the validation slice for that volume, as for the ensemble)."""
    names = [c.name for c in contenders]
    budgets = {
        budget: {
            baseline: {name: _differences(row[name], row[baseline], samples, seed) for name in names}
            for baseline in THRESHOLDED_BASELINES
            if baseline in row
        }
        for budget, row in by_budget.items()
    }
    out: dict[str, Any] = {"by_budget": budgets}
    if "rule" in natural and natural["rule"]["validation_rate"] > 0:
        volume = natural["rule"]["validation_rate"]
        cut = {}
        for name in names:
            threshold, rate = threshold_for_budget(validation, scorers[name][1], volume)
            point = at_threshold(name, threshold, volume, rate)
            cut[name] = {**_public(point), **_differences(point, natural["rule"], samples, seed)}
        out["rule"] = {"volume": volume, "contenders": cut}
    return out


def baseline_verdicts(versus: dict[str, Any]) -> dict[str, Any]:
    """Per contender: for each baseline and budget (the rule: at its volume) whether the
    contender's alarm precision is higher with the 95% interval of the difference above zero
    (`beats`), lower with it below zero (`loses`), or neither (`not shown`); and `beats_all`:
    it beats every baseline at every operating point."""

    verdict = {"above": "beats", "below": "loses", None: "not shown"}
    out: dict[str, Any] = {}
    every: dict[str, list[str]] = {}
    for budget, baselines in versus["by_budget"].items():
        for baseline, by_name in baselines.items():
            for name, entry in by_name.items():
                v = verdict[_interval_side(entry)]
                out.setdefault(name, {}).setdefault(baseline, {})[budget] = v
                every.setdefault(name, []).append(v)
    for name, entry in versus.get("rule", {}).get("contenders", {}).items():
        v = verdict[_interval_side(entry)]
        out.setdefault(name, {})["rule"] = v
        every.setdefault(name, []).append(v)
    for name, by_baseline in out.items():
        by_baseline["beats_all"] = all(v == "beats" for v in every[name])
    return out


def _interval_side(entry: dict[str, Any]) -> str | None:
    """Where the 95% interval of a precision difference lies: wholly `above` zero, wholly
    `below`, or neither (None, also when there is no interval)."""
    low, high = entry["precision_difference_ci"]
    if low is not None and low > 0:
        return "above"
    if high is not None and high < 0:
        return "below"
    return None


def _key(budget: float) -> str:
    return f"{budget:g}"


def _untied(pair: tuple[Any, Any], test: np.ndarray, validation: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A scorer's (test, validation) scores with their ties broken (`models.alarms.untied`, each
    frame's `tie_fractions`), by the gap of its validation scores."""
    gap = tie_gap(pair[1])
    return untied(pair[0], test, gap), untied(pair[1], validation, gap)


def _scorers(result: WalkForwardResult, contenders: Sequence[Contender], seed: int) -> dict[str, tuple[Any, Any]]:
    """(test scores, validation scores) of everything thresholded: the contenders' calibrated
    risk, then the heuristic and random baselines on their own scores."""
    assert result.validation is not None
    out = {c.name: (result.calibrated[c.name], result.validation_calibrated[c.name]) for c in contenders}
    out["heuristic"] = (heuristic_scores(result.test), heuristic_scores(result.validation))
    # The random baseline's validation draw is its own: the seed plus one.
    out["random"] = (random_scores(len(result.test), seed), random_scores(len(result.validation), seed + 1))
    return out


def _flags(result: WalkForwardResult, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(test flags, validation flags) of the scorers with their own operating point."""
    assert result.validation is not None
    out = {name: (result.flags[name], result.validation_flags[name]) for name in result.flags}
    if rule_columns(result.test) and rule_columns(result.validation):
        out["rule"] = (rule_flags(result.test), rule_flags(result.validation))
    return out


def _differences(first: dict[str, Any], second: dict[str, Any], samples: int, seed: int) -> dict[str, Any]:
    """First minus second operating point (the ensemble minus a single model, a contender minus
    a baseline): alarm precision and failure recall, with paired bootstrap intervals over the
    test days."""
    e, s = first["_day_counts"], second["_day_counts"]

    def diff(a: Any, b: Any) -> float | None:
        return None if a is None or b is None else float(a - b)

    return {
        "precision_difference": diff(first["precision"], second["precision"]),
        "precision_difference_ci": list(
            paired_difference_ci(
                np.column_stack([e["hits"], e["alarms"]]),
                np.column_stack([s["hits"], s["alarms"]]),
                samples=samples,
                seed=seed,
            )
        ),
        "recall_difference": diff(first["recall"], second["recall"]),
        "recall_difference_ci": list(
            paired_difference_ci(
                np.column_stack([e["caught"], e["failures"]]),
                np.column_stack([s["caught"], s["failures"]]),
                samples=samples,
                seed=seed,
            )
        ),
    }


def ensemble_verdict(equal_volume: dict[str, Any]) -> dict[str, Any]:
    """Whether the paper's ensemble gain holds at equal alarm volume, per parallel contender:
    `holds` when its alarm precision beats every single model cut to its volume with the 95%
    interval of the difference above zero; `reversed` when some single model beats it so;
    `not shown` otherwise (the intervals include no difference)."""
    out = {}
    for name, entry in equal_volume.items():
        sides = [_interval_side(single) for single in entry["singles"].values()]
        if sides and all(side == "above" for side in sides):
            out[name] = "holds"
        elif "below" in sides:
            out[name] = "reversed"
        else:
            out[name] = "not shown"
    return out
