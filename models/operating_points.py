"""The walk-forward comparison at its operating points: every scorer turned into alarms
(`models.alarms`, one alarm per GPU episode, judged within the label horizon and 72 h).

Operating points (`alarm_comparison`):

- `quota`: for each budget of alarms per 1,000 GPUs per day, a daily quota on the test period
  (`models.alarms.quota_alarms`): each day the riskiest GPUs not already alarmed, as many as the
  budget allows. Every scorer raises the same number of alarms, so their precisions compare;
  flagging scorers (the rule, the parallel intersection) rank their flagged GPUs first. Paired
  differences (`models.power`) for each contender against each baseline, each ensemble against
  each single contender and each retrained contender against its static twin;
- `matched`: for each budget, each scorer's threshold set on the test period's scores (never
  its labels) for the budget, exactly (`threshold_for_budget` on the test rows): the same volume
  for every scorer, alarms raised the hour the risk crosses. A comparison device (the threshold
  is not known in advance), the fair one where failures follow their precursor within hours,
  faster than a daily review; the same pairs as at the quota;
- `budgets`: each scorer's threshold chosen on the validation slice before the test period (the
  lowest whose volume there stays within the budget, `threshold_for_budget`), with the volume it
  realises on the test and how far apart the scorers' volumes are (`volume_ratio`): their
  precisions are not comparable where those differ. The contenders are thresholded on their
  calibrated risk, the baselines on their own scores;
- `natural`: scorers that flag rather than score, at the volume their flags give: the rule
  baseline and the parallel contenders' intersection (`models.ensemble.intersection_flags`);
- `equal_volume`: per parallel contender, its validation volume is the budget of every single
  contender (threshold chosen on the validation slice again), with paired differences;
- `false_alarms`: the top false alarms of one configuration at the headline quota
  (`models.false_alarms`).

The test period's labels enter the figures only, never a threshold or a quota's choice (tested).
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
    quota_alarms,
    threshold_for_budget,
    tie_fractions,
    tie_gap,
    untied,
)
from models.evaluate import heuristic_scores, random_scores, rule_columns, rule_flags
from models.false_alarms import FeatureView, top_false_alarms
from models.history import History
from models.kinds import ENSEMBLE_KINDS, SINGLE_KINDS
from models.power import compare_points
from models.walk_forward import Contender, WalkForwardResult


def _public(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if not k.startswith("_")}


def alarm_comparison(
    history: History,
    result: WalkForwardResult,
    contenders: Sequence[Contender],
    rules: AlarmRules,
    budgets: Sequence[float],
    *,
    failure_modes: Any = None,
    samples: int = 1000,
    seed: int = 0,
    extra_scorers: dict[str, tuple[Any, Any]] | None = None,
    explain: str | None = None,
    headline: float | None = None,
    features: FeatureView | None = None,
) -> dict[str, Any]:
    """The `alarms` section of the comparison's metrics (see the module docstring).
    `history`: of every row of the data (the failures it knows, also after the test period,
    judge the long window; its nodes name the false alarms'). `features`: the test rows'
    features the false alarms are explained by (default: `result.test`'s).
    `extra_scorers`: more baselines, name -> (test scores, validation scores), thresholded as
    the heuristic is. `explain`: the contender whose top false alarms at the `headline` quota
    (default: the first budget) are listed."""
    known = history.episodes()
    last = history.last
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
        alarm = test.alarms(test.sorted_values(test_scores >= threshold))
        figures = alarm_metrics(test, alarm, samples=samples, seed=seed)
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

    flags = _flags(result, seed)
    natural: dict[str, dict[str, Any]] = {}
    for name, (test_flags, validation_flags) in flags.items():
        rate = validation.rate(validation.alarms(validation.sorted_values(validation_flags)))
        alarm = test.alarms(test.sorted_values(np.asarray(test_flags, dtype=bool)))
        figures = alarm_metrics(test, alarm, samples=samples, seed=seed)
        natural[name] = {"budget": None, "threshold": None, "validation_rate": rate, **figures}

    ranked = _quota_scores(scorers, flags, test_ties)
    quota: dict[str, Any] = {}
    quota_alarm_rows: dict[tuple[str, str], np.ndarray] = {}
    for budget in budgets:
        points = {}
        for name, values in ranked.items():
            alarm = quota_alarms(test, values, budget)
            quota_alarm_rows[_key(budget), name] = alarm
            points[name] = {"budget": budget, **alarm_metrics(test, alarm, samples=samples, seed=seed)}
        quota[_key(budget)] = {
            "points": points,
            "volume_ratio": volume_ratio(points),
            "comparisons": _quota_pairs(points, contenders, samples, seed),
        }

    matched: dict[str, Any] = {}
    for budget in budgets:
        points = {}
        for name, ranking in ranked.items():
            # Set on the test period's scores, never its labels: the same volume for every scorer.
            # Ties left (a score constant on the validation slice) broken by the test's own gap;
            # a score constant on the test too (a counter that never moves) in the hash's order.
            values = untied(ranking, test_ties, tie_gap(ranking) or 1.0)
            threshold, _ = threshold_for_budget(test, values, budget)
            alarm = test.alarms(test.sorted_values(values >= threshold))
            shown = float(threshold) if np.isfinite(threshold) else None
            points[name] = {
                "budget": budget,
                "threshold": shown,
                **alarm_metrics(test, alarm, samples=samples, seed=seed),
            }
        matched[_key(budget)] = {
            "points": points,
            "volume_ratio": volume_ratio(points),
            "comparisons": _quota_pairs(points, contenders, samples, seed),
        }

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
    shown_budget = _key(budgets[0] if headline is None else headline)
    false_alarms = None
    if explain is not None and (shown_budget, explain) in quota_alarm_rows:
        false_alarms = {
            "name": explain,
            "budget": float(shown_budget),
            "alarms": top_false_alarms(
                test,
                result.test,
                quota_alarm_rows[shown_budget, explain],
                test.sorted_values(ranked[explain]),
                features=features or FeatureView.of(result.test),
                failure_modes=failure_modes,
                nodes=history.nodes,
            ),
        }

    return {
        "rules": {
            "horizon_h": test.horizon / pd.Timedelta(hours=1),
            "long_horizon_h": test.long_horizon / pd.Timedelta(hours=1),
        },
        "budgets": [float(b) for b in budgets],
        "validation": {
            "start": result.validation["ts"].min().isoformat(),
            "end": result.validation["ts"].max().isoformat(),
            "n_rows": len(result.validation),
            "gpu_days": validation.gpu_days,
        },
        "test_gpu_days": test.gpu_days,
        "quota": quota,
        "matched": matched,
        "by_budget": {b: {n: _public(m) for n, m in row.items()} for b, row in by_budget.items()},
        "threshold_volume_ratio": {b: volume_ratio(row) for b, row in by_budget.items()},
        "natural": {n: _public(m) for n, m in natural.items()},
        "equal_volume": equal,
        "versus_baselines": versus,
        "false_alarms": false_alarms,
    }


def volume_ratio(points: dict[str, dict[str, Any]]) -> float | None:
    """The highest realised test volume over the lowest among `points` (None when some scorer
    raised no alarm: no ratio bounds it)."""
    volumes = [p["alarms_per_1000_gpu_days"] for p in points.values()]
    if not volumes or min(volumes) <= 0:
        return None
    return float(max(volumes) / min(volumes))


def _quota_scores(
    scorers: dict[str, tuple[np.ndarray, np.ndarray]],
    flags: dict[str, tuple[np.ndarray, np.ndarray]],
    ties: np.ndarray,
) -> dict[str, np.ndarray]:
    """The test score each scorer's quota ranks by: its own (ties broken), and for a flagging
    scorer its flagged rows first, then its risk (the intersection: the ensemble's) or, for
    the rule, the tie order."""
    out = {name: test for name, (test, _) in scorers.items() if name not in flags}
    for name, (test_flags, _) in flags.items():
        flagged = np.asarray(test_flags, dtype=np.float64)
        within = scorers[name][0] if name in scorers else ties
        out[name] = 2.0 * flagged + np.clip(np.nan_to_num(np.asarray(within, dtype=np.float64), nan=0.0), 0.0, 1.0)
    return out


QUOTA_BASELINES = ("heuristic", "best_feature", "rule")
"""The baselines each contender is compared with at every quota."""


def _quota_pairs(
    points: dict[str, dict[str, Any]], contenders: Sequence[Contender], samples: int, seed: int
) -> dict[str, Any]:
    """At one quota: first - second (`models.power.compare_points`) for each contender against
    each baseline, each ensemble against each single contender, and each retrained single
    contender against the static contender of its kind."""
    pairs: list[tuple[str, str, str]] = []
    for c in contenders:
        pairs += [(c.name, b, "baseline") for b in QUOTA_BASELINES if b in points]
    singles = [c for c in contenders if c.kind in SINGLE_KINDS]
    for c in contenders:
        if c.kind in ENSEMBLE_KINDS:
            pairs += [(c.name, s.name, "ensemble") for s in singles]
    for c in singles:
        if c.mode != "static":
            pairs += [(c.name, s.name, "retraining") for s in singles if s.mode == "static" and s.kind == c.kind]
    return {
        f"{first} - {second}": {
            "first": first,
            "second": second,
            "question": question,
            **compare_points([points[first]], [points[second]], samples=samples, seed=seed),
        }
        for first, second, question in pairs
        if first in points and second in points
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
    a baseline): alarm precision and failure recall within the label horizon, with paired
    bootstrap intervals over the test days (`models.power`), the smallest difference they
    could detect and the verdict."""
    compared = compare_points([first], [second], samples=samples, seed=seed)
    precision, recall = compared["precision"], compared["recall"]
    return {
        "precision_difference": precision["difference"],
        "precision_difference_ci": precision["ci"],
        "precision_detectable": precision["detectable"],
        "precision_verdict": precision["verdict"],
        "recall_difference": recall["difference"],
        "recall_difference_ci": recall["ci"],
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


def quota_verdicts(comparisons: dict[str, Any], question: str = "ensemble") -> dict[str, str]:
    """Per first scorer of the `question` pairs at one quota (the ensembles): `holds` when its
    precision is higher than every second's (each interval above zero), `reversed` when some
    second is higher, `no difference` when every pair is, else `not shown` (underpowered)."""
    by_first: dict[str, list[str]] = {}
    for c in comparisons.values():
        if c["question"] == question:
            by_first.setdefault(c["first"], []).append(c["precision"]["verdict"])
    out = {}
    for name, verdicts in by_first.items():
        if all(v == "higher" for v in verdicts):
            out[name] = "holds"
        elif "lower" in verdicts:
            out[name] = "reversed"
        elif all(v == "no difference" for v in verdicts):
            out[name] = "no difference"
        else:
            out[name] = "not shown"
    return out
