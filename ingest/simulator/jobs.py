"""The simulated fleet's jobs: who runs where, when, and how often each job checkpoints.

A greedy scheduler fills the fleet planned by `ingest.simulator.fleet` with jobs from 1 GPU to
thousands (capped at a third of the fleet), in steps of a quarter hour:

- sizes: most jobs are small, most GPU-hours are in large gang jobs (`JobMix.size_weights`);
  a job of 8 GPUs or more takes whole nodes, a smaller one packs onto a partly used node;
- durations: log-normal, longer for larger jobs; each job has a time limit above its duration
  (what `squeue` shows as its end) and checkpoints every `checkpoint_hours` from its start;
- a node takes new work only while it has joined, is out of maintenance and has a live GPU in
  every slot (a failed board waits for its replacement);
- when a GPU fails or a maintenance window starts under a job, the job's placement on that node
  ends then, and the job goes on on a free node if there is one (the restart itself is the
  replay's to count: `serving.replay`).

The trace (`trace_table`, written as `jobs/trace.parquet`) has one row per placement: a job's
GPUs on one node for a span of time. It is what a scheduler's accounting (`sacct`) would give;
`serving.replay` reads it back into job maps (`serving.jobs.JobMap`) hour by hour.

The jobs draw from their own random stream (seeded from the simulation's seed), so adding them
leaves the telemetry and failures of a seed unchanged. They do not drive the telemetry's
utilisation (`FleetPlan.busy`), which keeps its own per-node periods.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ingest.simulator.fleet import FleetPlan

STEP_H = 0.25
TRACE_SCHEMA = pa.schema(
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("gpus", pa.int32(), nullable=False),
        pa.field("start", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("end", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("job_gpus", pa.int32(), nullable=False),
        pa.field("job_start", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("job_end_by", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("checkpoint_interval_s", pa.int64(), nullable=False),
        pa.field("end_reason", pa.string(), nullable=False),
    ]
)
"""One row per placement: `gpus` of job `job_id` on `node` over [start, end). `end_reason`:
`done` (the job ended), `failure` (a GPU of the node failed), `maintenance`, `period_end`."""


@dataclass(frozen=True)
class JobMix:
    """The workload's shape (values are starting points, not measured)."""

    size_weights: dict[int, float] = field(
        default_factory=lambda: {
            1: 0.22,
            2: 0.08,
            4: 0.08,
            8: 0.2,
            16: 0.1,
            32: 0.09,
            64: 0.08,
            128: 0.06,
            256: 0.04,
            512: 0.025,
            1024: 0.015,
            2048: 0.008,
            4096: 0.004,
        }
    )
    """Share of jobs of each size (GPUs); sizes above `max_fleet_share` of the fleet are dropped."""
    max_fleet_share: float = 1 / 3
    median_hours_1_gpu: float = 3.0
    size_exponent: float = 0.25
    """Median duration = median_hours_1_gpu x GPUs ** size_exponent (1 GPU: 3 h, 4,096: 24 h)."""
    duration_sigma: float = 0.8
    max_hours: float = 14 * 24
    checkpoint_hours: dict[float, float] = field(default_factory=lambda: {0.5: 0.2, 1.0: 0.4, 2.0: 0.3, 4.0: 0.1})
    utilisation: float = 0.85
    """The scheduler starts jobs while less than this share of the available GPUs is in use."""
    backfill_tries: int = 50
    """Jobs drawn per step to fill the gaps while the head of the queue waits."""
    max_wait_hours: float = 6.0
    """After the head of the queue has waited this long, nothing is backfilled before it."""
    give_up_hours: float = 24.0
    """A job that could not start within this long is withdrawn (its size exceeds what is up)."""

    def sizes_for(self, fleet_gpus: int) -> tuple[np.ndarray, np.ndarray]:
        cap = max(1, int(fleet_gpus * self.max_fleet_share))
        sizes = np.array([s for s in self.size_weights if s <= cap])
        weights = np.array([self.size_weights[s] for s in sizes], dtype=float)
        return sizes, weights / weights.sum()


@dataclass
class JobTrace:
    """The placements, as arrays in hours since the period start."""

    job_id: list[str]
    node: list[int]
    gpus: list[int]
    start_h: list[float]
    end_h: list[float]
    end_reason: list[str]
    # per job (index = int(job_id[1:]) order of creation)
    job_gpus: list[int]
    job_start_h: list[float]
    job_end_by_h: list[float]
    job_interval_h: list[float]


