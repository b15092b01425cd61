"""The decision sections of the walk-forward report (`models.report`): alarms at the operating
points, the paper's ensemble at equal alarm volume, lead time per failure mode, calibration on
the test period, the seeds; and their plots (reliability diagram, precision against volume).
Pure functions of `metrics.json`'s figures (`models.comparison.evaluate_walk_forward`)."""

from __future__ import annotations

from typing import Any

from models.alarms import LEAD_TIMES_H
from models.report_format import pct


def _num(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ci(pair: Any, scale: float = 100.0, digits: int = 1) -> str:
    if not pair or pair[0] is None:
        return "-"
    return f"[{scale * pair[0]:.{digits}f}, {scale * pair[1]:.{digits}f}]"


def _risk(value: Any) -> str:
    if value is None:
        return "none fits"
    return f"{value:.3g}"


def budget_key(budget: float) -> str:
    return f"{budget:g}"


def _thresholded(metrics: dict[str, Any]) -> list[str]:
    """The rows of an alarm table: the contenders, then the thresholded baselines."""
    names = [c["name"] for c in metrics["contenders"]]
    return names + [
        b
        for b in ("heuristic", "best_feature", "random")
        if b in metrics["alarms"]["by_budget"][budget_key(metrics["alarms"]["budgets"][0])]
    ]


def _window_cells(point: dict[str, Any]) -> str:
    """precision and recall within the horizon, then within the long window, each with its
    counts and interval."""
    cells = []
    for suffix in ("", "_long"):
        cells.append(
            f"{pct(point[f'precision{suffix}'])} ({point[f'n_hits{suffix}']}/{point[f'n_alarms_known{suffix}']}) "
            f"{_ci(point[f'precision{suffix}_ci'])}"
        )
    for suffix in ("", "_long"):
        cells.append(
            f"{pct(point[f'recall{suffix}'])} ({point[f'n_caught{suffix}']}/{point['n_failures']}) "
            f"{_ci(point[f'recall{suffix}_ci'])}"
        )
    return " | ".join(cells)


def _alarm_row(name: str, point: dict[str, Any]) -> str:
    threshold = "own flags" if point["budget"] is None else _risk(point["threshold"])
    return (
        f"| {name} | {threshold} | {_num(point['validation_rate'], 2)} | "
        f"{_num(point['alarms_per_1000_gpu_days'], 2)} | {point['n_alarms']} | {_window_cells(point)} | "
        f"{_num(point['lead_time_h_median'])} |"
    )


def _quota_row(name: str, point: dict[str, Any]) -> str:
    return (
        f"| {name} | {point['n_alarms']} | {_num(point['alarms_per_1000_gpu_days'], 2)} | {_window_cells(point)} | "
        f"{_num(point['lead_time_h_median'])} |"
    )


def _windows_header(rules: dict[str, Any]) -> str:
    h, long = f"{rules['horizon_h']:g} h", f"{rules['long_horizon_h']:g} h"
    return (
        f"precision within {h} (right/judged) [CI] | precision within {long} [CI] | "
        f"recall within {h} (caught/failures) [CI] | recall within {long} [CI] | median lead h"
    )


def alarm_header(rules: dict[str, Any]) -> list[str]:
    return [
        "| configuration | threshold | alarms /1k GPU-days, validation | test | alarms | "
        + _windows_header(rules)
        + " |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]


def quota_header(rules: dict[str, Any]) -> list[str]:
    return [
        "| configuration | alarms | alarms /1k GPU-days, test | " + _windows_header(rules) + " |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]


def definition_text(rules: dict[str, Any]) -> str:
    h, long = f"{rules['horizon_h']:g} h", f"{rules['long_horizon_h']:g} h"
    return (
        "One alarm per GPU episode (a GPU's service between failures; a gap in its rows also ends one): a GPU "
        f"that stays risky is not a new alarm. An alarm is right within W when its GPU fails within W after it; a "
        f"failure is caught within W when its GPU alarmed within W before it; W = {h} (the label horizon) and "
        f"W = {long}. An alarm whose W reaches past the data is judged only when it was right (right/judged). "
        "Lead time: from the alarm to the failure, within the longer W. Intervals: percentile bootstrap over the "
        "test days (alarms by the day they are raised, failures by the day they happen)."
    )


def alarm_sections(metrics: dict[str, Any]) -> list[str]:
    """Markdown: the alarms at equal volume (the daily quota) first, then at the thresholds chosen
    on validation, the ensemble at equal volume, the baselines, the false alarms, lead time per mode."""
    alarms = metrics["alarms"]
    rules, validation = alarms["rules"], alarms["validation"]
    lines = [*quota_sections(metrics)] if "quota" in alarms else []
    lines += [
        "## Alarms at thresholds chosen before the test period",
        "",
        definition_text(rules)
        + " Each threshold (calibrated risk for the contenders) is the lowest whose alarm volume on the "
        f"validation slice {validation['start']} .. {validation['end']} ({_num(validation['gpu_days'], 0)} GPU-days, "
        "before the test period, scored by each contender's first model) stays within the budget (found exactly "
        "from the sorted episode maxima); the test period only judges it. The volumes the thresholds realise on "
        "the test differ from scorer to scorer, so the precisions below are **not comparable across rows**: the "
        "daily quota above is the comparison at equal volume.",
        "",
    ]
    ratios = alarms.get("threshold_volume_ratio", {})
    for budget in alarms["budgets"]:
        key = budget_key(budget)
        row = alarms["by_budget"][key]
        ratio = ratios.get(key)
        spread = (
            f"realised test volumes differ by a factor of {ratio:.2f}"
            if ratio is not None
            else "some scorer raised no alarm on the test"
        )
        lines += [f"### Budget {budget:g} alarms per 1,000 GPUs per day ({spread})", "", *alarm_header(rules)]
        lines += [_alarm_row(name, row[name]) for name in _thresholded(metrics) if name in row]
        lines.append("")
    if alarms["natural"]:
        lines += [
            "### At their own volume",
            "",
            "Scorers that flag rather than score, at the volume their flags give (no threshold): the rule baseline "
            "and the paper's parallel intersection (a GPU in every member's top K, never topped up to K).",
            "",
            *alarm_header(rules),
            *[_alarm_row(name, point) for name, point in alarms["natural"].items()],
            "",
        ]
    lines += equal_volume_section(metrics)
    lines += versus_baselines_section(metrics)
    lines += false_alarms_section(metrics)
    lines += mode_lead_section(metrics)
    return lines


QUESTION_WORDS = {
    "baseline": "against the baselines",
    "ensemble": "the paper's ensembles against the single models",
    "retraining": "retraining against the static model of the same kind",
}
VERDICT_WORDS = {
    "higher": "higher",
    "lower": "lower",
    "no difference": "no difference (interval within +-10 pts)",
    "not shown": "not shown: underpowered",
}


def quota_sections(metrics: dict[str, Any]) -> list[str]:
    """The alarms at a daily quota, then at thresholds matched on the test scores: every scorer
    at the same volume, its figures within both windows, and the paired differences with the
    smallest difference each could detect."""
    alarms = metrics["alarms"]
    rules = alarms["rules"]
    lines = _equal_volume_lines(
        metrics,
        "quota",
        "## Alarms at equal volume: a daily quota",
        "Operated as on a fleet: at the end of each test day the GPUs in service and not already alarmed in their "
        "episode are ranked by their highest risk that day, and the riskiest are alarmed, as many as bring the "
        "alarms so far to the budget times the GPU-days so far (0.5 per 1,000 GPUs per day on a few hundred GPUs "
        "is one alarm every few days). Every scorer raises the same number of alarms, so these precisions "
        "compare; the rule and the parallel intersection rank their flagged GPUs first. A GPU that fails within "
        "hours of its risk rising is often out of service by the day's review. " + definition_text(rules),
        "Quota",
    )
    if "matched" in alarms:
        lines += _equal_volume_lines(
            metrics,
            "matched",
            "## Alarms at equal volume: thresholds matched on the test scores",
            "Each scorer's threshold is set on the test period's scores (never its labels), exactly, for the "
            "budget's number of alarms: every scorer raises the same number, each the hour its risk crosses the "
            "threshold. A comparison device (no operator knows this threshold in advance), the fair one where "
            "failures follow their precursor within hours, faster than a daily review.",
            "Matched",
        )
    return lines


def _equal_volume_lines(metrics: dict[str, Any], key: str, title: str, text: str, label: str) -> list[str]:
    alarms = metrics["alarms"]
    rules = alarms["rules"]
    lines = [title, "", text, ""]
    for budget in alarms["budgets"]:
        entry = alarms[key][budget_key(budget)]
        ratio = entry["volume_ratio"]
        lines += [
            f"### {label} {budget:g} alarms per 1,000 GPUs per day"
            + ("" if ratio is None else f" (realised volumes within a factor {ratio:.2f})"),
            "",
            *quota_header(rules),
            *[_quota_row(name, point) for name, point in entry["points"].items()],
            "",
        ]
    headline = budget_key(metrics.get("alarm_headline_budget", alarms["budgets"][0]))
    comparisons = alarms[key][headline]["comparisons"]
    if comparisons:
        lines += [
            f"### Differences at the {headline} {label.lower()}, paired over the test days",
            "",
            "First minus second, in points, with the paired bootstrap 95% interval and the smallest difference the "
            "comparison could detect (80% power, 5% level: 2.8 x the bootstrap standard error). Higher or lower: the "
            "interval excludes zero; no difference: it includes zero and lies within +-10 points; not shown: it "
            "includes zero and is wider, too few alarms to tell.",
            "",
            f"| question | first - second | precision within {rules['horizon_h']:g} h [95% CI] | detectable | verdict | "
            f"within {rules['long_horizon_h']:g} h [95% CI] | verdict | recall within {rules['horizon_h']:g} h [95% CI] |",
            "| --- | --- | ---: | ---: | --- | ---: | --- | ---: |",
        ]
        for pair, c in comparisons.items():
            p, long, r = c["precision"], c["precision_long"], c["recall"]
            lines.append(
                f"| {QUESTION_WORDS[c['question']]} | {pair} | {_points(p['difference'])} {_ci(p['ci'])} | "
                f"{_pts(p['detectable'])} | {VERDICT_WORDS[p['verdict']]} | {_points(long['difference'])} "
                f"{_ci(long['ci'])} | {VERDICT_WORDS[long['verdict']]} | {_points(r['difference'])} {_ci(r['ci'])} |"
            )
        lines.append("")
    claims = metrics.get("claims", {})
    verdicts = [(f"ensemble_at_{key}", "the paper's ensemble gain"), (f"retraining_at_{key}", "retraining")]
    for claim, words in verdicts:
        for name, v in claims.get(claim, {}).items():
            lines.append(
                f"- At the {headline} {label.lower()}, {words} ({name}): **{v}**"
                + (" (too few alarms to tell: see the detectable differences)" if v == "not shown" else "")
            )
    if any(claims.get(claim) for claim, _ in verdicts):
        lines.append("")
    return lines


def _pts(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f} pts"


def false_alarms_section(metrics: dict[str, Any]) -> list[str]:
    """The top false alarms of the configuration chosen on validation, at the headline quota."""
    found = metrics["alarms"].get("false_alarms")
    if not found:
        return []
    long = metrics["alarms"]["rules"]["long_horizon_h"]
    lines = [
        f"## Top false alarms of {found['name']} (quota {found['budget']:g} per 1,000 GPUs per day)",
        "",
        f"Its riskiest alarms whose GPU did not fail within {long:g} h, with the failure nearest in time on the "
        "same node (a neighbour's failure or the GPU's own, later; its mode and the hours from the alarm) and the "
        "three features that stood out most in the alarm's row (value, and how many standard deviations from the "
        "test period's mean).",
        "",
        "| alarm | GPU | node | risk | nearest failure on the node | leading features |",
        "| --- | --- | --- | ---: | --- | --- |",
    ]
    if not found["alarms"]:
        lines += ["| none | | | | | |"]
    for a in found["alarms"]:
        near = a["nearest_failure"]
        nearest = "none" if near is None else f"{near['mode']} ({near['gpu_uuid']}, {near['hours_after_alarm']:+.0f} h)"
        features = "; ".join(f"{f['feature']} = {f['value']:.4g} ({f['z']:+.1f} sd)" for f in a["leading_features"])
        lines.append(
            f"| {a['ts']} | {a['gpu_uuid']} | {a['node'] or '-'} | {_risk(a['score'])} | {nearest} | {features or '-'} |"
        )
    return [*lines, ""]


BASELINE_WORDS = {"heuristic": "the heuristic", "best_feature": "the best single feature", "rule": "the rule"}


def versus_baselines_section(metrics: dict[str, Any]) -> list[str]:
    """Each contender's alarm precision minus each baseline's, at every budget (the rule at its
    own volume), with paired intervals, and which contenders beat every baseline everywhere."""
    versus = metrics["alarms"].get("versus_baselines")
    if not versus:
        return []
    names = [c["name"] for c in metrics["contenders"]]
    lines = [
        "## Against the baselines, alarm by alarm",
        "",
        "Alarm precision of each contender minus that of a baseline on the same test days, in points, with the "
        "paired bootstrap 95% interval over days. The heuristic and the best single feature are thresholded on "
        "the validation slice like the contenders (ties between equal counts broken by a hash of the GPU and "
        "time, so that a count-valued score can meet any budget); the rule flags, so each contender is cut to "
        "the rule's own validation volume instead.",
        "",
    ]
    budgets = list(versus["by_budget"])
    for baseline in ("heuristic", "best_feature"):
        if not any(baseline in versus["by_budget"][b] for b in budgets):
            continue
        lines += [
            f"### Minus {BASELINE_WORDS[baseline]}",
            "",
            "| configuration | " + " | ".join(f"budget {b}" for b in budgets) + " |",
            "| --- |" + " ---: |" * len(budgets),
        ]
        for name in names:
            cells = [
                _diff(versus["by_budget"][b][baseline][name]) if baseline in versus["by_budget"][b] else "-"
                for b in budgets
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    if "rule" in versus:
        rule = versus["rule"]
        lines += [
            f"### Minus the rule, at its volume ({_num(rule['volume'], 2)} alarms per 1,000 GPU-days on validation)",
            "",
            "| configuration | alarms | precision [CI] | failure recall | precision difference [95% CI] | "
            "recall difference [95% CI] |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, s in rule["contenders"].items():
            lines.append(
                f"| {name} | {s['n_alarms']} | {pct(s['precision'])} {_ci(s['precision_ci'])} | "
                f"{pct(s['recall'])} ({s['n_caught']}/{s['n_failures']}) | {_diff(s)} | "
                f"{_points(s['recall_difference'])} {_ci(s['recall_difference_ci'])} |"
            )
        lines.append("")
    verdicts = metrics["claims"].get("versus_baselines", {})
    winners = [name for name in names if verdicts.get(name, {}).get("beats_all")]
    lines += [
        "Verdict: "
        + (
            f"{', '.join(winners)} beat{'s' if len(winners) == 1 else ''} every baseline at every operating point, "
            "each interval above zero."
            if winners
            else "no contender beats every baseline at every operating point with the interval above zero "
            "(see the cells whose interval includes zero)."
        )
        + (
            " With several contenders, one of them clearing every interval can be luck; the configuration chosen "
            "before the test period is the claim that counts:"
            if winners and len(names) > 1
            else ""
        ),
        "",
        *_chosen_lines(metrics["claims"].get("chosen_on_validation"), metrics.get("seeds")),
    ]
    return lines


def _chosen_lines(chosen: dict[str, Any] | None, seeds: dict[str, Any] | None) -> list[str]:
    """The configuration chosen on the validation slice and whether it beats every baseline;
    over seeds, each seed's choice."""
    if chosen is None:
        return []
    name, versus = chosen["name"], chosen.get("versus_baselines") or {}
    auc = chosen["validation_roc_auc"][name]
    lines = [
        f"Chosen before the test period (the highest ROC-AUC on the validation slice, {auc:.3f}): **{name}**, which "
        + (
            "beats every baseline at every operating point."
            if versus.get("beats_all")
            else "does not beat every baseline at every operating point (the tables above say where not)."
        ),
        "",
    ]
    if seeds and seeds.get("chosen_on_validation"):
        per = seeds["chosen_on_validation"]
        cells = [
            f"seed {seed}: {c['name']} ({'beats all' if (c.get('versus_baselines') or {}).get('beats_all') else 'not all'})"
            for seed, c in per.items()
            if c is not None
        ]
        lines += ["Over the seeds: " + "; ".join(cells) + ".", ""]
    return lines


def _diff(entry: dict[str, Any]) -> str:
    detectable = entry.get("precision_detectable")
    return f"{_points(entry['precision_difference'])} {_ci(entry['precision_difference_ci'])}" + (
        "" if detectable is None else f" (detectable {_pts(detectable)})"
    )


def equal_volume_section(metrics: dict[str, Any]) -> list[str]:
    """The paper's ensemble at its own volume against each single model cut to that volume."""
    equal = metrics["alarms"]["equal_volume"]
    if not equal:
        return []
    lines = [
        "## The paper's parallel ensemble at equal alarm volume",
        "",
        "The intersection raises fewer alarms than K per grid time, so its precision rises as its recall falls; "
        "any single model cut to the same volume moves the same way. Each single model's threshold is chosen on "
        "the validation slice for the ensemble's validation volume; differences are ensemble minus single, with "
        "paired bootstrap intervals over the test days.",
        "",
    ]
    verdicts = metrics["claims"].get("ensemble_at_equal_volume", {})
    for name, entry in equal.items():
        e = entry["ensemble"]
        lines += [
            f"### {name}: {_num(entry['volume'], 2)} alarms per 1,000 GPU-days on validation",
            "",
            "| configuration | alarms /1k GPU-days, test | alarms | precision [CI] | failure recall [CI] | "
            "precision difference [95% CI] | recall difference [95% CI] |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| {name} (intersection) | {_num(e['alarms_per_1000_gpu_days'], 2)} | {e['n_alarms']} | "
            f"{pct(e['precision'])} {_ci(e['precision_ci'])} | {pct(e['recall'])} ({e['n_caught']}/{e['n_failures']}) | "
            "| |",
        ]
        for single, s in entry["singles"].items():
            lines.append(
                f"| {single} at the same volume | {_num(s['alarms_per_1000_gpu_days'], 2)} | {s['n_alarms']} | "
                f"{pct(s['precision'])} {_ci(s['precision_ci'])} | {pct(s['recall'])} ({s['n_caught']}/{s['n_failures']}) | "
                f"{_points(s['precision_difference'])} {_ci(s['precision_difference_ci'])} | "
                f"{_points(s['recall_difference'])} {_ci(s['recall_difference_ci'])} |"
            )
        verdict = verdicts.get(name, "not shown")
        lines += ["", f"Verdict: {_verdict_text(name, verdict)}", ""]
    return lines


def _points(value: Any) -> str:
    return "-" if value is None else f"{100 * value:+.1f} pts"


def _verdict_text(name: str, verdict: str) -> str:
    if verdict == "holds":
        return (
            f"the paper's ensemble gain **holds** at equal alarm volume: {name}'s alarm precision beats every "
            "single model cut to its volume, each 95% interval of the difference above zero."
        )
    if verdict == "reversed":
        return (
            f"the paper's ensemble gain **does not hold**: at {name}'s volume at least one single model is more "
            "precise, with the 95% interval of the difference below zero."
        )
    return (
        f"the paper's ensemble gain is **not shown** at equal alarm volume: the 95% intervals of the differences "
        f"between {name} and the single models include zero (too few alarms here to tell them apart)."
    )


def mode_lead_section(metrics: dict[str, Any]) -> list[str]:
    """Per failure mode, the primary contender's share of failures alarmed at least 1/6/24/72 h
    before, at the largest budget (the most alarms: the one where a mode has a chance)."""
    budget = budget_key(max(metrics["alarms"]["budgets"]))
    primary = metrics["primary"]
    point = metrics["alarms"]["quota"][budget]["points"][primary]
    heads = " | ".join(f"alarmed >= {h} h ahead" for h in LEAD_TIMES_H)
    lines = [
        f"## Lead time per failure mode ({primary}, daily quota of {budget} alarms per 1,000 GPUs per day)",
        "",
        "Share of the failures with an alarm at least that long before (within the longer window), among the "
        "failures at least that long after the start of the test period (only those could have had one).",
        "",
        f"| failure mode | failures | caught | median lead h | {heads} |",
        "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in LEAD_TIMES_H) + " |",
    ]
    for mode, m in {**point["by_mode"], "all": {**point, "n_failures": point["n_failures"]}}.items():
        shares = " | ".join(
            f"{pct(m['alarmed_before_h'][str(h)]['share'])} of {m['alarmed_before_h'][str(h)]['n_failures']}"
            for h in LEAD_TIMES_H
        )
        lines.append(f"| {mode} | {m['n_failures']} | {m['n_caught']} | {_num(m['lead_time_h_median'])} | {shares} |")
    return [*lines, ""]


def calibration_section(metrics: dict[str, Any]) -> list[str]:
    """Calibration on the test period, per contender, with the primary's reliability table."""
    plan = metrics["plan"]
    figures = metrics["calibration"]
    lines = [
        "## Calibration on the test period",
        "",
        f"Every model is calibrated ({plan.get('calibration', '-')}) on the {plan.get('calibration_window', '-')} of "
        "settled labels before its retraining time, as scored by a fit made as of the slice's start (rows it never "
        "saw); the model itself is trained up to the newest settled label and carries that map. The odds factor of "
        "class weighting and negative subsampling is divided out first. ECE: expected calibration error over ten equal-width bins of risk (with a rare event "
        "most rows fall in the first bin, so it is small even for a poor score: the table below shows the tails). "
        "High risk: rows with calibrated risk >= 0.5, their mean risk and observed failure rate within the "
        "horizon (95% Wilson interval over the rows' effective number: the hours of one GPU fail or survive "
        "together, so they count as fewer independent rows; the GPUs they come from in brackets); the verdict says "
        "whether they agree within 0.1, or that there are too few rows to tell. Rows at top risk: how many test rows share the contender's highest calibrated risk "
        "(more than a few: its output saturates, and the tie-break picks among them).",
        "",
        "| configuration | ECE, uncalibrated -> calibrated | Brier | mean risk / observed rate | rows >= 0.5 (GPUs) | "
        "mean risk there | observed [95% CI] | verdict | rows at top risk |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for name, f in figures.items():
        h = f["high_risk"]
        ties = f.get("top_ties") or {}
        lines.append(
            f"| {name} | {_num(f['uncalibrated']['ece'], 4)} -> {_num(f['ece'], 4)} | {_num(f['brier'], 5)} | "
            f"{_num(f['mean_risk'], 4)} / {_num(f['observed_rate'], 4)} | {_high_rows(h)} | {_num(h['mean_risk'], 3)} | "
            f"{_num(h['observed_rate'], 3)} {_ci(h['observed_ci'], 1.0, 3)} | {h['verdict']} | "
            f"{ties.get('n_rows', '-')} |"
        )
    lines += _methods_table(plan.get("calibration", "-"), figures)
    primary = metrics["primary"]
    lines += [
        "",
        f"Reliability of {primary} (`reliability.png`):",
        "",
        "| calibrated risk | rows | failures | mean risk | observed rate [95% CI] |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for b in figures[primary]["bins"]:
        if b["n_rows"]:
            lines.append(
                f"| {b['low']:g} - {b['high']:g} | {b['n_rows']:,} | {b['n_positives']} | {b['mean_risk']:.4f} | "
                f"{b['observed_rate']:.4f} {_ci(b['observed_ci'], 1.0, 4)} |"
            )
    return [*lines, ""]


def _high_rows(high_risk: dict[str, Any]) -> str:
    """The rows at high risk, and the GPUs they come from where the check counted them."""
    groups = high_risk.get("n_groups")
    return f"{high_risk['n_rows']:,}" if groups is None else f"{high_risk['n_rows']:,} ({groups:,})"


def _methods_table(in_use: str, figures: dict[str, Any]) -> list[str]:
    """Every calibration method on the same out-of-time scores: each retrain's map of each
    method fitted on the same slice, applied to the same test rows."""
    if not any(f.get("methods") for f in figures.values()):
        return []
    lines = [
        "",
        f"The calibration methods compared (`[model] calibration`, in use: {in_use}): each retrain's slice fitted "
        "with every method, each map applied to the rows that retrain's model scores.",
        "",
        "| configuration | method | ECE | Brier | rows >= 0.5 (GPUs) | mean risk there | observed [95% CI] | verdict | "
        "rows at top risk |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for name, f in figures.items():
        for method, m in [(in_use, f), *f.get("methods", {}).items()]:
            h, ties = m["high_risk"], m.get("top_ties") or {}
            missing = f" ({m['n_missing']:,} rows unscored)" if m.get("n_missing") else ""
            lines.append(
                f"| {name} | {method}{missing} | {_num(m['ece'], 4)} | {_num(m['brier'], 5)} | {_high_rows(h)} | "
                f"{_num(h['mean_risk'], 3)} | {_num(h['observed_rate'], 3)} {_ci(h['observed_ci'], 1.0, 3)} | "
                f"{h['verdict']} | {ties.get('n_rows', '-')} |"
            )
    return lines


def seeds_section(metrics: dict[str, Any]) -> list[str]:
    """Mean and range over seeds of the headline figures, when the comparison ran several."""
    seeds = metrics.get("seeds")
    if not seeds:
        return []
    budget = budget_key(metrics["alarm_headline_budget"])
    lines = [
        f"## Over seeds {', '.join(str(s) for s in seeds['seeds'])}",
        "",
        f"Mean [min, max] over the seeds (each seed draws every fit's negatives anew, on the same fleet: model "
        f"seeds, not fleet seeds); alarms at the daily quota of {budget} per 1,000 GPUs per day. The tables above "
        "are the first seed's.",
        "",
        "| configuration | ROC-AUC | alarm precision | within 72 h | failure recall | within 72 h | ECE |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def cell(entry: dict[str, Any], pct: bool) -> str:
        if entry["mean"] is None:
            return "-"
        scale, digits = (100.0, 1) if pct else (1.0, 3)
        suffix = "%" if pct else ""
        return (
            f"{scale * entry['mean']:.{digits}f}{suffix} "
            f"[{scale * entry['min']:.{digits}f}, {scale * entry['max']:.{digits}f}]"
        )

    for name, s in seeds["summary"].items():
        lines.append(
            f"| {name} | {cell(s['roc_auc'], False)} | {cell(s['alarm_precision'], True)} | "
            f"{cell(s['alarm_precision_long'], True)} | {cell(s['alarm_recall'], True)} | "
            f"{cell(s['alarm_recall_long'], True)} | {cell(s['ece'], False)} |"
        )
    return [*lines, "", *_paired_lines(seeds.get("paired") or {}, budget)]


def _diff_cell(entry: dict[str, Any], scale: float, digits: int) -> str:
    if entry["mean"] is None:
        return "-"
    low, high = entry["ci"]
    interval = "" if low is None else f" [{scale * low:+.{digits}f}, {scale * high:+.{digits}f}]"
    verdict = "" if low is None else (" above 0" if low > 0 else " below 0" if high < 0 else "")
    return f"{scale * entry['mean']:+.{digits}f}{interval}{verdict}"


def _paired_lines(paired: dict[str, Any], budget: str) -> list[str]:
    """Each contender minus each baseline, paired by seed: mean and 95% t interval over seeds."""
    if not paired:
        return []
    lines = [
        "Paired by seed (the contender's figure minus the baseline's under the same seed): mean difference "
        "and 95% t interval over the seeds. ROC-AUC in points of AUC, alarm precision at "
        f"the daily quota of {budget} per 1,000 GPUs per day and daily precision@K in percentage points.",
        "",
        "| configuration | against | ROC-AUC | alarm precision | precision@K |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, bases in paired.items():
        for base, figures in bases.items():
            lines.append(
                f"| {name} | {base} | {_diff_cell(figures['roc_auc'], 1.0, 3)} | "
                f"{_diff_cell(figures['alarm_precision'], 100.0, 1)} | "
                f"{_diff_cell(figures['precision_daily_mean'], 100.0, 1)} |"
            )
    return [*lines, ""]


# -- plots -----------------------------------------------------------------------------------------


def plot_reliability(metrics: dict[str, Any], ax: Any) -> None:
    """Observed failure rate against mean risk per bin, log scales, for the primary contender."""
    primary = metrics["primary"]
    bins = [b for b in metrics["calibration"][primary]["bins"] if b["n_rows"] and b["mean_risk"]]
    floor = 1e-5
    x = [max(b["mean_risk"], floor) for b in bins]
    y = [max(b["observed_rate"], floor) for b in bins]
    low = [max(yv - max(b["observed_ci"][0], floor), 0.0) for yv, b in zip(y, bins, strict=True)]
    high = [max(max(b["observed_ci"][1], floor) - yv, 0.0) for yv, b in zip(y, bins, strict=True)]
    ax.errorbar(x, y, yerr=[low, high], fmt="o", label=f"{primary}, calibrated")
    ax.plot([floor, 1.0], [floor, 1.0], color="grey", linestyle="--", label="perfect calibration")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("mean calibrated risk in the bin")
    ax.set_ylabel("observed failure rate (95% Wilson interval)")
    ax.legend(fontsize=7)


def plot_alarm_precision(metrics: dict[str, Any], ax: Any) -> None:
    """Alarm precision against test alarm volume, one line per scorer over the budgets."""
    alarms = metrics["alarms"]
    for name in _thresholded(metrics):
        points = [alarms["by_budget"][budget_key(b)].get(name) for b in alarms["budgets"]]
        points = [p for p in points if p is not None and p["precision"] is not None]
        ax.plot(
            [p["alarms_per_1000_gpu_days"] for p in points], [p["precision"] for p in points], marker="o", label=name
        )
    for name, p in alarms["natural"].items():
        if p["precision"] is not None:
            ax.scatter(
                [p["alarms_per_1000_gpu_days"]], [p["precision"]], marker="*", s=120, label=f"{name} (own volume)"
            )
    ax.set_xlabel("alarms per 1,000 GPUs per day (test)")
    ax.set_ylabel("alarm precision")
    ax.legend(fontsize=6, ncol=2)
