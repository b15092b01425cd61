"""End to end without the simulator: a fleet's own export, imported with the example mapping
through `gpufail ingest table`, goes through `gpufail features` and gives labelled rows."""

from __future__ import annotations

import csv
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl

from features.dataset import read_features
from ingest.store import Store
from tests.cli import gpufail

EXAMPLE = Path(__file__).parents[2] / "examples" / "table_import"
START = datetime(2026, 5, 1, tzinfo=UTC)
FAILED_AT = START + timedelta(days=2, hours=12)
STEP = timedelta(minutes=10)


def write_export(folder: Path, *, replaced: bool = True) -> None:
    """Two nodes of four GPUs over four days, in the example mapping's column names. One GPU's
    double-bit ECC count rises, it stops reporting, a ticket is opened and it is replaced
    (`replaced=False`: it keeps reporting after the ticket, as a GPU still in the node does)."""
    folder.mkdir()
    columns = [
        "host",
        "slot",
        "device_serial",
        "model",
        "sampled_at",
        "gpu_temp",
        "power_mw",
        "mem_used_bytes",
        "sbe",
        "dbe",
    ]
    failing, replacement = "SN-a-2", "SN-a-9"
    with open(folder / "telemetry.csv", "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(columns)
        moment = START
        while moment < START + timedelta(days=4):
            for host in ("node-a", "node-b"):
                for slot in range(4):
                    serial = f"SN-{host[-1]}-{slot}"
                    if replaced and serial == failing and moment >= FAILED_AT:
                        if moment < FAILED_AT + timedelta(hours=20):
                            continue  # out of the node until it is replaced
                        serial = replacement
                    hours_left = (FAILED_AT - moment) / timedelta(hours=1)
                    dbe = max(0, int(30 - hours_left)) if serial == failing else 0
                    temp = 50 + slot + (moment.hour % 6)
                    stamp = moment.strftime("%Y-%m-%d %H:%M:%S")
                    out.writerow(
                        [host, slot, serial, "A100-SXM4-40GB", stamp, temp, 250_000 + 1000 * slot, 2**34, 0, dbe]
                    )
            moment += STEP
    (folder / "tickets.csv").write_text(
        f"device_serial,opened_at,category\n{failing},{FAILED_AT:%Y-%m-%d %H:%M:%S},ECC\n"
    )
    repaired = FAILED_AT + timedelta(hours=20)
    (folder / "repairs.csv").write_text(
        f"device_serial,closed_at,kind,replacement_serial\n{failing},{repaired:%Y-%m-%d %H:%M:%S},RMA,{replacement}\n"
    )
    (folder / "mapping.toml").write_text((EXAMPLE / "mapping.toml").read_text())


def test_an_imported_export_goes_through_features_with_the_failing_gpu_labelled(tmp_path: Path) -> None:
    export = tmp_path / "export"
    write_export(export)
    root = str(tmp_path / "root")
    imported = gpufail(
        "ingest", "table", str(export / "telemetry.csv"), "--map", str(export / "mapping.toml"), "--data", root
    )
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.startswith("table: ") and "1 failures, 1 repairs" in imported.stdout

    built = gpufail("features", "--data", root, "--quiet")
    assert built.returncode == 0, built.stderr

    features = read_features(Store.open(root))
    assert features.height > 0
    assert set(features["gpu_uuid"].unique()) == {f"SN-{n}-{s}" for n in "ab" for s in range(4)} | {"SN-a-9"}
    failing = features.filter(pl.col("gpu_uuid") == "SN-a-2")
    before = failing.filter(pl.col("ts") > FAILED_AT - timedelta(hours=20))
    assert before.height > 0 and before["label"].to_list() == [1] * before.height
    healthy = features.filter(pl.col("gpu_uuid") == "SN-b-1", pl.col("ts") < START + timedelta(days=2))
    assert healthy["label"].to_list() == [0] * healthy.height


def import_without_repairs(tmp_path: Path, *, replaced: bool = True, tickets: str | None = None) -> str:
    """Import the example export with its mapping cut before `[repairs]` (failure records are
    then the only label evidence besides lost GPUs), optionally with other tickets; the root."""
    export = tmp_path / "export"
    write_export(export, replaced=replaced)
    mapping = (EXAMPLE / "mapping.toml").read_text()
    (export / "mapping.toml").write_text(mapping[: mapping.index("[repairs]")])
    if tickets is not None:
        (export / "tickets.csv").write_text(tickets)
    root = str(tmp_path / "root")
    imported = gpufail(
        "ingest", "table", str(export / "telemetry.csv"), "--map", str(export / "mapping.toml"), "--data", root
    )
    assert imported.returncode == 0, imported.stderr
    return root


def test_failure_records_alone_label_the_rows_before_them_and_have_their_own_summary_line(tmp_path: Path) -> None:
    """The GPU keeps reporting and no repair is mapped: the ticket is the only evidence."""
    root = import_without_repairs(tmp_path, replaced=False)

    built = gpufail("features", "--data", root, "--quiet")
    assert built.returncode == 0, built.stderr
    features = read_features(Store.open(root))
    positive = features.filter(pl.col("label") == 1)
    assert set(positive["gpu_uuid"]) == {"SN-a-2"}
    assert positive["ts"].max() < FAILED_AT and positive["ts"].min() >= FAILED_AT - timedelta(hours=24)
    assert f"{positive.height} positive from failure records" in built.stdout
    assert "warning" not in built.stdout


def test_failure_records_that_label_nothing_are_warned_about(tmp_path: Path) -> None:
    # The ticket was opened before the export's first sample: no row lies before it.
    tickets = "device_serial,opened_at,category\nSN-a-2,2026-04-30 23:00:00,ECC\n"
    root = import_without_repairs(tmp_path, tickets=tickets)
    built = gpufail("features", "--data", root, "--quiet")
    assert built.returncode == 0, built.stderr
    assert "warning: failure_events: 1 events from source 'record' gave no positive label" in built.stdout
