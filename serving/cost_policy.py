"""The cost-aware policy (`[publish] policy = "cost"`): per node, the action whose expected cost
in GPU-hours is lowest, given the node's risk and the jobs on it. Pure: no I/O, no clock, so a
replay can call `decide` on simulated fleets.

Per node, from its risk `p` (the chance it fails within the horizon `H`), its `NodeLoad`
(`serving.jobs`) and its GPUs `n`, with the `CostConfig` times in hours. A failure within the
horizon is taken to come at any time in it alike (uniformly: the calibrated risk says whether,
not when). Each job `j` on the node (`serving.jobs.Exposure`) has `g_j` GPUs, `a_j` hours since
its last checkpoint, its next periodic checkpoint in `r_j` hours, an interval `I_j`, and runs on
for the share `q_j` of the horizon (its time left over `H`, at most 1). It checkpoints on its
own schedule whatever the policy does (a hint is an extra checkpoint), so:

- `w_j` = min(r_j, q_j x H) / H: the share of the horizon before its next checkpoint (while it
  runs). A failure then loses its GPUs x (a_j + the time since now: on average
  min(r_j, q_j x H) / 2); a failure after it, about half an interval (I_j / 2).
- `L` = what the node's jobs lose on average if it fails within the horizon: the sum over the
  jobs of g_j x (w_j x (a_j + min(r_j, q_j x H) / 2) + (q_j - w_j) x I_j / 2 + q_j x (hang_time
  + restart_time)).
- `S` = what a checkpoint now saves of `L`: the sum of g_j x w_j x a_j (the work at risk, only
  when the failure comes before the job's own next checkpoint).
- `q` = the share of the horizon the node is busy (its last job's time left; 1 without a
  limit, 0 idle).
- `E` = what new jobs placed on the node would lose if it failed: `new_job_gpus` GPUs, each
  losing half a checkpoint interval, the hang and the restart; on the free GPUs while the jobs
  run, on all of them after (q x free/n + 1 - q times that).
- `F` = the node's GPUs out of service for `false_drain` when a drain was for nothing.

Expected cost of each option (GPU-hours; an option is offered only if its tier is enabled):

| option | cost |
| --- | --- |
| `none` | p x (L + E) |
| `checkpoint` (a job on the node) | GPUs of the jobs x checkpoint_time + p x (L - S + E) |
| `avoid` | p x (L + avoid_share x E) + avoid_cost x n |
| `drain_after_job` (a job on the node) | p x L + (1 - p) x F |
| `drain_now` | work at risk + GPUs of the jobs x restart_time + (1 - p) x F |

`drain_now` restarts the jobs now, from their last checkpoints, for certain: today's work at
risk, not the average loss of a failure later in the horizon.

The cheapest wins (a tie goes to the weaker option). Its tier (`checkpoint` is `watch`: the jobs
are told, the node stays) goes through `serving.policy.decide` as the node's wanted tier, so
repair, cooldown, circuit breaker and recovery rules are the tiered policy's, unchanged: a node
leaves a tier only after a weaker one was cheapest for the recovery period. A node whose raise
was held by the cooldown falls back to a checkpoint hint when that is cheaper than nothing.

Checkpoint hints go once per job (all its risky nodes in one reason), at most once per
`checkpoint_interval`, and none while the circuit breaker is open (a flood of hints is a mass
action too). The times of the hints are the policy's own state (`hinted`), kept with the
tiered state by the caller.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from ingest.errors import InputError
from serving.jobs import IDLE, Job, JobMap, NodeLoad, node_loads
from serving.policy import Decision, NodeRisk, PolicyConfig, PolicyState
from serving.policy import decide as decide_tiers

OPTIONS = ("none", "checkpoint", "avoid", "drain_after_job", "drain_now")
"""Every option, weakest first (ties go to the first)."""
OPTION_TIER = {
    "none": "none",
    "checkpoint": "watch",
    "avoid": "avoid",
    "drain_after_job": "drain_after_job",
    "drain_now": "drain_now",
}


@dataclass(frozen=True)
class CostConfig:
    horizon: timedelta = timedelta(hours=24)
    """The horizon of the node risk (the model's label horizon)."""
    checkpoint_interval: timedelta = timedelta(hours=1)
    """How often the jobs checkpoint: assumed for a job that reports no checkpoint, and the interval of
    one that reports only when it checkpointed (`serving.jobs.exposure`); also the least time
    between two hints to one job."""
    checkpoint_time: timedelta = timedelta(minutes=5)
    """What one checkpoint stalls each GPU of the job."""
    restart_time: timedelta = timedelta(minutes=10)
    """What a restart from the checkpoint costs each GPU of the job (reload, rendezvous)."""
    hang_time: timedelta = timedelta(minutes=15)
    """How long a job hangs on a failed node before the failure is noticed (collective time-outs)."""
    new_job_gpus: float = 64.0
    """The GPUs of a job that the scheduler would place on a free node (the blast radius it brings)."""
    avoid_share: float = 0.25
    """The share of new work an avoided node still gets (it is filled last, not never)."""
    avoid_cost: float = 0.5
    """GPU-hours per node GPU that keeping new large jobs off a node costs over the horizon."""
    false_drain: timedelta = timedelta(hours=24)
    """How long a node drained for nothing stays out of service."""

    def __post_init__(self) -> None:
        if self.horizon <= timedelta(0) or self.checkpoint_interval <= timedelta(0):
            raise InputError(
                f"cost: expected horizon and checkpoint_interval above zero, got {self.horizon} and "
                f"{self.checkpoint_interval}"
            )
        for name in ("checkpoint_time", "restart_time", "hang_time", "false_drain"):
            if getattr(self, name) < timedelta(0):
                raise InputError(f"cost.{name}: expected a duration >= 0, got {getattr(self, name)}")
        for name in ("new_job_gpus", "avoid_cost"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InputError(f"cost.{name}: expected a finite number >= 0, got {value}")
        if not 0.0 <= self.avoid_share <= 1.0:
            raise InputError(f"cost.avoid_share: expected a share in [0, 1], got {self.avoid_share}")


def _hours(t: timedelta) -> float:
    return t.total_seconds() / 3600


def option_costs(
    risk: float, load: NodeLoad, node_gpus: int, cost: CostConfig, offered: frozenset[str]
) -> dict[str, float]:
    """The expected cost in GPU-hours of each offered option for one node (see the module)."""
    p = min(max(risk, 0.0), 1.0)
    horizon = _hours(cost.horizon)
    restart, hang = _hours(cost.restart_time), _hours(cost.hang_time)
    loss, saved = job_losses(load, horizon, hang + restart)
    q = min(load.hours_to_end / horizon, 1.0) if load.busy else 0.0
    n = max(node_gpus, load.used_gpus, 1)
    per_new = cost.new_job_gpus * (_hours(cost.checkpoint_interval) / 2 + hang + restart)
    free = max(n - load.used_gpus, 0) / n
    new_work = q * free * per_new + (1 - q) * per_new
    false_drain = n * _hours(cost.false_drain)
    jobs_gpus = load.blast_radius
    out = {"none": p * (loss + new_work)}
    if load.busy and "checkpoint" in offered:
        out["checkpoint"] = jobs_gpus * _hours(cost.checkpoint_time) + p * (loss - saved + new_work)
    if "avoid" in offered:
        out["avoid"] = p * (loss + cost.avoid_share * new_work) + cost.avoid_cost * n
    if load.busy and "drain_after_job" in offered:
        out["drain_after_job"] = p * loss + (1 - p) * false_drain
    if "drain_now" in offered:
        out["drain_now"] = load.work_at_risk + jobs_gpus * restart + (1 - p) * false_drain
    return out


def job_losses(load: NodeLoad, horizon: float, hang_restart: float) -> tuple[float, float]:
    """`L` and `S` of the module: what the node's jobs lose on average if it fails at a time
    within the horizon (`horizon` hours), and how much of that a checkpoint now saves."""
    if len(load.exposures) != len(load.jobs):
        raise ValueError(
            f"a NodeLoad of {len(load.jobs)} job(s) with {len(load.exposures)} exposures: build it with node_loads"
        )
    loss = saved = 0.0
    for e in load.exposures:
        runs = min(e.to_end, horizon)
        before = min(e.to_checkpoint, runs)
        w, q = before / horizon, runs / horizon
        loss += e.gpus * (w * (e.since + before / 2) + (q - w) * e.interval / 2 + q * hang_restart)
        saved += e.gpus * w * e.since
    return loss, saved


def cheapest(costs: Mapping[str, float]) -> str:
    """The option of least cost; a tie goes to the weaker one."""
    return min((o for o in OPTIONS if o in costs), key=lambda o: (costs[o], OPTIONS.index(o)))


@dataclass(frozen=True)
class Hint:
    """A checkpoint hint to one job."""

    job: Job
    nodes: tuple[str, ...]
    """Its risky nodes whose cheapest option was the hint."""
    reason: str


@dataclass(frozen=True)
class CostDecision:
    decision: Decision
    option: str
    """The cheapest option."""
    costs: Mapping[str, float]
    """Expected GPU-hours of every offered option."""
    load: NodeLoad


@dataclass(frozen=True)
class CostOutcome:
    decisions: list[CostDecision]
    state: PolicyState
    hinted: dict[str, datetime]
    """Job id -> when it was last told to checkpoint (the state to keep)."""
    hints: list[Hint]
    """The hints to send now."""
    held: list[tuple[Hint, str]] = field(default_factory=list)
    """Hints wanted but not sent, and why."""


def offered_options(config: PolicyConfig) -> frozenset[str]:
    """The options whose tier is enabled; a checkpoint hint is always possible."""
    enabled = {t.name for t in config.tiers} | {"none"}
    return frozenset(o for o in OPTIONS if OPTION_TIER[o] in enabled or o == "checkpoint")


def decide(
    nodes: Sequence[NodeRisk],
    job_map: JobMap | None,
    node_gpus: Mapping[str, int],
    cost: CostConfig,
    state: PolicyState,
    hinted: Mapping[str, datetime],
    config: PolicyConfig,
    now: datetime,
    fleet_nodes: int | None = None,
) -> CostOutcome:
    """One decision per node (as `serving.policy.decide`), the expected costs behind each, and
    the checkpoint hints to send. Without a job map (`None`: it could not be read) nothing is
    priced: every node keeps its tier, and no hint is sent."""
    if now.tzinfo is None:
        raise InputError("now: expected a timezone-aware time")
    if job_map is None:
        kept = [
            replace(n, wanted=state.nodes[n.key].tier if n.key in state.nodes else "none", why=_NO_MAP) for n in nodes
        ]
        decisions, after = _decide_kept(kept, state, config, now, fleet_nodes)
        return CostOutcome([CostDecision(d, "", {}, IDLE) for d in decisions], after, dict(hinted), [], [])
    loads = node_loads(job_map, now, cost.checkpoint_interval)
    offered = offered_options(config)
    watch_on = any(t.name == "watch" for t in config.tiers)
    priced: dict[str, tuple[str, dict[str, float], NodeLoad]] = {}
    wanted = []
    for n in nodes:
        load = loads.get(n.node, IDLE)
        costs = option_costs(n.risk, load, node_gpus.get(n.node, len(n.gpus)), cost, offered)
        option = cheapest(costs)
        priced[n.key] = (option, costs, load)
        tier = OPTION_TIER[option] if option != "checkpoint" or watch_on else "none"
        wanted.append(replace(n, wanted=tier, why=_why(n.risk, option, costs, load)))
    decisions, after = decide_tiers(wanted, state, config, now, fleet_nodes)

    by_id = job_map.by_id()
    hint_nodes: dict[str, list[str]] = {}
    out = []
    for d in decisions:
        option, costs, load = priced[d.key]
        hint = option == "checkpoint" or (
            d.action == "cooldown_held" and "checkpoint" in costs and costs["checkpoint"] < costs["none"]
        )
        if hint and d.action != "skip":
            for job_id in load.jobs:
                hint_nodes.setdefault(job_id, []).append(d.node)
        out.append(CostDecision(d, option, costs, load))

    keep_hinted = {j: t for j, t in hinted.items() if now - t < cost.checkpoint_interval and j in by_id}
    hints, held = [], []
    for job_id, risky in sorted(hint_nodes.items()):
        job = by_id[job_id]
        hours, assumed = job.hours_since_checkpoint(now, cost.checkpoint_interval)
        reason = (
            f"job {job_id} ({job.gpus} GPUs, {hours:.2f} h since its {'assumed ' if assumed else ''}checkpoint) "
            f"on risky {', '.join(sorted(risky))}: a checkpoint now costs {job.gpus * _hours(cost.checkpoint_time):.1f} GPU-h"
        )
        h = Hint(job, tuple(sorted(risky)), reason)
        if after.breaker.tripped:
            held.append((h, f"circuit breaker open since {after.breaker.tripped_at:%Y-%m-%d %H:%M}Z"))
        elif job_id in keep_hinted:
            held.append(
                (h, f"told to checkpoint at {keep_hinted[job_id]:%Y-%m-%d %H:%M}Z, within {cost.checkpoint_interval}")
            )
        else:
            hints.append(h)
            keep_hinted[job_id] = now
    return CostOutcome(out, after, keep_hinted, hints, held)


_NO_MAP = "job map unavailable: the cost policy keeps every tier as it is"


def _decide_kept(
    kept: Sequence[NodeRisk], state: PolicyState, config: PolicyConfig, now: datetime, fleet_nodes: int | None
) -> tuple[list[Decision], PolicyState]:
    decisions, after = decide_tiers(kept, state, config, now, fleet_nodes)
    # A node held in its tier must not start its recovery clock for want of a job map.
    nodes = dict(after.nodes)
    for key, before in state.nodes.items():
        if key in nodes:
            nodes[key] = replace(nodes[key], below_since=before.below_since)
    return decisions, replace(after, nodes=nodes)


def _why(risk: float, option: str, costs: Mapping[str, float], load: NodeLoad) -> str:
    ranked = ", ".join(f"{o} {costs[o]:.1f}" for o in OPTIONS if o in costs)
    jobs = (
        f"{len(load.jobs)} job(s), blast radius {load.blast_radius} GPUs, {load.work_at_risk:.1f} GPU-h at risk"
        if load.busy
        else "idle"
    )
    return f"node risk {risk:.3f}, {jobs}: cheapest {option} (expected GPU-h: {ranked})"


def costs_json(costs: Mapping[str, float]) -> dict[str, Any]:
    """The audit's record of the options' costs (every option, None where not offered)."""
    return {o: (float(costs[o]) if o in costs else None) for o in OPTIONS}


def hinted_to_json(hinted: Mapping[str, datetime]) -> dict[str, str]:
    return {job: t.isoformat() for job, t in sorted(hinted.items())}


def hinted_from_json(data: Any, where: str) -> dict[str, datetime]:
    """The `hinted` state as `hinted_to_json` wrote it (None: none yet)."""
    if data is None:
        return {}
    try:
        out = {str(job): datetime.fromisoformat(str(t)) for job, t in data.items()}
    except (AttributeError, ValueError, TypeError) as exc:
        raise InputError(
            f'{where}: checkpoint_hints is not {{"JOB": ISO time}} ({type(exc).__name__}: {exc})'
        ) from None
    naive = [job for job, t in out.items() if t.tzinfo is None]
    if naive:
        raise InputError(f"{where}: checkpoint_hints: the time of job {naive[0]} has no time zone")
    return out
