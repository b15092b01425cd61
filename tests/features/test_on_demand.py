"""Features computed on demand from the stored aggregates equal the materialised features.

A simulated fleet with the demo preset's settings, and a slice of the paper preset's, each with
its kernel logs ingested: the store build (`features.runner`) writes the features table, the
aggregates build (`features.aggregates`) the buckets, and every column of every row computed on
demand (`features.on_demand`) must equal the table's: identities and labels exactly, features to
float32 tolerance. The on-demand side uses other time blocks and a bucket budget that splits
the fleet into shards, so that equality does not hang on computing the same way.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import UTC, datetime, timedelta

import numpy as np
import polars as pl
import pytest

from features.aggregates import BUCKETS, PRESENCE, build_aggregates, read_buckets
from features.dataset import computed, read_features
from features.on_demand import (
    OnDemandOptions,
    at_keys,
    drawn,
    features_on_demand,
    labelled,
    newest_on_demand,
)
from features.plan import FeaturesExistError, lookback
from features.runner import BuildOptions, build_features_from_store
from features.sample_key import SAMPLE_KEY, key_threshold
from features.schema import ID_COLUMNS, LABEL_COLUMNS
from features.spec import FeatureSpec
from ingest.errors import InputError
from ingest.failure_events import event_frame, write_failure_events
from ingest.simulator.run import simulate
from ingest.store import Store
from tests.cli import gpufail

US = timedelta(microseconds=1)
FLEET_START = datetime(2026, 3, 2, tzinfo=UTC)
# Blocks and shards unlike the materialised build's (3-day blocks, the whole fleet at once).
ON_DEMAND = OnDemandOptions(block_days=4, max_buckets_in_memory=20_000, rows_per_part=3_000, rows_per_chunk=1_000)

FLEETS = {
    # The demo preset's settings (5-minute samples in the demo; 15 here to keep it small).
    "demo": {"nodes": 4, "days": 10, "sample_interval_s": 900, "acceleration": 80.0, "fail_slow_fraction": 0.05},
    # The paper preset's (sample interval, model mix, late nodes, floods), on three nodes.
    "paper": {"nodes": 3, "days": 9, "acceleration": 60.0},
}


@pytest.fixture(scope="module", params=sorted(FLEETS))
def fleet(request, tmp_path_factory) -> tuple[Store, pl.DataFrame]:
    """A store with both forms built, and its materialised features with their stored keys."""
    root = tmp_path_factory.mktemp(request.param) / "data"
    simulate(root, request.param, seed=5, progress=False, **FLEETS[request.param])
    assert gpufail("ingest", "kernel-log", "--data", str(root)).returncode == 0
    store = Store.open(str(root))
    build_features_from_store(store, options=BuildOptions(block_days=3, progress=False))
    # Read before the aggregates exist: the table itself (afterwards the readers compute).
    assert not computed(store)
    columns = [*read_features(store).columns, SAMPLE_KEY]
    materialised = read_features(store, columns=columns).select(columns)
    build_aggregates(store)
    assert computed(store)
    assert materialised.height > 1000 and (materialised["label"] == 1).sum() > 0
    return store, materialised


def assert_same_rows(got: pl.DataFrame, expected: pl.DataFrame) -> None:
    """Same columns, order and types; identities and labels equal; features to float32
    tolerance. A standard deviation is a difference of sums of squares, so its rounding scales
    with the metric's level (memory used near 80,000 MiB): its tolerance is float32 rounding of
    the window's mean. (Rows are equal to the bit as well: `test_a_row_has_the_same_bits_in_every_read`.)"""
    assert got.columns == expected.columns
    assert got.schema == expected.schema
    assert got.height == expected.height
    for name in (*ID_COLUMNS, "label", SAMPLE_KEY):
        if name in got.columns:
            assert got[name].equals(expected[name], check_names=True), name
    for name in expected.columns:
        if name in ID_COLUMNS or name in ("label", SAMPLE_KEY):
            continue
        x, y = expected[name].to_numpy().astype(np.float64), got[name].to_numpy().astype(np.float64)
        assert (np.isnan(x) == np.isnan(y)).all(), f"{name}: unknown in one and not the other"
        level = np.abs(x)
        if "_std_" in name:
            level = np.maximum(level, np.abs(expected[name.replace("_std_", "_mean_")].to_numpy().astype(np.float64)))
        tolerance = 1e-4 + 4 * np.finfo(np.float32).eps * level
        known = ~np.isnan(x)
        worst = np.abs(x - y)[known] - tolerance[known]
        assert worst.size == 0 or worst.max() <= 0, f"{name}: differs by more than float32 rounding"


