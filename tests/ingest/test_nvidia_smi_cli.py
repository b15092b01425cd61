"""`gpufail ingest nvidia-smi`, run as a user runs it."""

from __future__ import annotations

from pathlib import Path

from ingest.store import Store
from tests.cli import gpufail

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nvidia_smi"


def test_csv_and_xml_captures_become_telemetry_with_a_summary_line(tmp_path: Path) -> None:
    csv_file = tmp_path / "gpu-node-1.csv"
    csv_file.write_text((FIXTURES / "query_h100_590.48.01_load.csv").read_text() + "2026/07/14 08:13, truncated\n")
    xml_file = FIXTURES / "qx-h100.xml"
    result = gpufail(
        "ingest",
        "nvidia-smi",
        "--data",
        str(tmp_path / "root"),
        "--node",
        "n1",
        "--quiet",
        str(csv_file),
        str(xml_file),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("nvidia-smi: 9 GPU samples from 2 file(s)")
    assert "1 lines with the wrong number of cells" in result.stdout
    table = Store.open(str(tmp_path / "root")).read("telemetry")
    assert table.num_rows == 9 and set(table["node"].to_pylist()) == {"n1"}


def test_a_noheader_capture_is_refused_in_one_line_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "n.csv"
    bad.write_text("2026/05/01 10:00:00.000, 0, GPU-a, 40\n")
    result = gpufail("ingest", "nvidia-smi", "--data", str(tmp_path / "root"), "--quiet", str(bad))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and f"{bad}, line 1: not a header line" in result.stderr


def test_an_unknown_time_zone_is_a_usage_error(tmp_path: Path) -> None:
    result = gpufail(
        "ingest", "nvidia-smi", "--data", str(tmp_path / "root"), "--tz", "Mars/Olympus", str(FIXTURES / "qx-t4.xml")
    )
    assert result.returncode == 2 and "Mars/Olympus" in result.stderr
