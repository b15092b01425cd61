"""The comparison pooled over several simulated fleets (fleet seeds, not model seeds): each
fleet's `metrics.json` (`gpufail evaluate`) holds, per daily quota and scorer, its alarm counts per
test day; pooled, the figures are the fleets' summed counts, and every pair of the fleets'
comparisons gets a paired interval with days drawn within each fleet (`models.power`).

`python -m benchmarks --fleets 1,2,3` simulates the fleets, evaluates each and writes
`pooled.json` and `pooled.md` (`benchmarks/fleets.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ingest.errors import InputError
from models.calibration import high_risk_verdict, wilson_interval
from models.power import compare_points
from models.report_format import pct

FIGURES = ("precision", "precision_long", "recall", "recall_long")


def _share(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def pooled_point(points: list[dict[str, Any]]) -> dict[str, Any]:
    """One scorer's operating point over fleets: summed counts and the shares they give."""
    total = {key: float(sum(sum(p["day_counts"][key]) for p in points)) for key in points[0]["day_counts"]}
    gpu_days = float(sum(p["gpu_days"] for p in points))
    return {
        "n_alarms": int(total["alarms"]),
        "gpu_days": gpu_days,
        "alarms_per_1000_gpu_days": total["alarms"] / gpu_days * 1000.0 if gpu_days else None,
        "n_failures": int(total["failures"]),
        **{f"n_hits{s}": int(total[f"hits{s}"]) for s in ("", "_long")},
        **{f"n_alarms_known{s}": int(total[f"known{s}"]) for s in ("", "_long")},
        **{f"n_caught{s}": int(total[f"caught{s}"]) for s in ("", "_long")},
        **{f"precision{s}": _share(total[f"hits{s}"], total[f"known{s}"]) for s in ("", "_long")},
        **{f"recall{s}": _share(total[f"caught{s}"], total["failures"]) for s in ("", "_long")},
    }