def test_every_row_on_demand_equals_the_materialised_row(fleet):
    store, materialised = fleet
    got = features_on_demand(store, sample_key=True, options=ON_DEMAND)
    assert_same_rows(got, materialised)
    assert got[LABEL_COLUMNS[1]].equals(materialised[LABEL_COLUMNS[1]])


def test_the_training_draw_on_demand_is_the_materialised_draw(fleet):
    store, materialised = fleet
    for share in (0.1, 0.5):
        expected = materialised.filter(
            (pl.col("label") == 1) | ((pl.col("label") == 0) & (pl.col(SAMPLE_KEY) < key_threshold(share)))
        )
        got = features_on_demand(store, rows=drawn(share), sample_key=True, options=ON_DEMAND)
        assert 0 < got.height < materialised.height
        assert_same_rows(got, expected)


def test_a_range_and_chosen_rows(fleet):
    store, materialised = fleet
    # A range that starts and ends within days, not at a block's edge.
    start = materialised["ts"].min() + timedelta(days=2, hours=5)
    end = start + timedelta(days=3, hours=7)
    expected = materialised.filter(pl.col("ts").is_between(start, end, closed="left")).drop(SAMPLE_KEY)
    assert_same_rows(features_on_demand(store, start, end, options=ON_DEMAND), expected)
    wanted = expected.sample(200, seed=1).select("ts", "gpu_uuid")
    chosen = features_on_demand(store, start, end, rows=at_keys(wanted))
    assert_same_rows(chosen, expected.join(wanted, on=["ts", "gpu_uuid"], how="semi"))
    censored = features_on_demand(store, start, end, rows=labelled())
    assert_same_rows(censored, expected.filter(pl.col("label").is_not_null()))


@pytest.mark.parametrize("options", [ON_DEMAND, OnDemandOptions(block_days=4, max_buckets_in_memory=1_000)])
def test_labels_alone_on_demand(fleet, options):
    # The second: the labels read in shards of a few nodes each.
    store, materialised = fleet
    got = features_on_demand(store, labels_only=True, options=options)
    assert got.columns == [*ID_COLUMNS, *LABEL_COLUMNS]
    assert got.equals(materialised.select(*ID_COLUMNS, *LABEL_COLUMNS))
    # Without the identity columns (not read): the same rows and labels, gpu_uuid and ts.
    keys = features_on_demand(store, labels_only=True, ids=False, options=options)
    assert keys.columns == got.columns
    assert keys.select("ts", "gpu_uuid", *LABEL_COLUMNS).equals(got.select("ts", "gpu_uuid", *LABEL_COLUMNS))
    others = [c for c in ID_COLUMNS if c not in ("ts", "gpu_uuid")]
    assert others and keys.select(pl.col(others).null_count()).row(0) == (keys.height,) * len(others)


def test_the_newest_hour_on_demand(fleet):
    store, materialised = fleet
    newest = materialised["ts"].max()
    got = features_on_demand(store, newest, newest + US)
    assert_same_rows(got, materialised.filter(pl.col("ts") == newest).drop(SAMPLE_KEY))
    assert_same_rows(newest_on_demand(store), materialised.filter(pl.col("ts") == newest).drop(SAMPLE_KEY))
    past = features_on_demand(store, newest + timedelta(hours=1))  # past the data: empty, the same columns
    assert past.height == 0 and past.schema == got.schema


