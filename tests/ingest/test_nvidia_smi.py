"""nvidia-smi import: real query-gpu CSV and `-q -x` XML captures, and every kind of bad input."""

from __future__ import annotations

import gzip
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from ingest.errors import InputError
from ingest.nvidia_smi import (
    NvidiaSmiSummary,
    field_mappings,
    import_nvidia_smi,
    node_from_filename,
    parse_nvidia_smi,
)
from ingest.schema import metric_columns, telemetry_schema
from ingest.store import Store

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nvidia_smi"
NOW = datetime(2026, 11, 21, tzinfo=UTC)


def parse(text: str, summary: NvidiaSmiSummary | None = None, **kwargs: object) -> list[dict[str, Any]]:
    options: dict[str, object] = {"source": "f", "cluster": "c", "node": "n", "now": NOW, **kwargs}
    table = parse_nvidia_smi(text, summary=summary, **options)  # type: ignore[arg-type]
    assert table.schema.equals(telemetry_schema())
    return table.to_pylist()


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# -- real captures ------------------------------------------------------------------------------


def test_a_real_h100_query_under_load_maps_values_units_and_identity() -> None:
    summary = NvidiaSmiSummary()
    [row] = parse(fixture("query_h100_590.48.01_load.csv"), summary)
    assert row["ts"] == datetime(2026, 7, 14, 8, 12, 53, 353000, tzinfo=UTC)  # "2026/07/14 08:12:53.353"
    assert (row["gpu_index"], row["pci_bus_id"], row["driver"]) == (0, "0000:00:09", "590.48.01")
    assert row["gpu_model"] == "NVIDIA H100 80GB HBM3"
    assert row["temp_gpu_c"] == 59.0 and row["temp_mem_c"] == 54.0
    assert row["power_w"] == pytest.approx(631.95)  # power.draw.average wins over .draw and .instant
    assert row["power_limit_w"] == 700.0
    assert (row["util_gpu_pct"], row["util_mem_pct"]) == (100.0, 11.0)
    assert (row["sm_clock_mhz"], row["fb_used_mib"]) == (1980.0, 19818.0)
    assert row["clock_event_reasons"] == 0
    assert row["retired_pages_sbe_total"] is None  # "[N/A]" on an H100: a missing reading
    assert summary.blank_values >= 3
    assert "utilization.encoder" in summary.unmapped_fields  # counted, not a crash


def test_an_idle_l40s_has_no_memory_temperature_and_its_idle_bit_set() -> None:
    [row] = parse(fixture("query_l40s_595.80_idle.csv"))
    assert row["temp_mem_c"] is None  # GDDR6: "N/A"
    assert row["power_violation_us_total"] == 200740215  # "200740215 us"


def test_a_field_the_header_names_twice_is_one_reading_not_a_sum() -> None:
    # nvidia-smi prints clocks.sm and clocks.current.sm (and the throttle/event reason aliases)
    # as two columns named clocks.current.sm: adding them up doubled the clock.
    idle, load = parse(fixture("query_h100_580.159.04_repeated_fields.csv"), now=datetime(2026, 11, 25, tzinfo=UTC))
    assert (idle["sm_clock_mhz"], idle["mem_clock_mhz"], idle["clock_event_reasons"]) == (345.0, 2619.0, 1)
    assert (load["sm_clock_mhz"], load["mem_clock_mhz"], load["clock_event_reasons"]) == (1395.0, 2619.0, 4)
    assert load["fb_used_mib"] == 1139.0 and load["power_w"] == pytest.approx(696.61)
    assert load["power_violation_us_total"] == 41248716  # held at the power cap all through the load
    assert load["retired_pages_sbe_total"] is None  # "[N/A]" twice: still one missing reading


def test_xml_violation_counters_are_read_as_the_query_fields_are() -> None:
    first = parse(fixture("qx-h100.xml"))[0]
    assert first["power_violation_us_total"] == 7015662857  # "7015662857 us"
    assert first["thermal_violation_us_total"] == 0  # hardware 0 us + software 0 us


@pytest.mark.parametrize(
    ("name", "gpus", "driver"),
    [("qx-a100.xml", 1, "570.148.08"), ("qx-t4.xml", 1, "595.91.07"), ("qx-h100.xml", 8, "580.105.08")],
)
def test_real_xml_captures_of_three_drivers_give_one_row_per_gpu(name: str, gpus: int, driver: str) -> None:
    rows = parse(fixture(name))
    assert len(rows) == gpus
    assert [r["gpu_index"] for r in rows] == list(range(gpus))
    assert {r["driver"] for r in rows} == {driver}
    assert all(r["temp_gpu_c"] is not None and r["power_w"] is not None for r in rows)