def pool_fleets(fleets: Mapping[str, dict[str, Any]], *, samples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """`fleets`: fleet name -> its metrics.json. Per budget: each scorer's pooled figures, each
    fleet's realised volumes, and the pooled paired comparisons of every pair the fleets compare.
    Raises InputError when a fleet lacks the quota (a report from before it) or the fleets were
    run with different budgets or scorers."""
    if not fleets:
        raise InputError("pooled fleets: expected at least one fleet's metrics.json, got none")
    for name, metrics in fleets.items():
        if "quota" not in metrics.get("alarms", {}):
            raise InputError(f"pooled fleets: {name}'s metrics have no daily quota; rerun gpufail evaluate")
    first = next(iter(fleets.values()))
    budgets = list(first["alarms"]["quota"])
    for name, metrics in fleets.items():
        if list(metrics["alarms"]["quota"]) != budgets:
            raise InputError(
                f"pooled fleets: {name} has budgets {list(metrics['alarms']['quota'])}, expected {budgets}"
            )
    out: dict[str, Any] = {
        "fleets": list(fleets),
        "rules": first["alarms"]["rules"],
        "headline_budget": f"{first['alarm_headline_budget']:g}",
        "n_failures_per_fleet": {},
        "chosen_on_validation": {
            name: (m["claims"].get("chosen_on_validation") or {}).get("name") for name, m in fleets.items()
        },
        "budgets": {},
    }
    for budget in budgets:
        out["budgets"][budget] = _pooled_budget(fleets, "quota", budget, samples, seed)
    # Thresholds matched on each fleet's test scores, where every fleet has them.
    if all("matched" in m["alarms"] for m in fleets.values()):
        out["matched"] = {b: _pooled_budget(fleets, "matched", b, samples, seed) for b in budgets}
    first_scorer = next(iter(first["alarms"]["quota"][budgets[0]]["points"]))
    if all("calibration" in m for m in fleets.values()):
        out["calibration"] = pooled_calibration(fleets)
    out["n_failures_per_fleet"] = {
        name: int(np.sum(m["alarms"]["quota"][budgets[0]]["points"][first_scorer]["day_counts"]["failures"]))
        for name, m in fleets.items()
    }
    return out


def pooled_calibration(fleets: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """Per contender and calibration map (the one in use, then the others the evaluation
    compared), the rows at calibrated risk >= 0.5 of every fleet pooled: summed rows and
    failures, their mean risk, and the observed rate's Wilson interval over the fleets' summed
    effective rows (each fleet's rows counted as the GPUs they come from,
    `models.calibration.effective_rows`; a report without them counts rows), with the
    `high_risk_check` verdict, beside each fleet's own."""
    first = next(iter(fleets.values()))
    in_use = first["plan"].get("calibration") or "-"
    out: dict[str, Any] = {}
    for name in first["calibration"]:
        if not all(name in m["calibration"] for m in fleets.values()):
            continue
        figures = [m["calibration"][name] for m in fleets.values()]
        maps = {in_use: [f["high_risk"] for f in figures]}
        for method in figures[0].get("methods", {}):
            if all(method in f.get("methods", {}) for f in figures):
                maps[method] = [f["methods"][method]["high_risk"] for f in figures]
        out[name] = {method: _pooled_high_risk(checks, list(fleets)) for method, checks in maps.items()}
    return out


def _pooled_high_risk(checks: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    n = sum(c["n_rows"] for c in checks)
    positives = sum(c["n_positives"] for c in checks)
    tolerance = checks[0]["tolerance"]
    pooled: dict[str, Any] = {"n_rows": n, "n_positives": positives, "tolerance": tolerance}
    if all("n_groups" in c for c in checks):
        pooled["n_groups"] = sum(c["n_groups"] for c in checks)
    if n == 0:
        pooled.update(mean_risk=None, observed_rate=None, observed_ci=[None, None], verdict="no rows")
    else:
        mean = sum(c["mean_risk"] * c["n_rows"] for c in checks if c["n_rows"]) / n
        effective = sum(c.get("effective_rows", c["n_rows"]) for c in checks)
        rate = positives / n
        low, high = wilson_interval(rate * effective, effective)
        assert low is not None and high is not None
        pooled.update(
            mean_risk=mean,
            observed_rate=rate,
            effective_rows=effective,
            observed_ci=[low, high],
            verdict=high_risk_verdict(mean, rate, (low, high), tolerance),
        )
    pooled["fleets"] = {
        name: {k: c.get(k) for k in ("n_rows", "n_groups", "mean_risk", "observed_rate", "verdict")}
        for name, c in zip(names, checks, strict=True)
    }
    pooled["n_fleets_within"] = sum(c["verdict"] == "within" for c in checks)
    return pooled


def _pooled_budget(
    fleets: Mapping[str, dict[str, Any]], key: str, budget: str, samples: int, seed: int
) -> dict[str, Any]:
    """One budget of operating points `key` ("quota" or "matched") pooled over the fleets."""
    quotas = [m["alarms"][key][budget] for m in fleets.values()]
    scorers = list(quotas[0]["points"])
    for name, q in zip(fleets, quotas, strict=True):
        if list(q["points"]) != scorers:
            raise InputError(f"pooled fleets: {name} scores {list(q['points'])}, expected {scorers}")
    points = {s: pooled_point([q["points"][s] for q in quotas]) for s in scorers}
    comparisons = {}
    for pair, c in quotas[0]["comparisons"].items():
        if all(pair in q["comparisons"] for q in quotas):
            compared = compare_points(
                [q["points"][c["first"]] for q in quotas],
                [q["points"][c["second"]] for q in quotas],
                samples=samples,
                seed=seed,
            )
            comparisons[pair] = {"first": c["first"], "second": c["second"], "question": c["question"], **compared}
    volumes = [p["alarms_per_1000_gpu_days"] for p in points.values() if p["alarms_per_1000_gpu_days"]]
    return {
        "points": points,
        "volume_ratio": max(volumes) / min(volumes) if volumes and min(volumes) > 0 else None,
        "volume_ratio_per_fleet": {name: q["volume_ratio"] for name, q in zip(fleets, quotas, strict=True)},
        "comparisons": comparisons,
    }


def _pts(value: Any, sign: bool = True) -> str:
    return "-" if value is None else (f"{100 * value:+.1f}" if sign else f"{100 * value:.1f}")


def _ci(pair: Any) -> str:
    return "-" if not pair or pair[0] is None else f"[{100 * pair[0]:+.1f}, {100 * pair[1]:+.1f}]"


def pooled_markdown(pooled: dict[str, Any]) -> str:
    """`pooled.md`: per budget the pooled table, then the pooled paired differences."""
    rules = pooled["rules"]
    h, long = f"{rules['horizon_h']:g} h", f"{rules['long_horizon_h']:g} h"
    fleets = ", ".join(pooled["fleets"])
    lines = [
        f"# The comparison pooled over {len(pooled['fleets'])} fleets ({fleets})",
        "",
        "Each fleet simulated with its own seed and evaluated alone (`gpufail evaluate`); alarms at a daily quota "
        "(every scorer the same volume); the figures are the fleets' summed counts. Differences: first minus "
        "second, paired bootstrap 95% interval with the test days drawn within each fleet, the smallest "
        "difference it could detect (80% power, 5% level), and the verdict: higher / lower (interval excludes 0), "
        "no difference (within +-10 points), not shown (underpowered).",
        "",
        "Failures in the test periods: "
        + ", ".join(f"{name} {n}" for name, n in pooled["n_failures_per_fleet"].items())
        + ". Chosen on validation: "
        + ", ".join(f"{name} {c}" for name, c in pooled["chosen_on_validation"].items())
        + ".",
        "",
    ]
    sections = [("Quota", pooled["budgets"])]
    if "matched" in pooled:
        sections.append(("Thresholds matched on the test scores,", pooled["matched"]))
    for label, by_budget in sections:
        lines += _budget_lines(label, by_budget, h, long)
    if "calibration" in pooled:
        lines += _calibration_lines(pooled["calibration"])
    return "\n".join(lines)


def _calibration_lines(calibration: dict[str, Any]) -> list[str]:
    lines = [
        "## Calibration: the rows at risk >= 0.5, over fleets",
        "",
        "Per contender and calibration map (the one in use first), the fleets' rows at calibrated risk >= 0.5 "
        "pooled: rows (GPUs), their mean risk, the observed failure rate within the horizon with its 95% Wilson "
        "interval over the fleets' effective rows (a GPU's hours counted as what they are worth), and whether "
        "they agree within 0.1 (pooled, opposite errors of two fleets cancel: read the fleets too); then on how "
        "many fleets they agree, and each fleet's mean risk / observed rate and verdict.",
        "",
        "| configuration | map | rows (GPUs) | mean risk | observed [95% CI] | verdict | fleets within | each fleet |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    for name, maps in calibration.items():
        for method, c in maps.items():
            groups = f" ({c['n_groups']:,})" if "n_groups" in c else ""
            low, high = c["observed_ci"]
            interval = "-" if low is None else f"{c['observed_rate']:.3f} [{low:.3f}, {high:.3f}]"
            each = "; ".join(
                f"{fleet} {_rate(f['mean_risk'])} / {_rate(f['observed_rate'])} {f['verdict']}"
                for fleet, f in c["fleets"].items()
            )
            lines.append(
                f"| {name} | {method} | {c['n_rows']:,}{groups} | {_rate(c['mean_risk'])} | {interval} | "
                f"{c['verdict']} | {c['n_fleets_within']}/{len(c['fleets'])} | {each} |"
            )
    return [*lines, ""]


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _budget_lines(label: str, by_budget: dict[str, Any], h: str, long: str) -> list[str]:
    lines: list[str] = []
    for budget, entry in by_budget.items():
        ratio = entry["volume_ratio"]
        lines += [
            f"## {label} {budget} alarms per 1,000 GPUs per day"
            + ("" if ratio is None else f" (pooled volumes within a factor {ratio:.2f})"),
            "",
            f"| scorer | alarms | /1k GPU-days | precision within {h} | within {long} | recall within {h} | "
            f"within {long} |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, p in entry["points"].items():
            rate = p["alarms_per_1000_gpu_days"]
            lines.append(
                f"| {name} | {p['n_alarms']} | {'-' if rate is None else f'{rate:.2f}'} | "
                f"{pct(p['precision'])} ({p['n_hits']}/{p['n_alarms_known']}) | "
                f"{pct(p['precision_long'])} ({p['n_hits_long']}/{p['n_alarms_known_long']}) | "
                f"{pct(p['recall'])} ({p['n_caught']}/{p['n_failures']}) | "
                f"{pct(p['recall_long'])} ({p['n_caught_long']}/{p['n_failures']}) |"
            )
        lines += [
            "",
            f"| first - second | precision within {h}, pts [95% CI] | detectable | verdict | within {long} [95% CI] | "
            f"verdict | recall within {h} [95% CI] |",
            "| --- | ---: | ---: | --- | ---: | --- | ---: |",
        ]
        for pair, c in entry["comparisons"].items():
            p, pl, r = c["precision"], c["precision_long"], c["recall"]
            lines.append(
                f"| {pair} | {_pts(p['difference'])} {_ci(p['ci'])} | {_pts(p['detectable'], False)} | "
                f"{p['verdict']} | {_pts(pl['difference'])} {_ci(pl['ci'])} | {pl['verdict']} | "
                f"{_pts(r['difference'])} {_ci(r['ci'])} |"
            )
        lines.append("")
    return lines
