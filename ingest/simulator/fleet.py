"""The fleet plan: everything about the simulated period decided up front, cheaply.

The plan is small (per node, per GPU, per event) so that the expensive part, rendering samples,
can run one day at a time in bounded memory. Time is in hours since the start of the period.

Decided here:
- layout: nodes of 8 GPUs, GPU model per node, PCI bus ids per slot, nodes that join late;
- latent health: per-GPU and per-node log-normal frailty (lemon nodes), a bad install batch
  whose hazard rises mid-period, benign look-alikes (chronic single-bit ECC or NVLink CRC noise
  on GPUs that never fail);
- GPU lifetimes: an hourly hazard loop draws failures and their mode; a failed GPU leaves the
  fleet and is replaced (new UUID, same slot) after a repair delay;
- workload: per-node busy/idle periods and their utilisation level;
- operations: maintenance windows and a rolling driver upgrade (both reload the driver, which
  resets volatile counters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ingest.simulator.presets import LLAMA3_GPU_FAILURES_PER_GPU_HOUR, LOG_FORMATS, Preset

# PCI bus ids of the eight GPUs on an HGX baseboard, as the kernel log prints them.
SLOT_PCI_BUS_IDS = (
    "0000:18:00",
    "0000:2a:00",
    "0000:3a:00",
    "0000:5d:00",
    "0000:9a:00",
    "0000:ab:00",
    "0000:ba:00",
    "0000:db:00",
)
NO_FAILURE = -1


@dataclass
class FleetPlan:
    preset: Preset
    cluster: str
    hours: int
    model_names: list[str]
    # per node
    node_names: list[str]
    node_model: np.ndarray  # index into model_names
    node_join_h: np.ndarray
    node_frailty: np.ndarray
    node_cooling_c: np.ndarray  # inlet temperature offset of the node's position
    node_log_format: list[str]
    node_upgrade_h: np.ndarray  # when the node's driver is upgraded
    busy: np.ndarray  # (nodes, samples) bool: a job runs
    job_util: np.ndarray  # (nodes, samples) uint8: the running job's utilisation level
    down: np.ndarray  # (nodes, samples) bool: maintenance, no telemetry
    reload: np.ndarray  # (nodes, samples) bool: first sample after a driver reload
    maintenance: list[tuple[int, float, float, bool]]  # (node, start_h, end_h, is_driver_upgrade)
    # per GPU (every board that ever sits in a slot, in order of installation)
    gpu_uuid: list[str]
    gpu_node: np.ndarray
    gpu_slot: np.ndarray
    gpu_start_h: np.ndarray
    gpu_end_h: np.ndarray  # failure time, or +inf
    gpu_frailty: np.ndarray
    gpu_bad_batch: np.ndarray
    gpu_benign_sbe: np.ndarray
    gpu_benign_nvlink: np.ndarray
    gpu_efficiency: np.ndarray
    fail_mode: np.ndarray  # index into preset.failure_modes, or NO_FAILURE
    fail_xid: np.ndarray  # terminal XID (0 = off-the-bus text with no Xid number)
    lead_h: np.ndarray
    strength: np.ndarray  # 0 for silent failures
    repair_h: np.ndarray  # when the replacement arrives (+inf when none)
    replaced_by: np.ndarray  # index of the replacement GPU, or -1
    slow_onset_h: np.ndarray  # when the board turns fail-slow (+inf: never)
    slow_deficit: np.ndarray  # the share of its speed it loses then (0: none)

    def slowdown(self, gpus: np.ndarray, t_h: np.ndarray) -> np.ndarray:
        """(len(gpus), len(t_h)) the share of speed each board has lost at each time."""
        on = t_h[None, :] >= self.slow_onset_h[gpus, None]
        return np.where(on, self.slow_deficit[gpus, None], 0.0).astype(np.float32)

    def timestamps(self, hours: np.ndarray, missing: np.ndarray | None = None) -> pa.Array:
        """Hours since the period start -> UTC timestamps; `missing` marks nulls."""
        start = np.datetime64(self.preset.start.isoformat(), "us")
        finite = np.where(np.isfinite(hours), hours, 0)
        values = start + (finite * 3_600_000_000).astype("timedelta64[us]")
        return pa.array(values, type=pa.timestamp("us", tz="UTC"), mask=missing)

    def driver_at(self, node: np.ndarray, t_h: np.ndarray) -> np.ndarray:
        """True where the node already runs the new driver at time t."""
        return t_h >= self.node_upgrade_h[node]


def make_uuid(rng: np.random.Generator) -> str:
    h = rng.bytes(16).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def plan_fleet(preset: Preset, seed: int, cluster: str = "default") -> FleetPlan:
    rng = np.random.default_rng(seed)
    hours = preset.days * 24
    n_nodes = preset.nodes + round(preset.nodes * preset.new_nodes_fraction)
    model_names = list(preset.model_mix)
    probs = np.array([preset.model_mix[m] for m in model_names])
    node_model = rng.choice(len(model_names), size=n_nodes, p=probs / probs.sum())
    node_join_h = np.zeros(n_nodes)
    # New nodes join at one moment, the way a new rack is brought up; they are H100s.
    late = np.arange(preset.nodes, n_nodes)
    node_join_h[late] = preset.new_nodes_day_fraction * hours
    node_model[late] = model_names.index("NVIDIA H100 80GB HBM3") if "NVIDIA H100 80GB HBM3" in model_names else 0
    node_frailty = _unit_mean_lognormal(rng, preset.node_frailty_sigma, n_nodes)
    node_cooling_c = rng.normal(0, 2.5, n_nodes)
    formats = list(LOG_FORMATS)
    fmt_p = np.array(list(LOG_FORMATS.values()))
    node_log_format = [formats[i] for i in rng.choice(len(formats), size=n_nodes, p=fmt_p / fmt_p.sum())]
    node_upgrade_h = preset.driver_upgrade_start_h + rng.uniform(0, preset.driver_rollout_days * 24, n_nodes)
    node_upgrade_h = np.maximum(node_upgrade_h, node_join_h)  # a node joining later is upgraded on arrival
    node_names = [f"gpu-node-{i + 1:04d}" for i in range(n_nodes)]

    samples = preset.days * preset.samples_per_day
    busy, job_util = _plan_jobs(rng, preset, n_nodes, samples)
    down, reload, maintenance = _plan_maintenance(rng, preset, node_join_h, node_upgrade_h, samples)

    gpus = _plan_gpus(rng, preset, hours, node_model, node_join_h, node_frailty, node_upgrade_h, model_names)
    # Its own stream: a fleet without fail-slow boards is the same as before the mode existed.
    gpus |= _plan_fail_slow(np.random.default_rng([seed, 73]), preset, hours, gpus["gpu_start_h"], gpus["gpu_end_h"])
    return FleetPlan(
        preset=preset,
        cluster=cluster,
        hours=hours,
        model_names=model_names,
        node_names=node_names,
        node_model=node_model,
        node_join_h=node_join_h,
        node_frailty=node_frailty,
        node_cooling_c=node_cooling_c,
        node_log_format=node_log_format,
        node_upgrade_h=node_upgrade_h,
        busy=busy,
        job_util=job_util,
        down=down,
        reload=reload,
        maintenance=maintenance,
        **gpus,
    )


def _plan_fail_slow(
    rng: np.random.Generator, preset: Preset, hours: int, start_h: np.ndarray, end_h: np.ndarray
) -> dict[str, np.ndarray]:
    """Which boards turn fail-slow, when (uniformly within their time in the period) and by how much."""
    n = len(start_h)
    onset = np.full(n, np.inf)
    deficit = np.zeros(n)
    if preset.fail_slow_fraction <= 0:
        return {"slow_onset_h": onset, "slow_deficit": deficit}
    chosen = np.flatnonzero(rng.random(n) < preset.fail_slow_fraction)
    lo, hi = start_h[chosen], np.minimum(end_h[chosen], hours)
    onset[chosen] = lo + rng.random(len(chosen)) * np.maximum(hi - lo, 0)
    deficit[chosen] = rng.uniform(*preset.fail_slow_deficit, len(chosen))
    return {"slow_onset_h": onset, "slow_deficit": deficit}


def _unit_mean_lognormal(rng: np.random.Generator, sigma: float, n: int) -> np.ndarray:
    return rng.lognormal(-(sigma**2) / 2, sigma, n)


def _plan_jobs(rng: np.random.Generator, preset: Preset, n_nodes: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Alternating idle and busy periods per node; all 8 GPUs of a node run the same job."""
    per_h = 3600 / preset.sample_interval_s
    busy = np.zeros((n_nodes, samples), dtype=bool)
    job_util = np.zeros((n_nodes, samples), dtype=np.uint8)
    for node in range(n_nodes):
        pos = int(rng.uniform(0, preset.idle_mean_h) * per_h)
        while pos < samples:
            length = max(1, int(rng.lognormal(np.log(preset.job_median_h), 1.0) * per_h))
            busy[node, pos : pos + length] = True
            job_util[node, pos : pos + length] = int(rng.uniform(70, 99))
            pos += length + max(1, int(rng.exponential(preset.idle_mean_h) * per_h))
    return busy, job_util


