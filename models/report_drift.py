"""The report's section on the drift events of the data (`models.drift`): which fall inside the
test period, and each scorer's precision before and after them, static beside retrained."""

from __future__ import annotations

from typing import Any

from models.report_format import pct


def _when(iso: str | None) -> str:
    return "-" if iso is None else iso[:16].replace("T", " ")


def _event_line(event: dict[str, Any], n_days: int) -> str:
    what = f"{event['what']} ({event['kind']}) from {_when(event['start'])}"
    if event.get("half"):
        what += f", on half the rows by {_when(event['half'])}"
    where = (
        f"inside the test period (day {event['day'] + 1} of {n_days})"
        if event["in_test"]
        else "outside the test period"
    )
    return f"- {what}: {where}."


def drift_section(metrics: dict[str, Any]) -> list[str]:
    """Markdown lines: the events, then per event inside the test period a table of the
    contenders (by mode) and the rule and heuristic baselines, before and after it."""
    events = metrics.get("drift")
    if events is None:
        return []
    n_days, k = metrics["test"]["n_days"], metrics["top_k"]
    budget = f"{metrics['alarm_headline_budget']:g}"
    lines = ["## Drift in the test period", ""]
    if not events:
        return [*lines, "The features show no driver rollout and no new nodes.", ""]
    lines += [_event_line(e, n_days) for e in events] + [""]
    modes = {c["name"]: c["mode"] for c in metrics["contenders"]}
    inside = [e for e in events if e["in_test"]]
    if not inside:
        return [*lines, "No event falls inside the test period: it cannot show what retraining is worth.", ""]
    for event in inside:
        lines += [
            f"Before and after {event['what']} (the test period split at day {event['day'] + 1}): daily "
            f"precision@{k} (mean over the days) and alarm precision within the horizon at the daily quota of "
            f"{budget} per 1,000 GPUs per day (the alarms of those days; every scorer the same number).",
            "",
            f"| scorer | mode | precision@{k} before | after | alarm precision before (alarms) | after (alarms) |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
        names = [n for n in modes if n in event["scorers"]] + [
            n for n in ("rule", "heuristic", "best_feature") if n in event["scorers"]
        ]
        for name in names:
            s = event["scorers"][name]
            ranking, alarm = s["precision_at_k"], s.get("alarm_precision")
            alarm_cells = (
                f"{pct(alarm['before'])} ({alarm['n_alarms_before']}) | {pct(alarm['after'])} ({alarm['n_alarms_after']})"
                if alarm
                else "- | -"
            )
            lines.append(
                f"| {name} | {modes.get(name, 'baseline')} | {pct(ranking['before'])} | {pct(ranking['after'])} | "
                f"{alarm_cells} |"
            )
        lines.append("")
    return lines