def test_the_newest_hour_when_no_gpu_is_in_service_at_the_last_grid_time(fleet, tmp_path):
    store, materialised = fleet
    copy = tmp_path / "data"
    shutil.copytree(store.root, copy)
    moved = Store.open(str(copy))
    newest = materialised["ts"].max()
    # Every node reported failed half an hour before the last grid time, none back: no GPU is in
    # service there, so the newest rows are those of an earlier grid time.
    nodes = materialised.select("cluster", "node").unique().rows()
    write_failure_events(
        moved,
        event_frame(
            {"ts": newest - timedelta(minutes=30), "cluster": c, "node": n, "source": "record", "ref": f"t-{n}"}
            for c, n in nodes
        ),
    )
    everything = features_on_demand(moved, newest - timedelta(days=2))
    assert everything.height and everything["ts"].max() < newest
    got = newest_on_demand(moved)
    assert got.height and got["ts"].n_unique() == 1
    assert got["ts"][0] == everything["ts"].max()
    assert_same_rows(got, everything.filter(pl.col("ts") == got["ts"][0]))


def test_aggregates_built_in_pieces_equal_one_build(fleet, tmp_path):
    store, materialised = fleet
    root = tmp_path / "data"
    shutil.copytree(store.root, root)
    copy = Store.open(str(root))
    shutil.rmtree(copy.path(BUCKETS))
    shutil.rmtree(copy.path(PRESENCE))
    (root / "_state" / "buckets.json").unlink()
    middle = materialised["ts"].min() + timedelta(days=4)
    later = build_aggregates(copy, start=middle)
    first = build_aggregates(copy, end=middle)
    assert first.buckets and later.buckets and first.days_kept == 0
    # Rows are counted once no day of telemetry before the newest built lacks its aggregates.
    assert later.rows == 0 and "days of telemetry" in later.warnings[0] and "have no aggregates" in later.warnings[0]
    assert first.rows == materialised.filter(pl.col("ts") < middle).height
    assert first.positives == materialised.filter((pl.col("ts") < middle) & (pl.col("label") == 1)).height
    with pytest.raises(FeaturesExistError):
        build_aggregates(copy)
    everything = materialised["ts"].min() - timedelta(days=1), materialised["ts"].max() + timedelta(days=1)
    assert (
        read_buckets(copy, *everything)
        .sort("gpu_uuid", "ts")
        .equals(read_buckets(store, *everything).sort("gpu_uuid", "ts"))
    )
    assert_same_rows(features_on_demand(copy), materialised.drop(SAMPLE_KEY))


def test_asking_without_aggregates_or_with_days_missing_is_an_input_error(fleet, tmp_path):
    store, _ = fleet

    def without_aggregates(name: str) -> Store:
        root = tmp_path / name
        shutil.copytree(store.root, root)
        copy = Store.open(str(root))
        shutil.rmtree(copy.path(BUCKETS))
        shutil.rmtree(copy.path(PRESENCE))
        (root / "_state" / "buckets.json").unlink()
        return copy

    copy = without_aggregates("none")
    with pytest.raises(InputError, match="no stored aggregates to compute features from; run `gpufail features --data"):
        features_on_demand(copy)
    days = copy.dates("telemetry")
    newest = datetime.combine(days[-1], datetime.min.time(), tzinfo=UTC)
    # Telemetry after the newest day built is data the features do not see yet, as with a table.
    build_aggregates(copy, end=newest)
    assert features_on_demand(copy)["ts"].max() < newest
    # A day missing before it is refused: every GPU's age and its failures need every day.
    holed = without_aggregates("holed")
    build_aggregates(holed, start=datetime.combine(days[1], datetime.min.time(), tzinfo=UTC))
    with pytest.raises(InputError, match=rf"lack 1 days of telemetry \({days[0]}..{days[0]}\)"):
        features_on_demand(holed)