def plan_jobs(plan: FleetPlan, seed: int, mix: JobMix | None = None) -> JobTrace:
    """Schedule jobs onto `plan`'s fleet over its whole period (see the module)."""
    mix = mix or JobMix()
    rng = np.random.default_rng([seed, 29])
    per_node = plan.preset.gpus_per_node
    n_nodes = len(plan.node_names)
    sizes, size_p = mix.sizes_for(n_nodes * per_node)
    intervals = np.array(list(mix.checkpoint_hours))
    interval_p = np.array(list(mix.checkpoint_hours.values()))
    interval_p = interval_p / interval_p.sum()

    # Node events in time order: a GPU fails (its slot dead until the repair), a replacement
    # arrives, a maintenance window starts or ends.
    events: list[tuple[float, int, str, int]] = []
    for g in np.flatnonzero(np.isfinite(plan.gpu_end_h)):
        events.append((float(plan.gpu_end_h[g]), 0, "fail", int(plan.gpu_node[g])))
        if np.isfinite(plan.repair_h[g]):
            events.append((float(plan.repair_h[g]), 1, "repair", int(plan.gpu_node[g])))
    for node, start, end, _ in plan.maintenance:
        events.append((start, 0, "down", node))
        events.append((end, 1, "up", node))
    events.sort()

    dead = np.zeros(n_nodes, dtype=np.int32)  # slots waiting for a replacement board
    down = np.zeros(n_nodes, dtype=np.int32)  # maintenance windows open
    used = np.zeros(n_nodes, dtype=np.int32)
    gang = np.zeros(n_nodes, dtype=bool)  # a whole-node job holds it
    active: dict[int, set[int]] = {n: set() for n in range(n_nodes)}  # node -> placement rows
    trace = JobTrace([], [], [], [], [], [], [], [], [], [])
    ends: list[tuple[float, int]] = []  # (job end, job)
    job_rows: dict[int, set[int]] = {}
    pending: tuple[int, float, float, float] | None = None  # the head of the queue: GPUs, hours, interval, since

    def available(t: float) -> np.ndarray:
        return (plan.node_join_h <= t) & (down == 0) & (dead == 0)

    def place(job: int, node: int, gpus: int, t: float, whole: bool) -> None:
        row = len(trace.node)
        trace.job_id.append(f"j{job}")
        trace.node.append(node)
        trace.gpus.append(gpus)
        trace.start_h.append(t)
        trace.end_h.append(np.inf)
        trace.end_reason.append("")
        used[node] += gpus
        gang[node] |= whole
        active[node].add(row)
        job_rows.setdefault(job, set()).add(row)

    def close(row: int, t: float, reason: str) -> None:
        node = trace.node[row]
        trace.end_h[row] = t
        trace.end_reason[row] = reason
        used[node] -= trace.gpus[row]
        if trace.gpus[row] >= per_node:
            gang[node] = False
        active[node].discard(row)
        job_rows[int(trace.job_id[row][1:])].discard(row)

    def free_nodes(t: float) -> np.ndarray:
        return np.flatnonzero(available(t) & (used == 0))

    def try_start(gpus: int, t: float) -> list[tuple[int, int]] | None:
        if gpus >= per_node:
            need = gpus // per_node
            free = free_nodes(t)
            if len(free) < need:
                return None
            return [(int(n), per_node) for n in rng.choice(free, size=need, replace=False)]
        room = per_node - used
        fits = np.flatnonzero(available(t) & ~gang & (room >= gpus))
        if not len(fits):
            return None
        best = fits[room[fits] == room[fits].min()]  # best fit: keep whole nodes free for gangs
        return [(int(rng.choice(best)), gpus)]

    def interrupt(node: int, t: float, reason: str) -> None:
        for row in sorted(active[node]):
            job, gpus = int(trace.job_id[row][1:]), trace.gpus[row]
            close(row, t, reason)
            spot = try_start(gpus, t)
            if spot is not None:
                for n, g in spot:
                    place(job, n, g, t, gpus >= per_node)

    def draw(t: float) -> tuple[int, float, float, float]:
        gpus = int(rng.choice(sizes, p=size_p))
        median = mix.median_hours_1_gpu * gpus**mix.size_exponent
        hours = float(np.clip(rng.lognormal(np.log(median), mix.duration_sigma), STEP_H, mix.max_hours))
        return gpus, hours, float(rng.choice(intervals, p=interval_p)), t

    def start_job(spec: tuple[int, float, float, float], t: float) -> bool:
        gpus, hours, interval, _ = spec
        spot = try_start(gpus, t)
        if spot is None:
            return False
        job = len(trace.job_gpus)
        start = t
        trace.job_gpus.append(gpus)
        trace.job_start_h.append(start)
        trace.job_end_by_h.append(start + float(np.ceil(hours * rng.uniform(1.0, 2.0))))
        trace.job_interval_h.append(interval)
        for n, g in spot:
            place(job, n, g, start, gpus >= per_node)
        heapq.heappush(ends, (start + hours, job))
        return True

    e = 0
    steps = int(plan.hours / STEP_H)
    for step in range(steps + 1):
        t = step * STEP_H
        # Node events and job ends up to t, in time order (a job that ends before a failure
        # of its node is not hit by it).
        while (e < len(events) and events[e][0] <= t) or (ends and ends[0][0] <= t):
            if ends and (e >= len(events) or ends[0][0] <= events[e][0]):
                when, job = heapq.heappop(ends)
                for row in sorted(job_rows.get(job, ())):
                    close(row, when, "done")
                continue
            when, _, kind, node = events[e]
            e += 1
            if kind == "fail":
                dead[node] += 1  # first, so the node's jobs do not restart on it
                interrupt(node, when, "failure")
            elif kind == "repair":
                dead[node] = max(dead[node] - 1, 0)
            elif kind == "down":
                down[node] += 1
                interrupt(node, when, "maintenance")
            else:
                down[node] = max(down[node] - 1, 0)
        if step == steps:
            break
        capacity = int(available(t).sum()) * per_node
        tries = 0
        while used.sum() < mix.utilisation * capacity and tries < mix.backfill_tries:
            if pending is None:
                pending = draw(t)
            job_spec = pending
            if not start_job(job_spec, t):
                # The head of the queue waits for room; smaller jobs drawn meanwhile fill the
                # gaps (backfill) until the head has waited `max_wait_hours`, then the fleet
                # drains for it.
                if t - job_spec[3] >= mix.give_up_hours:
                    pending = None  # withdrawn: the fleet has not had room for it
                    continue
                if t - job_spec[3] >= mix.max_wait_hours:
                    break
                tries += 1
                extra = draw(t)
                if extra[0] < job_spec[0]:
                    start_job(extra, t)
                continue
            pending = None
    for node in range(n_nodes):
        for row in sorted(active[node]):
            close(row, float(plan.hours), "period_end")
    return trace


