"""Scenarios for the fake libnvidia-ml.so.1, with readings taken from real `nvidia-smi -q -x` output.

`gpus_from_nvidia_smi_xml` turns each <gpu> of a capture into a `FakeGpu` holding what NVML
would have returned on that board: an element nvidia-smi printed as N/A becomes a reading the
fake does not support. A test then adjusts the scenario (a counter that moves, a GPU lost after
a few samples, XID events) and writes it where FAKE_NVML_CONFIG points.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pynvml

# nvmlValueType_t, as nvidia-ml-py declares it.
TYPE_DOUBLE, TYPE_UINT, TYPE_ULONGLONG = 0, 1, 3

_REASON_BITS = {
    "clocks_event_reason_gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "clocks_event_reason_applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "clocks_event_reason_sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "clocks_event_reason_hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "clocks_event_reason_sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "clocks_event_reason_sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "clocks_event_reason_hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "clocks_event_reason_hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "clocks_event_reason_display_clocks_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
}

_NVLINK_TOTALS = (
    "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
)


@dataclass
class FakeField:
    value: int
    value_type: int = TYPE_ULONGLONG
    step: int = 0  # increase per sample: a counter that moves between collections


@dataclass
class FakeGpu:
    name: str
    uuid: str
    pci: str
    temp: int | None = None
    util: tuple[int, int] | None = None
    clock_sm: int | None = None
    clock_mem: int | None = None
    memory: tuple[int, int, int] | None = None  # total, used, reserved by the driver (bytes)
    clock_event_reasons: int | None = None
    power_limit_mw: int | None = None
    fields: dict[int, FakeField] = field(default_factory=dict)
    field_errors: dict[int, int] = field(default_factory=dict)
    double_fields: dict[int, str] = field(default_factory=dict)  # field id -> "inf", "nan", "1e308"
    fail_after: tuple[int, int] | None = None  # (samples, nvmlReturn)
    supported_events: int = pynvml.nvmlEventTypeXidCriticalError

    def set_field(self, name: str, value: int, *, value_type: int = TYPE_ULONGLONG, step: int = 0) -> None:
        self.fields[field_id(name)] = FakeField(value, value_type, step)

    def field_value(self, name: str) -> int | None:
        entry = self.fields.get(field_id(name))
        return entry.value if entry else None

    def lines(self, index: int) -> list[str]:
        out = [f"gpu {index} name {self.name}", f"gpu {index} uuid {self.uuid}", f"gpu {index} pci {self.pci}"]
        simple = {
            "temp": self.temp,
            "clock_sm": self.clock_sm,
            "clock_mem": self.clock_mem,
            "clock_event_reasons": self.clock_event_reasons,
            "power_limit": self.power_limit_mw,
        }
        out += [f"gpu {index} {key} {value}" for key, value in simple.items() if value is not None]
        if self.util is not None:
            out.append(f"gpu {index} util {self.util[0]} {self.util[1]}")
        if self.memory is not None:
            out.append(f"gpu {index} memory {' '.join(map(str, self.memory))}")
        for fid, f in sorted(self.fields.items()):
            out.append(f"gpu {index} field {fid} {f.value} type {f.value_type} step {f.step}")
        out += [f"gpu {index} field_error {fid} {code}" for fid, code in sorted(self.field_errors.items())]
        out += [f"gpu {index} field_double {fid} {text}" for fid, text in sorted(self.double_fields.items())]
        if self.fail_after is not None:
            out.append(f"gpu {index} fail_after {self.fail_after[0]} {self.fail_after[1]}")
        out.append(f"gpu {index} events {self.supported_events}")
        return out


@dataclass
class Scenario:
    gpus: list[FakeGpu]
    driver: str | None = None
    init_error: int | None = None
    memory_v2: bool = True  # False: a driver before R510, without nvmlDeviceGetMemoryInfo_v2
    events: list[tuple[int, int, int]] = field(default_factory=list)  # (gpu, xid, after samples)

    def write(self, path: Path) -> Path:
        lines = ["# fake libnvidia-ml.so.1 scenario (tests/fake_nvml/fake_nvml.c)"]
        if self.driver is not None:
            lines.append(f"driver {self.driver}")
        if self.init_error is not None:
            lines.append(f"init_error {self.init_error}")
        if not self.memory_v2:
            lines.append("no_memory_v2")
        for index, gpu in enumerate(self.gpus):
            lines += gpu.lines(index)
        lines += [f"event {gpu} {xid} {after}" for gpu, xid, after in self.events]
        path.write_text("\n".join(lines) + "\n")
        return path


def field_id(name: str) -> int:
    """The id this nvidia-ml-py gives a field, so the fake and the collector agree on numbers."""
    return int(getattr(pynvml, name))


def _number(text: str | None) -> float | None:
    """'29 C', '68.57 W', '81559 MiB', '7015662857 us', '0' -> the number; N/A and prose -> None."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)(?:\s*[A-Za-z%/]+)?\s*", text)
    return float(match.group(1)) if match else None


def _yes_no(text: str | None) -> int | None:
    return {"Yes": 1, "No": 0}.get((text or "").strip())


def _sum(element: ET.Element | None, names: tuple[str, ...]) -> int | None:
    if element is None:
        return None
    values = [_number(element.findtext(name)) for name in names if element.find(name) is not None]
    if not values or any(v is None for v in values):
        return None
    return int(sum(v for v in values if v is not None))


