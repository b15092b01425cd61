"""Kernel-log text for the simulated fleet, in the formats real nodes produce.

Each node writes one log file in one format (rsyslog RFC 3339, journald short, `dmesg -T`,
`dmesg --time-format=iso`), so `gpufail ingest kernel-log` is exercised on every format with
the same parser a real fleet uses. Message texts follow what the NVIDIA driver prints (see
`tests/fixtures/kernel_log/`); the incidents come from:

- user jobs that crash (XID 13/31/43 on some GPUs, XID 45 on the rest of the node), sometimes
  as floods of thousands of identical lines, and now and then one large multi-node job whose
  crash hits many nodes at once (the trap that makes rule-based tools drain healthy nodes);
- precursors the telemetry implies (XID 63 row remap/page retirement, XID 92 high single-bit
  ECC rate) and a contained ECC error (XID 94) hours before some memory failures;
- the failure itself (its terminal XID, or the multi-line "fallen off the bus" text that has
  no Xid number), preceded by the driver's "GPU at PCI" banner;
- driver loads after maintenance, and unrelated kernel noise.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

from ingest.simulator.fleet import SLOT_PCI_BUS_IDS, FleetPlan
from ingest.simulator.presets import APP_CRASH_XIDS, GPU_MODELS, GpuModel

MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
WEEKDAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
UNKNOWN = "pid='<unknown>', name=<unknown>"

XID_TEXT = {
    13: "Graphics SM Warp Exception on (GPC 4, TPC 1, SM 0): Out Of Range Address",
    31: "Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f2a_4c000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    43: "Ch 00000010",
    45: "Ch 00000010",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 2, subpartition 0.",
    63: "Row Remapper: New row (0x00000000002c4a10) marked for remapping, reset gpu to activate.",
    64: "Row Remapper Error: Failed to remap row (0x00000000002c4a10). No spare rows left.",
    74: "NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error.",
    95: "Uncontained ECC error.",
    119: "Timeout after 6s of waiting for RPC response from GPU{slot} GSP! Expected function 76 (GSP_RM_CONTROL) (0x20802a02 0x8).",
    120: "GSP task exception: pc 0x1c2f0, task 2",
}
# Page retirement on Volta reads differently from row remapping.
VOLTA_63 = "Dynamic Page Retirement: New page (0x00000000003b2c1a) retired, reboot to activate."
APP_PROCESSES = ("python3", "pt_main_thread", "python", "torchrun")
NOISE = (
    "IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready",
    "nvidia-nvswitch0: open (major=510)",
    "EXT4-fs (nvme0n1p1): re-mounted. Quota mode: none.",
    "mlx5_core 0000:0c:00.0: mlx5_fw_tracer_handle_traces:742: FWTracer: Event: 0x3",
    "perf: interrupt took too long (2512 > 2500), lowering kernel.perf_event_max_sample_rate to 79500",
)


@dataclass(order=True)
class Entry:
    t_h: float
    node: int = field(compare=False)
    lines: list[str] = field(compare=False)  # lines of one kernel message


@dataclass
class AppIncident:
    node: int
    t_h: float
    xid: int
    gpus_hit: int  # how many of the node's GPUs report the crash XID (the rest report 45)
    repeats: int  # lines per GPU: a flood repeats the same line many times
    pid: int


def plan_app_incidents(plan: FleetPlan, rng: np.random.Generator) -> list[AppIncident]:
    """Job crashes over the whole period: per job on each node, plus fleet-wide crashes."""
    preset = plan.preset
    per_h = 3600 / preset.sample_interval_s
    codes = list(APP_CRASH_XIDS)
    code_p = np.array(list(APP_CRASH_XIDS.values()))
    incidents = []
    for node in range(len(plan.node_names)):
        edges = np.diff(plan.busy[node].astype(np.int8), prepend=0, append=0)
        for start, end in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True):
            t = rng.uniform(start, end) / per_h
            boost = preset.new_driver_app_xid_multiplier if t >= plan.node_upgrade_h[node] else 1.0
            if rng.random() < preset.job_crash_probability * boost:
                flood = rng.random() < preset.flood_probability
                incidents.append(
                    AppIncident(
                        node=node,
                        t_h=t,
                        xid=int(rng.choice(codes, p=code_p / code_p.sum())),
                        gpus_hit=int(rng.integers(1, 9)),
                        repeats=int(rng.integers(*preset.flood_lines)) if flood else int(rng.integers(1, 4)),
                        pid=int(rng.integers(1000, 4_000_000)),
                    )
                )
    # One large gang-scheduled job spans many nodes; when it crashes, they all log at once.
    n_big = rng.poisson(preset.days / preset.fleet_crash_every_days)
    for t in rng.uniform(0, plan.hours, n_big):
        span = rng.choice(
            len(plan.node_names), size=max(2, int(len(plan.node_names) * rng.uniform(0.1, 0.3))), replace=False
        )
        pid = int(rng.integers(1000, 4_000_000))
        for node in span:
            if plan.node_join_h[node] <= t:
                incidents.append(AppIncident(int(node), t + rng.uniform(0, 0.01), 43, 8, int(rng.integers(1, 4)), pid))
    return sorted(incidents, key=lambda i: i.t_h)


class KernelLogWriter:
    """Collects a day's entries per node, then appends them to each node's log file."""

    def __init__(self, plan: FleetPlan, folder: Path, rng: np.random.Generator) -> None:
        self.plan = plan
        self.folder = folder
        self.rng = rng
        self.start = datetime.combine(plan.preset.start, datetime.min.time(), tzinfo=UTC)
        self.incidents = plan_app_incidents(plan, rng)
        self._next_incident = 0
        self._gpus_by_node: dict[int, np.ndarray] = defaultdict(lambda: np.empty(0, dtype=int))
        for node in np.unique(plan.gpu_node):
            self._gpus_by_node[int(node)] = np.flatnonzero(plan.gpu_node == node)
        self.banner_shown: set[int] = set()
        # About half of the memory failures that have precursors log a contained ECC error
        # (XID 94) one to five hours before the end.
        hbm = [m.name for m in plan.preset.failure_modes].index("hbm_ecc")
        candidates = np.flatnonzero((plan.fail_mode == hbm) & (plan.strength > 0))
        warned = candidates[rng.random(len(candidates)) < 0.5]
        self.contained_warning_h = {int(g): float(plan.gpu_end_h[g] - rng.uniform(1, 5)) for g in warned}
        self.lines_written = 0
        folder.mkdir(parents=True, exist_ok=True)

    # -- which GPU is where ----------------------------------------------------------------

    def _alive(self, node: int, t_h: float) -> np.ndarray:
        gpus = self._gpus_by_node[node]
        return gpus[(self.plan.gpu_start_h[gpus] <= t_h) & (self.plan.gpu_end_h[gpus] > t_h)]

    # -- message construction --------------------------------------------------------------

    def _xid_line(self, gpu: int, xid: int, who: str) -> str:
        slot = int(self.plan.gpu_slot[gpu])
        text = XID_TEXT[xid].format(slot=slot)
        if xid == 63 and self._model(gpu).memory_repair == "page_retirement":
            text = VOLTA_63
        return f"NVRM: Xid (PCI:{SLOT_PCI_BUS_IDS[slot]}): {xid}, {who}, {text}"

    def _model(self, gpu: int) -> GpuModel:
        return GPU_MODELS[self.plan.model_names[self.plan.node_model[self.plan.gpu_node[gpu]]]]

    def _emit(self, entries: list[Entry], t_h: float, gpu: int, message: list[str]) -> None:
        """Append a GPU's message, preceded by the banner the driver prints (GPU at PCI, with
        the UUID) the first time that GPU reports an Xid after the driver loaded."""
        node = int(self.plan.gpu_node[gpu])
        if gpu not in self.banner_shown:
            self.banner_shown.add(gpu)
            slot = int(self.plan.gpu_slot[gpu])
            entries.append(Entry(t_h, node, [f"NVRM: GPU at PCI:{SLOT_PCI_BUS_IDS[slot]}: {self.plan.gpu_uuid[gpu]}"]))
            entries.append(Entry(t_h, node, [f"NVRM: GPU Board Serial Number: 16523{gpu:08d}"]))
        entries.append(Entry(t_h, node, message))

    def _off_bus_text(self, gpu: int) -> list[str]:
        slot = int(self.plan.gpu_slot[gpu])
        return [
            f"NVRM: The NVIDIA GPU {SLOT_PCI_BUS_IDS[slot]}.0",
            f"NVRM: (PCI ID: {self._model(gpu).pci_device_id}) installed in this system has",
            "NVRM: fallen off the bus and is not responding to commands.",
        ]

    # -- a day's entries -------------------------------------------------------------------

    def day_entries(self, day: int, telemetry_events: tuple[list[int], list[float], list[int]]) -> list[Entry]:
        plan, rng = self.plan, self.rng
        lo, hi = day * 24.0, (day + 1) * 24.0
        entries: list[Entry] = []
        # Driver loads reset the banner memory of the node's GPUs.
        for node, _, end, is_upgrade in plan.maintenance:
            if lo <= end < hi:
                driver = (
                    plan.preset.driver_new if is_upgrade or end >= plan.node_upgrade_h[node] else plan.preset.driver_old
                )
                entries.append(
                    Entry(
                        end,
                        node,
                        [
                            f"NVRM: loading NVIDIA UNIX x86_64 Kernel Module  {driver}  Release Build  (dvs-builder@U16-I3-B03-4-3)"
                        ],
                    )
                )
                self.banner_shown.difference_update(self._gpus_by_node[node].tolist())
        # Application crashes.
        while self._next_incident < len(self.incidents) and self.incidents[self._next_incident].t_h < hi:
            inc = self.incidents[self._next_incident]
            self._next_incident += 1
            alive = self._alive(inc.node, inc.t_h)
            if len(alive) == 0:
                continue
            hit = rng.permutation(alive)[: inc.gpus_hit]
            who = f"pid={inc.pid}, name={APP_PROCESSES[inc.pid % len(APP_PROCESSES)]}"
            for gpu in hit.tolist():
                spacing = rng.uniform(60, 600) / 3600 / max(inc.repeats, 1)
                line = self._xid_line(gpu, inc.xid, who)
                self._emit(entries, inc.t_h, gpu, [line])
                for r in range(1, inc.repeats):
                    entries.append(Entry(inc.t_h + r * spacing, inc.node, [line]))
            for gpu in np.setdiff1d(alive, hit).tolist():
                self._emit(entries, inc.t_h + 2 / 3600, gpu, [self._xid_line(gpu, 45, who)])
        # Precursors that the telemetry implies.
        for gpu, t, xid in zip(*telemetry_events, strict=True):
            self._emit(entries, t + rng.uniform(0, 0.05), gpu, [self._xid_line(gpu, xid, UNKNOWN)])
        for gpu, t in self.contained_warning_h.items():
            if lo <= t < hi:
                self._emit(entries, t, gpu, [self._xid_line(gpu, 94, "pid=48213, name=python3")])
        # Failures: the terminal Xid, or the off-the-bus text that carries no Xid number.
        for gpu in np.flatnonzero((plan.gpu_end_h >= lo) & (plan.gpu_end_h < hi)).tolist():
            xid = int(plan.fail_xid[gpu])
            message = self._off_bus_text(gpu) if xid == 0 else [self._xid_line(gpu, xid, UNKNOWN)]
            self._emit(entries, float(plan.gpu_end_h[gpu]), gpu, message)
        # Unrelated kernel noise.
        for noisy in np.flatnonzero(plan.node_join_h < hi).tolist():
            for t in rng.uniform(lo, hi, rng.poisson(3)):
                entries.append(Entry(float(t), noisy, [NOISE[int(rng.integers(len(NOISE)))]]))
        return entries

    # -- formatting and writing ------------------------------------------------------------

    def write(self, entries: list[Entry]) -> None:
        by_node: dict[int, list[Entry]] = defaultdict(list)
        for entry in entries:
            by_node[entry.node].append(entry)
        for node, node_entries in by_node.items():
            node_entries.sort()
            fmt = self.plan.node_log_format[node]
            host = self.plan.node_names[node]
            text = []
            for entry in node_entries:
                moment = self.start + timedelta(hours=entry.t_h)
                text.extend(format_message(fmt, moment, host, entry.lines))
            with open(self.folder / f"{host}.log", "a", encoding="utf-8") as fh:
                fh.write("\n".join(text) + "\n")
            self.lines_written += len(text)


def format_message(fmt: str, moment: datetime, host: str, lines: list[str]) -> list[str]:
    """One kernel message in a node's log format.

    Syslog-style formats prefix every line of a multi-line message; dmesg prints the
    continuation lines of one printk indented under the first, as the real tools do.
    """
    if fmt == "rfc3339_syslog":
        prefix = f"{moment.isoformat(timespec='microseconds')} {host} kernel: "
        return [prefix + line for line in lines]
    if fmt == "journal":
        prefix = f"{MONTHS[moment.month - 1]} {moment.day:02d} {moment:%H:%M:%S} {host} kernel: "
        return [prefix + line for line in lines]
    if fmt == "dmesg_ctime":
        prefix = f"[{WEEKDAYS[moment.weekday()]} {MONTHS[moment.month - 1]} {moment.day:2d} {moment:%H:%M:%S} {moment.year}] "
    elif fmt == "dmesg_iso":
        prefix = f"kern  :warn  : {moment:%Y-%m-%dT%H:%M:%S},{moment.microsecond:06d}+00:00 "
    else:
        raise ValueError(f"unknown kernel-log format {fmt!r}")
    return [prefix + lines[0]] + [" " * len(prefix) + line for line in lines[1:]]
