"""Shards of whole nodes for the store build: how many, which nodes, and the carried buckets
that wait on disk between days."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from datetime import date, timedelta
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from polars.testing import assert_frame_equal

from features.build import build_features
from features.dataset import feature_files, read_features
from features.labels import gpu_presence
from features.peers import model_medians, peer_features
from features.runner import BuildOptions, build_features_from_store
from features.shards import SHARD, ShardedBuckets, shard_map
from features.spec import FeatureSpec
from features.windows import dense_grid, hourly_aggregate
from ingest.journal import Staging
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


def on_telemetry_read(monkeypatch: pytest.MonkeyPatch, store: Store, hook: Callable[[date], None]) -> None:
    """Call `hook(first day)` at each read of a block's telemetry through the store's public
    file listing (`Store.files`, which every read goes through; the whole-dataset scan for presence
    passes no day), before the read itself."""
    real = store.files

    def files(name: str, first_day: date | None = None, last_day: date | None = None, **kwargs):  # type: ignore[no-untyped-def]
        if name == "telemetry" and first_day is not None:
            hook(first_day)
        return real(name, first_day, last_day, **kwargs)

    monkeypatch.setattr(store, "files", files)


def on_features_write(monkeypatch: pytest.MonkeyPatch, store: Store, hook: Callable[[date], None]) -> list[date]:
    """Call `hook(day)` before each features file the build writes into the store's features
    journal (a build's files are staged there until its commit, `Staging.write_owned`); returns
    the days of the calls, in order."""
    real = Staging.write_owned
    calls: list[date] = []
    lock = threading.Lock()

    def write_owned(self: Staging, dataset: str, day: date, table, **options):  # type: ignore[no-untyped-def]
        if dataset == "features" and self.store.root == store.root:
            with lock:
                calls.append(day)
            hook(day)
        return real(self, dataset, day, table, **options)

    monkeypatch.setattr(Staging, "write_owned", write_owned)
    return calls


def fail_at_call(number: int, error: Exception) -> Callable[[date], None]:
    """A hook that raises `error` at its `number`-th call (counting from 1) and only then."""
    count = itertools.count(1)
    lock = threading.Lock()

    def hook(_: date) -> None:
        with lock:
            n = next(count)
        if n == number:
            raise error

    return hook


def new_threads(before: set[threading.Thread]) -> list[str]:
    """Threads started since `before` that still run and would keep the process from exiting
    (not daemons, such as a progress bar's monitor)."""
    return [t.name for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]


def scratch_left(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith("gpufail-buckets-")]


def test_a_failed_read_fails_the_build_and_leaves_no_scratch_files_behind(tmp_path, fleet, monkeypatch):
    store = store_of(tmp_path, fleet)
    # The third block's read fails, after two blocks wrote their shards' buckets to scratch.
    on_telemetry_read(monkeypatch, store, fail_at_call(3, OSError("disk went away")))
    before = set(threading.enumerate())
    with pytest.raises(OSError, match="disk went away"):
        build_features_from_store(
            store,
            FeatureSpec(windows=WINDOWS),
            BuildOptions(max_buckets_in_memory=0, block_days=1, progress=False, scratch=str(tmp_path)),
        )
    assert not scratch_left(tmp_path)
    assert not new_threads(before)


def test_a_shard_that_fails_on_a_worker_fails_the_build_and_removes_the_scratch_files(tmp_path, fleet, monkeypatch):
    store = store_of(tmp_path, fleet)
    on_features_write(monkeypatch, store, fail_at_call(2, OSError("No space left on device")))
    before = set(threading.enumerate())
    with pytest.raises(OSError, match="No space left"):
        build_features_from_store(
            store,
            FeatureSpec(windows=WINDOWS),
            BuildOptions(max_buckets_in_memory=400, progress=False, scratch=str(tmp_path), workers=2),
        )
    assert not scratch_left(tmp_path)
    assert not new_threads(before)
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
def test_the_next_blocks_days_are_read_while_a_block_is_written_and_the_rows_are_the_same(
    tmp_path, fleet, monkeypatch, read_ahead
):
    store = store_of(tmp_path, fleet)
    events: list[tuple[str, date]] = []
    second_day = (T0 + 24 * H).date()
    second_day_read = threading.Event()

    def read(day: date) -> None:
        events.append(("read", day))
        if day == second_day:
            second_day_read.set()

    def write(day: date) -> None:
        if read_ahead and day == T0.date():
            # With read-ahead the first block's writes can wait for the second day's read, which
            # runs beside them (the timeout only bounds a failure).
            assert second_day_read.wait(timeout=120), "the next block was not read beside the first"
        events.append(("write", day))

    on_telemetry_read(monkeypatch, store, read)
    on_features_write(monkeypatch, store, write)
    summary = build_features_from_store(
        store,
        FeatureSpec(windows=WINDOWS),
        BuildOptions(max_buckets_in_memory=0, block_days=1, read_ahead=read_ahead, progress=False),
    )
    assert summary.blocks == 3
    first_write = events.index(("write", T0.date()))
    second_read = events.index(("read", second_day))
    # Without read-ahead the second day is read only once the first block is written.
    assert (second_read < first_write) is read_ahead
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


def test_a_failed_read_stops_the_block_being_built_beside_it(tmp_path, fleet, monkeypatch):
    store = store_of(tmp_path, fleet)
    second_day = (T0 + 24 * H).date()
    read_failed = threading.Event()

    first_write = threading.Event()

    def read(day: date) -> None:
        if day == second_day:
            # The read beside the first block fails once that block (four shards of one node, a
            # file each) is being written (the timeouts only bound a failure).
            assert first_write.wait(timeout=120)
            read_failed.set()
            raise OSError("disk went away")

    def write(day: date) -> None:
        first_write.set()
        assert read_failed.wait(timeout=120)

    on_telemetry_read(monkeypatch, store, read)
    writes = on_features_write(monkeypatch, store, write)
    before = set(threading.enumerate())
    with pytest.raises(OSError, match="disk went away"):
        build_features_from_store(
            store,
            FeatureSpec(windows=WINDOWS),
            BuildOptions(max_buckets_in_memory=0, block_days=1, progress=False, scratch=str(tmp_path)),
        )
    # The block stopped at the next shard's first part instead of finishing its four shards.
    assert 1 <= len(writes) < 4 and set(writes) == {T0.date()}
    assert not new_threads(before)
    assert not scratch_left(tmp_path)


def test_a_block_that_fails_while_the_next_days_are_read_fails_the_build(tmp_path, fleet, monkeypatch):
    store = store_of(tmp_path, fleet)
    on_features_write(monkeypatch, store, fail_at_call(1, OSError("No space left on device")))
    before = set(threading.enumerate())
    with pytest.raises(OSError, match="No space left"):
        build_features_from_store(
            store,
            FeatureSpec(windows=WINDOWS),
            BuildOptions(max_buckets_in_memory=0, block_days=1, progress=False, scratch=str(tmp_path)),
        )
    assert not new_threads(before)
    assert not scratch_left(tmp_path)


@pytest.mark.parametrize("write_ahead", [True, False])
def test_rows_written_beside_the_next_part_are_those_written_in_turn(tmp_path, fleet, write_ahead):
    store = store_of(tmp_path, fleet)
    # Parts of about two GPUs, each flushed on its own: eight flushes a block.
    build_features_from_store(
        store,
        FeatureSpec(windows=WINDOWS),
        BuildOptions(rows_per_part=2 * 72, flush_rows=1, write_ahead=write_ahead, progress=False),
    )
    expected = build_features(*fleet, FeatureSpec(windows=WINDOWS)).sort("ts", "gpu_uuid")
    assert_frame_equal(read_features(store), expected, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)


def test_a_failed_write_stops_the_shard_at_its_next_flush(tmp_path, fleet, monkeypatch):
    store = store_of(tmp_path, fleet)
    calls = on_features_write(monkeypatch, store, fail_at_call(2, OSError("No space left on device")))
    before = set(threading.enumerate())
    with pytest.raises(OSError, match="No space left"):
        # Blocks of a day, parts of about two GPUs, each flushed on its own: eight flushes of one
        # file a block.
        build_features_from_store(
            store,
            FeatureSpec(windows=WINDOWS),
            BuildOptions(rows_per_part=2 * 72, flush_rows=1, block_days=1, progress=False),
        )
    # The second flush failed; the shard learnt of it at the third and wrote no more.
    assert len(calls) == 2
    assert not new_threads(before)
    for path in feature_files(store):  # what was written is whole
        pq.read_metadata(path)