def _gpu_from_xml(node: ET.Element, nvlink_counters: bool) -> FakeGpu:
    def num(path: str) -> float | None:
        return _number(node.findtext(path))

    gpu = FakeGpu(
        name=node.findtext("product_name", ""),
        uuid=node.findtext("uuid", ""),
        pci=node.findtext("pci/pci_bus_id", ""),
    )
    temp = num("temperature/gpu_temp")
    gpu.temp = int(temp) if temp is not None else None
    util_gpu, util_mem = num("utilization/gpu_util"), num("utilization/memory_util")
    if util_gpu is not None and util_mem is not None:
        gpu.util = (int(util_gpu), int(util_mem))
    for attr, path in (("clock_sm", "clocks/sm_clock"), ("clock_mem", "clocks/mem_clock")):
        value = num(path)
        setattr(gpu, attr, int(value) if value is not None else None)
    total, used = num("fb_memory_usage/total"), num("fb_memory_usage/used")
    if total is not None and used is not None:
        reserved = num("fb_memory_usage/reserved") or 0  # drivers before R510 print no reservation
        gpu.memory = (int(total) << 20, int(used) << 20, int(reserved) << 20)
    reasons = node.find("clocks_event_reasons")
    if reasons is not None:
        gpu.clock_event_reasons = sum(bit for tag, bit in _REASON_BITS.items() if reasons.findtext(tag) == "Active")
    limit = num("gpu_power_readings/current_power_limit")
    if limit is not None:
        gpu.power_limit_mw = round(limit * 1000)
        gpu.set_field("NVML_FI_DEV_POWER_CURRENT_LIMIT", round(limit * 1000), value_type=TYPE_UINT)

    memory_temp = num("temperature/memory_temp")
    if memory_temp is not None:
        gpu.set_field("NVML_FI_DEV_MEMORY_TEMP", int(memory_temp), value_type=TYPE_UINT)
    for name, path in (
        ("NVML_FI_DEV_POWER_AVERAGE", "gpu_power_readings/average_power_draw"),
        ("NVML_FI_DEV_POWER_INSTANT", "gpu_power_readings/instant_power_draw"),
    ):
        watts = num(path)
        if watts is not None:
            gpu.set_field(name, round(watts * 1000), value_type=TYPE_UINT)

    # Drivers from R570 print ECC counts by memory (SRAM, DRAM); NVML's totals add them up.
    uncorrectable = (
        "sram_uncorrectable_parity",
        "sram_uncorrectable_secded",
        "sram_uncorrectable",
        "dram_uncorrectable",
    )
    for scope, suffix in (("volatile", "VOL"), ("aggregate", "AGG")):
        ecc = node.find(f"ecc_errors/{scope}")
        sbe = _sum(ecc, ("sram_correctable", "dram_correctable"))
        dbe = _sum(ecc, uncorrectable)
        if sbe is not None and dbe is not None:
            gpu.set_field(f"NVML_FI_DEV_ECC_SBE_{suffix}_TOTAL", sbe)
            gpu.set_field(f"NVML_FI_DEV_ECC_DBE_{suffix}_TOTAL", dbe)

    for name, path in (
        ("NVML_FI_DEV_RETIRED_SBE", "retired_pages/multiple_single_bit_retirement/retired_count"),
        ("NVML_FI_DEV_RETIRED_DBE", "retired_pages/double_bit_retirement/retired_count"),
        ("NVML_FI_DEV_REMAPPED_COR", "remapped_rows/remapped_row_corr"),
        ("NVML_FI_DEV_REMAPPED_UNC", "remapped_rows/remapped_row_unc"),
        ("NVML_FI_DEV_PCIE_REPLAY_COUNTER", "pci/replay_counter"),
    ):
        value = num(path)
        if value is not None:
            gpu.set_field(name, int(value))
    for name, path in (
        ("NVML_FI_DEV_RETIRED_PENDING", "retired_pages/pending_retirement"),
        ("NVML_FI_DEV_REMAPPED_PENDING", "remapped_rows/remapped_row_pending"),
        ("NVML_FI_DEV_REMAPPED_FAILURE", "remapped_rows/remapped_row_failure"),
    ):
        flag = _yes_no(node.findtext(path))
        if flag is not None:
            gpu.set_field(name, flag, value_type=TYPE_UINT)

    # nvidia-smi prints the violation counters in us; NVML's perf-policy fields count ns.
    counters = "clocks_event_reasons_counters/clocks_event_reasons_counters_"
    for name, tag in (
        ("NVML_FI_DEV_PERF_POLICY_POWER", "sw_power_cap"),
        ("NVML_FI_DEV_PERF_POLICY_THERMAL", "sw_therm_slowdown"),
    ):
        micros = num(counters + tag)
        if micros is not None:
            gpu.set_field(name, int(micros) * 1000)

    # The captures carry no NVLink error counters; an NVLink board starts them at 0.
    if nvlink_counters:
        for name in _NVLINK_TOTALS:
            gpu.set_field(name, 0)
    return gpu


def gpus_from_nvidia_smi_xml(path: Path, *, nvlink_counters: bool = False) -> tuple[str, list[FakeGpu]]:
    """(driver version, one FakeGpu per <gpu>) from an `nvidia-smi -q -x` capture."""
    root = ET.parse(path).getroot()
    gpus = [_gpu_from_xml(node, nvlink_counters) for node in root.findall("gpu")]
    return root.findtext("driver_version", ""), gpus


def scenario_from_capture(path: Path, *, nvlink_counters: bool = False) -> Scenario:
    """A node with the GPUs and driver of one capture."""
    driver, gpus = gpus_from_nvidia_smi_xml(path, nvlink_counters=nvlink_counters)
    return Scenario(gpus, driver=driver)
