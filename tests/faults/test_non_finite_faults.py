"""Readings that are not numbers a metric can have: `inf`, `nan`, `1e308` (infinity once stored
in a float32 column), `1e400` (infinity when parsed), magnitudes beyond what an int64 column
holds, in every importer (table, nvidia-smi, dcgm-exporter scrape) and the NVML collector. Each is stored as missing and counted,
and the readings beside it are kept: no GPU's power features become infinite."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ingest.collect.nvml_collector import NvmlCollector
from ingest.dcgm_scrape import parse_scrape_detailed
from ingest.nvidia_smi import NvidiaSmiSummary, parse_nvidia_smi
from ingest.store import Store
from ingest.table_import import import_table
from ingest.table_mapping import load_mapping
from tests.fake_nvml.scenario import field_id, scenario_from_capture

NOW = datetime(2026, 11, 21, 12, tzinfo=UTC)
NON_FINITE = ["inf", "nan", "1e308", "1e400", "Infinity"]
H100 = Path(__file__).parents[1] / "fixtures" / "nvml" / "qx-h100.xml"


def assert_finite_or_missing(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        for column, value in row.items():
            if isinstance(value, float):
                assert math.isfinite(value) and abs(value) < 1e38, f"{column} = {value}"


@pytest.mark.parametrize("bad", NON_FINITE)
@pytest.mark.parametrize("column", ["power_w", "ecc_dbe_volatile_total"])
def test_table_import(tmp_path: Path, bad: str, column: str) -> None:
    mapping = tmp_path / "map.toml"
    mapping.write_text(
        '[telemetry]\ngpu = "gpu"\nnode = "host"\ntime = "t"\n[telemetry.metrics]\n'
        'power_w = "p"\ntemp_gpu_c = "temp"\necc_dbe_volatile_total = "dbe"\n'
    )
    good = {"p": "300", "temp": "40", "dbe": "1"}
    source = {"power_w": "p", "temp_gpu_c": "temp", "ecc_dbe_volatile_total": "dbe"}[column]
    data = tmp_path / "data.csv"
    cells = {**good, source: bad}
    data.write_text(
        "host,gpu,t,p,temp,dbe\n"
        f"n,g1,2026-05-01T10:00:00,{good['p']},{good['temp']},{good['dbe']}\n"
        f"n,g1,2026-05-01T10:01:00,{cells['p']},{cells['temp']},{cells['dbe']}\n"
    )
    store = Store.create(str(tmp_path / "root"))
    summary = import_table(store, data, load_mapping(mapping), mapping_path=mapping, cluster="c", now=NOW)
    rows = sorted(store.read("telemetry").to_pylist(), key=lambda r: r["ts"])
    assert_finite_or_missing(rows)
    assert rows[1][column] is None and rows[0][column] is not None
    assert rows[1]["temp_gpu_c"] is not None  # the rest of the row kept
    assert summary.out_of_range[column] == 1
    assert "1 readings outside their metric's valid range left missing" in summary.line()


@pytest.mark.parametrize("bad", ["1e308", "1e400", "-1e308", "1e39"])
def test_nvidia_smi_import(bad: str) -> None:
    text = (
        "timestamp, index, uuid, temperature.gpu, power.draw [W]\n"
        "2026/05/01 10:00:00.000, 0, GPU-a, 40, 300.00 W\n"
        f"2026/05/01 10:01:00.000, 0, GPU-a, 41, {bad} W\n"
    )
    summary = NvidiaSmiSummary()
    table = parse_nvidia_smi(text, source="f", cluster="c", node="n", now=NOW, summary=summary)
    rows = table.to_pylist()
    assert_finite_or_missing(rows)
    assert [r["power_w"] for r in rows] == [300.0, None]
    assert [r["temp_gpu_c"] for r in rows] == [40.0, 41.0]
    assert summary.skipped == {"readings of power_w outside its valid range [0, ...) or not finite": 1}


LABELS = 'gpu="0",UUID="GPU-aaaa",pci_bus_id="00000000:3B:00.0",modelName="NVIDIA H100",Hostname="n1"'


@pytest.mark.parametrize("bad", ["-1e308", "-1e19", "-9.3e18"])
def test_dcgm_exporter_scrape(bad: str) -> None:
    # Infinities, NaN and huge positive values were already blanks (DCGM's sentinels lie
    # there); a huge negative value of the one metric without a lower bound was not.
    text = (
        f"DCGM_FI_DEV_CLOCKS_EVENT_REASONS{{{LABELS}}} {bad}\n"
        f"DCGM_FI_DEV_GPU_TEMP{{{LABELS}}} 40\n"
        f"DCGM_FI_DEV_POWER_USAGE{{{LABELS}}} +Inf\n"
    )
    result = parse_scrape_detailed(text, now=NOW, cluster="c")
    (row,) = result.table.to_pylist()
    assert_finite_or_missing([row])
    assert row["clock_event_reasons"] is None and row["power_w"] is None and row["temp_gpu_c"] == 40
    assert result.out_of_range == {"clock_event_reasons": 1} and result.blank_values == 1


@pytest.mark.parametrize("bad", ["inf", "-inf", "nan", "1e308", "-1e308", "1e45"])
def test_nvml_collector(use_scenario, bad: str) -> None:
    scenario = scenario_from_capture(H100)
    for gpu in scenario.gpus[:2]:
        for name in ("NVML_FI_DEV_POWER_AVERAGE", "NVML_FI_DEV_POWER_INSTANT", "NVML_FI_DEV_MEMORY_TEMP"):
            gpu.fields.pop(field_id(name), None)
            gpu.double_fields[field_id(name)] = bad
    # A counter column whose field is a double gone wrong (an integer column).
    scenario.gpus[2].fields.pop(field_id("NVML_FI_DEV_PCIE_REPLAY_COUNTER"), None)
    scenario.gpus[2].double_fields[field_id("NVML_FI_DEV_PCIE_REPLAY_COUNTER")] = bad
    use_scenario(scenario)
    collector = NvmlCollector("c", "node-01")
    try:
        rows = collector.collect()["telemetry"].to_pylist()
        rows += collector.collect()["telemetry"].to_pylist()
    finally:
        collector.close()
    assert_finite_or_missing(rows)
    assert [r["power_w"] is None for r in rows] == [i % 8 < 2 for i in range(16)]
    assert all(r["temp_mem_c"] is None for r in rows if r["gpu_index"] < 2)
    assert all(r["temp_gpu_c"] is not None for r in rows)
    assert [r["pcie_replay_total"] is None for r in rows] == [i % 8 == 2 for i in range(16)]
    assert collector.counts()["out_of_range"] == {"power_w": 4, "temp_mem_c": 4, "pcie_replay_total": 2}


@pytest.mark.parametrize("bad", [-1e308, -1e19, -9.3e18])
def test_prometheus_import_readings(bad: float) -> None:
    # The Prometheus importer's reading rules over a series' values (its server tests are slow):
    # a huge negative value of the one metric without a lower bound is out of range, not stored.
    import numpy as np

    from ingest.prometheus_rows import SeriesCounts, readings
    from ingest.schema import metric_catalogue

    (metric,) = [m for m in metric_catalogue() if m.column == "clock_event_reasons"]
    counts = SeriesCounts()
    out = readings(np.array([bad, 4.0, float("inf")]), metric, counts)
    assert np.isnan(out[0]) and out[1] == 4.0 and np.isnan(out[2])
    assert counts.out_of_range == {"clock_event_reasons": 1} and counts.blank_values == 1
