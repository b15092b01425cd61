"""`gpufail simulate`: plan the fleet, render it day by day, write a gpufail data root.

Output (under `--out`):
    gpufail.json, telemetry/            the telemetry dataset, as a collector would write it
    raw/kernel-log/<node>.log           kernel logs to be parsed by `gpufail ingest kernel-log`
    repairs/                            operator records: failed boards replaced
    failures/                           ground truth: when each GPU failed, how, with what warning
    ground_truth/gpus.parquet           every board's slot, lifetime and latent health
    jobs/trace.parquet                  the jobs the fleet ran: one row per job and node
                                        (`ingest.simulator.jobs`; the replay reads it)
    simulation.json                     preset, seed, calibration and counts

Everything is written into a hidden sibling folder first and renamed into place at the end,
so an interrupted or failed run leaves nothing at `--out`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from ingest.errors import InputError
from ingest.simulator.fleet import FleetPlan, plan_fleet
from ingest.simulator.jobs import plan_jobs, trace_table
from ingest.simulator.kernel_log_writer import KernelLogWriter
from ingest.simulator.presets import Preset, get_preset
from ingest.simulator.telemetry import CounterState, render_day
from ingest.store import Store


@dataclass
class SimulationSummary:
    out: str
    preset: str
    seed: int
    gpus: int
    nodes: int
    days: int
    telemetry_rows: int
    kernel_log_lines: int
    failures: int
    expected_failures: float
    failures_by_mode: dict[str, int]
    seconds: float
    jobs: int = 0
    job_placements: int = 0


def simulate(
    out: str | Path,
    preset_name: str = "demo",
    seed: int = 7,
    progress: bool = True,
    cluster: str = "default",
    **overrides: object,
) -> SimulationSummary:
    """Simulate a fleet into a new data root at `out` (which must be absent or empty).

    `cluster` is the name written into every row; use the one `gpufail ingest` is configured
    with so kernel-log events map onto the simulated GPUs."""
    preset = get_preset(preset_name, **overrides)
    if "://" in str(out):
        raise InputError(
            f"simulate --out {out}: the simulator writes to a local folder; copy the result to object storage afterwards"
        )
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"simulate --out {out}: exists and is not an empty folder; choose a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        summary = _simulate_into(staging, preset, seed, progress, cluster)
        if out.exists():
            out.rmdir()
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    summary.out = str(out)
    (out / "simulation.json").write_text(
        json.dumps(asdict(summary) | {"preset_parameters": _describe(preset)}, indent=1, default=str)
    )
    return summary


def _simulate_into(root: Path, preset: Preset, seed: int, progress: bool, cluster: str) -> SimulationSummary:
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    plan = plan_fleet(preset, seed, cluster)
    store = Store.create(str(root))
    state = CounterState.start(len(plan.gpu_uuid), rng)
    logs = KernelLogWriter(plan, root / "raw" / "kernel-log", rng)
    rows = 0
    days = tqdm(range(preset.days), desc=f"simulate {preset.name}", unit="day", disable=not progress)
    # Parquet encoding releases the GIL: write day d on a second thread while day d+1 renders.
    # At most one day waits, so memory stays bounded by two days of the fleet.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="parquet-writer") as writer:
        pending: Future[str] | None = None
        for day in days:
            table, events = render_day(plan, day, state, rng)
            if pending is not None:
                pending.result()  # surfaces a write error before more work is done
            pending = writer.submit(store.write_partition, "telemetry", preset.start + timedelta(days=day), table)
            logs.write(logs.day_entries(day, (events.gpu, events.t_h, events.xid)))
            rows += table.num_rows
            days.set_postfix(rows=f"{rows:,}")
        if pending is not None:
            pending.result()
    # Year-less log formats take their year from the file's modification time, as on a real host.
    end = datetime.combine(preset.start + timedelta(days=preset.days), datetime.min.time(), tzinfo=UTC).timestamp()
    for log in (root / "raw" / "kernel-log").glob("*.log"):
        os.utime(log, (end, end))
    failures = ground_truth_failures(plan)
    store.write("failures", failures)
    store.write("repairs", ground_truth_repairs(plan))
    (root / "ground_truth").mkdir()
    pq.write_table(ground_truth_gpus(plan), root / "ground_truth" / "gpus.parquet")
    trace = plan_jobs(plan, seed)
    (root / "jobs").mkdir()
    pq.write_table(trace_table(plan, trace), root / "jobs" / "trace.parquet")
    modes = [m.name for m in preset.failure_modes]
    by_mode = {
        name: int(count)
        for name, count in zip(
            modes, np.bincount(plan.fail_mode[plan.fail_mode >= 0], minlength=len(modes)), strict=True
        )
    }
    return SimulationSummary(
        out=str(root),
        preset=preset.name,
        seed=seed,
        gpus=len(plan.gpu_uuid),
        nodes=len(plan.node_names),
        days=preset.days,
        telemetry_rows=rows,
        kernel_log_lines=logs.lines_written,
        failures=failures.num_rows,
        expected_failures=round(preset.expected_failures, 1),
        failures_by_mode=by_mode,
        seconds=round(time.perf_counter() - started, 2),
        jobs=len(trace.job_gpus),
        job_placements=len(trace.node),
    )


def ground_truth_failures(plan: FleetPlan) -> pa.Table:
    gpus = np.flatnonzero(plan.fail_mode >= 0)
    end = plan.gpu_end_h[gpus]
    has_lead = plan.lead_h[gpus] > 0
    precursor_start = plan.timestamps(end - plan.lead_h[gpus], missing=~has_lead)
    xid = plan.fail_xid[gpus]
    return pa.table(
        {
            "ts": plan.timestamps(end),
            "cluster": [plan.cluster] * len(gpus),
            "node": [plan.node_names[n] for n in plan.gpu_node[gpus]],
            "gpu_index": plan.gpu_slot[gpus].astype(np.int16),
            "gpu_uuid": [plan.gpu_uuid[g] for g in gpus],
            "gpu_model": [plan.model_names[plan.node_model[n]] for n in plan.gpu_node[gpus]],
            "mode": [plan.preset.failure_modes[m].name for m in plan.fail_mode[gpus]],
            "xid": pa.array(xid, type=pa.int32(), mask=xid == 0),
            "precursor_start": precursor_start,
            "precursor_strength": plan.strength[gpus].astype(np.float32),
        }
    )


def ground_truth_repairs(plan: FleetPlan) -> pa.Table:
    old = np.flatnonzero(np.isfinite(plan.repair_h))
    return pa.table(
        {
            "ts": plan.timestamps(plan.repair_h[old]),
            "cluster": [plan.cluster] * len(old),
            "node": [plan.node_names[n] for n in plan.gpu_node[old]],
            "gpu_index": plan.gpu_slot[old].astype(np.int16),
            "old_gpu_uuid": [plan.gpu_uuid[g] for g in old],
            "new_gpu_uuid": [plan.gpu_uuid[g] for g in plan.replaced_by[old]],
            "action": ["replace"] * len(old),
        }
    )


def ground_truth_gpus(plan: FleetPlan) -> pa.Table:
    modes = [m.name for m in plan.preset.failure_modes]
    return pa.table(
        {
            "gpu_uuid": plan.gpu_uuid,
            "node": [plan.node_names[n] for n in plan.gpu_node],
            "gpu_index": plan.gpu_slot.astype(np.int16),
            "gpu_model": [plan.model_names[plan.node_model[n]] for n in plan.gpu_node],
            "installed": plan.timestamps(plan.gpu_start_h),
            "failed": plan.timestamps(plan.gpu_end_h, missing=~np.isfinite(plan.gpu_end_h)),
            "failure_mode": [modes[m] if m >= 0 else None for m in plan.fail_mode],
            "frailty": plan.gpu_frailty.astype(np.float32),
            "bad_batch": plan.gpu_bad_batch,
            "benign_sbe_noise": plan.gpu_benign_sbe,
            "benign_nvlink_noise": plan.gpu_benign_nvlink,
            "fail_slow_since": plan.timestamps(plan.slow_onset_h, missing=~np.isfinite(plan.slow_onset_h)),
            "fail_slow_deficit": plan.slow_deficit.astype(np.float32),
        }
    )


def _describe(preset: Preset) -> dict[str, object]:
    described = asdict(preset)
    described["failure_modes"] = [asdict(m) for m in preset.failure_modes]
    return described