def test_xml_values_of_an_a100_with_average_power_unavailable() -> None:
    [row] = parse(fixture("qx-a100.xml"))
    assert row["ts"] == datetime(2026, 8, 21, 10, 21, 36, tzinfo=UTC)  # "Fri Aug 21 10:21:36 2026"
    assert row["power_w"] == pytest.approx(49.68)  # average "N/A": the instant draw is next in line
    assert row["fb_used_mib"] == 0.0 and row["mem_clock_mhz"] == 1215.0
    assert row["retired_pages_sbe_total"] is None  # "N/A" on Ampere (rows are remapped instead)
    assert (row["remapped_rows_pending"], row["remapped_rows_failure"]) == (0, 0)


def test_newer_drivers_split_ecc_counts_add_up_to_the_totals() -> None:
    rows = parse(fixture("qx-gb200-ecc-injected.xml"))
    # dram_uncorrectable 5 (+ SRAM N/A) volatile, 8 aggregate; a remap failure is flagged
    assert (rows[0]["ecc_dbe_volatile_total"], rows[0]["ecc_dbe_aggregate_total"]) == (5, 8)
    assert rows[0]["remapped_rows_failure"] == 1
    t4 = parse(fixture("qx-t4.xml"))[0]
    assert t4["ecc_sbe_aggregate_total"] == 1  # dram_correctable 1 + sram_correctable 0


def test_the_times_zone_is_the_capture_hosts() -> None:
    [row] = parse(fixture("qx-a100.xml"), tz="Europe/Warsaw")
    assert row["ts"] == datetime(2026, 8, 21, 8, 21, 36, tzinfo=UTC)  # CEST is UTC+2


def test_every_mapping_row_names_a_catalogue_column() -> None:
    mapped = {m.metric.column for m in field_mappings()}
    assert mapped <= set(metric_columns())
    assert {"temp_gpu_c", "power_w", "ecc_dbe_volatile_total"} <= mapped


# -- query CSV shapes ---------------------------------------------------------------------------

HEADER = "timestamp, index, uuid, temperature.gpu, power.draw [W], memory.used [MiB], clocks.sm [MHz]"


def test_nounits_output_takes_the_fields_default_unit_and_a_header_unit_is_converted() -> None:
    nounits = "timestamp, index, uuid, power.draw, memory.used\n2026/05/01 10:00:00.000, 0, GPU-a, 300.5, 2048\n"
    assert parse(nounits)[0]["fb_used_mib"] == 2048.0
    kib = "timestamp, index, uuid, memory.used [KiB]\n2026/05/01 10:00:00.000, 0, GPU-a, 2048\n"
    assert parse(kib)[0]["fb_used_mib"] == 2.0


def test_a_looped_capture_with_a_second_run_appended_keeps_both_runs() -> None:
    text = (
        f"{HEADER}\n"
        "2026/05/01 10:00:00.000, 0, GPU-a, 40, 300.00 W, 100 MiB, 1400 MHz\n"
        "2026/05/01 10:00:00.000, 1, GPU-b, 41, 310.00 W, 100 MiB, 1400 MHz\n"
        "timestamp, uuid, temperature.gpu\n"
        "2026/05/01 10:01:00.000, GPU-b, 45\n"
    )
    rows = parse(text)
    assert [(r["gpu_uuid"], r["temp_gpu_c"]) for r in rows] == [("GPU-a", 40.0), ("GPU-b", 41.0), ("GPU-b", 45.0)]
    assert rows[2]["gpu_index"] == 0  # no index field: numbered in the order the file lists GPUs
    assert rows[2]["power_w"] is None


def test_an_appended_run_with_an_unusable_header_loses_only_its_own_lines() -> None:
    text = (
        f"{HEADER}\n"
        "2026/05/01 10:00:00.000, 0, GPU-a, 40, 300.00 W, 100 MiB, 1400 MHz\n"
        "index, uuid, temperature.gpu\n"  # no timestamp, and no --time
        "0, GPU-a, 41\n"
        f"{HEADER}\n"
        "2026/05/01 10:02:00.000, 0, GPU-a, 42, 300.00 W, 100 MiB, 1400 MHz\n"
    )
    summary = NvidiaSmiSummary()
    assert [r["temp_gpu_c"] for r in parse(text, summary)] == [40.0, 42.0]
    assert summary.skipped == {"runs whose header cannot be used": 1, "lines under a header that cannot be used": 1}
    assert "line 3: no timestamp column" in summary.examples["runs whose header cannot be used"][0]