def test_features_of_another_grid_need_the_aggregates_rebuilt(fleet):
    store, _ = fleet
    with pytest.raises(InputError, match="grid 0:30:00"):
        features_on_demand(store, spec=FeatureSpec(grid=timedelta(minutes=30), windows=[timedelta(hours=1)]))
    with pytest.raises(ValueError, match="block_days: expected at least 1"):
        OnDemandOptions(block_days=0)


def test_the_readers_compute_what_the_table_holds(fleet):
    from features.dataset import (
        drawn_rows,
        feature_days,
        features_shape,
        has_sample_keys,
        label_counts,
        read_newest_grid_time,
        rows_at,
        scan_features,
    )

    store, materialised = fleet
    table = materialised.drop(SAMPLE_KEY)
    first, last = materialised["ts"].min(), materialised["ts"].max()
    assert_same_rows(read_features(store), table)
    assert read_features(store, columns=["label"]).equals(materialised.select("ts", "gpu_uuid", "label"))
    assert feature_days(store) == sorted(set(materialised["ts"].dt.date().to_list()))
    assert label_counts(store, first, last + US) == (
        int((materialised["label"] == 0).sum()),
        int((materialised["label"] == 1).sum()),
    )
    assert has_sample_keys(store, first, last + US) and not has_sample_keys(
        store, last + timedelta(days=1), last + timedelta(days=2)
    )
    draw = (pl.col("label") == 1) | ((pl.col("label") == 0) & (pl.col(SAMPLE_KEY) < key_threshold(0.1)))
    assert_same_rows(drawn_rows(store, first, last + US, 0.1), table.filter(materialised.select(draw).to_series()))
    keyed = scan_features(store, first, first + timedelta(days=2), where=draw).collect()
    assert_same_rows(
        keyed, table.filter(materialised.select(draw).to_series() & (pl.col("ts") < first + timedelta(days=2)))
    )
    day = first + timedelta(days=3)
    wanted = table.filter(pl.col("ts").is_between(day, day + timedelta(days=1), closed="left")).sample(50, seed=2)
    assert_same_rows(rows_at(store, day, wanted.select("ts", "gpu_uuid")), wanted.sort("ts", "gpu_uuid"))
    assert_same_rows(read_newest_grid_time(store), table.filter(pl.col("ts") == last))
    rows, columns = features_shape(store)
    # Rows: the GPU-hours with samples, about the feature rows (silent hours add rows, failed GPUs
    # take some away), from the files' footers.
    assert columns == table.width and abs(rows - table.height) <= 0.1 * table.height


def test_a_spec_of_the_same_grid_is_recorded_and_another_grid_refused(fleet, tmp_path):
    from features.aggregates import aggregates_spec
    from features.spec import FeatureSpecMismatch

    store, materialised = fleet
    root = tmp_path / "data"
    shutil.copytree(store.root, root)
    copy = Store.open(str(root))
    files = copy.files(BUCKETS)
    shorter = FeatureSpec(windows=[timedelta(hours=1), timedelta(hours=6)], horizon=timedelta(hours=12))
    with pytest.raises(FeaturesExistError):
        build_aggregates(copy, shorter)  # nothing to build: the days stay, the spec is recorded
    assert aggregates_spec(copy) == shorter and copy.files(BUCKETS) == files
    frame = read_features(copy)
    assert "temp_gpu_c_mean_7d" not in frame.columns and "temp_gpu_c_mean_6h" in frame.columns
    assert frame.height == materialised.height
    other = FeatureSpec(max_silence=timedelta(hours=12))
    with pytest.raises(FeatureSpecMismatch, match="gpufail features --overwrite"):
        build_aggregates(copy, other)
    assert aggregates_spec(copy) == shorter and copy.files(BUCKETS) == files
    rebuilt = build_aggregates(copy, other, overwrite=True)
    # Every day built again; the old files go first (`FeatureManifest.use_spec`).
    assert aggregates_spec(copy) == other and rebuilt.leftovers_removed == len(files) + len(store.files(PRESENCE))
    assert not set(files) & set(copy.files(BUCKETS))


