"""Imports start a new data root when asked, and a failed one leaves nothing behind; unstamped
kernel-log lines are placed at the capture time given."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from ingest.store import Store
from tests.cli import gpufail

EXAMPLE = Path(__file__).parents[2] / "examples" / "table_import"
# A plain `dmesg` payload and `journalctl -o cat` print the message with no stamp at all.
UNSTAMPED = (
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n"
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n"
    "[ 5312.1] NVRM: Xid (PCI:0000:3c:00): 48, pid=1, name=x, An uncorrectable double bit error\n"
)


def test_a_kernel_log_alone_starts_a_new_data_root_and_its_unstamped_lines_take_the_capture_time(
    tmp_path: Path,
) -> None:
    log = tmp_path / "node-7.log"
    log.write_text(UNSTAMPED)
    root = tmp_path / "fleet"
    result = gpufail("ingest", "kernel-log", "--data", str(root), "--time", "2026-05-01T10:00", str(log))
    assert result.returncode == 0, result.stderr
    assert result.stderr == f"created data root {root}\n"
    assert "2 unstamped XID lines placed at the capture time (--time)" in result.stdout
    assert "1 untimed XID lines" in result.stdout  # the [uptime] line needs --boot-time
    [row] = Store.open(str(root)).read("xid_events").to_pylist()
    assert (row["ts"], row["xid"], row["repeat_count"], row["node"]) == (
        datetime(2026, 5, 1, 10, tzinfo=UTC),
        79,
        2,
        "node-7",
    )

    again = gpufail("ingest", "kernel-log", "--data", str(root), "--time", "2026-05-01T10:00", str(log))
    assert again.returncode == 0 and "created" not in again.stderr


def test_without_the_capture_time_unstamped_lines_are_untimed_and_the_hint_names_the_option(tmp_path: Path) -> None:
    log = tmp_path / "n.log"
    log.write_text(UNSTAMPED)
    result = gpufail("ingest", "kernel-log", "--data", str(tmp_path / "d"), str(log))
    assert result.returncode == 0, result.stderr
    assert "3 untimed XID lines" in result.stdout and "the capture time (--time)" in result.stdout


def test_a_failed_import_into_a_new_root_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "new"
    # The tickets file has no telemetry time column: refused after the root was opened.
    failed = gpufail(
        "ingest", "table", str(EXAMPLE / "tickets.csv"), "--map", str(EXAMPLE / "mapping.toml"), "--data", str(root)
    )
    assert failed.returncode == 2
    assert "no column 'sampled_at' (mapping [telemetry] time)" in failed.stderr
    assert "__row" not in failed.stderr  # our row counter is not one of their columns
    assert not root.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    failed = gpufail(
        "ingest", "table", str(EXAMPLE / "tickets.csv"), "--map", str(EXAMPLE / "mapping.toml"), "--data", str(empty)
    )
    assert failed.returncode == 2 and list(empty.iterdir()) == []

    ok = gpufail(
        "ingest", "table", str(EXAMPLE / "telemetry.csv"), "--map", str(EXAMPLE / "mapping.toml"), "--data", str(root)
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("table: 6 telemetry rows, 1 failures, 1 repairs")
    assert ok.stderr == f"created data root {root}\n"


def test_a_failed_import_into_an_existing_root_keeps_it(tmp_path: Path) -> None:
    root = tmp_path / "d"
    assert (
        gpufail(
            "ingest",
            "table",
            str(EXAMPLE / "telemetry.csv"),
            "--map",
            str(EXAMPLE / "mapping.toml"),
            "--data",
            str(root),
        ).returncode
        == 0
    )
    failed = gpufail(
        "ingest", "table", str(EXAMPLE / "tickets.csv"), "--map", str(EXAMPLE / "mapping.toml"), "--data", str(root)
    )
    assert failed.returncode == 2
    assert Store.open(str(root)).read("telemetry").num_rows == 6
