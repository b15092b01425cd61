"""The replay: what each action policy would have cost the jobs of a past period, in GPU-hours.

It walks the period hour by hour (the grid times of the scored rows). At each hour every policy
sees the node risks of that hour and the jobs running then (`job_map_at`, from a job trace as
`ingest.simulator.jobs` writes it) and decides with the production decision code:

- `none`: no action;
- `rule`: the rule baseline's flags (risk 1 where a GPU of the node is flagged, else 0) through
  the tiered policy (`serving.policy.decide`): a flagged node enters the strongest tier;
- `tiers`: the model's calibrated node risk through the tiered policy;
- `cost`: the same risk through the cost policy (`serving.cost_policy.decide`).

What the decisions do to the jobs (each policy keeps its own jobs' checkpoints and restarts):

- a GPU failure stops every job with a placement on its node that the policy left there; each
  loses its GPUs x the hours since its last checkpoint, plus its GPUs x (hang + restart time);
- `drain_now` restarts the node's jobs at once (their work since the checkpoint and a restart)
  and moves them off; the node is out of service until the policy lets it go;
- `drain_after_job`: the running jobs stay (and are hit if the node fails); jobs that would
  start on the node go elsewhere; once its jobs are gone the node is out of service;
- `avoid`: multi-node jobs that would start on the node go elsewhere; priced at the cost
  policy's `avoid_cost` per GPU over the horizon (a placement constraint has no GPU-hours of
  its own to count);
- a checkpoint hint: the job checkpoints now (its GPUs x `checkpoint_time`).

A node out of service costs its GPUs for every hour it is out (until its failure, when it is
down for repair anyway); a drain is **false** when the node did not fail during it or within the
horizon after it began. Jobs moved elsewhere are taken to find room (the fleet is not full);
the replay does not re-run the scheduler. A tripped circuit breaker is reset after
`breaker_reset_after` (an operator's reset) so one trip does not switch a policy off for the
rest of the period.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pandas as pd

from ingest.errors import InputError
from serving.cost_policy import CostConfig
from serving.cost_policy import decide as decide_cost
from serving.jobs import Job, JobMap
from serving.policy import PolicyConfig, PolicyState, reset_breaker
from serving.policy import decide as decide_tiers
from serving.publish import node_inputs

POLICIES = ("none", "rule", "tiers", "cost")
DRAINS = frozenset({"drain_now", "drain_after_job"})
TRACE_COLUMNS = (
    "job_id",
    "node",
    "gpus",
    "start",
    "end",
    "job_gpus",
    "job_start",
    "job_end_by",
    "checkpoint_interval_s",
)
_H = 3600e6  # microseconds per hour


def _hours(t: Any) -> np.ndarray:
    """UTC times -> hours since the epoch (float)."""
    return pd.to_datetime(t, utc=True).to_numpy(dtype="datetime64[us]").astype(np.int64) / _H


def _time(h: float) -> datetime:
    return datetime.fromtimestamp(h * 3600, tz=UTC)


@dataclass
class Trace:
    """A job trace as arrays (hours since the epoch); one entry per placement."""

    job: np.ndarray  # int: index into job_ids
    node: np.ndarray  # object: node name
    gpus: np.ndarray
    start: np.ndarray
    end: np.ndarray
    job_ids: list[str]
    job_gpus: np.ndarray  # per job
    job_start: np.ndarray
    job_end_by: np.ndarray
    job_interval: np.ndarray  # hours

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, where: str = "job trace") -> Trace:
        missing = [c for c in TRACE_COLUMNS if c not in frame.columns]
        if missing:
            raise InputError(f"{where}: missing columns {missing}; expected {list(TRACE_COLUMNS)} (docs/actions.md)")
        codes, ids = pd.factorize(frame["job_id"].astype(str))
        first = pd.Series(np.arange(len(frame))).groupby(codes).first().to_numpy()
        interval = frame["checkpoint_interval_s"].to_numpy(dtype=np.float64)[first] / 3600
        if len(interval) and not np.all(interval > 0):
            raise InputError(f"{where}: checkpoint_interval_s: expected seconds above zero")
        return cls(
            job=codes,
            node=frame["node"].astype(str).to_numpy(dtype=object),
            gpus=frame["gpus"].to_numpy(dtype=np.int64),
            start=_hours(frame["start"]),
            end=_hours(frame["end"]),
            job_ids=[str(i) for i in ids],
            job_gpus=frame["job_gpus"].to_numpy(dtype=np.int64)[first],
            job_start=_hours(frame["job_start"])[first],
            job_end_by=_hours(frame["job_end_by"])[first],
            job_interval=interval,
        )


def refill_after_job_ends(trace: Trace, horizon_h: float, gpus_per_node: int = 8) -> dict[str, Any]:
    """How busy a node was in the `horizon_h` hours after a job left it: the check of the cost
    policy's new-job loss, which takes a freed node's GPUs to be refilled for the whole horizon.

    A job's end on a node is the end of its last placement (an earlier one was moved off by a
    failure or maintenance, and the node was then down, not free); ends within `horizon_h` of the
    trace's last end are left out (their window runs past what the trace knows). Returns the ends
    counted, the mean share of the node's GPU-hours busy in the window after each (`busy_share`),
    and the median hours to the node's next placement (`median_hours_to_next`; None if none)."""
    last_of_job = pd.Series(trace.end).groupby(trace.job).transform("max").to_numpy()
    cut = trace.end.max(initial=-np.inf) - horizon_h
    by_node = pd.Series(np.arange(len(trace.node))).groupby(trace.node).indices
    busy, waits = [], []
    for e in np.flatnonzero((trace.end == last_of_job) & (trace.end <= cut)):
        rows, t = by_node[trace.node[e]], trace.end[e]
        start, end = trace.start[rows], trace.end[rows]
        overlap = np.clip(np.minimum(end, t + horizon_h) - np.maximum(start, t), 0.0, None)
        busy.append(float(trace.gpus[rows] @ overlap) / (gpus_per_node * horizon_h))
        later = start[start >= t]
        if len(later):
            waits.append(float(later.min() - t))
    return {
        "horizon_h": horizon_h,
        "job_ends": len(busy),
        "busy_share": float(np.mean(busy)) if busy else None,
        "median_hours_to_next": float(np.median(waits)) if waits else None,
    }