def test_a_day_built_before_its_telemetry_ended_is_built_again(tmp_path):
    from tests.synthetic import synthetic_telemetry

    t0 = FLEET_START
    store = Store.create(str(tmp_path / "data"))
    store.write("telemetry", synthetic_telemetry(8, 30, seed=2, start=t0).to_arrow())  # day 2 until 06:00
    first = gpufail("features", "--data", str(tmp_path / "data"), "--quiet")
    assert first.returncode == 0 and first.stdout.startswith("features: ")
    store.write("telemetry", synthetic_telemetry(8, 48, seed=3, start=t0 + timedelta(hours=31)).to_arrow())
    more = gpufail("features", "--data", str(tmp_path / "data"), "--quiet", "--json")
    facts = json.loads(more.stdout)
    # Day 1 stays; day 2 (built at 06:00) is built again with days 3 and 4: two files a day.
    assert facts["days_kept"] == 1 and (len(facts["files_written"]), facts["files_replaced"]) == (6, 2)
    clean = tmp_path / "clean"
    shutil.copytree(tmp_path / "data", clean)
    again = gpufail("features", "--data", str(clean), "--quiet", "--overwrite")
    assert again.returncode == 0
    everything = (t0 - timedelta(days=1), t0 + timedelta(days=5))
    assert (
        read_buckets(store, *everything)
        .sort("gpu_uuid", "ts")
        .equals(read_buckets(Store.open(str(clean)), *everything).sort("gpu_uuid", "ts"))
    )


def test_a_row_has_the_same_bits_in_every_read(fleet):
    """A window's value depends on its buckets alone (`features.rolling`): on demand with other
    blocks and shards, over all days, a range or one hour, a row is the materialised row to the
    last bit, so that a model fitted on one read's rows is the model of any other's."""
    store, materialised = fleet
    table = materialised.drop(SAMPLE_KEY)
    assert features_on_demand(store, options=ON_DEMAND).equals(table)
    newest = materialised["ts"].max()
    for start in (newest, newest - timedelta(days=1, hours=7)):
        assert features_on_demand(store, start, newest + US).equals(table.filter(pl.col("ts") >= start))


def test_a_block_reads_the_xid_incidents_its_rows_can_see_and_the_same_rows_come_out(fleet, monkeypatch):
    """A block's XID features see incidents up to its lookback (counts) or the since-last cap
    before it; older ones are left out of its computation. With a 6-hour cap, blocks of two days
    drop the first days' incidents in the last blocks, and every row equals one block's."""
    from features import on_demand

    store, _ = fleet
    spec = FeatureSpec(xid_since_cap=timedelta(hours=6))
    whole = features_on_demand(store, spec=spec, options=OnDemandOptions(block_days=30))
    seen: list[int] = []
    original = on_demand.iter_features_from_buckets

    def recorded(hourly, xid, *args, **kwargs):
        seen.append(xid.height)
        return original(hourly, xid, *args, **kwargs)

    monkeypatch.setattr(on_demand, "iter_features_from_buckets", recorded)
    blocks = features_on_demand(store, spec=spec, options=OnDemandOptions(block_days=2))
    assert blocks.equals(whole)
    assert whole.select(pl.sum_horizontal(pl.col("^xid_.*_count_7d$")).sum()).item() > 0
    everything = on_demand.stored_fleet_facts(store, on_demand.on_demand_spec(store)).xid.height
    assert seen[0] == everything and seen[-1] < everything  # the last block left the first days' out