def test_bad_lines_are_skipped_counted_and_the_good_lines_around_them_kept() -> None:
    text = (
        f"{HEADER}\n"
        "2026/05/01 10:00:00.000, 0, GPU-a, 40, 300.00 W, 100 MiB, 1400 MHz\n"
        "2026/05/01 10:00:05.000, 0, GPU-a, 4\n"  # truncated
        "\x00\x01\x02\xff garbage \x00\n"  # binary junk
        "yesterday, 0, GPU-a, 40, 300.00 W, 100 MiB, 1400 MHz\n"  # timestamp does not parse
        "2026/05/01 09:00:00.000, 0, GPU-a, 40, 300.00 W, 100 MiB, 1400 MHz\n"  # clock jumped back
        "1970/01/01 00:00:07.000, 0, GPU-a, 40, 300.00 W, 100 MiB, 1400 MHz\n"  # clock not set
        "2026/05/01 10:00:10.000, 0, GPU-a, hot, [GPU is lost], 100 MiB, 1400 MHz\n"  # bad cells only
        "2026/05/01 10:00:20.000, 0, GPU-a, 42, 301.00 W, 100 MiB, 1400 MHz\n"
    )
    summary = NvidiaSmiSummary()
    rows = parse(text, summary)
    assert [r["ts"].second for r in rows] == [0, 10, 20]
    assert rows[1]["temp_gpu_c"] is None and rows[1]["power_w"] is None and rows[1]["fb_used_mib"] == 100.0
    reasons = " | ".join(summary.skipped)
    for expected in ("wrong number of cells", "not text", "timestamp does not parse", "does not move forward",
                     "implausible time", "temperature.gpu that are not numbers"):  # fmt: skip
        assert expected in reasons
    assert sum(summary.skipped.values()) == 6
    assert summary.examples[next(r for r in summary.skipped if "wrong number" in r)] == ["f:3"]
    assert "skipped" in summary.line() and "3 GPU samples" in summary.line()


def test_unsupported_cells_of_every_spelling_are_missing_readings() -> None:
    cells = ["[N/A]", "[Not Supported]", "N/A", "Not Supported", "[Unknown Error]", ""]
    text = "timestamp, index, uuid, temperature.gpu\n" + "".join(
        f"2026/05/01 10:00:{i:02d}.000, 0, GPU-a, {cell}\n" for i, cell in enumerate(cells)
    )
    summary = NvidiaSmiSummary()
    rows = parse(text, summary)
    assert [r["temp_gpu_c"] for r in rows] == [None] * len(cells)
    assert summary.blank_values == len(cells)
    assert not summary.skipped


