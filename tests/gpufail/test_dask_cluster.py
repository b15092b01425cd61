"""`[dask] scheduler`: a bad address or value is a clear error; a good one runs `gpufail
features` and `gpufail train` on that cluster."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from gpufail.config import load_settings
from gpufail.dask_cluster import ClusterError, dask_client
from ingest.errors import ConfigError
from tests.cli import gpufail


def test_a_scheduler_that_does_not_answer_is_an_error_naming_it():
    expected = r"\[dask\] scheduler 'tcp://127.0.0.1:1': no Dask scheduler answered"
    with (
        pytest.raises(ClusterError, match=expected),
        dask_client("tcp://127.0.0.1:1", connect_timeout=timedelta(seconds=1)),
    ):
        pass


def test_a_scheduler_value_that_is_not_an_address_is_a_config_error():
    with pytest.raises(
        ConfigError,
        match=r"GPUFAIL_DASK__SCHEDULER \(\[dask\] scheduler\): expected '' \(one machine\), 'local'.*'127.0.0.1:8786'",
    ):
        load_settings(environ={"GPUFAIL_DASK__SCHEDULER": "127.0.0.1:8786"})


def test_the_cli_reports_an_unreachable_scheduler(tmp_path):
    env = {"GPUFAIL_DASK__SCHEDULER": "tcp://127.0.0.1:1", "GPUFAIL_DASK__CONNECT_TIMEOUT": "1s"}
    from ingest.store import Store

    Store.create(str(tmp_path / "data"))
    result = gpufail("features", "--materialise", "--data", str(tmp_path / "data"), "--quiet", env=env)
    # A GpufailError (`ClusterError`), which `gpufail.cli.main` prints as one line with exit status 2.
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("gpufail: error: ") and "no Dask scheduler answered" in result.stderr


@pytest.mark.slow
def test_features_and_train_run_on_the_configured_cluster(tmp_path):
    import polars as pl

    from features.dataset import read_features
    from ingest.store import Store
    from tests.features import T0
    from tests.synthetic import synthetic_telemetry, synthetic_xids

    tel = synthetic_telemetry(16, 72, seed=3, start=T0)
    store = Store.create(str(tmp_path / "data"))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", synthetic_xids(tel, per_gpu_day=0.5, seed=3).to_arrow())
    with dask_client("local", processes=False) as client:
        env = {
            "GPUFAIL_DASK__SCHEDULER": client.scheduler.address,
            "GPUFAIL_FEATURES__WINDOWS": '["1h", "6h", "24h"]',
            "GPUFAIL_MODEL__MONOTONE_INCREASING": "[]",
            "GPUFAIL_MODEL__TRAIN_WINDOW": "1d",
            # The model is calibrated on the half day after its window (three days of data).
            "GPUFAIL_MODEL__CALIBRATION_WINDOW": "12h",
        }
        result = gpufail("features", "--materialise", "--data", str(tmp_path / "data"), "--quiet", env=env)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("features: ")
        assert read_features(store).select(pl.col("gpu_uuid").n_unique()).item() == 16
        result = gpufail("train", "--data", str(tmp_path / "data"), "--model-out", str(tmp_path / "model"), env=env)
        assert result.returncode == 0, result.stderr
    meta = json.loads(Path(tmp_path / "model" / "metadata.json").read_text())
    assert meta["kind"] == "lightgbm" and meta["n_positives"] > 0
    assert meta["calibrated"] and meta["calibration"]["n_positives"] > 0
