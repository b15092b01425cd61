"""An 8 x H100 node of the fake library (a real capture): what the NVML collector's tests and its
benchmark (`benchmarks.nvml_collector`) run against."""

from __future__ import annotations

from pathlib import Path

from tests.fake_nvml.build import build_fake_nvml
from tests.fake_nvml.scenario import scenario_from_capture

H100_CAPTURE = Path(__file__).parents[1] / "fixtures" / "nvml" / "qx-h100.xml"


def fake_h100_node(work: Path) -> tuple[Path, dict[str, str]]:
    """Build the fake library into `work`; return its folder and the environment selecting
    an 8 x H100 node (qx-h100.xml) whose ECC and PCIe counters move on every sample."""
    library = build_fake_nvml(work)
    scenario = scenario_from_capture(H100_CAPTURE, nvlink_counters=True)
    for gpu in scenario.gpus:
        gpu.set_field("NVML_FI_DEV_ECC_SBE_VOL_TOTAL", 0, step=1)
        gpu.set_field(
            "NVML_FI_DEV_PCIE_REPLAY_COUNTER", gpu.field_value("NVML_FI_DEV_PCIE_REPLAY_COUNTER") or 0, step=1
        )
    path = scenario.write(work / "h100-node.txt")
    return library.parent, {"FAKE_NVML_CONFIG": str(path)}
