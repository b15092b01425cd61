"""The stored aggregates' build (`features.aggregates.build_aggregates`): day files in any row
order give the same buckets, and a day whose files fail to write stops the build with the days
before it committed and none after it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import pairwise

import polars as pl
import pyarrow.parquet as pq
import pytest
from polars.testing import assert_frame_equal

from features import aggregates, bucket_stream
from features.aggregates import BUCKETS, PRESENCE, build_aggregates, read_buckets, read_presence
from features.bucket_stream import BucketStream
from features.labels import gpu_presence
from features.spec import DEFAULT_MAX_SILENCE
from features.windows import hourly_aggregate
from ingest.store import Store
from tests.synthetic import synthetic_telemetry

T0 = datetime(2026, 1, 5, tzinfo=UTC)
EVERYTHING = (T0 - timedelta(days=1), T0 + timedelta(days=6))
H = timedelta(hours=1)


def _store(root, telemetry: pl.DataFrame) -> Store:
    store = Store.create(str(root))
    store.write("telemetry", telemetry.to_arrow())
    return store


@pytest.fixture(scope="module")
def telemetry() -> pl.DataFrame:
    # Four days at 15-minute samples: every day's first bucket needs the day before's last
    # samples (held back) and each GPU's last reading (a counter's baseline).
    return synthetic_telemetry(6, 96, interval=timedelta(minutes=15), gpus_per_node=3, start=T0, seed=4)


@pytest.fixture(scope="module")
def clean(telemetry, tmp_path_factory) -> tuple[pl.DataFrame, pl.DataFrame]:
    store = _store(tmp_path_factory.mktemp("clean") / "data", telemetry)
    build_aggregates(store)
    return read_buckets(store, *EVERYTHING).sort("gpu_uuid", "ts"), read_presence(store)


def test_day_files_in_any_row_order_give_the_same_buckets(telemetry, clean, tmp_path):
    shuffled = telemetry.sample(fraction=1.0, shuffle=True, seed=9)
    store = _store(tmp_path / "data", shuffled)
    first_day = store.collect(store.scan("telemetry", T0, T0 + timedelta(days=1)), "telemetry")
    assert first_day["gpu_uuid"].rle_id().max() + 1 != first_day["gpu_uuid"].n_unique()  # not GPU by GPU
    build_aggregates(store)
    assert read_buckets(store, *EVERYTHING).sort("gpu_uuid", "ts").equals(clean[0])
    assert read_presence(store).equals(clean[1])


def test_a_day_that_fails_to_write_stops_the_build_with_the_days_before_it_committed(
    telemetry, clean, tmp_path, monkeypatch
):
    store = _store(tmp_path / "data", telemetry)
    write_day = aggregates.write_day
    failing = T0 + timedelta(days=2)

    def fail_on_the_third_day(staging, day, buckets, presence):
        if day == failing:
            raise OSError(28, "No space left on device")
        return write_day(staging, day, buckets, presence)

    monkeypatch.setattr(aggregates, "write_day", fail_on_the_third_day)
    with pytest.raises(OSError, match="No space left"):
        build_aggregates(store)
    built = sorted(Store.open(store.root).dates(BUCKETS))
    assert built == [T0.date(), (T0 + timedelta(days=1)).date()]
    assert sorted(store.dates(PRESENCE)) == built
    kept = read_buckets(store, *EVERYTHING).sort("gpu_uuid", "ts")
    assert kept.equals(clean[0].filter(pl.col("ts") < failing))

    monkeypatch.setattr(aggregates, "write_day", write_day)
    again = build_aggregates(store)
    assert again.days_kept == 2
    assert read_buckets(store, *EVERYTHING).sort("gpu_uuid", "ts").equals(clean[0])
    assert read_presence(store).equals(clean[1])


@pytest.mark.parametrize("shard_rows", [1, 150, 10**9])
def test_days_taken_in_shards_of_gpus_give_the_buckets_of_all_history_at_once(telemetry, shard_rows):
    # One GPU silent on the second day (its held rows still complete a bucket), and the third
    # day's rows out of order.
    silent = telemetry["gpu_uuid"].unique().sort()[0]
    second = (pl.col("ts") >= T0 + timedelta(days=1)) & (pl.col("ts") < T0 + timedelta(days=2))
    fleet = telemetry.filter(~(second & (pl.col("gpu_uuid") == silent)))
    stream = BucketStream(H, DEFAULT_MAX_SILENCE, shard_rows=shard_rows)
    days = []
    for n in range(4):
        start = T0 + timedelta(days=n)
        day = fleet.filter((pl.col("ts") >= start) & (pl.col("ts") < start + timedelta(days=1)))
        days.append(
            stream.day(day.sample(fraction=1.0, shuffle=True, seed=n) if n == 2 else day, start + timedelta(days=1))
        )
    streamed = pl.concat(days).sort("gpu_uuid", "ts")
    at_once = hourly_aggregate(fleet, H).filter(pl.col("ts") < T0 + timedelta(days=4)).sort("gpu_uuid", "ts")
    assert streamed.height == at_once.height > 0
    assert_frame_equal(streamed, at_once, check_exact=False, rel_tol=1e-12, abs_tol=1e-9)
    assert stream.held is not None and stream.held.height  # the last hour's rows, for the next day


@pytest.mark.parametrize("shard_rows", [150, 10**9])
def test_the_next_day_is_asked_for_once_a_day_just_before_the_days_last_shard(telemetry, shard_rows, monkeypatch):
    # The store build reads the next day then: read at the day's start, it was held beside the
    # whole day's aggregation and the day before's write.
    log: list[str] = []
    aggregate = bucket_stream.hourly_aggregate

    def logged(*args, **kwargs):
        log.append("shard")
        return aggregate(*args, **kwargs)

    monkeypatch.setattr(bucket_stream, "hourly_aggregate", logged)
    stream = BucketStream(H, DEFAULT_MAX_SILENCE, shard_rows=shard_rows)
    for n in range(3):
        start = T0 + timedelta(days=n)
        day = telemetry.filter((pl.col("ts") >= start) & (pl.col("ts") < start + timedelta(days=1)))
        log.clear()
        stream.day(day, start + timedelta(days=1), before_last=lambda: log.append("next"))
        shards = log.count("shard")
        assert shards >= (2 if shard_rows == 150 else 1)
        assert log == ["shard"] * (shards - 1) + ["next", "shard"]
    # A day with nothing to aggregate (no rows, nothing carried) still asks, once (its empty
    # frame of buckets is made after).
    log.clear()
    BucketStream(H, DEFAULT_MAX_SILENCE).day(
        telemetry.clear(), T0 + timedelta(days=1), before_last=lambda: log.append("next")
    )
    assert log[0] == "next" and log.count("next") == 1


@pytest.mark.parametrize("shard_rows", [1, 150, 10**9])
def test_a_day_is_taken_and_each_of_its_rows_given_once_a_shard_of_whole_gpus_at_a_time(telemetry, shard_rows):
    # The store build takes the day's GPU presence from the shards, as the day's rows are let go.
    stream = BucketStream(H, DEFAULT_MAX_SILENCE, shard_rows=shard_rows)
    for n in range(2):
        start = T0 + timedelta(days=n)
        day = telemetry.filter((pl.col("ts") >= start) & (pl.col("ts") < start + timedelta(days=1)))
        expected = day.clone()
        given: list[pl.DataFrame] = []
        stream.day(day, start + timedelta(days=1), each_shard=given.append)
        assert day.width == 0  # taken, not copied
        assert len(given) >= (2 if shard_rows < 10**9 else 1)
        gpus = [set(shard["gpu_uuid"].unique()) for shard in given]
        assert sum(len(g) for g in gpus) == len(set().union(*gpus))  # a GPU in one shard only
        assert pl.concat(given).sort("gpu_uuid", "ts").equals(expected.sort("gpu_uuid", "ts"))


def test_a_build_in_shards_stores_each_days_presence_and_counts_each_row_once(telemetry, clean, tmp_path, monkeypatch):
    # A day's presence is taken from its shards as they are let go (`BucketStream.day`'s
    # `each_shard`): with shards of 150 rows it must still be the day's, and every row counted.
    monkeypatch.setattr(bucket_stream, "SHARD_ROWS", 150)
    store = _store(tmp_path / "data", telemetry)
    summary = build_aggregates(store)
    assert summary.telemetry_rows_read == telemetry.height
    days = store.dates(PRESENCE)
    assert len(days) == 4  # the fixture's four days
    for day in days:
        start = datetime(day.year, day.month, day.day, tzinfo=UTC)
        rows = telemetry.filter((pl.col("ts") >= start) & (pl.col("ts") < start + timedelta(days=1)))
        stored = pl.read_parquet(store.files(PRESENCE, day, day))
        expected = gpu_presence(rows)
        assert stored.select(expected.columns).sort(expected.columns).equals(expected.sort(expected.columns)), day
    assert read_buckets(store, *EVERYTHING).sort("gpu_uuid", "ts").equals(clean[0])


def test_a_days_buckets_are_stored_in_node_order_in_row_groups_a_shard_read_can_skip(
    telemetry, clean, tmp_path, monkeypatch
):
    # A shard of whole nodes (`features.on_demand`) skips the row groups whose node statistics
    # miss its nodes only if each file is in node order: a file in GPU order has every node in
    # every row group.
    monkeypatch.setattr(aggregates, "BUCKET_ROW_GROUP_ROWS", 40)
    store = _store(tmp_path / "data", telemetry)
    build_aggregates(store)
    files = store.files(BUCKETS)
    assert files
    for path in files:
        meta = pq.ParquetFile(path).metadata
        assert meta.num_row_groups > 1, path
        rows = pl.read_parquet(path)
        assert rows.equals(rows.sort(aggregates.NODE_ORDER)), path
        node = meta.schema.to_arrow_schema().get_field_index("node")
        ranges = [
            (meta.row_group(g).column(node).statistics.min, meta.row_group(g).column(node).statistics.max)
            for g in range(meta.num_row_groups)
        ]
        assert all(earlier[1] <= later[0] for earlier, later in pairwise(ranges)), ranges
    assert read_buckets(store, *EVERYTHING).sort("gpu_uuid", "ts").equals(clean[0])
    one_node = clean[0]["node"].min()
    shard = read_buckets(store, *EVERYTHING, where=pl.col("node").is_in([one_node])).sort("gpu_uuid", "ts")
    assert shard.height > 0
    assert shard.equals(clean[0].filter(pl.col("node") == one_node))
