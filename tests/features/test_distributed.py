"""The feature build on Dask (a LocalCluster of two in-process workers on 127.0.0.1) writes the
rows the single-machine build computes."""

from __future__ import annotations

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from features.build import build_features
from features.dataset import feature_files, read_features
from features.distributed import build_features_distributed
from features.plan import FeaturesExistError
from features.shards import node_groups
from features.spec import FeatureSpec
from gpufail.dask_cluster import dask_client
from ingest.store import Store
from tests.features import T0, H, store_of
from tests.synthetic import synthetic_telemetry, synthetic_xids

WINDOWS = [H, 6 * H, 24 * H]
MOVED = "GPU-00000009"


@pytest.fixture(scope="module")
def client():
    with dask_client("local", n_workers=2, processes=False) as c:
        yield c


@pytest.fixture(scope="module")
def fleet() -> tuple[pl.DataFrame, pl.DataFrame]:
    """24 GPUs on 3 nodes over 3 days, 1-minute samples with jitter; one GPU goes silent (lost),
    one board is moved from node00001 to node00000 on the third day."""
    tel = synthetic_telemetry(24, 72, seed=3, start=T0)
    tel = tel.filter(~((pl.col("gpu_uuid") == "GPU-00000004") & (pl.col("ts") > T0 + 40 * H)))
    moved = (pl.col("gpu_uuid") == MOVED) & (pl.col("ts") > T0 + 50 * H)
    tel = tel.with_columns(pl.when(moved).then(pl.lit("node00000")).otherwise(pl.col("node")).alias("node"))
    return tel, synthetic_xids(tel, per_gpu_day=0.3, seed=3)


def test_nodes_that_share_a_gpu_are_one_partition(fleet):
    from features.labels import gpu_presence

    groups = node_groups(gpu_presence(fleet[0]), partition_nodes=1)
    assert [sorted(g["node"].to_list()) for g in groups] == [["node00000", "node00001"], ["node00002"]]
    assert len(node_groups(gpu_presence(fleet[0]), partition_nodes=64)) == 1


def test_a_dask_build_writes_the_rows_of_an_in_memory_build(tmp_path, client, fleet):
    tel, events = fleet
    store = store_of(tmp_path, fleet)
    # One node group per partition and one-day blocks: every partition edge is exercised.
    summary = build_features_distributed(
        client, store, FeatureSpec(windows=WINDOWS), partition_nodes=1, partition_days=1
    )
    expected = build_features(tel, events, FeatureSpec(windows=WINDOWS)).sort("ts", "gpu_uuid")
    stored = read_features(store)
    assert summary.rows == stored.height == expected.height
    assert summary.gpus == 24 and summary.blocks == 2 * 3
    assert summary.positives == int((expected["label"] == 1).sum())
    assert sorted(summary.files_written) == feature_files(store)  # as they are once committed
    assert_frame_equal(stored, expected, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)
    # The fleet median of each GPU model is taken over every partition, so the model deltas are
    # exact (a partition's own median differs: it sees 8 or 16 of the 24 GPUs).
    deltas = [c for c in expected.columns if "_model_delta_" in c]
    assert deltas and stored.select(deltas).equals(expected.select(deltas))
    # The moved board's windows span both nodes.
    assert stored.filter(pl.col("gpu_uuid") == MOVED)["node"].unique().sort().to_list() == ["node00000", "node00001"]


def test_an_existing_range_is_refused_then_replaced(tmp_path, client, fleet):
    store = store_of(tmp_path, fleet)
    start, end = T0 + 30 * H, T0 + 50 * H
    build_features_distributed(client, store, FeatureSpec(windows=WINDOWS), start=start, end=end)
    first = set(feature_files(store))
    assert read_features(store)["ts"].min() == T0 + 24 * H  # whole UTC days
    with pytest.raises(FeaturesExistError, match="overwrite"):
        build_features_distributed(client, store, FeatureSpec(windows=WINDOWS), start=start, end=end)
    summary = build_features_distributed(
        client, store, FeatureSpec(windows=WINDOWS), start=start, end=end, overwrite=True
    )
    assert summary.files_replaced == len(first) and not first & set(feature_files(store))


def test_an_empty_store_builds_nothing(tmp_path, client):
    store = Store.create(str(tmp_path / "data"))
    assert build_features_distributed(client, store).rows == 0
    assert read_features(store).height == 0


def test_a_store_without_xid_events_builds_as_on_one_machine(tmp_path, client, fleet):
    # A fleet collecting NVML telemetry before any kernel log or XID arrived: the Dask path
    # failed on the missing dataset (no last_ts column) where the single-machine build did not.
    tel, _ = fleet
    store = Store.create(str(tmp_path / "data"))
    store.write("telemetry", tel.to_arrow())
    summary = build_features_distributed(
        client, store, FeatureSpec(windows=WINDOWS), partition_nodes=2, partition_days=2
    )
    expected = build_features(
        tel, pl.DataFrame(schema={"ts": pl.Datetime("us", "UTC"), "xid": pl.Int32()}), FeatureSpec(windows=WINDOWS)
    )
    stored = read_features(store)
    assert summary.rows == stored.height == expected.height > 0
    assert summary.positives == int((expected["label"] == 1).sum()) > 0  # the lost GPU still fails
    assert_frame_equal(stored, expected.sort("ts", "gpu_uuid"), check_exact=False, rel_tol=1e-5, abs_tol=1e-4)


def test_dask_aggregates_are_the_single_machine_ones(tmp_path, client, fleet):
    from features.aggregates import BUCKETS, PRESENCE, build_aggregates, read_buckets, read_presence
    from features.distributed import build_aggregates_distributed
    from features.on_demand import features_on_demand

    local = store_of(tmp_path / "local", fleet)
    build_aggregates(local, FeatureSpec(windows=WINDOWS))
    store = store_of(tmp_path / "dask", fleet)
    # One node group per partition and one-day blocks: every partition edge is exercised.
    summary = build_aggregates_distributed(
        client, store, FeatureSpec(windows=WINDOWS), partition_nodes=1, partition_days=1
    )
    span = (T0 - 24 * H, T0 + 96 * H)
    expected = read_buckets(local, *span).sort("gpu_uuid", "ts")
    assert read_buckets(store, *span).sort("gpu_uuid", "ts").equals(expected)
    assert read_presence(store).equals(read_presence(local))
    assert summary.buckets == expected.height and summary.rows > 0 and summary.blocks == 2 * 3
    assert sorted(summary.files_written) == sorted(store.files(BUCKETS) + store.files(PRESENCE))
    assert_frame_equal(features_on_demand(store), features_on_demand(local))
    with pytest.raises(FeaturesExistError):
        build_aggregates_distributed(client, store, FeatureSpec(windows=WINDOWS))
    with pytest.raises(ValueError, match="partition_days: expected at least 1"):
        build_aggregates_distributed(client, store, partition_days=0)