def test_the_newest_hour_reads_only_its_lookback(fleet, monkeypatch):
    from features import newest_cache, on_demand

    store, materialised = fleet
    read: list[tuple[datetime, datetime]] = []
    original = on_demand.read_buckets

    def recorded(store, start, end, **options):
        read.append((start, end))
        return original(store, start, end, **options)

    monkeypatch.setattr(on_demand, "read_buckets", recorded)
    newest = materialised["ts"].max()
    cached = newest_cache.ROWS_FILE.path(store)
    if os.path.exists(cached):  # computed by an earlier test of this store
        os.remove(cached)
    got = newest_on_demand(store)
    assert got.height and got["ts"].max() == newest
    spec = on_demand.on_demand_spec(store)
    assert read and min(start for start, _ in read) == newest - lookback(spec)
    assert max(end for _, end in read) == newest + US


def test_the_parts_of_a_read_are_computed_on_the_threads_its_options_ask_for(fleet, monkeypatch):
    from features import build

    store, materialised = fleet
    asked: list[int] = []
    in_order = build.in_order

    def recorded(compute, items, *, threads):
        asked.append(threads)
        return in_order(compute, items, threads=threads)

    monkeypatch.setattr(build, "in_order", recorded)
    rows = features_on_demand(store, options=OnDemandOptions(rows_per_part=2_000, part_threads=3))
    assert rows.equals(materialised.drop(SAMPLE_KEY))
    assert asked and set(asked) == {3}


