from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest

from ingest.dcgm_scrape import parse_scrape, parse_scrape_detailed
from ingest.errors import InputError
from ingest.schema import metric_columns, telemetry_schema
from ingest.store import Store

FIXTURES = Path(__file__).parent.parent / "fixtures" / "dcgm_exporter"
NOW = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
LABELS = 'gpu="0",UUID="GPU-aaaa",pci_bus_id="00000000:3B:00.0",modelName="NVIDIA H100",Hostname="n1"'


def parse_fixture(name: str) -> pa.Table:
    path = FIXTURES / name
    return parse_scrape(path.read_text(), now=NOW, cluster="c1", source=str(path))


def row(table: pa.Table, index: int = 0) -> dict[str, object]:
    return table.to_pylist()[index]


def test_t4_scrape_real_values() -> None:
    table = parse_fixture("ericsson_T4_590.48.01.prom")
    assert table.num_rows == 1
    r = row(table)
    assert r["gpu_uuid"] == "GPU-6d5c0ac5-74d7-3130-46f1-e93ed57f469a"
    assert r["pci_bus_id"] == "0000:37:00"
    assert (r["node"], r["gpu_index"], r["gpu_model"], r["driver"]) == ("cp-bm14r7", 0, "Tesla T4", "590.48.01")
    assert r["temp_gpu_c"] == 74
    assert r["power_w"] == pytest.approx(68.244, rel=1e-6)
    assert (r["sm_clock_mhz"], r["mem_clock_mhz"], r["fb_used_mib"]) == (660, 5000, 5120)
    assert (r["util_gpu_pct"], r["util_mem_pct"], r["pcie_replay_total"]) == (91, 73, 0)
    assert r["ts"] == NOW and r["cluster"] == "c1"
    # Not in this scrape: null, never zero.
    assert r["ecc_dbe_volatile_total"] is None and r["power_violation_us_total"] is None


def test_l4_scrape_counters_and_repeated_scrape() -> None:
    # The evidence file holds the same scrape twice: still one row for the one GPU.
    table = parse_fixture("kops_aws_L4_580.105.08.prom")
    assert table.num_rows == 1
    r = row(table)
    assert r["gpu_uuid"] == "GPU-c2f76b33-7953-256e-8f33-1343419b1a1c"
    assert r["pci_bus_id"] == "0000:31:00"
    assert (r["node"], r["gpu_model"], r["driver"]) == ("i-030791dc5a37cd257", "NVIDIA L4", "580.105.08")
    assert r["temp_gpu_c"] == 31
    assert r["power_w"] == pytest.approx(16.365, rel=1e-6)
    assert (r["sm_clock_mhz"], r["mem_clock_mhz"]) == (210, 405)
    # Declared `# TYPE ... counter` without a _total suffix: still mapped.
    assert r["pcie_replay_total"] == 0
    assert r["remapped_rows_correctable_total"] == 0
    assert r["remapped_rows_uncorrectable_total"] == 0
    assert r["remapped_rows_failure"] == 0


def test_vgpu_scrape_has_no_temperature_or_power() -> None:
    table = parse_fixture("vmware_vks_GRID-A100-8C_580.65.06.prom")
    assert table.num_rows == 1
    r = row(table)
    assert r["gpu_uuid"] == "GPU-44d2411e-1604-478f-aa96-5a3c00000000"
    assert r["pci_bus_id"] == "0000:03:00"
    assert (r["gpu_model"], r["driver"]) == ("GRID A100-10C", "580.126.09")
    assert (r["sm_clock_mhz"], r["mem_clock_mhz"], r["fb_used_mib"]) == (1410, 1215, 0)
    assert r["temp_gpu_c"] is None and r["power_w"] is None


def test_unknown_metrics_are_counted_not_mapped() -> None:
    text = (FIXTURES / "ericsson_T4_590.48.01.prom").read_text()
    result = parse_scrape_detailed(text, now=NOW, cluster="c1")
    assert result.ignored_metrics["DCGM_FI_DEV_FB_FREE"] == 1
    assert result.ignored_metrics["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] == 1
    assert sum(result.ignored_metrics.values()) == 11


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_GPU_TEMP_CELSIUS"),
        ("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_BOARD_POWER_WATTS"),
    ],
)
def test_old_and_new_field_names_map_to_the_same_column(old: str, new: str) -> None:
    a = row(parse_scrape(f"{old}{{{LABELS}}} 55\n", now=NOW, cluster="c1"))
    b = row(parse_scrape(f"{new}{{{LABELS}}} 55\n", now=NOW, cluster="c1"))
    column = "temp_gpu_c" if "TEMP" in old else "power_w"
    assert a[column] == b[column] == 55
    assert a["pci_bus_id"] == "0000:3b:00"


def test_blank_sentinel_and_nan_become_null() -> None:
    text = (
        f"DCGM_FI_DEV_GPU_TEMP{{{LABELS}}} 9223372036854775794\n"
        f"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{LABELS}}} 9223372036854775792\n"
        f"DCGM_FI_DEV_POWER_USAGE{{{LABELS}}} NaN\n"
        f"DCGM_FI_DEV_SM_CLOCK{{{LABELS}}} 1980\n"
    )
    result = parse_scrape_detailed(text, now=NOW, cluster="c1")
    r = row(result.table)
    assert r["temp_gpu_c"] is None and r["ecc_dbe_volatile_total"] is None and r["power_w"] is None
    assert r["sm_clock_mhz"] == 1980
    assert result.blank_values == 3


