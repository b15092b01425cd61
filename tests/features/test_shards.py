"""Shards of whole nodes for the store build: how many, which nodes, and the carried buckets
that wait on disk between days."""

from __future__ import annotations

from datetime import timedelta

import polars as pl
import pyarrow.parquet as pq
import pytest
from polars.testing import assert_frame_equal

from features.build import BuildOptions, build_features, build_features_from_store, feature_files, read_features
from features.labels import gpu_presence
from features.peers import model_medians, peer_features
from features.shards import SHARD, ShardedBuckets, shard_map
from features.spec import FeatureSpec
from features.windows import dense_grid, hourly_aggregate
from ingest.store import Store
from tests.features import T0, H, store_of
from tests.synthetic import synthetic_telemetry, synthetic_xids

WINDOWS = [H, 6 * H, 24 * H]


@pytest.fixture(scope="module")
def fleet() -> tuple[pl.DataFrame, pl.DataFrame]:
    # 4 nodes of 4 GPUs over 3 days, one sample every 15 minutes.
    tel = synthetic_telemetry(16, 72, interval=timedelta(minutes=15), gpus_per_node=4, start=T0, seed=11)
    return tel, synthetic_xids(tel, per_gpu_day=0.5, seed=11)


def test_the_fleet_is_split_into_the_fewest_shards_that_fit_the_budget(fleet):
    presence = gpu_presence(fleet[0])
    # 16 GPUs x 10 buckets = 160 carried buckets.
    assert shard_map(presence, gpu_buckets=10, max_buckets=1_000)[SHARD].n_unique() == 1
    halves = shard_map(presence, gpu_buckets=10, max_buckets=80)
    assert halves[SHARD].n_unique() == 2
    assert halves.group_by(SHARD).len()["len"].to_list() == [2, 2]  # whole nodes, two each
    assert shard_map(presence, gpu_buckets=10, max_buckets=0)[SHARD].n_unique() == 4  # one node each
    assert shard_map(presence, gpu_buckets=10, max_buckets=1)[SHARD].n_unique() == 4  # never below a node
    every = shard_map(presence, gpu_buckets=10, max_buckets=0)
    assert sorted(every["node"].to_list()) == sorted(presence["node"].unique().to_list())


def test_nodes_that_share_a_gpu_are_in_one_shard(fleet):
    tel = fleet[0]
    # A board moved from node00001 to node00003 on the second day.
    moved = tel.with_columns(
        pl.when((pl.col("gpu_uuid") == "GPU-00000005") & (pl.col("ts") > T0 + 24 * H))
        .then(pl.lit("node00003"))
        .otherwise(pl.col("node"))
        .alias("node")
    )
    shards = shard_map(gpu_presence(moved), gpu_buckets=10, max_buckets=0)
    of = dict(zip(shards["node"].to_list(), shards[SHARD].to_list(), strict=True))
    assert of["node00001"] == of["node00003"]
    assert len(set(of.values())) == 3


def test_sharded_buckets_wait_on_disk_and_come_back_per_shard(tmp_path, fleet):
    tel = fleet[0]
    shards = shard_map(gpu_presence(tel), gpu_buckets=10, max_buckets=0)
    buckets = ShardedBuckets(shards, scratch=str(tmp_path))
    days = [hourly_aggregate(tel.filter(pl.col("ts").dt.date() == d)) for d in tel["ts"].dt.date().unique().sort()]
    for frame in days:
        buckets.add(frame["ts"].min().date(), frame)
    folder = next(tmp_path.iterdir())
    assert len(list(folder.iterdir())) == 4 * len(days)  # one file per shard and day
    assert buckets.rows() == 0  # nothing held in memory
    whole = pl.concat(days).sort("gpu_uuid", "ts")
    after = T0 + 30 * H
    for shard, nodes in shards.group_by(SHARD):
        expected = whole.join(nodes.drop(SHARD), on=["cluster", "node"], how="semi").filter(pl.col("ts") > after)
        got = buckets.take(int(shard[0]), after)
        assert got is not None
        assert_frame_equal(got.sort("gpu_uuid", "ts"), expected)
    # Forgetting the first day removes its files; a shard with nothing left answers None.
    buckets.forget(T0 + 25 * H)
    assert len(list(folder.iterdir())) == 4 * (len(days) - 1)
    buckets.forget(T0 + 100 * H)
    assert buckets.take(0, T0) is None
    buckets.close()
    assert not folder.exists()


