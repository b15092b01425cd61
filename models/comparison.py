"""The walk-forward comparison: every contender of `models.walk_forward.run_walk_forward` and
the baselines (`random`, `rule`, `heuristic`, `oracle`) scored on the same test rows, with the
figures of the report (`models.report`):

- the ranking: precision@K per day and pooled (per GPU-hour and per distinct GPU and day),
  episode recall and lead time per K, by failure mode and by model age
  (`models.evaluate.compare_scores`), on the uncalibrated risk;
- the alarms at a daily quota (every scorer at the same volume, with paired differences and the
  power to read them), at thresholds chosen before the test period (with the volumes they
  realise), and the paper's ensemble at its own volume against single models at the same volume
  (`models.operating_points`), on the calibrated risk; the top false alarms of the
  configuration chosen on validation;
- the calibration on the test period: reliability table, Brier score, expected calibration
  error, and the rows at high risk (`models.calibration`);
- the drift events the features show (a driver rollout, new nodes: `models.drift`), and for
  those inside the test period each scorer's precision before and after;
- the claims the report checks, each with a paired bootstrap confidence interval over days:
  the step from the best static single model to the best contender and to the best retrained
  ensemble (the paper's claim), the stability of daily precision, and whether the ensemble's
  gain holds at equal alarm volume.

`evaluate_seeds` repeats the comparison under several seeds (the negative draw of every fit)
and reports the mean and range of the headline figures."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
from sklearn.metrics import roc_auc_score

from features.fail_slow import FAIL_SLOW_WINDOW
from ingest.errors import InputError
from ingest.store import Store
from models.alarms import DEFAULT_BUDGETS, AlarmRules
from models.calibration import calibration_summary, high_risk_check, reliability, top_risk_ties
from models.drift import before_after, drift_events
from models.evaluate import (
    baseline_scores,
    bootstrap_ci,
    compare_scores,
    episode_recall,
    rule_columns,
    rule_flags,
)
from models.evaluation_inputs import EvaluationInputs, inputs_from_store, inputs_in_memory
from models.fail_slow import fail_slow_report, has_fail_slow_inputs
from models.feature_baseline import feature_scores
from models.frame import labels, to_pandas
from models.kinds import ENSEMBLE_KINDS, SINGLE_KINDS
from models.operating_points import alarm_comparison, baseline_verdicts, ensemble_verdict, quota_verdicts
from models.walk_forward import Contender, WalkForwardPlan, WalkForwardResult, duration_label

PAPER_PRECISION = (0.463, 0.840)
"""Liu et al.: precision at the top of the ranking, best single model -> sliding ensembles."""


def covered_days(times: pd.Series) -> int:
    """Days a test period covers: from its first grid time to one grid step past its last (a
    daily grid's 7 grid times are 7 days, not the 6 between the first and the last)."""
    unique = np.sort(times.unique())
    if len(unique) == 0:
        return 0
    step = np.diff(unique).min() if len(unique) > 1 else np.timedelta64(1, "h")
    return math.ceil((unique[-1] - unique[0] + step) / np.timedelta64(1, "D"))


def evaluate_walk_forward(
    source: Any,
    contenders: Sequence[Contender],
    plan: WalkForwardPlan,
    *,
    top_k: Sequence[str] = ("10", "expected"),
    failures: Any = None,
    bootstrap_samples: int = 1000,
    progress: bool = False,
    alarm_rules: AlarmRules | None = None,
    budgets: Sequence[float] = DEFAULT_BUDGETS,
    replay: Callable[[pd.DataFrame, np.ndarray, np.ndarray | None], dict[str, Any]] | None = None,
    fail_slow_truth: pd.DataFrame | None = None,
    client: Any = None,
    fail_slow_window: str | None = FAIL_SLOW_WINDOW,
) -> dict[str, Any]:
    """Run the walk-forward comparison and return every figure of its report (JSON-ready) on
    `source`: a features frame in memory, or a `Store` whose features are read a day at a time
    (`models.evaluation_inputs`: no process holds the whole frame). The figures are
    the contenders, the baselines `random`, `rule` (`models.evaluate.rule_flags`; absent with
    a reason when the frame lacks its columns), `heuristic` and `oracle`, scored on the same
    test rows; `model` repeats the primary contender (the first `auto` one, else the first).
    Alarms follow `alarm_rules` (default: `AlarmRules` at the plan's horizon) at each of
    `budgets` (alarms per 1,000 GPUs per day). With `replay` (`serving.replay.evaluation_replay`),
    `replay` holds what it makes of the test rows, the primary contender's calibrated risk and
    the rule's flags (None without the rule). `fail_slow` holds the fail-slow alarm class
    (`models.fail_slow`) on the features of `fail_slow_window` (the feature spec's
    `fail_slow_label`; None: none) when the features have them, judged against
    `fail_slow_truth` (gpu_uuid, fail_slow_since) when given. The walk-forward's fits and
    scoring run on the Dask cluster of `client` when given (`run_walk_forward`)."""
    if not budgets:
        raise InputError("alarm budgets: expected at least one number of alarms per 1,000 GPUs per day, got none")
    specs = [str(s) for s in top_k]
    if not specs:
        raise InputError("top_k: expected at least one K specification, got none")
    plan = WalkForwardPlan(**{**plan.__dict__, "top_k": specs[0]})
    if isinstance(source, Store):
        inputs = inputs_from_store(
            source, contenders, plan, fail_slow_window=fail_slow_window, progress=progress, client=client
        )
    else:
        inputs = inputs_in_memory(source, contenders, plan, progress=progress, client=client)
    with inputs:
        return _figures(
            inputs,
            contenders,
            plan,
            specs,
            failures=failures,
            bootstrap_samples=bootstrap_samples,
            alarm_rules=alarm_rules,
            budgets=budgets,
            replay=replay,
            fail_slow_truth=fail_slow_truth,
            fail_slow_window=fail_slow_window,
        )


def _figures(
    inputs: EvaluationInputs,
    contenders: Sequence[Contender],
    plan: WalkForwardPlan,
    specs: list[str],
    *,
    failures: Any,
    bootstrap_samples: int,
    alarm_rules: AlarmRules | None,
    budgets: Sequence[float],
    replay: Callable[[pd.DataFrame, np.ndarray, np.ndarray | None], dict[str, Any]] | None,
    fail_slow_truth: pd.DataFrame | None,
    fail_slow_window: str | None,
) -> dict[str, Any]:
    """`evaluate_walk_forward`'s figures of the walk-forward and what it read (`inputs`)."""
    result, history = inputs.result, inputs.history
    test = result.test
    expected = history.expected_failures_per_day(result.test_start - result.horizon)
    baselines = baseline_scores(test, plan.seed)
    scores: dict[str, np.ndarray] = dict(result.scores)
    scores["random"] = baselines["random"]
    rule_note = None
    if rule_columns(test):
        # A rule flags or not; among flagged (and among unflagged) GPUs the order is random.
        scores["rule"] = rule_flags(test).astype(np.float64)
    else:
        rule_note = "the features have no hardware-XID or uncorrectable-ECC columns"
    scores["heuristic"] = baselines["heuristic"]
    assert result.validation is not None
    feature = inputs.best_feature
    extra = {}
    if feature is not None:
        scores["best_feature"] = feature_scores(test, feature)
        extra["best_feature"] = (scores["best_feature"], feature_scores(result.validation, feature))
    scores["oracle"] = labels(test).to_numpy(dtype=np.float64)
    compared = compare_scores(
        test,
        scores,
        top_k=specs,
        expected_per_day=expected,
        model_age_h=result.model_age_h,
        failures=failures,
        bootstrap_samples=bootstrap_samples,
        seed=plan.seed,
        flags=result.flags,
    )
    chosen = chosen_on_validation(result, contenders)
    headline = 1.0 if 1.0 in [float(b) for b in budgets] else float(budgets[0])
    alarms = alarm_comparison(
        history,
        result,
        contenders,
        alarm_rules or AlarmRules(horizon=plan.horizon),
        budgets,
        failure_modes=failures,
        samples=bootstrap_samples,
        seed=plan.seed,
        extra_scorers=extra,
        explain=None if chosen is None else chosen["name"],
        headline=headline,
        features=inputs.features,
    )
    if "rule" in scores:
        compared["rule"]["flagged"] = _flag_metrics(test, scores["rule"])
    primary = next((c.name for c in contenders if c.mode == "auto"), contenders[0].name)
    compared["model"] = {**compared[primary], "name": primary}
    y = labels(test).to_numpy()
    at_headline = alarms["quota"][f"{headline:g}"]["points"]
    drift = before_after(
        drift_events(inputs.drift),
        result.test_start,
        result.test_end,
        {
            name: [d["precision"] for d in s["by_k"][specs[0]]["daily"]]
            for name, s in compared.items()
            if name != "model"
        },
        {name: m["by_day"] for name, m in at_headline.items()},
    )
    verdicts = ensemble_verdict(alarms["equal_volume"])
    versus = baseline_verdicts(alarms["versus_baselines"])
    if chosen is not None:
        chosen["versus_baselines"] = versus.get(chosen["name"])
    replayed = (
        {}
        if replay is None
        else {"replay": {"model": primary, **replay(test, result.calibrated[primary], scores.get("rule"))}}
    )
    if fail_slow_window is not None and has_fail_slow_inputs(test, fail_slow_window):
        replayed["fail_slow"] = fail_slow_report(test, fail_slow_truth, window=fail_slow_window)
    return {
        **replayed,
        "kind": "walk-forward",
        "top_k": specs[0],
        "top_k_specs": specs,
        "expected_failures_per_day": expected,
        "horizon_h": result.horizon / pd.Timedelta(hours=1),
        "primary": primary,
        "test": {
            "start": result.test_start.isoformat(),
            "end": result.test_end.isoformat(),
            "n_days": covered_days(test["ts"]),
            "n_rows": len(test),
            "n_positives": int(np.nansum(y)),
            "n_gpus": int(test["gpu_uuid"].nunique()),
            "n_times": int(test["ts"].nunique()),
        },
        "plan": {
            "test_days": plan.test_days,
            "retrain_every": duration_label(plan.retrain_every, "retrain_every"),
            "train_window": duration_label(plan.train_window, "train_window"),
            "candidate_windows": [duration_label(w, "candidate_windows") for w in plan.candidate_windows],
            "validation_window": duration_label(plan.validation_window, "validation_window"),
            "negative_fraction": plan.negative_fraction,
            "bootstrap_samples": bootstrap_samples,
            "switch_margin": plan.switch_margin,
            "seed": plan.seed,
            "jobs": plan.jobs,
            "n_fits": result.n_fits,
            "n_fits_unshared": result.n_fits_unshared,
            "calibration": plan.calibration,
            "calibration_window": duration_label(plan.calibration_window, "calibration_window"),
        },
        "contenders": [
            {
                "name": c.name,
                "kind": c.kind,
                "mode": c.mode,
                "params": dict(c.params),
                "train_window": None if c.train_window is None else duration_label(c.train_window, "train_window"),
            }
            for c in contenders
        ],
        "baselines": {
            "random": "uniform scores (fixed seed)",
            "rule": rule_note
            or "flag a GPU with any hardware-class XID (memory, NVLink, bus, GSP) or any uncorrectable ECC error in the last 24 h",
            "heuristic": "sum of xid_count* and *ecc*increase* columns",
            "best_feature": "no numeric feature separates the validation slice's classes"
            if feature is None
            else f"the single feature with the best ROC-AUC on the validation slice: {feature['feature']} "
            f"({'higher' if feature['direction'] > 0 else 'lower'} is riskier; "
            f"{feature['validation_roc_auc']:.3f} there)",
            "oracle": "ranks by the label itself: the ceiling",
        },
        "retrain_times": [t.isoformat() for t in result.retrain_times],
        "fits": [f.as_dict() for f in result.fits],
        "scores": compared,
        "alarms": alarms,
        "alarm_headline_budget": headline,
        "calibration": calibration_figures(
            y,
            result.scores,
            result.calibrated,
            result.calibrated_by_method,
            gpus=pd.factorize(test["gpu_uuid"])[0],
        ),
        "drift": drift,
        "claims": {
            **claims(
                compared,
                contenders,
                specs[0],
                samples=bootstrap_samples,
                seed=plan.seed,
                own_volume=tuple(result.flags),
            ),
            "ensemble_at_equal_volume": verdicts,
            "ensemble_at_quota": quota_verdicts(alarms["quota"][f"{headline:g}"]["comparisons"]),
            "retraining_at_quota": quota_verdicts(alarms["quota"][f"{headline:g}"]["comparisons"], "retraining"),
            "ensemble_at_matched": quota_verdicts(alarms["matched"][f"{headline:g}"]["comparisons"]),
            "retraining_at_matched": quota_verdicts(alarms["matched"][f"{headline:g}"]["comparisons"], "retraining"),
            "versus_baselines": versus,
            "chosen_on_validation": chosen,
        },
    }


def chosen_on_validation(result: WalkForwardResult, contenders: Sequence[Contender]) -> dict[str, Any] | None:
    """The contender with the highest ROC-AUC on the validation slice before the test period
    (scored by each contender's first model, which never trained on it): "the best
    configuration" as it could have been picked without the test period, so that the claim
    that it beats the baselines is not a choice among contenders made on the test. None
    without a validation slice that has both classes."""
    if result.validation is None:
        return None
    y = labels(result.validation).to_numpy()
    known = ~np.isnan(y)
    if len(np.unique(y[known])) < 2:
        return None
    aucs = {
        c.name: float(roc_auc_score(y[known], np.asarray(result.validation_calibrated[c.name])[known]))
        for c in contenders
        if c.name in result.validation_calibrated
    }
    if not aucs:
        return None
    best = max(aucs, key=lambda name: aucs[name])
    return {"name": best, "validation_roc_auc": aucs}


def calibration_figures(
    y: np.ndarray,
    uncalibrated: dict[str, np.ndarray],
    calibrated: dict[str, np.ndarray],
    by_method: dict[str, dict[str, np.ndarray]] | None = None,
    gpus: np.ndarray | None = None,
) -> dict[str, Any]:
    """Per contender, the reliability figures (`models.calibration.reliability`) and the check
    of the rows at risk >= 0.5 (`high_risk_check`) of its calibrated risk on the test period,
    how many rows share its top risk (`top_risk_ties`), the same figures of its uncalibrated
    (odds-corrected) risk, and under "methods" those of the other calibration methods fitted on
    the same slices (`WalkForwardResult.calibrated_by_method`). `gpus`: each row's GPU as an
    integer code, so that the intervals count a GPU's correlated hours as what they are worth
    (`models.calibration.effective_rows`)."""
    out = {}
    for name, risk in calibrated.items():
        before = calibration_summary(y, uncalibrated[name])
        out[name] = {
            **reliability(y, risk, groups=gpus),
            "high_risk": high_risk_check(y, risk, groups=gpus),
            "top_ties": top_risk_ties(risk),
            "uncalibrated": {
                "ece": before["ece"],
                "brier": before["brier"],
                "mean_risk": before["mean_risk"],
                "high_risk": high_risk_check(y, uncalibrated[name], groups=gpus),
            },
            "methods": {
                method: _method_figures(y, other, risk, gpus)
                for method, other in sorted((by_method or {}).get(name, {}).items())
            },
        }
    return out


def _method_figures(y: np.ndarray, risk: np.ndarray, in_use: np.ndarray, gpus: np.ndarray | None) -> dict[str, Any]:
    """A method's figures on the rows the map in use scores; `n_missing` of them it could not
    (its fit failed on that retrain's slice, so its figures leave them out)."""
    scored = np.isfinite(in_use)
    keep = scored & np.isfinite(risk)
    kept_gpus = None if gpus is None else gpus[keep]
    figures = calibration_summary(y[keep], risk[keep])
    return {
        "ece": figures["ece"],
        "brier": figures["brier"],
        "high_risk": high_risk_check(y[keep], risk[keep], groups=kept_gpus),
        "top_ties": top_risk_ties(risk[keep]),
        "n_missing": int(scored.sum() - keep.sum()),
    }


def _flag_metrics(test: pd.DataFrame, flags: np.ndarray) -> dict[str, Any]:
    """The rule at its own operating point: every flagged GPU, however many."""
    y = labels(test).to_numpy()
    flagged = flags > 0
    known = ~np.isnan(y)
    n_flags = int((flagged & known).sum())
    per_time = pd.Series(flagged & known).groupby(test["ts"].to_numpy()).sum()
    recall = episode_recall(test.assign(_flag=flags), threshold=0.5, score="_flag")
    return {
        "flags_per_grid_time_mean": float(per_time.mean()),
        "precision": float((y[flagged & known] == 1).mean()) if n_flags else None,
        "recall": recall["recall"],
        "n_caught": recall["n_caught"],
        "lead_time_h_median": recall["lead_time_h_median"],
    }


def claims(
    scores: dict[str, Any],
    contenders: Sequence[Contender],
    k: str,
    *,
    samples: int = 1000,
    seed: int = 0,
    own_volume: Sequence[str] = (),
) -> dict[str, Any]:
    """The report's targets checked against the figures: the best contender against the best
    static single model (the paper's step), against the rule, and its day-to-day stability.
    Contenders in `own_volume` (a parallel intersection) pick fewer than K GPUs: they are not
    candidates for the best at K; the retrained-ensemble claim names their volume."""

    def daily(name: str) -> dict[str, Any]:
        return dict(scores[name]["by_k"][k])

    def mean(name: str) -> float:
        return daily(name)["precision_daily_mean"] or 0.0

    names = [c.name for c in contenders if c.name not in own_volume] or [c.name for c in contenders]
    best = max(names, key=mean)
    statics = [c.name for c in contenders if c.mode == "static" and c.kind in SINGLE_KINDS]
    out: dict[str, Any] = {"best": best, "best_precision": mean(best)}
    oracle = daily("oracle")["precision_daily_mean"]
    out["oracle_precision"] = oracle
    if statics:
        static = max(statics, key=mean)
        out["best_static_single"] = static
        out["best_static_precision"] = mean(static)
        out["gain"] = mean(best) - mean(static)
        out["gain_ratio"] = mean(best) / mean(static) if mean(static) > 0 else None
        out["paper_gain"] = PAPER_PRECISION[1] - PAPER_PRECISION[0]
        out["paper_gain_ratio"] = PAPER_PRECISION[1] / PAPER_PRECISION[0]
        # What the paper's relative step would give here, capped by the ceiling of this data.
        out["paper_step_target"] = min(mean(static) * out["paper_gain_ratio"], oracle or 1.0)
        out["meets_paper_step"] = mean(best) >= out["paper_step_target"]
        s_best, s_static = daily(best)["precision_daily_std"], daily(static)["precision_daily_std"]
        out["std_best"], out["std_static"] = s_best, s_static
        out["std_ratio"] = s_best / s_static if s_best is not None and s_static else None
        out["stability_target_met"] = out["std_ratio"] is not None and out["std_ratio"] <= 0.5
        out["gain_ci"] = _paired_ci(daily(best)["daily"], daily(static)["daily"], samples, seed)
    ensembles = [c.name for c in contenders if c.kind in ENSEMBLE_KINDS and c.mode != "static"]
    if statics and ensembles:
        out["sliding_ensemble"] = _ensemble_claim(daily, mean, max(ensembles, key=mean), out, samples, seed)
    if "rule" in scores:
        out["rule_precision"] = mean("rule")
        out["beats_rule"] = mean(best) > mean("rule")
        out["gain_over_rule_ci"] = _paired_ci(daily(best)["daily"], daily("rule")["daily"], samples, seed)
    return out


def _ensemble_claim(
    daily: Any, mean: Any, name: str, claims: dict[str, Any], samples: int, seed: int
) -> dict[str, Any]:
    """The paper's two claims for its own configuration: the best retrained ensemble (sliding
    or auto) against the best static single model, the step in daily precision@K and the
    ratio of the daily standard deviations, each with a paired bootstrap CI over days."""
    static = claims["best_static_single"]
    gain = mean(name) - mean(static)
    std, std_static = daily(name)["precision_daily_std"], daily(static)["precision_daily_std"]
    ratio = std / std_static if std is not None and std_static else None
    return {
        "name": name,
        "precision": mean(name),
        "picks_per_grid_time": daily(name).get("picks_mean"),
        # Drift, which retraining is there to follow: how close the static model stays to the
        # ceiling (the oracle) in the first and the second half of the test period.
        "static_of_oracle_halves": _halves_of_oracle(daily(static)["daily"], daily("oracle")["daily"]),
        "oracle_std": daily("oracle")["precision_daily_std"],
        "static_single": static,
        "static_precision": mean(static),
        "gain": gain,
        "gain_ci": _paired_ci(daily(name)["daily"], daily(static)["daily"], samples, seed),
        "meets_paper_step": mean(name) >= claims["paper_step_target"],
        "std": std,
        "std_static": std_static,
        "std_ratio": ratio,
        "std_ratio_ci": _std_ratio_ci(daily(name)["daily"], daily(static)["daily"], samples, seed),
        "stability_target_met": ratio is not None and ratio <= 0.5,
    }


def _halves_of_oracle(model: list[dict[str, Any]], oracle: list[dict[str, Any]]) -> list[float | None]:
    """Mean daily precision of `model` over the oracle's, in the first and the second half of
    the test days (None where the oracle has nothing)."""
    half = len(model) // 2
    out: list[float | None] = []
    for part in (slice(0, half), slice(half, None)):
        m = [d["precision"] for d in model[part] if d["precision"] is not None]
        o = [d["precision"] for d in oracle[part] if d["precision"] is not None]
        out.append(float(np.mean(m) / np.mean(o)) if m and o and np.mean(o) > 0 else None)
    return out


def _std_ratio_ci(a: list[dict[str, Any]], b: list[dict[str, Any]], samples: int, seed: int) -> list[float | None]:
    """Bootstrap CI over days of std(a) / std(b) of daily precision (the same days drawn)."""
    pairs = np.array(
        [
            (x["precision"], y["precision"])
            for x, y in zip(a, b, strict=True)
            if x["precision"] is not None and y["precision"] is not None
        ],
        dtype=np.float64,
    ).reshape(-1, 2)

    def ratio(days: np.ndarray) -> float:
        below = np.std(days[:, 1])
        return float(np.std(days[:, 0]) / below) if below > 0 else math.nan

    if len(pairs) < 2:
        return [None, None]
    return list(bootstrap_ci(pairs, ratio, samples=samples, seed=seed))


def _paired_ci(a: list[dict[str, Any]], b: list[dict[str, Any]], samples: int, seed: int) -> list[float | None]:
    """Bootstrap CI over days of the mean daily precision difference a - b (same days drawn)."""
    diff = np.array(
        [
            (x["precision"] - y["precision"])
            for x, y in zip(a, b, strict=True)
            if x["precision"] is not None and y["precision"] is not None
        ]
    )
    if len(diff) < 2:
        return [None, None]
    return list(bootstrap_ci(diff, np.mean, samples=samples, seed=seed))


SEED_FIGURES = (
    "roc_auc",
    "pr_auc",
    "precision_daily_mean",
    "alarm_precision",
    "alarm_precision_long",
    "alarm_recall",
    "alarm_recall_long",
    "alarms_per_1000_gpu_days",
    "alarm_lead_time_h_median",
    "ece",
)
"""The headline figures `evaluate_seeds` averages, per contender."""


def headline_figures(metrics: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per contender and `SEED_BASELINES` baseline, the `SEED_FIGURES` of one comparison
    (None where a scorer has none): ROC-AUC and PR-AUC, daily
    precision@K at the headline K, the alarms at the headline budget's daily quota (every
    scorer at the same volume), the calibrated ECE."""
    k, budget = metrics["top_k"], f"{metrics['alarm_headline_budget']:g}"
    at_budget = metrics["alarms"]["quota"][budget]["points"]
    names = [c["name"] for c in metrics["contenders"]] + [b for b in SEED_BASELINES if b in metrics["scores"]]
    out = {}
    for name in names:
        score, alarm = metrics["scores"][name], at_budget.get(name, {})
        out[name] = {
            "roc_auc": score["roc_auc"],
            "pr_auc": score["pr_auc"],
            "precision_daily_mean": score["by_k"][k]["precision_daily_mean"],
            "alarm_precision": alarm.get("precision"),
            "alarm_precision_long": alarm.get("precision_long"),
            "alarm_recall": alarm.get("recall"),
            "alarm_recall_long": alarm.get("recall_long"),
            "alarms_per_1000_gpu_days": alarm.get("alarms_per_1000_gpu_days"),
            "alarm_lead_time_h_median": alarm.get("lead_time_h_median"),
            "ece": metrics["calibration"][name]["ece"] if name in metrics["calibration"] else None,
        }
    return out


SEED_BASELINES = ("rule", "heuristic", "best_feature")
"""The baselines whose headline figures `evaluate_seeds` keeps beside the contenders'."""

PAIRED_FIGURES = ("roc_auc", "alarm_precision", "precision_daily_mean")
"""The figures whose per-seed differences `paired_over_seeds` gives an interval."""


def _t_interval(diffs: np.ndarray) -> list[float | None]:
    """95% Student-t interval of the mean of `diffs` (one per seed)."""
    if len(diffs) < 2:
        return [None, None]
    from scipy.stats import t

    half = float(t.ppf(0.975, len(diffs) - 1) * diffs.std(ddof=1) / math.sqrt(len(diffs)))
    mean = float(diffs.mean())
    return [mean - half, mean + half]


def paired_over_seeds(per_seed: dict[str, dict[str, dict[str, float | None]]]) -> dict[str, Any]:
    """Per contender and baseline it is measured against (`SEED_BASELINES`), per figure of
    `PAIRED_FIGURES`: the difference contender - baseline within each seed (both scored on the
    same fits' test rows), its mean, min and max over the seeds, and a 95% t interval of the
    mean (seeds where either figure is missing are left out)."""
    seeds = list(per_seed.values())
    contenders = [n for n in seeds[0] if n not in SEED_BASELINES]
    out: dict[str, Any] = {}
    for name in contenders:
        out[name] = {}
        for base in (b for b in SEED_BASELINES if b in seeds[0]):
            out[name][base] = {}
            for figure in PAIRED_FIGURES:
                diffs = np.asarray(
                    [
                        float(a) - float(b)
                        for s in seeds
                        if (a := s[name][figure]) is not None and (b := s[base][figure]) is not None
                    ],
                    dtype=np.float64,
                )
                out[name][base][figure] = {
                    "mean": float(diffs.mean()) if len(diffs) else None,
                    "min": float(diffs.min()) if len(diffs) else None,
                    "max": float(diffs.max()) if len(diffs) else None,
                    "ci": _t_interval(diffs),
                    "n_seeds": len(diffs),
                }
    return out


def evaluate_seeds(
    source: Any, contenders: Sequence[Contender], plan: WalkForwardPlan, seeds: Sequence[int], **options: Any
) -> dict[str, Any]:
    """`evaluate_walk_forward` under each of `seeds` (the plan's seed: every fit's negative
    draw, the random baseline, the bootstrap): the first seed's metrics in full, with `seeds`
    holding each seed's headline figures (`headline_figures`) and, per contender and figure,
    the mean, min and max over the seeds (figures a seed lacks are left out of its mean), and
    each seed's configuration chosen on validation with its verdicts against the baselines."""
    if not seeds:
        raise InputError("seeds: expected at least one seed, got none")
    if len(set(seeds)) != len(seeds):
        raise InputError(f"seeds: expected distinct seeds, got {list(seeds)}")
    source = source if isinstance(source, Store) else to_pandas(source)
    first: dict[str, Any] | None = None
    per_seed, chosen = {}, {}
    for seed in seeds:
        metrics = evaluate_walk_forward(
            source, contenders, WalkForwardPlan(**{**plan.__dict__, "seed": seed}), **options
        )
        first = first or metrics
        per_seed[str(seed)] = headline_figures(metrics)
        chosen[str(seed)] = metrics["claims"]["chosen_on_validation"]
    assert first is not None
    summary: dict[str, dict[str, dict[str, float | None]]] = {}
    for name in next(iter(per_seed.values())):
        summary[name] = {}
        for figure in SEED_FIGURES:
            values = [v for s in per_seed.values() if (v := s[name][figure]) is not None]
            summary[name][figure] = {
                "mean": float(np.mean(values)) if values else None,
                "min": float(np.min(values)) if values else None,
                "max": float(np.max(values)) if values else None,
                "n_seeds": len(values),
            }
    return {
        **first,
        "seeds": {
            "seeds": list(seeds),
            "per_seed": per_seed,
            "summary": summary,
            "paired": paired_over_seeds(per_seed),
            "chosen_on_validation": chosen,
        },
    }