def test_violation_ns_become_us_and_counters_are_ints() -> None:
    text = (
        f"DCGM_FI_DEV_POWER_VIOLATION{{{LABELS}}} 1234567\n"
        f"DCGM_FI_DEV_THERMAL_VIOLATION{{{LABELS}}} 2500\n"
        f"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{{{LABELS}}} 7\n"
    )
    r = row(parse_scrape(text, now=NOW, cluster="c1"))
    assert (r["power_violation_us_total"], r["thermal_violation_us_total"]) == (1235, 2)
    assert r["ecc_sbe_volatile_total"] == 7


def test_xid_errors_metric_is_ignored() -> None:
    result = parse_scrape_detailed(f"DCGM_FI_DEV_XID_ERRORS{{{LABELS}}} 79\n", now=NOW, cluster="c1")
    assert result.table.num_rows == 0
    assert result.ignored_metrics["DCGM_FI_DEV_XID_ERRORS"] == 1


def test_one_row_per_gpu_and_node_argument_wins() -> None:
    other = LABELS.replace('gpu="0"', 'gpu="1"').replace("GPU-aaaa", "GPU-bbbb").replace("3B", "3C")
    text = f"DCGM_FI_DEV_GPU_TEMP{{{LABELS}}} 40\nDCGM_FI_DEV_GPU_TEMP{{{other}}} 41\n"
    table = parse_scrape(text, now=NOW, cluster="c1", node="override")
    assert table.column("gpu_uuid").to_pylist() == ["GPU-aaaa", "GPU-bbbb"]
    assert table.column("gpu_index").to_pylist() == [0, 1]
    assert table.column("pci_bus_id").to_pylist() == ["0000:3b:00", "0000:3c:00"]
    assert table.column("node").to_pylist() == ["override", "override"]


def test_now_is_stored_in_utc() -> None:
    local = NOW.astimezone(timezone(timedelta(hours=2)))
    r = row(parse_scrape(f"DCGM_FI_DEV_GPU_TEMP{{{LABELS}}} 40\n", now=local, cluster="c1"))
    assert r["ts"] == NOW
    with pytest.raises(ValueError, match="naive"):
        parse_scrape("", now=NOW.replace(tzinfo=None), cluster="c1")


@pytest.mark.parametrize("text", ["", "# only a comment\n", "node_load1 0.5\nup 1\n"])
def test_scrape_without_dcgm_metrics_is_an_empty_table(text: str) -> None:
    table = parse_scrape(text, now=NOW, cluster="c1")
    assert table.num_rows == 0
    assert table.schema.equals(telemetry_schema(), check_metadata=True)


def test_malformed_text_names_source_and_line() -> None:
    text = f"DCGM_FI_DEV_GPU_TEMP{{{LABELS}}} 40\n<html>not a scrape</html>\n"
    with pytest.raises(InputError, match=r"node7\.prom, line 2: not Prometheus text exposition format"):
        parse_scrape(text, now=NOW, cluster="c1", source="node7.prom")


def test_missing_hostname_needs_node_argument() -> None:
    labels = LABELS.replace(',Hostname="n1"', "")
    with pytest.raises(InputError, match="no Hostname label"):
        parse_scrape(f"DCGM_FI_DEV_GPU_TEMP{{{labels}}} 40\n", now=NOW, cluster="c1", source="s")
    assert row(parse_scrape(f"DCGM_FI_DEV_GPU_TEMP{{{labels}}} 40\n", now=NOW, cluster="c1", node="n9"))["node"] == "n9"


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.prom")))
def test_schema_matches_and_store_accepts(name: str, tmp_path: Path) -> None:
    table = parse_fixture(name)
    assert table.schema.equals(telemetry_schema(), check_metadata=True)
    assert set(metric_columns()) <= set(table.column_names)
    store = Store.create(str(tmp_path / "root"))
    assert len(store.write("telemetry", table)) == 1


def test_a_memory_temperature_of_zero_means_no_sensor_and_becomes_null():
    # Real T4 and L4 scrapes report DCGM_FI_DEV_MEMORY_TEMP 0: GDDR6 boards have no HBM sensor.
    from datetime import UTC, datetime

    from ingest.dcgm_scrape import parse_scrape

    scrape = (
        "# TYPE DCGM_FI_DEV_MEMORY_TEMP gauge\n"
        'DCGM_FI_DEV_MEMORY_TEMP{gpu="0",UUID="GPU-a",pci_bus_id="00000000:3B:00.0",Hostname="n1"} 0\n'
        'DCGM_FI_DEV_MEMORY_TEMP{gpu="1",UUID="GPU-b",pci_bus_id="00000000:5D:00.0",Hostname="n1"} 41\n'
    )
    table = parse_scrape(scrape, now=datetime(2026, 1, 5, tzinfo=UTC), cluster="c")
    assert table.sort_by("gpu_index")["temp_mem_c"].to_pylist() == [None, 41.0]