def test_one_shard_keeps_its_buckets_in_memory(tmp_path, fleet):
    tel = fleet[0]
    buckets = ShardedBuckets(shard_map(gpu_presence(tel), gpu_buckets=10, max_buckets=10**9), scratch=str(tmp_path))
    frame = hourly_aggregate(tel)
    buckets.add(T0.date(), frame)
    assert buckets.count == 1 and buckets.rows() == frame.height
    assert not list(tmp_path.iterdir())
    assert_frame_equal(buckets.take(0, T0 + 10 * H), frame.filter(pl.col("ts") > T0 + 10 * H))


def test_peer_features_of_a_shard_use_the_fleet_median_they_are_given(fleet):
    hourly = hourly_aggregate(fleet[0])
    dense = dense_grid(hourly, H, data_end=T0 + 72 * H)
    whole = peer_features(dense)
    shard = dense.filter(pl.col("node").is_in(["node00000", "node00001"]))
    with_fleet = peer_features(shard, medians=model_medians(hourly))
    assert_frame_equal(with_fleet, whole.join(shard.select("gpu_uuid", "ts"), on=["gpu_uuid", "ts"], how="semi"))
    # Without the fleet's medians the shard's own would differ: the test above can fail.
    alone = peer_features(shard)
    assert not alone["temp_gpu_c_model_delta_1h"].equals(with_fleet["temp_gpu_c_model_delta_1h"])


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sharded_build_in_blocks_equals_building_in_memory(tmp_path, fleet, workers):
    tel, events = fleet
    store = Store.create(str(tmp_path / "data"))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", events.to_arrow())
    summary = build_features_from_store(
        store,
        FeatureSpec(windows=WINDOWS),
        BuildOptions(max_buckets_in_memory=400, block_days=2, progress=False, scratch=str(tmp_path), workers=workers),
    )
    # 16 GPUs x 24 buckets x 5 carried days (a block of 2, the 25 h lookback's 2, 1 more) = 1,920
    # buckets: more than 4 shards of 400, so one node each; 3 days in blocks of 2: 2 blocks.
    assert (summary.shards, summary.blocks) == (4, 2)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("gpufail-buckets-")]  # scratch removed
    expected = build_features(tel, events, FeatureSpec(windows=WINDOWS)).sort("ts", "gpu_uuid")
    assert_frame_equal(read_features(store), expected, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)


def test_a_failed_build_leaves_no_scratch_files_behind(tmp_path, fleet, monkeypatch):
    tel, events = fleet
    store = Store.create(str(tmp_path / "data"))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", events.to_arrow())
    import features.build as build

    calls = {"n": 0}
    real = build._read_telemetry

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(build, "_read_telemetry", failing)
    with pytest.raises(OSError, match="disk went away"):
        build_features_from_store(
            store,
            FeatureSpec(windows=WINDOWS),
            BuildOptions(max_buckets_in_memory=0, progress=False, scratch=str(tmp_path)),
        )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("gpufail-buckets-")]


def test_a_shard_that_fails_on_a_worker_fails_the_build_and_removes_the_scratch_files(tmp_path, fleet, monkeypatch):
    tel, events = fleet
    store = Store.create(str(tmp_path / "data"))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", events.to_arrow())
    import features.build as build

    real = build.write_features
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(build, "write_features", failing)
    with pytest.raises(OSError, match="No space left"):
        build_features_from_store(
            store,
            FeatureSpec(windows=WINDOWS),
            BuildOptions(max_buckets_in_memory=400, progress=False, scratch=str(tmp_path), workers=2),
        )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("gpufail-buckets-")]
    # What was written is whole: every visible file reads.
    for path in feature_files(store):
        pq.read_metadata(path)


