"""The feature frame's contract, and building over a store in chunks equals building in memory."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import polars as pl
import pyarrow.parquet as pq
import pytest
from polars.testing import assert_frame_equal

from features.build import build_features, empty_features, features_from_buckets, in_order, iter_features_from_buckets
from features.dataset import feature_files, read_features, read_newest_grid_time, write_features
from features.runner import BuildOptions, build_features_from_store
from features.schema import (
    ID_COLUMNS,
    LABEL_COLUMNS,
    FeatureSchemaError,
    feature_columns,
    validate_features,
    window_label,
)
from features.spec import FeatureSpec
from features.windows import hourly_aggregate
from ingest.schema import metric_columns
from ingest.store import Store
from tests.features import NO_XIDS, T0, H, at, every, samples
from tests.synthetic import synthetic_telemetry, synthetic_xids

WINDOWS = [H, 6 * H, 24 * H]


@pytest.fixture(scope="module")
def fleet() -> tuple[pl.DataFrame, pl.DataFrame]:
    tel = synthetic_telemetry(24, 72, seed=3, start=T0)
    # One GPU goes silent for good at 40:00 while its node keeps reporting: a lost GPU.
    tel = tel.filter(~((pl.col("gpu_uuid") == "GPU-00000004") & (pl.col("ts") > T0 + 40 * H)))
    events = synthetic_xids(tel, per_gpu_day=0.3, seed=3)
    return tel, events


def test_columns_types_and_order(fleet):
    tel, events = fleet
    out = build_features(tel, events, FeatureSpec(windows=WINDOWS))
    validate_features(out)
    assert out.columns[: len(ID_COLUMNS)] == ID_COLUMNS
    assert out.columns[-2:] == LABEL_COLUMNS
    feats = feature_columns(out)
    assert all(out.schema[c] == pl.Float32 for c in feats)
    # Every catalogue metric shows up, in a window-named column.
    for g in metric_columns("gauge"):
        assert {f"{g}_mean_6h", f"{g}_max_24h", f"{g}_min_1h", f"{g}_std_1h", f"{g}_slope_6h", f"{g}_last"} <= set(
            feats
        )
    for c in metric_columns("counter"):
        assert {f"{c}_increase_24h", f"{c}_rate_6h", f"{c}_last"} <= set(feats)
    for f in metric_columns("flag"):
        assert f"{f}_max_6h" in feats
    assert {
        "gpu_age_h",
        "telemetry_since_last_h",
        "telemetry_missing_frac_24h",
        "xid_gsp_count_6h",
        "xid_application_repeats_1h",
        "xid_bus_since_last_h",
        "xid_13_count_24h",
        "xid_application_burst_h_6h",
        "temp_gpu_c_node_delta_1h",
        "power_w_model_delta_1h",
    } <= set(feats)
    assert len(feats) == len(set(feats))
    assert out.select("gpu_uuid", "ts").is_unique().all()
    assert out.equals(out.sort("gpu_uuid", "ts"))
    assert out["label"].drop_nulls().is_in([0, 1]).all()


def test_empty_features_has_the_columns_of_a_build(fleet):
    tel, events = fleet
    out = build_features(tel, events, FeatureSpec(windows=WINDOWS))
    empty = empty_features(tel.columns, FeatureSpec(windows=WINDOWS))
    assert empty.height == 0
    assert empty.schema == out.schema


def test_validate_names_the_problem():
    out = build_features(samples(every(at(0, 10), at(5)), temp_gpu_c=60.0), NO_XIDS)
    with pytest.raises(FeatureSchemaError, match="share a"):
        validate_features(pl.concat([out, out.head(1)]))
    with pytest.raises(FeatureSchemaError, match="temp_gpu_c_mean_1h"):
        validate_features(out.with_columns(pl.col("temp_gpu_c_mean_1h").cast(pl.Float64)))
    with pytest.raises(FeatureSchemaError, match="missing columns"):
        validate_features(out.drop("label"))


def test_window_labels():
    assert [
        window_label(w) for w in (H, 6 * H, 24 * H, timedelta(days=7), timedelta(minutes=15), timedelta(hours=48))
    ] == ["1h", "6h", "24h", "7d", "15m", "2d"]
    with pytest.raises(ValueError):
        window_label(timedelta(0))


def test_write_and_read_features_round_trip(tmp_path, fleet):
    tel, events = fleet
    out = build_features(tel, events, FeatureSpec(windows=WINDOWS))
    store = Store.create(str(tmp_path / "data"))
    written = write_features(store, out)
    assert len(written) == out["ts"].dt.date().n_unique()
    assert not [p for p in (tmp_path / "data").rglob(".tmp-*")]
    back = read_features(store)
    assert_frame_equal(back, out.sort("ts", "gpu_uuid"))
    part = read_features(store, start=T0 + 30 * H, end=T0 + 31 * H, columns=["temp_gpu_c_mean_1h", "label"])
    assert part["ts"].unique().to_list() == [T0 + 30 * H]
    assert part.columns == ["ts", "gpu_uuid", "temp_gpu_c_mean_1h", "label"]


def test_building_from_a_store_day_by_day_equals_building_in_memory(tmp_path, fleet):
    tel, events = fleet
    store = Store.create(str(tmp_path / "data"))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", events.to_arrow())
    # No bucket budget: every node is a shard of its own whose buckets wait on disk, and one-day
    # blocks are built from the carried trailing window, in parts and chunks of a few GPUs, so
    # that day, block, shard, part and chunk edges and the carried raw rows are exercised.
    summary = build_features_from_store(
        store,
        FeatureSpec(windows=WINDOWS),
        BuildOptions(
            rows_per_chunk=500, rows_per_part=700, max_buckets_in_memory=0, block_days=1, flush_rows=500, progress=False
        ),
    )
    assert summary.blocks == 3  # 72 h: three days, each emitted on its own
    assert summary.shards == tel.select("cluster", "node").n_unique() > 1
    assert summary.telemetry_rows_read == tel.height  # each raw row is read once
    stored = read_features(store)
    expected = build_features(tel, events, FeatureSpec(windows=WINDOWS)).sort("ts", "gpu_uuid")
    assert summary.rows == stored.height == expected.height
    assert_frame_equal(stored, expected, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)
    assert stored.filter(pl.col("gpu_uuid") == "GPU-00000004")["ts"].max() <= T0 + 40 * H
    assert "features:" in str(summary)

    # A second build over the same days is refused, then replaces the files when asked to;
    # this time everything fits the budget: one shard, one block.
    with pytest.raises(FileExistsError, match="overwrite"):
        build_features_from_store(store, FeatureSpec(windows=WINDOWS), BuildOptions(progress=False))
    before = set(feature_files(store))
    summary = build_features_from_store(
        store, FeatureSpec(windows=WINDOWS), BuildOptions(progress=False), overwrite=True
    )
    assert summary.blocks == 1 and summary.shards == 1 and summary.telemetry_rows_read == tel.height
    assert summary.files_replaced == len(before)
    assert not before & set(feature_files(store))
    assert_frame_equal(read_features(store), stored, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)


@pytest.mark.slow
def test_building_part_of_a_store(tmp_path, fleet):
    tel, events = fleet
    store = Store.create(str(tmp_path / "data"))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", events.to_arrow())
    summary = build_features_from_store(
        store, FeatureSpec(windows=WINDOWS), BuildOptions(progress=False), start=T0 + 30 * H, end=T0 + 50 * H
    )
    stored = read_features(store)
    # Whole UTC days: day 2 (24:00 .. 47:00 ... 48:00 is day 3) up to the day holding 50:00.
    assert stored["ts"].min() == T0 + 24 * H
    assert stored["ts"].max() == T0 + 71 * H  # the data ends at 71:59
    expected = (
        build_features(tel, events, FeatureSpec(windows=WINDOWS))
        .filter(pl.col("ts") >= T0 + 24 * H)
        .sort("ts", "gpu_uuid")
    )
    assert summary.data_end == tel["ts"].max()
    assert_frame_equal(stored, expected, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)


def test_an_empty_store_builds_nothing(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    summary = build_features_from_store(store, options=BuildOptions(progress=False))
    assert summary.rows == 0 and read_features(store).height == 0


def test_row_order_of_the_input_does_not_matter(fleet):
    tel, events = fleet
    expected = build_features(tel, events, FeatureSpec(windows=WINDOWS))
    shuffled = build_features(
        tel.sample(fraction=1.0, shuffle=True, seed=5), events.reverse(), FeatureSpec(windows=WINDOWS)
    )
    assert_frame_equal(shuffled, expected, check_exact=False, rel_tol=1e-6, abs_tol=1e-5)


def test_a_store_on_another_filesystem_builds_the_same(tmp_path, fleet):
    """Non-local stores (s3://, memory://) are read through `Store.read`, not polars."""
    tel, events = fleet
    local = Store.create(str(tmp_path / "data"))
    remote = Store.create(f"memory://gpufail-features-test-{tmp_path.name}")
    for store in (local, remote):
        store.write("telemetry", tel.to_arrow())
        store.write("xid_events", events.to_arrow())
        build_features_from_store(
            store, FeatureSpec(windows=WINDOWS), BuildOptions(max_buckets_in_memory=0, progress=False)
        )
    assert_frame_equal(read_features(remote), read_features(local))
    remote.fs.rm(remote.path(), recursive=True)


def test_an_xid_seen_by_both_nvml_and_the_kernel_log_counts_once_in_the_features(fleet):
    # A node running both collectors writes each XID twice: the kernel log's row and NVML's
    # event, read at the next collection. The features must equal those of the kernel log alone.
    tel, events = fleet
    nvml_copies = events.with_columns(
        pl.col("ts") + pl.duration(seconds=30), pl.col("last_ts") + pl.duration(seconds=30), source=pl.lit("nvml")
    )
    expected = build_features(tel, events, FeatureSpec(windows=WINDOWS))
    both = build_features(tel, pl.concat([events, nvml_copies]), FeatureSpec(windows=WINDOWS))
    assert_frame_equal(both, expected)
    xid_columns = [c for c in expected.columns if c.startswith("xid_") and "count" in c]
    assert xid_columns and expected.select(pl.sum_horizontal(xid_columns).sum()).item() > 0


def test_features_in_parts_of_whole_gpus_equal_the_whole_frame(fleet):
    """The store build's parts: the narrow grid decides rows, labels and peers for every GPU;
    each part's wide grid covers a few GPUs. Their concatenation is the one-frame build."""
    tel, events = fleet
    hourly = hourly_aggregate(tel, H)
    end = tel["ts"].max()
    whole = features_from_buckets(hourly, events, FeatureSpec(windows=WINDOWS), data_end=end)
    parts = list(
        iter_features_from_buckets(hourly, events, FeatureSpec(windows=WINDOWS), data_end=end, rows_per_part=100)
    )
    assert len(parts) > 2
    for part in parts:  # whole GPUs: no GPU is split across parts
        assert part.height > 0
    gpus = [set(p["gpu_uuid"].unique()) for p in parts]
    assert sum(len(g) for g in gpus) == len(set().union(*gpus)) == whole["gpu_uuid"].n_unique()
    assert_frame_equal(pl.concat(parts), whole)
    threaded = iter_features_from_buckets(
        hourly, events, FeatureSpec(windows=WINDOWS), data_end=end, rows_per_part=100, part_threads=3
    )
    assert_frame_equal(pl.concat(list(threaded)), whole)
    # An emitted range that keeps no row still yields one (empty) frame with every column.
    for threads in (1, 2):
        none = list(
            iter_features_from_buckets(
                hourly,
                events,
                FeatureSpec(windows=WINDOWS),
                data_end=end,
                rows_per_part=100,
                emit_start=end + 48 * H,
                part_threads=threads,
            )
        )
        assert len(none) == 1 and none[0].height == 0 and none[0].columns == whole.columns


def test_parts_on_threads_come_in_order_computed_at_once_and_stop_with_their_reader():
    started: list[int] = []
    both_running = threading.Barrier(2, timeout=10)

    def compute(i: int) -> pl.DataFrame:
        started.append(i)
        if i < 2:
            both_running.wait()  # the first two are computed at once, or this times out
        time.sleep(0.05 * (5 - i))  # later parts finish first
        return pl.DataFrame({"part": [i]})

    assert [f["part"].item() for f in in_order(compute, range(5), threads=2)] == list(range(5))

    started.clear()
    both_running.reset()
    reader = in_order(compute, range(10), threads=2)
    assert next(reader)["part"].item() == 0
    reader.close()  # a reader that stops early: the parts not started are not computed
    assert len(started) <= 3

    def fails_on_the_third(i: int) -> pl.DataFrame:
        if i == 2:
            raise ValueError("part 2: a bad bucket")
        return pl.DataFrame({"part": [i]})

    got = []
    with pytest.raises(ValueError, match="part 2"):
        for frame in in_order(fails_on_the_third, range(5), threads=2):
            got.append(frame["part"].item())
    assert got == [0, 1]


def test_a_failed_write_of_one_date_raises_and_leaves_the_other_dates_whole(tmp_path, fleet, monkeypatch):
    tel, events = fleet
    out = build_features(tel, events, FeatureSpec(windows=WINDOWS))
    days = sorted(out["ts"].dt.date().unique().to_list())
    assert len(days) >= 3
    store = Store.create(str(tmp_path / "data"))
    real_write = Store.write_owned

    def disk_full_on_the_second_day(self, dataset, day, table, **options):
        if day == days[1]:
            raise OSError(28, "No space left on device")
        return real_write(self, dataset, day, table, **options)

    monkeypatch.setattr(Store, "write_owned", disk_full_on_the_second_day)
    with pytest.raises(OSError, match="No space left"):
        write_features(store, out, threads=2)
    monkeypatch.undo()
    assert not [p for p in (tmp_path / "data").rglob(".tmp-*")]
    written = {p.parent.name for p in (tmp_path / "data" / "features").rglob("*.parquet")}
    assert f"date={days[1]}" not in written
    # Every file that was written reads back whole: the same rows as the frame for its date.
    back = read_features(store)
    assert back.height > 0
    kept = back["ts"].dt.date().unique().implode()
    assert_frame_equal(back, out.filter(pl.col("ts").dt.date().is_in(kept)).sort("ts", "gpu_uuid"))


def test_each_file_group_is_in_gpu_then_time_order_whatever_the_frame_order(tmp_path, fleet):
    """Readers and compression rely on the (gpu_uuid, ts) order within each row group; a caller
    may pass rows in any order (the store build's flushes come sorted, the Dask path's need not)."""
    tel, events = fleet
    frame = build_features(tel, events, FeatureSpec(windows=WINDOWS))
    store = Store.create(str(tmp_path / "data"))
    write_features(store, frame.sample(fraction=1.0, shuffle=True, seed=5))
    for path in feature_files(store):
        parquet = pq.ParquetFile(path)
        for group in range(parquet.metadata.num_row_groups):
            keys = pl.from_arrow(parquet.read_row_group(group, columns=["gpu_uuid", "ts"]))
            assert keys.equals(keys.sort("gpu_uuid", "ts")), (path, group)
    assert_frame_equal(read_features(store), frame.sort("ts", "gpu_uuid"))


def test_the_newest_grid_time_is_read_alone_and_equals_filtering_a_whole_read(tmp_path, fleet):
    tel, events = fleet
    out = build_features(tel, events, FeatureSpec(windows=WINDOWS))
    newest = out["ts"].max()
    # A GPU that stopped reporting before the newest hour has no row there.
    stopped = out.filter(pl.col("ts") == newest)["gpu_uuid"][0]
    out = out.filter((pl.col("gpu_uuid") != stopped) | (pl.col("ts") < newest))
    store = Store.create(str(tmp_path / "data"))
    assert read_newest_grid_time(store).height == 0  # no features yet: empty, not an error
    write_features(store, out.sample(fraction=1.0, shuffle=True, seed=1))

    got = read_newest_grid_time(store)

    expected = read_features(store).filter(pl.col("ts") == newest)
    assert got.height > 0 and stopped not in got["gpu_uuid"].to_list()
    assert_frame_equal(got, expected)


def test_a_damaged_feature_file_is_named_when_read(tmp_path, fleet):
    from ingest.errors import StoreError

    tel, events = fleet
    store = Store.create(str(tmp_path / "data"))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", events.to_arrow())
    build_features_from_store(store, FeatureSpec(windows=WINDOWS), BuildOptions(progress=False))
    damaged = feature_files(store)[0]
    with open(damaged, "r+b") as fh:
        fh.truncate(2000)  # polars alone says "parquet: File out of specification"
    for read in (lambda: read_features(store), lambda: read_features(store, columns=["label"])):
        with pytest.raises(StoreError, match=f"^{re.escape(damaged)}: corrupt file .*its rows are not used"):
            read()