def trace_table(plan: FleetPlan, trace: JobTrace) -> pa.Table:
    """The trace as rows of `TRACE_SCHEMA`, ordered by start."""
    order = np.argsort(np.asarray(trace.start_h), kind="stable")
    job = np.array([int(j[1:]) for j in trace.job_id], dtype=np.int64)[order]
    return pa.table(
        {
            "job_id": pa.array(np.asarray(trace.job_id, dtype=object)[order], pa.string()),
            "node": pa.array([plan.node_names[n] for n in np.asarray(trace.node)[order]], pa.string()),
            "gpus": pa.array(np.asarray(trace.gpus, dtype=np.int32)[order]),
            "start": plan.timestamps(np.asarray(trace.start_h)[order]),
            "end": plan.timestamps(np.asarray(trace.end_h)[order]),
            "job_gpus": pa.array(np.asarray(trace.job_gpus, dtype=np.int32)[job]),
            "job_start": plan.timestamps(np.asarray(trace.job_start_h)[job]),
            "job_end_by": plan.timestamps(np.asarray(trace.job_end_by_h)[job]),
            "checkpoint_interval_s": pa.array(np.round(np.asarray(trace.job_interval_h)[job] * 3600).astype(np.int64)),
            "end_reason": pa.array(np.asarray(trace.end_reason, dtype=object)[order], pa.string()),
        },
        schema=TRACE_SCHEMA,
    )