def _plan_maintenance(
    rng: np.random.Generator, preset: Preset, node_join_h: np.ndarray, node_upgrade_h: np.ndarray, samples: int
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, float, float, bool]]]:
    per_h = 3600 / preset.sample_interval_s
    hours = preset.days * 24
    down = np.zeros((len(node_join_h), samples), dtype=bool)
    reload = np.zeros_like(down)
    windows: list[tuple[int, float, float, bool]] = []
    for node in range(len(node_join_h)):
        count = rng.poisson(preset.days / preset.maintenance_every_days)
        starts = rng.uniform(node_join_h[node], hours, count)
        node_windows = [(float(s), float(s + rng.uniform(2, 8)), False) for s in starts]
        up = float(node_upgrade_h[node])
        if node_join_h[node] < up < hours:
            node_windows.append((up, up + rng.uniform(0.5, 1.0), True))
        for start, end, is_upgrade in node_windows:
            a, b = int(start * per_h), min(samples, int(np.ceil(end * per_h)))
            down[node, a:b] = True
            if b < samples:
                reload[node, b] = True
            windows.append((node, start, end, is_upgrade))
    return down, reload, sorted(windows, key=lambda w: w[1])


def _plan_gpus(
    rng: np.random.Generator,
    preset: Preset,
    hours: int,
    node_model: np.ndarray,
    node_join_h: np.ndarray,
    node_frailty: np.ndarray,
    node_upgrade_h: np.ndarray,
    model_names: list[str],
) -> dict[str, Any]:
    """Who sits in each slot, and when and how each board fails.

    An hourly loop over the period, vectorised over slots: at each hour every occupied slot
    fails with its current hazard; a failed board is replaced after a repair delay by a new one
    with fresh (average) health.
    """
    n_slots = len(node_model) * preset.gpus_per_node
    slot_node = np.repeat(np.arange(len(node_model)), preset.gpus_per_node)
    modes = preset.failure_modes
    shares = np.array([m.share for m in modes])
    gsp = [m.name for m in modes].index("gsp")
    base = LLAMA3_GPU_FAILURES_PER_GPU_HOUR * preset.acceleration

    rows: dict[str, list] = {
        k: [] for k in ("node", "slot", "start", "frailty", "bad", "benign_sbe", "benign_nvl", "eff")
    }

    def install(slots: np.ndarray, at: np.ndarray, first: bool) -> np.ndarray:
        start = len(rows["node"])
        n = len(slots)
        rows["node"].extend(slot_node[slots])
        rows["slot"].extend(slots % preset.gpus_per_node)
        rows["start"].extend(at)
        rows["frailty"].extend(_unit_mean_lognormal(rng, preset.gpu_frailty_sigma, n))
        # The bad batch is one install lot of A100s in the original fleet.
        eligible = first & (np.array([model_names[node_model[s]] for s in slot_node[slots]]) == "NVIDIA A100-SXM4-80GB")
        share_of_eligible = preset.bad_batch_fraction / max(eligible.mean(), 1e-9) if first else 0.0
        rows["bad"].extend(eligible & (rng.random(n) < share_of_eligible))
        rows["benign_sbe"].extend(rng.random(n) < preset.benign_sbe_fraction)
        rows["benign_nvl"].extend(rng.random(n) < preset.benign_nvlink_fraction)
        rows["eff"].extend(rng.normal(1.0, 0.03, n))
        return np.arange(start, start + n)

    occupant = install(np.arange(n_slots), node_join_h[slot_node], True)
    # The current occupant's health, per slot, so the loop never converts the growing lists.
    slot_frailty = np.asarray(rows["frailty"]) * node_frailty[slot_node]
    slot_bad = np.asarray(rows["bad"], dtype=bool)
    pending_until = np.full(n_slots, np.inf)  # a failed slot waits for its replacement
    failed_in = np.full(n_slots, -1)  # the failed board a waiting slot held (its occupant is -1)
    failures: list[tuple[int, float, int]] = []  # (gpu, time, mode)
    replacements: list[tuple[int, int, float]] = []  # (old gpu, new gpu, time)
    onset = preset.bad_batch_onset_fraction * hours
    for hour in range(hours):
        # Slots whose replacement arrives now get a new board.
        arriving = np.flatnonzero(pending_until <= hour)
        if len(arriving):
            arrive_at = pending_until[arriving]
            new = install(arriving, arrive_at, False)
            for old, nw, t in zip(failed_in[arriving], new, arrive_at, strict=True):
                replacements.append((int(old), int(nw), float(t)))
            occupant[arriving] = new
            slot_frailty[arriving] = np.asarray(rows["frailty"][-len(new) :]) * node_frailty[slot_node[arriving]]
            slot_bad[arriving] = False
            pending_until[arriving] = np.inf
        live = (occupant >= 0) & (node_join_h[slot_node] <= hour)
        gpu = occupant[live]
        frailty = slot_frailty[live]
        ramp = np.clip((hour - onset) / (preset.bad_batch_ramp_days * 24), 0, 1)
        batch = np.where(slot_bad[live], 1 + (preset.bad_batch_multiplier - 1) * ramp, 1.0)
        new_driver = hour >= node_upgrade_h[slot_node[live]]
        mode_weight = np.tile(shares, (len(gpu), 1))
        mode_weight[:, gsp] *= np.where(new_driver, preset.new_driver_gsp_multiplier, 1.0)
        hazard = base * frailty * batch * mode_weight.sum(axis=1)
        fails = rng.random(len(gpu)) < hazard
        if not fails.any():
            continue
        when = hour + rng.random(fails.sum())
        weights = mode_weight[fails] / mode_weight[fails].sum(axis=1, keepdims=True)
        chosen = (rng.random((len(weights), 1)) > np.cumsum(weights, axis=1)).sum(axis=1)
        failed_slots = np.flatnonzero(live)[fails]
        for g, t, m in zip(gpu[fails], when, chosen, strict=True):
            failures.append((int(g), float(t), int(m)))
        pending_until[failed_slots] = when + rng.uniform(*preset.repair_hours, len(failed_slots))
        failed_in[failed_slots] = occupant[failed_slots]
        occupant[failed_slots] = -1

    n = len(rows["node"])
    end = np.full(n, np.inf)
    fail_mode = np.full(n, NO_FAILURE)
    fail_xid = np.full(n, -1)
    lead = np.zeros(n)
    strength = np.zeros(n)
    for g, t, m in failures:
        mode = modes[m]
        end[g], fail_mode[g] = t, m
        codes = list(mode.terminal_xids)
        fail_xid[g] = codes[rng.choice(len(codes), p=list(mode.terminal_xids.values()))]
        if mode.lead_median_h > 0 and rng.random() >= mode.silent_fraction:
            lead[g] = np.clip(
                rng.lognormal(np.log(mode.lead_median_h), mode.lead_sigma), mode.lead_min_h, mode.lead_max_h
            )
            strength[g] = rng.uniform(0.15, 1.0)
    repair = np.full(n, np.inf)
    replaced_by = np.full(n, -1)
    for old_gpu, new_gpu, arrived in replacements:
        repair[old_gpu] = arrived
        replaced_by[old_gpu] = new_gpu
    return {
        "gpu_uuid": [make_uuid(rng) for _ in range(n)],
        "gpu_node": np.asarray(rows["node"]),
        "gpu_slot": np.asarray(rows["slot"]),
        "gpu_start_h": np.asarray(rows["start"], dtype=float),
        "gpu_end_h": end,
        "gpu_frailty": np.asarray(rows["frailty"]),
        "gpu_bad_batch": np.asarray(rows["bad"], dtype=bool),
        "gpu_benign_sbe": np.asarray(rows["benign_sbe"], dtype=bool),
        "gpu_benign_nvlink": np.asarray(rows["benign_nvl"], dtype=bool),
        "gpu_efficiency": np.asarray(rows["eff"]),
        "fail_mode": fail_mode,
        "fail_xid": fail_xid,
        "lead_h": lead,
        "strength": strength,
        "repair_h": repair,
        "replaced_by": replaced_by,
    }