def last_checkpoint(trace: Trace, job: int, t: float, extra: Mapping[int, float]) -> float:
    """The job's last checkpoint at `t`: its periodic one, or a later hint or restart."""
    start, step = trace.job_start[job], trace.job_interval[job]
    periodic = start + math.floor(max(t - start, 0.0) / step) * step
    return max(periodic, min(extra.get(job, -math.inf), t))


def job_map_at(trace: Trace, rows: np.ndarray, t: float, extra: Mapping[int, float]) -> JobMap:
    """The job map at `t` of the placements `rows` (those running then), each job reporting its
    last checkpoint."""
    by_job: dict[int, dict[str, int]] = {}
    for r in rows:
        on = by_job.setdefault(int(trace.job[r]), {})
        on[trace.node[r]] = on.get(trace.node[r], 0) + int(trace.gpus[r])
    jobs = []
    for j, gpus_on in by_job.items():
        jobs.append(
            Job(
                id=trace.job_ids[j],
                gpus_on=gpus_on,
                start=_time(trace.job_start[j]),
                checkpoint_at=_time(last_checkpoint(trace, j, t, extra)),
                end_by=_time(trace.job_end_by[j]),
            )
        )
    return JobMap(tuple(jobs), "replay")


@dataclass
class _Run:
    """One policy's world: its decisions' state and what they cost."""

    name: str
    state: PolicyState = field(default_factory=PolicyState)
    hinted: dict[str, datetime] = field(default_factory=dict)
    tier: dict[str, str] = field(default_factory=dict)
    extra: dict[int, float] = field(default_factory=dict)  # job -> latest hint or restart
    moved: set[int] = field(default_factory=set)  # placements the policy kept off or took off their node
    episode: dict[str, list[float]] = field(default_factory=dict)  # node -> [entered, out GPU-h]
    episodes: list[tuple[str, float, float, float]] = field(default_factory=list)  # node, entered, left, GPU-h
    daily: dict[int, float] = field(default_factory=dict)  # day of the period -> GPU-h spent in it
    spent: float = 0.0
    figures: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            (
                "failure_gpu_h",
                "failures_hitting_jobs",
                "failures_on_drained_nodes",
                "drain_restart_gpu_h",
                "drained_gpu_h",
                "false_drain_gpu_h",
                "checkpoint_gpu_h",
                "hints",
                "avoid_gpu_h",
                "drains",
                "false_drains",
                "breaker_trips",
                "slow_gpu_h",
            ),
            0.0,
        )
    )