def test_a_block_of_no_days_is_refused(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    with pytest.raises(ValueError, match="block_days: expected at least 1"):
        build_features_from_store(store, options=BuildOptions(block_days=0, progress=False))


def test_no_workers_is_refused(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    with pytest.raises(ValueError, match="workers: expected at least 1, got 0"):
        build_features_from_store(store, options=BuildOptions(workers=0, progress=False))


def test_an_xid_in_a_silence_where_a_block_starts_counts_as_in_an_all_history_build(tmp_path, fleet):
    """A block's frame starts at its lookback; a GPU silent there still gets grid rows from that
    point, so an XID logged during the silence counts in the windows that reach it."""
    tel, _ = fleet
    quiet = "GPU-00000003"
    tel = tel.filter(~((pl.col("gpu_uuid") == quiet) & pl.col("ts").is_between(T0 + 22 * H, T0 + 30 * H)))
    event = (
        tel.filter(pl.col("gpu_uuid") == quiet)
        .head(1)
        .select("cluster", "node", "pci_bus_id", "gpu_index", "gpu_uuid")
        .with_columns(
            ts=pl.lit(T0 + 25.5 * H),
            last_ts=pl.lit(T0 + 25.5 * H),
            xid=pl.lit(13, dtype=pl.Int32),  # an application XID, not a failure
            pid=pl.lit(None, dtype=pl.Int64),
            process=pl.lit(None, dtype=pl.String),
            message=pl.lit("test"),
            source=pl.lit("test"),
            repeat_count=pl.lit(1, dtype=pl.Int32),
        )
    )
    store = Store.create(str(tmp_path / "data"))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", event.to_arrow())
    # The third day's block reads buckets after 48 h - 25 h of lookback = 23 h; the GPU's first
    # bucket there is 30:15, after the XID (bucket 26 h).
    build_features_from_store(store, FeatureSpec(windows=WINDOWS), BuildOptions(block_days=1, progress=False))
    stored = read_features(store).filter(pl.col("gpu_uuid") == quiet)
    expected = build_features(tel, event, FeatureSpec(windows=WINDOWS)).filter(pl.col("gpu_uuid") == quiet).sort("ts")
    at_48 = pl.col("ts").is_in([T0 + 48 * H, T0 + 49 * H])
    assert expected.filter(at_48)["xid_13_count_24h"].to_list() == [1.0, 1.0]  # the window reaches 26 h
    assert stored.filter(at_48)["xid_13_count_24h"].to_list() == [1.0, 1.0]
    assert_frame_equal(stored, expected, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)


def test_a_block_without_telemetry_builds_the_rows_of_an_all_history_build(tmp_path, fleet):
    """A whole day without telemetry (an outage longer than a block) leaves a block with no new
    buckets; its GPUs are silent, not an error."""
    tel, events = fleet
    tel = tel.filter(~pl.col("ts").is_between(T0 + 24 * H, T0 + 48 * H, closed="right"))
    store = Store.create(str(tmp_path / "data"))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", events.to_arrow())
    summary = build_features_from_store(
        store,
        FeatureSpec(windows=WINDOWS),
        BuildOptions(max_buckets_in_memory=0, block_days=1, progress=False, scratch=str(tmp_path)),
    )
    assert summary.blocks == 3
    expected = build_features(tel, events, FeatureSpec(windows=WINDOWS)).sort("ts", "gpu_uuid")
    assert_frame_equal(read_features(store), expected, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)


@pytest.mark.parametrize("read_ahead", [True, False])
def test_the_next_blocks_days_are_read_while_a_block_is_built_and_the_rows_are_the_same(
    tmp_path, fleet, monkeypatch, read_ahead
):
    import threading

    import features.build as build

    store = store_of(tmp_path, fleet)
    second_day_read = threading.Event()
    seen: dict[str, bool] = {}
    real_read, real_parts = build._read_telemetry, build.iter_features_from_buckets

    def reading(store, start, end, **kwargs):
        frame = real_read(store, start, end, **kwargs)
        if start == T0 + 24 * H:
            second_day_read.set()
        return frame

    def parts(*args, **kwargs):
        if kwargs["emit_start"] == T0 and "first block" not in seen:
            # The first block (day one) waits a little for the second day to be read beside it.
            seen["first block"] = second_day_read.wait(timeout=5 if read_ahead else 0.5)
        return real_parts(*args, **kwargs)

    monkeypatch.setattr(build, "_read_telemetry", reading)
    monkeypatch.setattr(build, "iter_features_from_buckets", parts)
    summary = build_features_from_store(
        store,
        FeatureSpec(windows=WINDOWS),
        BuildOptions(max_buckets_in_memory=0, block_days=1, read_ahead=read_ahead, progress=False),
    )
    assert summary.blocks == 3
    assert seen["first block"] is read_ahead
    expected = build_features(*fleet, FeatureSpec(windows=WINDOWS)).sort("ts", "gpu_uuid")
    assert_frame_equal(read_features(store), expected, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)


@pytest.mark.parametrize("read_ahead", [True, False])
def test_one_shard_in_memory_only_when_the_read_ahead_fits_beside_it(tmp_path, fleet, read_ahead):
    store = store_of(tmp_path, fleet)
    # 16 GPUs x 24 buckets: a block of 2 days carries 5 days (1,920 buckets); reading the next
    # block's 2 days beside it makes 7 (2,688): over a budget of 2,000, so two shards on disk.
    summary = build_features_from_store(
        store,
        FeatureSpec(windows=WINDOWS),
        BuildOptions(
            max_buckets_in_memory=2_000, block_days=2, read_ahead=read_ahead, progress=False, scratch=str(tmp_path)
        ),
    )
    assert summary.shards == (2 if read_ahead else 1)
    expected = build_features(*fleet, FeatureSpec(windows=WINDOWS)).sort("ts", "gpu_uuid")
    assert_frame_equal(read_features(store), expected, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)


def _build_threads() -> list[str]:
    """The store build's own threads still alive: the block builder's and the shards' writers'."""
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith(("features-block", "features-write"))]


def test_a_failed_read_stops_the_block_being_built_beside_it(tmp_path, fleet, monkeypatch):
    import threading

    import features.build as build

    store = store_of(tmp_path, fleet)
    read_failed = threading.Event()
    real_read, real_parts = build._read_telemetry, build.iter_features_from_buckets

    def reading(store, start, end, **kwargs):
        if start == T0 + 24 * H:
            read_failed.set()
            raise OSError("disk went away")
        return real_read(store, start, end, **kwargs)

    def parts(*args, **kwargs):
        read_failed.wait(timeout=5)  # the first block is still being built when the read fails
        return real_parts(*args, **kwargs)

    monkeypatch.setattr(build, "_read_telemetry", reading)
    monkeypatch.setattr(build, "iter_features_from_buckets", parts)
    with pytest.raises(OSError, match="disk went away"):
        build_features_from_store(
            store,
            FeatureSpec(windows=WINDOWS),
            BuildOptions(max_buckets_in_memory=0, block_days=1, progress=False, scratch=str(tmp_path)),
        )
    # The block stopped at its first part instead of finishing: nothing of it was written.
    assert feature_files(store) == []
    assert not _build_threads()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("gpufail-buckets-")]


