"""Simulator presets: every realism knob in one place, with where its value comes from.

Calibration: Llama 3 saw about 1.2e-5 GPU-related failures per GPU-hour
on 16,384 H100s. At that rate a 400-GPU fleet has about 7 failures in two months, too few to
learn from, so each preset multiplies the hazard by an explicit `acceleration` factor; the
simulator records the factor and the expected count in `simulation.json`, and tests check the
realised counts against it.

Failure-mode shares follow the published breakdown loosely: Llama 3 attributes GPU-related
interruptions to faulty GPUs incl. NVLink (30.1% of all), HBM3 (17.2%), SRAM (4.5%) and GSP
(4.1%); NCSA Delta and ORNL Titan add off-the-bus losses and thermal/board problems.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import date

from ingest.errors import InputError

LLAMA3_GPU_FAILURES_PER_GPU_HOUR = 1.2e-5


@dataclass(frozen=True)
class GpuModel:
    name: str
    tdp_w: float
    idle_w: float
    sm_clock_mhz: float
    mem_clock_mhz: float
    fb_total_mib: float
    memory_repair: str  # "page_retirement" (Volta) or "row_remap" (Ampere and later)
    pci_device_id: str


GPU_MODELS = {
    m.name: m
    for m in (
        GpuModel("Tesla V100-SXM2-32GB", 300, 45, 1530, 877, 32768, "page_retirement", "10de:1db5"),
        GpuModel("NVIDIA A100-SXM4-80GB", 400, 62, 1410, 1593, 81920, "row_remap", "10de:20b2"),
        GpuModel("NVIDIA H100 80GB HBM3", 700, 72, 1980, 2619, 81559, "row_remap", "10de:2330"),
    )
}


@dataclass(frozen=True)
class FailureMode:
    """How one kind of failure announces itself.

    `lead_median_h`: typical warning time before the failure (log-normal, `lead_sigma`).
    `silent_fraction`: share of failures of this mode with no numeric precursor at all.
    `terminal_xids`: XIDs written when the GPU fails, with their probabilities; 0 stands for
    the multi-line "fallen off the bus" message that carries no Xid number.
    """

    name: str
    share: float
    lead_median_h: float
    lead_sigma: float
    lead_min_h: float
    lead_max_h: float
    silent_fraction: float
    terminal_xids: dict[int, float]


FAILURE_MODES = (
    FailureMode("hbm_ecc", 0.30, 48, 0.7, 6, 240, 0.15, {48: 0.4, 95: 0.4, 64: 0.2}),
    FailureMode("nvlink", 0.22, 24, 0.7, 3, 120, 0.15, {74: 1.0}),
    FailureMode("off_bus", 0.20, 6, 0.6, 1, 48, 0.5, {79: 0.7, 0: 0.3}),
    FailureMode("thermal_power", 0.16, 72, 0.5, 12, 240, 0.2, {79: 0.6, 48: 0.4}),
    FailureMode("gsp", 0.12, 0, 0, 0, 0, 1.0, {119: 0.7, 120: 0.3}),
)

# Application XIDs written when a user job crashes, with their probabilities; XID 45 follows on
# the job's other GPUs (pre-emptive cleanup).
APP_CRASH_XIDS = {13: 0.5, 31: 0.3, 43: 0.2}

LOG_FORMATS = {"rfc3339_syslog": 0.4, "journal": 0.3, "dmesg_ctime": 0.15, "dmesg_iso": 0.15}


@dataclass(frozen=True)
class Preset:
    name: str
    nodes: int
    gpus_per_node: int
    days: int
    sample_interval_s: int
    start: date
    acceleration: float
    model_mix: dict[str, float]
    # Nodes that join the fleet part-way through (new GPUs), as (fraction of nodes, at day).
    new_nodes_fraction: float = 0.15
    new_nodes_day_fraction: float = 0.55
    # Drift: one install batch whose hazard rises mid-period.
    bad_batch_fraction: float = 0.12
    bad_batch_onset_fraction: float = 0.45
    bad_batch_ramp_days: float = 10
    bad_batch_multiplier: float = 5.0
    # Drift: a driver upgrade rolled through the fleet.
    driver_old: str = "535.183.01"
    driver_new: str = "550.127.05"
    driver_upgrade_fraction: float = 0.6
    # When set, the rollout starts this many days before the end of the period instead, whatever
    # its length: the demo and paper presets place it inside the walk-forward's test period (its
    # last `[evaluate] test_days`, 14 by default, of settled labels), so the comparison sees a
    # static model meet a driver it was never trained on (volatile counters reset on the reload,
    # power readings shift, GSP and application XIDs rise) while the sliding ones retrain.
    driver_upgrade_days_before_end: float | None = None
    driver_rollout_days: float = 5
    new_driver_gsp_multiplier: float = 3.0  # GSP firmware regressions after upgrades
    new_driver_power_bias: float = 1.03  # power readings shift by +3%
    new_driver_app_xid_multiplier: float = 1.5
    # Per-GPU and per-node latent health (log-normal frailty; lemon nodes).
    gpu_frailty_sigma: float = 1.0
    node_frailty_sigma: float = 0.5
    # Benign look-alikes that never fail: they make precision hard.
    benign_sbe_fraction: float = 0.04
    benign_nvlink_fraction: float = 0.03
    # Workload and operations noise.
    job_median_h: float = 10.0
    idle_mean_h: float = 2.0
    job_crash_probability: float = 0.08
    flood_probability: float = 0.25
    flood_lines: tuple[int, int] = (200, 3000)  # lines per GPU in a flood
    fleet_crash_every_days: float = 6.0  # one big multi-node job crash
    maintenance_every_days: float = 25.0
    sample_drop_probability: float = 0.003
    sensor_blank_probability: float = 0.002
    repair_hours: tuple[float, float] = (12.0, 72.0)
    # Fail-slow GPUs (stragglers): this share of boards loses a fraction of its speed (SM clock,
    # and the power it draws for its utilisation) from a moment on, and keeps it; 0: none.
    fail_slow_fraction: float = 0.0
    fail_slow_deficit: tuple[float, float] = (0.05, 0.3)
    failure_modes: tuple[FailureMode, ...] = field(default=FAILURE_MODES)

    @property
    def driver_upgrade_start_h(self) -> float:
        """Hours from the start of the period to the first node's driver upgrade."""
        if self.driver_upgrade_days_before_end is not None:
            return max(0.0, (self.days - self.driver_upgrade_days_before_end) * 24)
        return self.driver_upgrade_fraction * self.days * 24

    @property
    def samples_per_day(self) -> int:
        return 86400 // self.sample_interval_s

    @property
    def expected_failures(self) -> float:
        """Failures expected before drift multipliers, for the initial fleet."""
        gpu_hours = self.nodes * self.gpus_per_node * self.days * 24
        return gpu_hours * LLAMA3_GPU_FAILURES_PER_GPU_HOUR * self.acceleration