def test_a_capture_without_timestamps_takes_the_time_given() -> None:
    text = "index, uuid, temperature.gpu\n0, GPU-a, 40\n"
    with pytest.raises(InputError, match=r"f, line 1: no timestamp column and no --time"):
        parse(text)
    [row] = parse(text, time=datetime(2026, 5, 1, 12, tzinfo=UTC))
    assert row["ts"] == datetime(2026, 5, 1, 12, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2026/05/01 10:00:00.000, 0, GPU-a, 40\n", r"line 1: not a header line .*not `noheader`"),
        ("timestamp, index, temperature.gpu\n2026/05/01 10:00:00.000, 0, 40\n", "no uuid column"),
        ("timestamp, uuid, fan.speed [%]\n2026/05/01 10:00:00.000, GPU-a, 30 %\n", "none of its fields"),
        ("\n\n", "empty"),
        ("<nvidia_smi_lo", "XML without <nvidia_smi_log>"),
    ],
)
def test_a_file_that_cannot_be_used_at_all_is_an_input_error_naming_it(text: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        parse(text)


# -- XML shapes ---------------------------------------------------------------------------------

GPU = (
    '<gpu id="00000000:3B:00.0"><product_name>NVIDIA A100</product_name><uuid>GPU-{n}</uuid>'
    "<temperature><gpu_temp>{t} C</gpu_temp></temperature>{extra}</gpu>"
)


def xml_doc(stamp: str, *gpus: str) -> str:
    return f"<?xml version='1.0' ?>\n<nvidia_smi_log>\n<timestamp>{stamp}</timestamp>\n{''.join(gpus)}\n</nvidia_smi_log>\n"


def test_looped_xml_documents_one_truncated_and_an_unknown_element_from_a_future_driver() -> None:
    future = "<quantum_flux><level>3 qF</level></quantum_flux>"
    text = (
        xml_doc("Fri May  1 10:00:00 2026", GPU.format(n="a", t=40, extra=future))
        + xml_doc("Fri May  1 10:01:00 2026", GPU.format(n="a", t=41, extra=""))[:-40]  # cut short
        + xml_doc("Fri May  1 10:02:00 2026", GPU.format(n="a", t=42, extra=""))
    )
    summary = NvidiaSmiSummary()
    rows = parse(text, summary)
    assert [(r["ts"].minute, r["temp_gpu_c"]) for r in rows] == [(0, 40.0), (2, 42.0)]
    assert summary.skipped == {"XML documents that do not parse (truncated or garbled)": 1}
    assert summary.unmapped_fields["quantum_flux/level"] == 1
    assert rows[0]["pci_bus_id"] == "0000:3b:00"


def test_xml_without_a_timestamp_needs_the_time_option() -> None:
    text = "<nvidia_smi_log>" + GPU.format(n="a", t=40, extra="") + "</nvidia_smi_log>"
    with pytest.raises(InputError, match="XML without <timestamp> and no --time"):
        parse(text)
    assert parse(text, time=datetime(2026, 5, 1, tzinfo=UTC))[0]["temp_gpu_c"] == 40.0


def test_xml_gpus_without_uuid_and_unparseable_stamps_are_skipped_with_reasons() -> None:
    no_uuid = '<gpu id="00000000:3B:00.0"><uuid>N/A</uuid></gpu>'
    summary = NvidiaSmiSummary()
    rows = parse(
        xml_doc("Fri May  1 10:00:00 2026", no_uuid, GPU.format(n="b", t=1, extra="")) + xml_doc("soon"), summary
    )
    assert [r["gpu_uuid"] for r in rows] == ["GPU-b"]
    assert rows[0]["gpu_index"] == 1  # its place among the <gpu> elements
    assert set(summary.skipped) == {
        "XML <gpu> elements without a GPU UUID",
        "XML documents whose <timestamp> does not parse",
    }


# -- files and store ----------------------------------------------------------------------------


def test_node_names_come_from_file_names() -> None:
    assert node_from_filename("gpu-node-007.csv") == "gpu-node-007"
    assert node_from_filename("gpu-node-007.nvidia-smi.xml.gz") == "gpu-node-007"
    assert node_from_filename("host.example.com.csv") == "host.example.com"


def test_import_writes_good_files_skips_bad_ones_and_reads_gzip(tmp_path: Path) -> None:
    good = tmp_path / "node-a.xml.gz"
    good.write_bytes(gzip.compress((FIXTURES / "qx-h100.xml").read_bytes()))
    noheader = tmp_path / "node-b.csv"
    noheader.write_text("2026/05/01 10:00:00.000, 0, GPU-a, 40\n")
    store = Store.create(str(tmp_path / "root"))
    summary = import_nvidia_smi(store, [good, noheader, tmp_path / "missing.csv"], cluster="c")
    assert (summary.files, summary.samples) == (1, 8)
    assert summary.skipped["files that could not be used"] == 2
    table = store.read("telemetry")
    assert table.num_rows == 8 and set(table["node"].to_pylist()) == {"node-a"}


def test_import_of_nothing_usable_raises_the_first_files_reason_and_writes_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "node-b.csv"
    bad.write_text("2026/05/01 10:00:00.000, 0, GPU-a, 40\n")
    store = Store.create(str(tmp_path / "root"))
    with pytest.raises(InputError, match="node-b.csv, line 1: not a header line"):
        import_nvidia_smi(store, [bad], cluster="c")
    assert not store.exists("telemetry")


def test_a_broken_gzip_is_an_input_error(tmp_path: Path) -> None:
    broken = tmp_path / "n.csv.gz"
    broken.write_bytes(gzip.compress(b"timestamp, uuid\n")[:12])
    with pytest.raises(InputError, match="broken gzip"):
        import_nvidia_smi(Store.create(str(tmp_path / "root")), [broken], cluster="c")


def test_rows_fit_the_telemetry_schema_types() -> None:
    table = parse_nvidia_smi(fixture("qx-h100.xml"), source="f", cluster="c", node="n", now=NOW)
    assert table.schema.field("ecc_dbe_volatile_total").type == pa.int64()
    assert table.column("pcie_replay_total").to_pylist()[0] == 150
