"""The feature dictionary is generated from the code and covers every column a build writes;
the `gpufail features` command's dictionary output and its user errors."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from features.build import build_features
from features.dictionary import describe, dictionary_markdown, feature_dictionary
from features.spec import FeatureSpec
from ingest.store import Store
from tests.cli import gpufail
from tests.features import T0, H
from tests.synthetic import synthetic_telemetry, synthetic_xids

DOC = Path(__file__).parents[2] / "docs" / "features.md"


def test_every_column_of_a_build_has_an_entry_with_a_unit_and_a_window():
    tel = synthetic_telemetry(8, 30, seed=2, start=T0)
    out = build_features(tel, synthetic_xids(tel, seed=2))
    entries = {e.name: e for e in feature_dictionary()}
    assert list(entries) == out.columns
    for e in entries.values():
        assert e.meaning and e.unit and e.window, e
    assert entries["temp_gpu_c_slope_24h"].unit == "degC/h"
    assert entries["ecc_dbe_volatile_total_rate_7d"].unit == "count/h"
    assert entries["power_w_model_delta_1h"].family == "features.peers"
    assert entries["xid_13_count_6h"].window == "6h"


def test_the_dictionary_follows_the_configured_windows():
    names = [e.name for e in feature_dictionary(FeatureSpec(windows=[H, timedelta(hours=12)]))]
    assert "temp_gpu_c_mean_12h" in names and "temp_gpu_c_mean_24h" not in names


def test_a_column_no_family_makes_is_refused():
    with pytest.raises(ValueError, match="no feature family makes this column"):
        describe("temp_gpu_c_median_1h")


def test_docs_features_md_is_the_generated_dictionary():
    # Regenerate with: gpufail features --dictionary docs/features.md
    assert DOC.read_text() == dictionary_markdown()


def test_cli_writes_the_dictionary_to_stdout_without_a_data_root():
    result = gpufail("features", "--dictionary", "-")
    assert result.returncode == 0, result.stderr
    assert result.stdout == dictionary_markdown()


def test_cli_refuses_an_end_before_the_start_in_one_line(tmp_path):
    Store.create(str(tmp_path / "data"))
    result = gpufail("features", "--data", str(tmp_path / "data"), "--start", "2026-02-02", "--end", "2026-02-01")
    assert result.returncode == 2
    assert "--end 2026-02-01: expected a time after --start 2026-02-02" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_builds_what_is_missing_and_with_nothing_new_says_it_is_up_to_date(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    store.write("telemetry", synthetic_telemetry(8, 30, seed=2, start=T0).to_arrow())
    first = gpufail("features", "--materialise", "--data", str(tmp_path / "data"), "--quiet")
    assert first.returncode == 0, first.stderr
    again = gpufail("features", "--materialise", "--data", str(tmp_path / "data"), "--quiet")
    assert again.returncode == 0, again.stderr
    days = f"{T0.date()}..{(T0 + timedelta(hours=30)).date()}"
    assert again.stdout.startswith(f"features: up to date: 2 files cover {days}, every day, built from the data")
    assert "gpufail features --overwrite rebuilds them" in again.stdout and "overwrite=True" not in again.stdout

    # Two more days of telemetry: the next run builds them, and rebuilds the days whose
    # censored labels they settle, without --start.
    store.write("telemetry", synthetic_telemetry(8, 48, seed=3, start=T0 + timedelta(hours=31)).to_arrow())
    more = gpufail("features", "--materialise", "--data", str(tmp_path / "data"), "--quiet", "--json")
    assert more.returncode == 0, more.stderr
    facts = json.loads(more.stdout)
    assert facts["up_to_date"] is False and facts["start"].startswith(str(T0.date()))
    assert (len(facts["files_written"]), facts["files_replaced"]) == (4, 2)

    ranged = gpufail(
        "features",
        "--materialise",
        "--data",
        str(tmp_path / "data"),
        "--quiet",
        "--start",
        str(T0.date()),
        "--end",
        str((T0 + timedelta(days=1)).date()),
    )
    assert ranged.returncode == 0 and ranged.stdout.startswith(
        f"features: up to date: 1 files cover {T0.date()}..{T0.date()}, every day asked for"
    )
    rebuilt = gpufail(
        "features",
        "--materialise",
        "--data",
        str(tmp_path / "data"),
        "--quiet",
        "--overwrite",
        "--start",
        str(T0.date()),
        "--end",
        str((T0 + timedelta(days=1)).date()),
    )
    assert rebuilt.returncode == 0 and "1 files written, 1 replaced" in rebuilt.stdout
