"""The report's fail-slow section: the `fail_slow` alarm class (`models.fail_slow`), apart from
the failure alarms. A pure function of `metrics["fail_slow"]`."""

from __future__ import annotations

from typing import Any

from models.report_format import pct


def fail_slow_section(metrics: dict[str, Any]) -> list[str]:
    """The section's lines, or none when the features lacked the fail-slow inputs."""
    slow = metrics.get("fail_slow")
    if not slow:
        return []
    per_day = slow["alarms_per_1000_gpu_days"]
    lines = [
        "## Fail-slow GPUs (stragglers)",
        "",
        f"A separate alarm class: a GPU whose `fail_slow_score_{slow['window']}` (its sustained SM clock deficit "
        f"against both its node and its model peers) reaches {slow['threshold']:g}. Over the test period: "
        f"{slow['n_alarms']} alarms on {slow['n_gpus_alarmed']} GPUs"
        + ("" if per_day is None else f" ({per_day:.2f} per 1,000 GPU-days)")
        + ".",
        "",
    ]
    if "n_slow_gpus" in slow:
        delay = slow["delay_h_median"]
        lines += [
            f"Against the simulator's truth: {slow['n_slow_gpus']} GPUs were slow during the period; "
            f"precision {pct(slow['precision'])} (alarms on a GPU already slow), recall {pct(slow['recall'])} "
            f"({slow['n_caught']} caught)"
            + ("" if delay is None else f", median delay {delay:.1f} h after the onset")
            + ".",
            "",
        ]
    if slow["top"]:
        lines += ["| GPU | node | first alarm | score |", "| --- | --- | --- | ---: |"]
        lines += [
            f"| {t['gpu_uuid']} | {t['node']} | {t['first_alarm'][:16]} | {t['score']:.3f} |" for t in slow["top"]
        ]
        lines.append("")
    return lines