def replay(
    rows: pd.DataFrame,
    risk: np.ndarray,
    rule_flags: np.ndarray | None,
    trace: Trace,
    failures: pd.DataFrame,
    policy: PolicyConfig,
    cost: CostConfig,
    repairs: pd.DataFrame | None = None,
    gpus_per_node: int = 8,
    breaker_reset_after: timedelta = timedelta(hours=24),
    slow: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """GPU-hours each policy of `POLICIES` loses over the grid times of `rows` (columns ts,
    cluster, node, gpu_uuid, gpu_index; `risk` the calibrated GPU risk of each row, `rule_flags` the rule's flags or
    None to leave the rule out). `failures`: ts, node of every GPU failure; `repairs`: ts, node.
    `slow`: node, since, until (null: to the end) and deficit of every fail-slow GPU, when known
    (the simulator's truth): each policy's `slow_gpu_h` is then what its jobs lost to them (a
    synchronous job steps at its slowest GPU's pace: its GPUs x the hours x the deficit; a job
    holding part of the node is on the slow board with the chance of its share of the node)."""
    if len(rows) != len(risk) or (rule_flags is not None and len(rule_flags) != len(rows)):
        raise InputError(f"replay: expected one risk per row, got {len(risk)} risks for {len(rows)} rows")
    if len(rows) == 0:
        raise InputError("replay: no scored rows to walk")
    ts = _hours(rows["ts"])
    times = np.unique(ts)
    step = float(np.min(np.diff(times))) if len(times) > 1 else 1.0
    scored = rows[["cluster", "node", "gpu_uuid", "gpu_index"]].assign(risk=np.asarray(risk, dtype=np.float64))
    flagged = None if rule_flags is None else np.asarray(rule_flags, dtype=np.float64)
    first_tier = policy.tiers[0].enter
    fail_t = _hours(failures["ts"]) if len(failures) else np.zeros(0)
    fail_node = failures["node"].astype(str).to_numpy(dtype=object) if len(failures) else np.zeros(0, dtype=object)
    in_period = (fail_t >= times[0]) & (fail_t < times[-1] + step)
    fail_t, fail_node = fail_t[in_period], fail_node[in_period]
    fail_order = np.argsort(fail_t, kind="stable")
    fail_t, fail_node = fail_t[fail_order], fail_node[fail_order]
    repair_t = _hours(repairs["ts"]) if repairs is not None and len(repairs) else np.zeros(0)
    repair_node = (
        repairs["node"].astype(str).to_numpy(dtype=object) if repairs is not None and len(repairs) else np.zeros(0)
    )
    fleet = int(rows["node"].nunique())
    horizon_h = cost.horizon.total_seconds() / 3600
    hang_restart = (cost.hang_time + cost.restart_time).total_seconds() / 3600
    restart_h = cost.restart_time.total_seconds() / 3600
    checkpoint_h = cost.checkpoint_time.total_seconds() / 3600
    runs = {name: _Run(name) for name in POLICIES if name != "rule" or flagged is not None}
    by_time = pd.Series(np.arange(len(rows))).groupby(ts).indices
    job_index = {j: i for i, j in enumerate(trace.job_ids)}

    def exposed(run: _Run, node: str, t: float) -> np.ndarray:
        on = np.flatnonzero((trace.node == node) & (trace.start <= t) & (trace.end >= t))
        return np.array([r for r in on if r not in run.moved], dtype=np.int64)

    if slow is not None and len(slow):
        slow_node = slow["node"].astype(str).to_numpy(dtype=object)
        slow_since = _hours(slow["since"])
        until = pd.to_datetime(slow["until"], utc=True)
        slow_until = np.where(until.isna(), np.inf, _hours(until.fillna(pd.Timestamp(0, tz="UTC"))))
        slow_deficit = slow["deficit"].to_numpy(dtype=np.float64)
    else:
        slow_node, slow_since, slow_until, slow_deficit = (np.zeros(0),) * 4
    f = 0
    for h in times:
        idx = by_time[h]
        now = _time(h)
        at_h = scored.iloc[idx]
        repaired = {
            (c, n): _time(float(repair_t[(repair_node == n) & (repair_t <= h)].max()))
            for c, n in set(zip(at_h["cluster"].astype(str), at_h["node"].astype(str), strict=True))
            if ((repair_node == n) & (repair_t <= h)).any()
        }
        model_nodes = node_inputs(at_h, flag_threshold=first_tier, repairs=repaired)
        rule_nodes = (
            None
            if flagged is None
            else node_inputs(at_h.assign(risk=flagged[idx]), flag_threshold=first_tier, repairs=repaired)
        )
        running = np.flatnonzero((trace.start <= h) & (trace.end > h))
        for run in runs.values():
            if run.name == "none":
                continue
            tripped_at = run.state.breaker.tripped_at
            if tripped_at is not None and now - tripped_at >= breaker_reset_after:
                run.state = reset_breaker(run.state)
            nodes = rule_nodes if run.name == "rule" else model_nodes
            assert nodes is not None
            tripped = run.state.breaker.tripped
            if run.name == "cost":
                live = np.array([r for r in running if r not in run.moved], dtype=np.int64)
                outcome = decide_cost(
                    nodes,
                    job_map_at(trace, live, h, run.extra),
                    {n.node: gpus_per_node for n in nodes},
                    cost,
                    run.state,
                    run.hinted,
                    policy,
                    now,
                    fleet_nodes=fleet,
                )
                decisions = [d.decision for d in outcome.decisions]
                run.state, run.hinted = outcome.state, outcome.hinted
                for hint in outcome.hints:
                    j = job_index[hint.job.id]
                    run.extra[j] = h
                    run.figures["checkpoint_gpu_h"] += trace.job_gpus[j] * checkpoint_h
                    run.figures["hints"] += 1
            else:
                decisions, run.state = decide_tiers(nodes, run.state, policy, now, fleet_nodes=fleet)
            run.figures["breaker_trips"] += int(run.state.breaker.tripped and not tripped)
            for d in decisions:
                before, after = run.tier.get(d.node, "none"), d.tier
                run.tier[d.node] = after
                if after == "drain_now" and before != "drain_now":
                    restarted: set[int] = set()
                    for r in exposed(run, d.node, h):
                        run.moved.add(int(r))
                        j = int(trace.job[r])
                        if j in restarted:
                            continue
                        restarted.add(j)
                        lost = (h - last_checkpoint(trace, j, h, run.extra)) + restart_h
                        run.figures["drain_restart_gpu_h"] += trace.job_gpus[j] * lost
                        run.extra[j] = h
                if after in DRAINS and before not in DRAINS:
                    run.episode[d.node] = [h, 0.0]
                    run.figures["drains"] += 1
                elif after not in DRAINS and before in DRAINS:
                    entered, gpu_h = run.episode.pop(d.node)
                    run.episodes.append((d.node, entered, h, gpu_h))
        # The hour until the next grid time: placements that start, failures, time out of service.
        starting = np.flatnonzero((trace.start >= h) & (trace.start < h + step))
        ending_fails = []
        while f < len(fail_t) and fail_t[f] < h + step:
            ending_fails.append((fail_t[f], fail_node[f]))
            f += 1
        now_slow = (slow_since <= h) & (slow_until > h)
        slow_at = (
            pd.Series(slow_deficit[now_slow]).groupby(slow_node[now_slow]).max().to_dict() if now_slow.any() else {}
        )
        for run in runs.values():
            if slow_at:
                slowest: dict[int, float] = {}
                for r in running:
                    deficit = slow_at.get(trace.node[r])
                    if deficit is None or r in run.moved:
                        continue
                    j = int(trace.job[r])
                    slowest[j] = max(slowest.get(j, 0.0), deficit * min(trace.gpus[r] / gpus_per_node, 1.0))
                run.figures["slow_gpu_h"] += sum(trace.job_gpus[j] * step * x for j, x in slowest.items())
            for r in starting:
                tier = run.tier.get(trace.node[r], "none")
                multi = trace.job_gpus[trace.job[r]] > trace.gpus[r]
                if tier in DRAINS or (tier == "avoid" and multi):
                    run.moved.add(int(r))
            for t_fail, node in ending_fails:
                if run.tier.get(node, "none") == "drain_now":
                    run.figures["failures_on_drained_nodes"] += 1
                    continue
                hit = exposed(run, node, t_fail)
                if len(hit):
                    run.figures["failures_hitting_jobs"] += 1
                for j in {int(trace.job[r]) for r in hit}:
                    lost = (t_fail - last_checkpoint(trace, j, t_fail, run.extra)) + hang_restart
                    run.figures["failure_gpu_h"] += trace.job_gpus[j] * lost
                    run.extra[j] = t_fail
            for node, tier in run.tier.items():
                if tier == "avoid":
                    run.figures["avoid_gpu_h"] += cost.avoid_cost * gpus_per_node * step / horizon_h
                if tier not in DRAINS or node not in run.episode:
                    continue
                failed = fail_t[(fail_node == node) & (fail_t >= run.episode[node][0]) & (fail_t < h + step)]
                if len(failed) and failed.min() < h:
                    continue  # failed during the drain: down for repair anyway
                if tier == "drain_after_job" and len(exposed(run, node, h)):
                    continue  # its job still runs
                run.episode[node][1] += gpus_per_node * (min(failed.min(), h + step) - h if len(failed) else step)
            total = _spent(run)
            day = int((h - times[0]) // 24)
            run.daily[day] = run.daily.get(day, 0.0) + total - run.spent
            run.spent = total
    end = times[-1] + step
    out: dict[str, Any] = {}
    for run in runs.values():
        for node, (entered, gpu_h) in run.episode.items():
            run.episodes.append((node, entered, end, gpu_h))
        for node, entered, left, gpu_h in run.episodes:
            run.figures["drained_gpu_h"] += gpu_h
            failed = (fail_node == node) & (fail_t >= entered) & (fail_t <= max(left, entered + horizon_h))
            if not failed.any():
                run.figures["false_drains"] += 1
                run.figures["false_drain_gpu_h"] += gpu_h
        fig = run.figures
        fig["total_gpu_h"] = (
            fig["failure_gpu_h"]
            + fig["drain_restart_gpu_h"]
            + fig["drained_gpu_h"]
            + fig["checkpoint_gpu_h"]
            + fig["avoid_gpu_h"]
            + fig["slow_gpu_h"]
        )
        out[run.name] = {k: float(v) for k, v in fig.items()}
    baseline = out["none"]["total_gpu_h"]
    for figures in out.values():
        figures["saved_gpu_h"] = baseline - figures["total_gpu_h"]
    days = int((end - times[0] - 1e-9) // 24) + 1
    daily = {name: [run.daily.get(d, 0.0) for d in range(days)] for name, run in runs.items()}
    return {
        "policies": out,
        "daily_total_gpu_h": daily,
        "cost_against": {
            other: _paired_day_ci(daily["cost"], daily[other]) for other in ("none", "rule", "tiers") if other in daily
        },
        "start": _time(times[0]).isoformat(),
        "end": _time(end).isoformat(),
        "hours": len(times),
        "failures": len(fail_t),
        "jobs": len(np.unique(trace.job[(trace.end > times[0]) & (trace.start < end)])),
        "breaker_reset_after_h": breaker_reset_after.total_seconds() / 3600,
        "refill": refill_after_job_ends(trace, horizon_h, gpus_per_node),
    }


_COSTS = ("failure_gpu_h", "drain_restart_gpu_h", "checkpoint_gpu_h", "avoid_gpu_h", "slow_gpu_h")


def _spent(run: _Run) -> float:
    """GPU-hours the run has spent so far (drained hours of open and closed drains included)."""
    drained = sum(e[3] for e in run.episodes) + sum(e[1] for e in run.episode.values())
    return sum(run.figures[k] for k in _COSTS) + drained


def _paired_day_ci(a: list[float], b: list[float], samples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The total of a - b over the period, and a 95% percentile bootstrap interval of it with the
    days resampled (the same days for both: paired). Actions reach across days (a drain lasts a
    day or more), so the interval is a rough one."""
    diff = np.asarray(a) - np.asarray(b)
    draws = np.random.default_rng(seed).integers(0, len(diff), (samples, len(diff)))
    totals = diff[draws].sum(axis=1)
    return {
        "difference_gpu_h": float(diff.sum()),
        "ci95": [float(np.percentile(totals, 2.5)), float(np.percentile(totals, 97.5))],
    }


def evaluation_replay(
    trace: Trace,
    failures: pd.DataFrame,
    repairs: pd.DataFrame | None,
    policy: PolicyConfig,
    cost: CostConfig,
    gpus_per_node: int = 8,
    slow: pd.DataFrame | None = None,
) -> Any:
    """The `replay` hook of `models.comparison.evaluate_walk_forward` (`gpufail evaluate
    --policy`): the replay of the test rows with the primary contender's calibrated risk."""

    def run(test: pd.DataFrame, risk: np.ndarray, rule: np.ndarray | None) -> dict[str, Any]:
        return replay(test, risk, rule, trace, failures, policy, cost, repairs, gpus_per_node, slow=slow)

    return run


def read_trace(path: str) -> Trace:
    """A job trace file (Parquet, the columns of `TRACE_COLUMNS`: `ingest.simulator.jobs`)."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise InputError(
            f"{path}: no job trace; `gpufail simulate` writes one (jobs/trace.parquet), or write one of your "
            f"scheduler's jobs with the columns {list(TRACE_COLUMNS)} (docs/actions.md)"
        ) from None
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise InputError(f"{path}: not a readable Parquet job trace ({type(exc).__name__}: {exc})") from None
    return Trace.from_frame(table.to_pandas(), path)
