"""Rendering one day of telemetry (and the XID events the samples imply) from the fleet plan.

Everything is a numpy array of shape (GPUs alive that day, samples per day). Counters carry
their state from day to day in `CounterState`, so days are rendered in order with memory
bounded by one day of the fleet.

Physics, roughly: power follows utilisation up to the board's limit; temperature follows
power plus the node's inlet offset and the slot's position; precursors of a coming failure
ramp up as `strength * x**2` (linearly for a GPU going quiet before it falls off the bus), x going from 0 at the start of the warning period to 1 at the
failure, so the signal is faint at first and clear only near the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ingest.schema import metric_catalogue, telemetry_schema
from ingest.simulator.fleet import SLOT_PCI_BUS_IDS, FleetPlan
from ingest.simulator.presets import GPU_MODELS

# Clock-event reason bits as NVML defines them (nvmlClocksEventReason*).
GPU_IDLE, SW_POWER_CAP, SW_THERMAL, HW_THERMAL = 0x1, 0x4, 0x20, 0x40
THROTTLE_TEMP_C = 87.0
# Slot position on the baseboard: the rear GPUs breathe the front ones' air.
SLOT_OFFSET_C = np.array([0.0, 0.5, 1.5, 2.5, 0.5, 1.0, 2.0, 3.5])

VOLATILE = (  # reset when the driver reloads
    "ecc_sbe_volatile_total",
    "ecc_dbe_volatile_total",
    "pcie_replay_total",
    "nvlink_crc_flit_errors_total",
    "nvlink_crc_data_errors_total",
    "nvlink_replay_errors_total",
    "nvlink_recovery_errors_total",
    "power_violation_us_total",
    "thermal_violation_us_total",
)
PERSISTENT = (
    "ecc_sbe_aggregate_total",
    "ecc_dbe_aggregate_total",
    "retired_pages_sbe_total",
    "retired_pages_dbe_total",
    "remapped_rows_correctable_total",
    "remapped_rows_uncorrectable_total",
)


@dataclass
class CounterState:
    """Counter values at the end of the last rendered day, one array entry per GPU in the plan."""

    values: dict[str, np.ndarray]
    pending_retire: np.ndarray  # a retirement/remap waits for the next reload

    @classmethod
    def start(cls, n_gpus: int, rng: np.random.Generator) -> CounterState:
        values = {name: np.zeros(n_gpus, dtype=np.int64) for name in VOLATILE + PERSISTENT}
        # Boards arrive with some history: aggregate counters are not zero on a used fleet.
        values["ecc_sbe_aggregate_total"] = rng.poisson(3, n_gpus).astype(np.int64)
        values["remapped_rows_correctable_total"] = rng.poisson(0.3, n_gpus).astype(np.int64)
        return cls(values, np.zeros(n_gpus, dtype=bool))


@dataclass
class DayEvents:
    """XID-worthy moments found while rendering a day: (gpu, time in hours, xid)."""

    gpu: list[int] = field(default_factory=list)
    t_h: list[float] = field(default_factory=list)
    xid: list[int] = field(default_factory=list)

    def add(self, gpus: np.ndarray, times: np.ndarray, xid: int) -> None:
        self.gpu.extend(int(g) for g in gpus)
        self.t_h.extend(float(t) for t in times)
        self.xid.extend([xid] * len(gpus))


def precursor(plan: FleetPlan, gpus: np.ndarray, t_h: np.ndarray, mode: str, shape: float = 2.0) -> np.ndarray:
    """Precursor intensity in [0, 1] of `mode` for each GPU at each time (0 for other modes):
    `strength * x**shape`, x the fraction of the warning period elapsed."""
    names = [m.name for m in plan.preset.failure_modes]
    out = np.zeros((len(gpus), len(t_h)), dtype=np.float32)
    rows = np.flatnonzero((plan.fail_mode[gpus] == names.index(mode)) & (plan.strength[gpus] > 0))
    for row in rows:
        g = gpus[row]
        end, lead = plan.gpu_end_h[g], plan.lead_h[g]
        x = np.clip((t_h - (end - lead)) / lead, 0, 1)
        out[row] = plan.strength[g] * x**shape
    return out


def render_day(plan: FleetPlan, day: int, state: CounterState, rng: np.random.Generator) -> tuple[pa.Table, DayEvents]:
    """Samples of every GPU alive on `day` (0-based), and the XID events they imply."""
    preset = plan.preset
    spd = preset.samples_per_day
    dt_h = preset.sample_interval_s / 3600
    t_h = day * 24 + np.arange(spd) * dt_h
    events = DayEvents()
    gpus = np.flatnonzero((plan.gpu_start_h < (day + 1) * 24) & (plan.gpu_end_h > day * 24))
    if len(gpus) == 0:
        return telemetry_schema().empty_table(), events
    node = plan.gpu_node[gpus]
    sample_idx = day * spd + np.arange(spd)
    # Index (node, sample) pairs directly: slicing by node first would copy whole periods.
    day_cells = np.ix_(node, sample_idx)
    busy = plan.busy[day_cells]
    level = plan.job_util[day_cells].astype(np.float32)
    reload = plan.reload[day_cells]
    models = [GPU_MODELS[plan.model_names[i]] for i in plan.node_model[node]]
    tdp = np.array([m.tdp_w for m in models], dtype=np.float32)[:, None]
    idle = np.array([m.idle_w for m in models], dtype=np.float32)[:, None]
    remaps = np.array([m.memory_repair == "row_remap" for m in models])
    shape = busy.shape
    noise = rng.standard_normal

    hbm = precursor(plan, gpus, t_h, "hbm_ecc")
    nvl = precursor(plan, gpus, t_h, "nvlink")
    therm = precursor(plan, gpus, t_h, "thermal_power")
    # A GPU on its way off the bus misses more and more samples: a steadier ramp than the
    # accelerating counter precursors.
    offbus = precursor(plan, gpus, t_h, "off_bus", shape=1.0)

    util = np.where(busy, np.clip(level + 4 * noise(shape), 0, 100), np.clip(0.5 + 0.5 * noise(shape), 0, 100))
    new_driver = plan.driver_at(node[:, None], t_h[None, :])
    # A fail-slow board runs its share of the job at a lower clock and draws less power for
    # the same utilisation (the job keeps it busy while the others wait for it).
    slow = np.where(busy, plan.slowdown(gpus, t_h), 0.0)
    power = idle + (0.95 * tdp - idle) * (util / 100) * plan.gpu_efficiency[gpus, None] * (1 - slow)
    power = power * (1 + 0.12 * therm) + therm * 0.06 * tdp * np.abs(noise(shape))
    power = power * np.where(new_driver, preset.new_driver_power_bias, 1.0) + 0.01 * tdp * noise(shape)
    power = np.clip(power, 0.8 * idle, tdp)
    temp = (
        26
        + plan.node_cooling_c[node, None]
        + SLOT_OFFSET_C[plan.gpu_slot[gpus], None]
        + 48 * power / tdp
        + 14 * therm
        + 0.8 * noise(shape)
    )
    hot = temp > THROTTLE_TEMP_C
    capped = power > 0.97 * tdp
    sm_max = np.array([m.sm_clock_mhz for m in models], dtype=np.float32)[:, None]
    sm_clock = np.where(busy, sm_max * (1 - slow) - np.abs(30 * noise(shape)), 345.0) * np.where(hot, 0.85, 1.0)
    reasons = (
        np.where(busy, 0, GPU_IDLE) | np.where(capped, SW_POWER_CAP, 0) | np.where(hot, SW_THERMAL | HW_THERMAL, 0)
    )
    fb_total = np.array([m.fb_total_mib for m in models], dtype=np.float32)[:, None]
    columns: dict[str, np.ndarray] = {
        "temp_gpu_c": temp,
        "temp_mem_c": temp + 3 + 4 * util / 100 + 0.5 * noise(shape),
        "power_w": power,
        "power_limit_w": np.broadcast_to(tdp, shape),
        "util_gpu_pct": util,
        "util_mem_pct": np.clip(0.55 * util + 2 * noise(shape), 0, 100),
        "sm_clock_mhz": sm_clock,
        "mem_clock_mhz": np.broadcast_to(np.array([m.mem_clock_mhz for m in models], dtype=np.float32)[:, None], shape),
        "fb_used_mib": np.where(busy, fb_total * (0.55 + 0.4 * level / 100), 450 + 20 * np.abs(noise(shape))),
        "clock_event_reasons": reasons.astype(np.int64),
    }

    # Counter increments per sample, as Poisson draws from per-hour rates.
    def draws(rate_per_h: np.ndarray | float) -> np.ndarray:
        return rng.poisson(np.broadcast_to(np.asarray(rate_per_h, dtype=np.float64) * dt_h, shape))

    benign_sbe = plan.gpu_benign_sbe[gpus, None]
    sbe = draws(np.where(benign_sbe, 0.4, 0.003) + 400 * hbm)
    dbe = draws(0.6 * hbm**3)
    repairs_c = draws(np.where(benign_sbe, 0.004, 0.0) + 3 * hbm)
    repairs_u = dbe
    benign_nvl = plan.gpu_benign_nvlink[gpus, None]
    inc = {
        "ecc_sbe_volatile_total": sbe,
        "ecc_sbe_aggregate_total": sbe,
        "ecc_dbe_volatile_total": dbe,
        "ecc_dbe_aggregate_total": dbe,
        "remapped_rows_correctable_total": np.where(remaps[:, None], repairs_c, 0),
        "remapped_rows_uncorrectable_total": np.where(remaps[:, None], repairs_u, 0),
        "retired_pages_sbe_total": np.where(remaps[:, None], 0, repairs_c),
        "retired_pages_dbe_total": np.where(remaps[:, None], 0, repairs_u),
        "pcie_replay_total": draws(0.01 + 40 * offbus),
        "nvlink_crc_flit_errors_total": draws(np.where(benign_nvl, 3.0, 0.01) + 300 * nvl),
        "nvlink_crc_data_errors_total": draws(np.where(benign_nvl, 0.5, 0.0) + 60 * nvl),
        "nvlink_replay_errors_total": draws(25 * nvl),
        "nvlink_recovery_errors_total": draws(1.0 * nvl**2),
        "power_violation_us_total": np.where(
            capped, (dt_h * 3.6e9 * 0.3 * (1 + noise(shape) ** 2)).astype(np.int64), 0
        ),
        "thermal_violation_us_total": np.where(hot, int(dt_h * 3.6e9 * 0.5), 0),
    }
    for name, increments in inc.items():
        columns[name] = _accumulate(state.values[name][gpus], increments, reload if name in VOLATILE else None)
        state.values[name][gpus] = columns[name][:, -1]

    # Retirements and remaps take effect at the next driver reload: pending until then.
    new_repair = (repairs_c + repairs_u) > 0
    pending = _pending_flag(state.pending_retire[gpus], new_repair, reload)
    state.pending_retire[gpus] = pending[:, -1]
    columns["retired_pages_pending"] = np.where(remaps[:, None], 0, pending).astype(np.int64)
    columns["remapped_rows_pending"] = np.where(remaps[:, None], pending, 0).astype(np.int64)
    remap_failing = (plan.fail_xid[gpus, None] == 64) & (hbm > 0.8 * plan.strength[gpus, None]) & (hbm > 0)
    columns["remapped_rows_failure"] = (remaps[:, None] & remap_failing).astype(np.int64)

    # Events the driver would log: a row remap or page retirement (XID 63), a high single-bit
    # rate (XID 92).
    r, c = np.nonzero(new_repair)
    events.add(gpus[r], t_h[c], 63)
    r, c = np.nonzero(sbe >= 25)
    events.add(gpus[r], t_h[c], 92)

    present = _present(plan, gpus, node, sample_idx, t_h, offbus, rng)
    return _to_table(plan, gpus, t_h, new_driver, columns, present, rng), events


def _accumulate(start: np.ndarray, increments: np.ndarray, reload: np.ndarray | None) -> np.ndarray:
    """Running totals from `start`; volatile counters restart from zero after a reload."""
    out = start[:, None] + np.cumsum(increments, axis=1, dtype=np.int64)
    if reload is None:
        return out
    # Reloads are rare (a few per node per month): fix up only the rows that have one.
    for row in np.flatnonzero(reload.any(axis=1)):
        for cut in np.flatnonzero(reload[row]):
            out[row, cut:] = np.cumsum(increments[row, cut:])
    return out


def _pending_flag(start: np.ndarray, new_event: np.ndarray, reload: np.ndarray) -> np.ndarray:
    """1 from an event until the next reload (which applies the pending retirement)."""
    out = np.zeros(new_event.shape, dtype=bool)
    flag = start.copy()
    for s in range(new_event.shape[1]):
        flag = (flag & ~reload[:, s]) | new_event[:, s]
        out[:, s] = flag
    return out


def _present(
    plan: FleetPlan,
    gpus: np.ndarray,
    node: np.ndarray,
    sample_idx: np.ndarray,
    t_h: np.ndarray,
    offbus: np.ndarray,
    rng: np.random.Generator,
) -> np.ndarray:
    """Which samples exist: the GPU is installed and not failed, its node is up, the collector
    did not drop the sample, and a GPU about to fall off the bus has not gone quiet."""
    alive = (t_h[None, :] >= plan.gpu_start_h[gpus, None]) & (t_h[None, :] < plan.gpu_end_h[gpus, None])
    alive &= t_h[None, :] >= plan.node_join_h[node, None]
    up = ~plan.down[np.ix_(node, sample_idx)]
    kept = rng.random(alive.shape) >= plan.preset.sample_drop_probability + 0.9 * offbus
    return alive & up & kept


_TABLE_FIELDS = [m.column for m in metric_catalogue()]


def _to_table(
    plan: FleetPlan,
    gpus: np.ndarray,
    t_h: np.ndarray,
    new_driver: np.ndarray,
    columns: dict[str, np.ndarray],
    present: np.ndarray,
    rng: np.random.Generator,
) -> pa.Table:
    rows, cols = np.nonzero(present)
    start = np.datetime64(plan.preset.start.isoformat(), "us")
    ts = start + (t_h[cols] * 3_600_000_000).astype("timedelta64[us]")
    node = plan.gpu_node[gpus[rows]]
    data: dict[str, pa.Array] = {
        "ts": pa.array(ts, type=pa.timestamp("us", tz="UTC")),
        "cluster": pa.DictionaryArray.from_arrays(np.zeros(len(rows), dtype=np.int32), [plan.cluster]),
        "node": _dict(node, plan.node_names),
        "gpu_index": pa.array(plan.gpu_slot[gpus[rows]].astype(np.int16)),
        "gpu_uuid": _dict(gpus[rows], plan.gpu_uuid),
        "pci_bus_id": _dict(plan.gpu_slot[gpus[rows]], list(SLOT_PCI_BUS_IDS)),
        "gpu_model": _dict(plan.node_model[node], plan.model_names),
        "driver": _dict(new_driver[rows, cols].astype(np.int32), [plan.preset.driver_old, plan.preset.driver_new]),
    }
    for name in _TABLE_FIELDS:
        values = columns[name][rows, cols]
        blank = rng.random(len(values)) < plan.preset.sensor_blank_probability
        if name.endswith("_total"):
            blank[:] = False  # counters are read from one NVML field call; blanks hit gauges
        arrow_type = pa.float32() if values.dtype.kind == "f" else pa.int64()
        data[name] = pa.array(values.astype(arrow_type.to_pandas_dtype()), type=arrow_type, mask=blank)
    return pa.table(data)


def _dict(codes: np.ndarray, names: list[str]) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), pa.array(names, type=pa.string()))
