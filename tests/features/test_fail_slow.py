"""Fail-slow features (features/fail_slow.py) on a simulated fleet with planted stragglers, and
on hand-made rows."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from features.dataset import read_features
from features.fail_slow import fail_slow_columns, fail_slow_features
from features.runner import BuildOptions, build_features_from_store
from features.spec import FeatureSpec
from ingest.errors import InputError
from ingest.simulator.run import simulate
from ingest.store import Store


@pytest.fixture(scope="module")
def slow_fleet(tmp_path_factory):
    out = tmp_path_factory.mktemp("slow") / "fleet"
    simulate(
        out, "demo", seed=4, progress=False, nodes=8, days=6, sample_interval_s=900, acceleration=1.0,
        fail_slow_fraction=0.04, fail_slow_deficit=(0.06, 0.12),
    )  # fmt: skip
    store = Store.open(str(out))
    build_features_from_store(
        store, FeatureSpec(windows=(timedelta(hours=1), timedelta(hours=24))), BuildOptions(progress=False)
    )
    frame = read_features(store).to_pandas()
    truth = pq.read_table(out / "ground_truth" / "gpus.parquet").to_pandas()
    return frame, truth


def test_a_planted_fail_slow_gpu_is_ranked_first_by_its_score_once_a_window_has_passed(slow_fleet):
    frame, truth = slow_fleet
    slow = truth[truth["fail_slow_since"].notna()]
    assert len(slow) >= 1
    scores = frame.assign(**fail_slow_features(frame))
    score = fail_slow_columns()[-1]
    checked = 0
    for gpu in slow.itertuples():
        since = pd.Timestamp(gpu.fail_slow_since)
        # A full window after its onset, while its node is loaded.
        later = scores[(scores["ts"] >= since + pd.Timedelta(hours=24)) & (scores["util_gpu_pct_mean_24h"] > 50)]
        for _, at_t in later.groupby("ts"):
            top = at_t.sort_values(score, ascending=False).iloc[0]
            assert top["gpu_uuid"] == gpu.gpu_uuid, (since, top["ts"], top[score])
            own = at_t.loc[at_t["gpu_uuid"] == gpu.gpu_uuid, score].iloc[0]
            assert own == pytest.approx(gpu.fail_slow_deficit, abs=0.03)
            checked += 1
    assert checked > 5
    # Healthy GPUs keep their score near zero.
    healthy = scores[~scores["gpu_uuid"].isin(slow["gpu_uuid"])][score].dropna()
    assert healthy.abs().quantile(0.99) < 0.02


def test_node_and_model_peers_must_agree():
    rows = []
    for node, clocks in (("a", [1400.0] * 7 + [1260.0]), ("b", [1260.0] * 8), ("c", [1400.0] * 8)):
        for i, clock in enumerate(clocks):
            rows.append(
                {
                    "ts": pd.Timestamp("2026-01-02", tz="UTC"),
                    "cluster": "c",
                    "node": node,
                    "gpu_uuid": f"{node}{i}",
                    "gpu_model": "H100",
                    "sm_clock_mhz_mean_24h": clock,
                    "sm_clock_mhz_max_24h": clock + 20,
                    "power_w_mean_24h": 600.0 * clock / 1400,
                    "util_gpu_pct_mean_24h": 90.0,
                    "util_gpu_pct_max_24h": 99.0,
                }
            )
    rows.append(
        {**rows[0], "node": "idle", "gpu_uuid": "idle0", "util_gpu_pct_mean_24h": 0.5, "util_gpu_pct_max_24h": 1.0}
    )
    # An idle board beside a busy job (a fresh replacement, one the job does not use) is not slow.
    rows.append({**rows[0], "gpu_uuid": "a-idle", "sm_clock_mhz_mean_24h": 345.0, "sm_clock_mhz_max_24h": 345.0,
                 "util_gpu_pct_mean_24h": 0.1, "util_gpu_pct_max_24h": 0.2})  # fmt: skip
    out = pd.DataFrame(rows).join(fail_slow_features(pd.DataFrame(rows))).set_index("gpu_uuid")
    assert out.loc["a7", "sm_clock_node_deficit_24h"] == pytest.approx(0.1)
    assert out.loc["a7", "power_per_util_node_deficit_24h"] == pytest.approx(0.1)
    assert out.loc["a7", "fail_slow_score_24h"] > 0.05
    # A node slow as a whole is behind its model peers, not its node peers: not one board's fault.
    assert out.loc["b0", "sm_clock_model_deficit_24h"] > 0.05
    assert out.loc["b0", "fail_slow_score_24h"] == pytest.approx(0.0)
    # An idle board has no model peers' clock to compare with and no node peers: no score.
    assert np.isnan(out.loc["idle0", "fail_slow_score_24h"])
    assert np.isnan(out.loc["a-idle", "fail_slow_score_24h"])
    assert out.loc["a7", "sm_clock_node_deficit_24h"] == pytest.approx(0.1)  # the idle board is no peer


def test_a_frame_without_the_window_is_refused_in_one_line():
    with pytest.raises(InputError, match=r"no \['sm_clock_mhz_mean_24h'"):
        fail_slow_features(pd.DataFrame({"ts": [], "cluster": [], "node": []}))


def test_the_spec_s_window_shapes_the_columns_alike_in_a_store_build_in_shards_and_from_raw_telemetry(tmp_path):
    import polars as pl

    from features.build import build_features
    from features.inputs import read_repairs, read_xid_events

    out = tmp_path / "fleet"
    simulate(
        out, "demo", seed=5, progress=False, nodes=4, days=3, sample_interval_s=900, acceleration=1.0,
        fail_slow_fraction=0.1, fail_slow_deficit=(0.1, 0.15),
    )  # fmt: skip
    store = Store.open(str(out))
    hour = timedelta(hours=1)
    six = FeatureSpec(windows=(hour, 6 * hour, 24 * hour), fail_slow_window=6 * hour)
    # Built in shards of one node: a GPU's model peers are every shard's.
    build_features_from_store(store, six, BuildOptions(progress=False, max_buckets_in_memory=0, block_days=1))
    stored = read_features(store)
    raw = build_features(store.read("telemetry"), read_xid_events(store), six, repairs=read_repairs(store))
    for frame in (stored, raw):
        assert [c for c in frame.columns if c in fail_slow_columns("6h") + fail_slow_columns("24h")] == list(
            fail_slow_columns("6h")
        )
    both = stored.join(raw, on=["gpu_uuid", "ts"], suffix="_raw")
    assert both.height == stored.height == raw.height
    for name in fail_slow_columns("6h"):
        assert both[name].equals(both[f"{name}_raw"].alias(name)), name
    # They are the 6 h statistics' features, which differ from the 24 h ones of the same rows.
    frame = stored.to_pandas()
    score = fail_slow_columns("6h")[-1]
    expected = fail_slow_features(frame, "6h")[score].to_numpy(dtype=np.float32)
    np.testing.assert_array_equal(frame[score].to_numpy(dtype=np.float32), expected)
    day = fail_slow_features(frame, "24h")[fail_slow_columns("24h")[-1]].to_numpy()
    assert np.nanmax(np.abs(day - frame[score].to_numpy())) > 0.01
    assert stored.filter(pl.col(score) > 0.05).height > 0  # the planted stragglers show
