"""The feature dictionary is generated from the code and covers every column a build writes;
the `gpufail features` command's dictionary output and its user errors."""

from __future__ import annotations

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


def test_cli_refuses_to_overwrite_features_without_overwrite_in_one_line(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    tel = synthetic_telemetry(8, 30, seed=2, start=T0)
    store.write("telemetry", tel.to_arrow())
    first = gpufail("features", "--data", str(tmp_path / "data"), "--quiet")
    assert first.returncode == 0, first.stderr
    again = gpufail("features", "--data", str(tmp_path / "data"), "--quiet")
    assert again.returncode == 2
    assert "files already cover" in again.stderr and "--overwrite" in again.stderr
    assert "Traceback" not in again.stderr
