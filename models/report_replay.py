"""The report's replay section (`gpufail evaluate --policy`): GPU-hours each action policy loses
over the test period, from `metrics["replay"]` (`serving.replay`). A pure function of the figures."""

from __future__ import annotations

from typing import Any

REPLAY_POLICIES = {
    "none": "no action",
    "rule": "rule baseline through the tiers",
    "tiers": "tiered policy",
    "cost": "cost policy",
}


def replay_section(metrics: dict[str, Any]) -> list[str]:
    """The section's lines, or none when the evaluation ran without a replay."""
    replay = metrics.get("replay")
    if not replay:
        return []
    policies = replay["policies"]
    lines = [
        "## What the actions would have cost the jobs (replay)",
        "",
        f"The test period walked hour by hour ({replay['hours']} grid times, {replay['jobs']:,} jobs, "
        f"{replay['failures']} GPU failures) with {replay['model']}'s calibrated risk; every policy decides "
        "with the production decision code (serving/policy.py, serving/cost_policy.py). GPU-hours:",
        "",
        "| policy | failures | drain restarts | drained (of which false) | checkpoints (hints) | avoid (priced) "
        "| slowness | total | saved vs none |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, label in REPLAY_POLICIES.items():
        p = policies.get(name)
        if p is None:
            continue
        lines.append(
            f"| {label} | {p['failure_gpu_h']:,.0f} ({p['failures_hitting_jobs']:.0f} hit jobs) "
            f"| {p['drain_restart_gpu_h']:,.0f} | {p['drained_gpu_h']:,.0f} ({p['false_drain_gpu_h']:,.0f}; "
            f"{p['drains']:.0f} drains, {p['false_drains']:.0f} false) | {p['checkpoint_gpu_h']:,.0f} "
            f"({p['hints']:.0f}) | {p['avoid_gpu_h']:,.0f} | {p.get('slow_gpu_h', 0.0):,.0f} | {p['total_gpu_h']:,.0f} "
            f"| {p['saved_gpu_h']:,.0f} |"
        )
    against = replay.get("cost_against", {})
    if against:
        lines += [
            "",
            "The cost policy against each other policy (its total minus theirs; negative: it lost less), with a "
            "95% bootstrap interval over days: "
            + "; ".join(
                f"{REPLAY_POLICIES[o]} {d['difference_gpu_h']:+,.0f} GPU-h [{d['ci95'][0]:+,.0f}, {d['ci95'][1]:+,.0f}]"
                for o, d in against.items()
            )
            + ".",
        ]
    refill = replay.get("refill") or {}
    if refill.get("busy_share") is not None:
        wait = refill["median_hours_to_next"]
        lines += [
            "",
            f"After a job left a node its GPUs were busy {refill['busy_share']:.0%} of the next "
            f"{refill['horizon_h']:g} h ({refill['job_ends']:,} job ends"
            + ("" if wait is None else f"; the next job came a median {wait:.1f} h later")
            + "): the cost policy's new-job loss counts a freed node busy for the whole horizon.",
        ]
    lines += [
        "",
        "Failures: the work since each hit job's last checkpoint plus its hang and restart, on all its GPUs. "
        "Drain restarts: the jobs a drain-now moved (their work since the checkpoint and a restart). Drained: "
        "node GPU-hours out of service (false: the node did not fail during the drain or within the horizon "
        f"after it began). Slowness: what the jobs lost to fail-slow GPUs (known only on a simulated fleet; "
        f"a job steps at its slowest GPU's pace). A tripped circuit breaker is reset after {replay['breaker_reset_after_h']:g} h. "
        "How the replay counts: docs/actions.md.",
        "",
    ]
    return lines