def test_a_block_that_fails_while_the_next_days_are_read_fails_the_build(tmp_path, fleet, monkeypatch):
    import features.build as build

    store = store_of(tmp_path, fleet)

    def failing(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(build, "write_features", failing)
    with pytest.raises(OSError, match="No space left"):
        build_features_from_store(
            store,
            FeatureSpec(windows=WINDOWS),
            BuildOptions(max_buckets_in_memory=0, block_days=1, progress=False, scratch=str(tmp_path)),
        )
    assert not _build_threads()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("gpufail-buckets-")]


@pytest.mark.parametrize("write_ahead", [True, False])
def test_a_flush_is_written_while_the_next_part_is_computed_and_the_rows_are_the_same(
    tmp_path, fleet, monkeypatch, write_ahead
):
    import threading

    import features.build as build

    store = store_of(tmp_path, fleet)
    second_part = threading.Event()
    seen: dict[str, bool] = {}
    real_parts, real_write = build.iter_features_from_buckets, build.write_features

    def parts(*args, **kwargs):
        for i, frame in enumerate(real_parts(*args, **kwargs)):
            if i == 1:
                second_part.set()
            yield frame

    def writing(*args, **kwargs):
        if "first write" not in seen:
            # The first flush's write waits a little for the next part to be computed beside it.
            seen["first write"] = second_part.wait(timeout=5 if write_ahead else 0.5)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(build, "iter_features_from_buckets", parts)
    monkeypatch.setattr(build, "write_features", writing)
    # Parts of about two GPUs, each flushed on its own: eight flushes a block.
    build_features_from_store(
        store,
        FeatureSpec(windows=WINDOWS),
        BuildOptions(rows_per_part=2 * 72, flush_rows=1, write_ahead=write_ahead, progress=False),
    )
    assert seen["first write"] is write_ahead
    assert not _build_threads()
    expected = build_features(*fleet, FeatureSpec(windows=WINDOWS)).sort("ts", "gpu_uuid")
    assert_frame_equal(read_features(store), expected, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)


def test_a_failed_write_stops_the_shard_at_its_next_flush(tmp_path, fleet, monkeypatch):
    import features.build as build

    store = store_of(tmp_path, fleet)
    real_write = build.write_features
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("No space left on device")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(build, "write_features", failing)
    with pytest.raises(OSError, match="No space left"):
        build_features_from_store(
            store, FeatureSpec(windows=WINDOWS), BuildOptions(rows_per_part=2 * 72, flush_rows=1, progress=False)
        )
    # Eight flushes were due; the shard learnt of the failed second at the third and wrote no more.
    assert calls["n"] == 2
    assert not _build_threads()
    for path in feature_files(store):  # what was written is whole
        pq.read_metadata(path)
