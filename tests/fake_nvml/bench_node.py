"""The node the NVML collector benchmark runs against: the fake library serving 8 H100s."""

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


def bench_fake_h100_daemon(ticks: int = 1440) -> dict[str, float]:
    """`ingest.collect.nvml_bench.bench_daemon` against the fake 8 x H100 node (10-s interval).

    Raises `NoCompiler` where no C compiler exists."""
    import tempfile

    from ingest.collect.nvml_bench import run_with_library

    with tempfile.TemporaryDirectory(prefix="gpufail-fake-nvml-") as work:
        library_dir, env = fake_h100_node(Path(work))
        return run_with_library(library_dir, env=env, daemon_ticks=ticks)


def bench_fake_h100_node(collections: int = 2000) -> dict[str, float]:
    """`ingest.collect.nvml_bench` against the fake 8 x H100 node, built in a temporary folder.

    Raises `NoCompiler` where no C compiler exists."""
    import tempfile

    from ingest.collect.nvml_bench import run_with_library

    with tempfile.TemporaryDirectory(prefix="gpufail-fake-nvml-") as work:
        library_dir, env = fake_h100_node(Path(work))
        return run_with_library(library_dir, collections, env=env)