def test_blocks_by_default_hold_the_fleet_in_memory_or_last_three_lookbacks(fleet):
    from features.on_demand import block_length, on_demand_spec, stored_fleet_facts

    store, materialised = fleet
    spec = on_demand_spec(store)
    facts = stored_fleet_facts(store, spec)
    gpus = facts.presence["gpu_uuid"].n_unique()
    back = lookback(spec)
    # Room for 30 days of every GPU's buckets: blocks of the whole days that leave for the lookback.
    roomy = OnDemandOptions(max_buckets_in_memory=gpus * 24 * 30)
    assert block_length(facts, spec, roomy) == timedelta(days=30) - back
    # Not a day beyond the lookback: blocks of three lookbacks (whole days), read in shards.
    tight = OnDemandOptions(max_buckets_in_memory=gpus * 24 * 7, rows_per_part=2_000)
    assert block_length(facts, spec, tight) == 3 * (-(-back // timedelta(days=1))) * timedelta(days=1)
    assert block_length(facts, spec, OnDemandOptions(block_days=3)) == timedelta(days=3)
    table = materialised.drop(SAMPLE_KEY)
    assert features_on_demand(store, options=tight).equals(table)
    assert features_on_demand(store, options=roomy).equals(table)


def test_blocks_count_only_the_gpus_reporting_in_the_range_read(fleet):
    import dataclasses

    from features.on_demand import block_length, on_demand_spec, stored_fleet_facts

    store, _ = fleet
    spec = on_demand_spec(store)
    facts = stored_fleet_facts(store, spec)
    gpus = facts.presence["gpu_uuid"].n_unique()
    roomy = OnDemandOptions(max_buckets_in_memory=gpus * 24 * 30)
    # As many GPUs again, replaced a year before the data: a read of the data's range holds
    # none of their buckets, so its blocks are as long as without them.
    year = timedelta(days=365)
    gone = facts.presence.with_columns(
        (pl.col("gpu_uuid") + "-replaced").alias("gpu_uuid"), pl.col("first_ts") - year, pl.col("last_ts") - year
    )
    churned = dataclasses.replace(facts, presence=pl.concat([facts.presence, gone]))
    span = (facts.first_data, facts.data_end)
    assert (
        block_length(churned, spec, roomy, span)
        == block_length(facts, spec, roomy, span)
        == timedelta(days=30) - lookback(spec)
    )
    # Counted over the whole history, they halve the days the budget holds.
    assert block_length(churned, spec, roomy) < block_length(facts, spec, roomy)


def test_nodes_of_the_same_name_in_two_clusters_are_read_in_their_own_shards(tmp_path):
    from tests.synthetic import synthetic_telemetry

    start = datetime(2026, 1, 5, tzinfo=UTC)
    telemetry = synthetic_telemetry(12, 72, interval=timedelta(minutes=15), gpus_per_node=3, start=start, seed=5)
    # GPUs 6-11 (node00002, node00003) move to cluster c1 as node00000 and node00001: two pairs
    # of (cluster, node) share each node name.
    moved = pl.col("gpu_uuid") >= "GPU-00000006"
    telemetry = telemetry.with_columns(
        pl.when(moved).then(pl.lit("c1")).otherwise(pl.col("cluster")).alias("cluster"),
        pl.when(moved)
        .then(pl.col("node").str.replace("node00002", "node00000").str.replace("node00003", "node00001"))
        .otherwise(pl.col("node"))
        .alias("node"),
    )
    store = Store.create(str(tmp_path / "data"))
    store.write("telemetry", telemetry.to_arrow())
    build_aggregates(store)
    assert (
        read_buckets(store, start - timedelta(days=1), start + timedelta(days=4))
        .select("cluster", "node")
        .unique()
        .height
        == 4
    )
    whole = features_on_demand(store)
    # A shard a node: each (cluster, node) alone, though its name is also another shard's.
    sharded = features_on_demand(store, options=OnDemandOptions(max_buckets_in_memory=1, rows_per_part=50))
    assert whole.height and whole["gpu_uuid"].n_unique() == 12
    assert sharded.equals(whole)
    # The labels without the identity columns read them for the shards' exact join alone.
    labels = features_on_demand(
        store, labels_only=True, ids=False, options=OnDemandOptions(max_buckets_in_memory=1, rows_per_part=50)
    )
    assert labels.select("ts", "gpu_uuid", "label").equals(whole.select("ts", "gpu_uuid", "label"))
    assert labels["node"].null_count() == labels.height


def test_a_blocks_shards_hold_the_gpus_that_report_in_it_or_its_lookback():
    """GPUs gone before a block's lookback (replaced, retired) take no room in its shards."""
    from types import SimpleNamespace

    from features.on_demand import _node_shards
    from features.shards import SHARD

    block = (datetime(2026, 5, 1, tzinfo=UTC), datetime(2026, 5, 1, 1, tzinfo=UTC))
    back = timedelta(days=7)
    gone = datetime(2026, 4, 1, tzinfo=UTC)

    def gpu(node: str, index: int, last: datetime) -> dict[str, object]:
        return {
            "cluster": "c0",
            "node": node,
            "gpu_index": index,
            "pci_bus_id": f"0000:{index:02x}:00.0",
            "gpu_uuid": f"GPU-{node}-{index}",
            "first_ts": datetime(2026, 1, 1, tzinfo=UTC),
            "last_ts": last,
            "n_samples": 1,
        }

    presence = pl.DataFrame(
        [gpu("node-a", i, gone) for i in range(8)]  # replaced a month before
        + [gpu("node-b", i, block[1]) for i in range(8)]
        + [gpu("node-c", i, block[0] - back + timedelta(minutes=30)) for i in range(8)]  # within the lookback
    ).with_columns(pl.col("first_ts", "last_ts").cast(pl.Datetime("us", "UTC")))
    facts = SimpleNamespace(presence=presence)
    spec = FeatureSpec()
    buckets_per_gpu = (block[1] - block[0] + back) // spec.grid
    # Room for eight GPUs' buckets a shard: a node a shard, and the gone node in none.
    shards = _node_shards(facts, spec, block, back, 8 * buckets_per_gpu)  # type: ignore[arg-type]
    assert sorted(shards["node"].to_list()) == ["node-b", "node-c"]
    assert shards[SHARD].n_unique() == 2