PRESETS = {
    # A few hundred GPUs over two months: generates in seconds, enough failures to learn from.
    "demo": Preset(
        name="demo",
        nodes=48,
        gpus_per_node=8,
        days=60,
        sample_interval_s=300,
        start=date(2026, 1, 5),
        acceleration=20.0,
        model_mix={"Tesla V100-SXM2-32GB": 0.25, "NVIDIA A100-SXM4-80GB": 0.4, "NVIDIA H100 80GB HBM3": 0.35},
        driver_upgrade_days_before_end=10,
    ),
    # The reference paper's scale: tens of thousands of GPUs, four months, ~350M rows.
    "paper": Preset(
        name="paper",
        nodes=3750,
        gpus_per_node=8,
        days=120,
        sample_interval_s=900,
        start=date(2026, 1, 5),
        acceleration=4.0,
        model_mix={"Tesla V100-SXM2-32GB": 0.5, "NVIDIA A100-SXM4-80GB": 0.3, "NVIDIA H100 80GB HBM3": 0.2},
        new_nodes_fraction=0.05,
        # Floods as in the demo would write ~1M log lines a day at this scale (~20 GB over the
        # period); smaller, rarer floods keep the logs near 1 GB and still exercise dedup.
        flood_probability=0.1,
        flood_lines=(20, 200),
        driver_upgrade_days_before_end=10,
    ),
}


def get_preset(name: str, **overrides: object) -> Preset:
    """A preset by name, optionally with fields replaced (tests shrink fleets this way)."""
    try:
        preset = PRESETS[name]
    except KeyError:
        raise InputError(f"simulator preset {name!r} does not exist; expected one of {sorted(PRESETS)}") from None
    return replace(preset, **overrides) if overrides else preset  # type: ignore[arg-type]
