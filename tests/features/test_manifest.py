"""The feature build's manifest: complete days stay, partial or unsettled days are rebuilt, and
what is rebuilt equals a full build (`features.manifest`)."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from features.dataset import read_features
from features.manifest import recorded_spec
from features.plan import FeaturesExistError
from features.runner import BuildOptions, build_features_from_store
from features.spec import FeatureSpec, FeatureSpecMismatch
from ingest.errors import StoreError
from ingest.store import Store
from tests.faults import kill_points
from tests.synthetic import synthetic_telemetry, synthetic_xids

T0 = datetime(2026, 1, 5, tzinfo=UTC)
H = timedelta(hours=1)
WINDOWS = [H, 6 * H, 24 * H]


@pytest.fixture(scope="module")
def fleet() -> tuple[pl.DataFrame, pl.DataFrame]:
    tel = synthetic_telemetry(12, 96, interval=timedelta(minutes=20), gpus_per_node=4, start=T0, seed=5)
    return tel, synthetic_xids(tel, per_gpu_day=0.6, seed=5)


def store_with(root: Path, fleet, until: datetime | None = None) -> Store:
    tel, xids = fleet
    if until is not None:
        tel, xids = tel.filter(pl.col("ts") < until), xids.filter(pl.col("ts") < until)
    store = Store.create(str(root))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", xids.to_arrow())
    return store


SPEC = FeatureSpec(windows=WINDOWS)
OTHER = FeatureSpec(windows=[H, 6 * H], horizon=12 * H)


def build(store: Store, *, max_buckets_in_memory: int = 4_000_000, spec: FeatureSpec = SPEC, **kwargs):
    options = BuildOptions(block_days=1, progress=False, max_buckets_in_memory=max_buckets_in_memory)
    return build_features_from_store(store, spec, options, **kwargs)


@pytest.fixture(scope="module")
def full(fleet, tmp_path_factory) -> pl.DataFrame:
    store = store_with(tmp_path_factory.mktemp("full") / "data", fleet)
    build(store)
    return read_features(store)


def same_rows(store: Store, expected: pl.DataFrame) -> None:
    rows = read_features(store)
    assert rows.select("gpu_uuid", "ts").is_duplicated().sum() == 0
    assert_frame_equal(rows, expected, check_exact=False, rel_tol=1e-5, abs_tol=1e-4)


def test_new_data_builds_the_new_days_and_rebuilds_the_unsettled_ones(fleet, full, tmp_path):
    store = store_with(tmp_path / "data", fleet, until=T0 + 72 * H)
    build(store)
    first_day = set(store.files("features", T0.date(), T0.date()))
    tel, xids = fleet
    store.write("telemetry", tel.filter(pl.col("ts") >= T0 + 72 * H).to_arrow())
    store.write("xid_events", xids.filter(pl.col("ts") >= T0 + 72 * H).to_arrow())

    summary = build(store)

    # Day 1's labels were settled (horizon + merge window + loss delay within the data then);
    # days 2 and 3 were not, and the new day 4 was missing.
    assert summary.days_kept == 1 and summary.blocks == 3
    assert set(store.files("features", T0.date(), T0.date())) == first_day
    same_rows(store, full)


def test_a_build_of_some_days_then_of_all_builds_only_the_rest(fleet, full, tmp_path):
    store = store_with(tmp_path / "data", fleet)
    first = build(store, start=T0 + 24 * H, end=T0 + 72 * H)
    summary = build(store)
    assert summary.days_kept == 2 and summary.blocks == 2  # day 1 and day 4, each on its own
    # The summaries name the files as they are once committed, block by block.
    assert sorted(first.files_written + summary.files_written) == store.files("features")
    same_rows(store, full)
    with pytest.raises(FeaturesExistError) as refused:
        build(store)
    files = len(store.files("features"))
    assert str(refused.value).startswith(f"features: {files} files already cover 2026-01-05..2026-01-08, every day")
    assert "gpufail features --overwrite" in str(refused.value)


def test_a_day_missing_one_of_its_files_is_rebuilt(fleet, full, tmp_path):
    store = store_with(tmp_path / "data", fleet)
    build(store, max_buckets_in_memory=300)  # shards: several files a day
    day2 = store.files("features", (T0 + 24 * H).date(), (T0 + 24 * H).date())
    assert len(day2) > 1
    store.fs.rm(day2[0])
    summary = build(store)
    assert summary.days_kept == 3 and summary.files_replaced == len(day2) - 1
    same_rows(store, full)


def test_files_no_manifest_names_are_leftovers_and_removed(fleet, full, tmp_path):
    store = store_with(tmp_path / "data", fleet)
    build(store)
    # What a rebuild (--overwrite) killed before its block completed leaves: new files beside
    # the day's listed ones.
    day2 = store.files("features", (T0 + 24 * H).date(), (T0 + 24 * H).date())
    shutil.copy(day2[0], day2[0].replace("part-", "part-0"))
    with pytest.raises(FeaturesExistError, match="removed 1 files an interrupted build left"):
        build(store)
    same_rows(store, full)


def test_an_interrupted_rebuild_keeps_the_old_days_until_the_new_ones_are_complete(fleet, full, tmp_path, monkeypatch):
    import features.manifest

    store = store_with(tmp_path / "data", fleet)
    build(store)
    real = features.manifest.FeatureManifest.complete
    calls = {"n": 0}

    def killed_after_two_blocks(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(features.manifest.FeatureManifest, "complete", killed_after_two_blocks)
    with pytest.raises(KeyboardInterrupt):
        build(store, overwrite=True)
    monkeypatch.setattr(features.manifest.FeatureManifest, "complete", real)
    # Days 1-2 rebuilt, days 3-4 as they were: readers see whole days, and the rebuild's
    # files of day 3, never committed, are gone.
    same_rows(store, full)
    assert kill_points.hidden_files(Path(store.path())) == []  # but what the last commit keeps for readers
    with pytest.raises(FeaturesExistError) as refused:
        build(store)
    assert "files an interrupted build left" not in str(refused.value)


def test_a_store_written_before_the_manifest_is_taken_as_it_is(fleet, full, tmp_path):
    store = store_with(tmp_path / "data", fleet)
    build(store)
    Path(store.path("_state", "features.json")).unlink()
    with pytest.raises(FeaturesExistError, match="already cover 2026-01-05..2026-01-08"):
        build(store)
    assert len(store.read_state("features")["days"]) == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "corrupt state file"),
        ('{"version": 1, "days": {"2026-01-05": 3}}', "not a gpufail feature manifest .*TypeError"),
        ('{"version": 9, "days": {}}', "not a gpufail feature manifest .*version 9, expected 1"),
    ],
)
def test_a_damaged_manifest_is_named_in_one_line(fleet, tmp_path, text, message):
    store = store_with(tmp_path / "data", fleet, until=T0 + 24 * H)
    Path(store.path("_state")).mkdir(exist_ok=True)
    Path(store.path("_state", "features.json")).write_text(text)
    with pytest.raises(StoreError, match=f"_state/features.json: {message}"):
        build(store)


# -- the spec the days were built with ----------------------------------------------------------


def test_the_manifest_records_the_spec_the_features_were_built_with(fleet, tmp_path):
    store = store_with(tmp_path / "data", fleet, until=T0 + 48 * H)
    assert recorded_spec(store) is None
    build(store)
    assert recorded_spec(store) == SPEC
    state = store.read_state("features")
    assert state["spec"] == SPEC.to_json() and state["spec_fingerprint"] == SPEC.fingerprint


def test_a_build_with_other_settings_is_refused_unless_it_rebuilds_every_day(fleet, tmp_path):
    store = store_with(tmp_path / "data", fleet)
    build(store)
    files = sorted(store.files("features"))
    for refused in ({}, {"overwrite": True, "start": T0 + 24 * H}):
        with pytest.raises(FeatureSpecMismatch) as error:
            build(store, spec=OTHER, **refused)
        message = str(error.value)
        assert message.startswith(f"{store.root}: the features were built with feature spec {SPEC.fingerprint}, ")
        assert f"but this build asks for feature spec {OTHER.fingerprint}; they differ in windows (" in message
        assert "horizon (" in message and "\n" not in message
        assert sorted(store.files("features")) == files and recorded_spec(store) == SPEC  # nothing changed
    assert "1 built days lie outside 2026-01-06..2026-01-08" in message

    summary = build(store, spec=OTHER, overwrite=True)
    assert recorded_spec(store) == OTHER and summary.days_kept == 0
    assert not set(store.files("features")) & set(files)  # every day of the old spec is gone
    fresh = store_with(tmp_path / "fresh", fleet)
    build(fresh, spec=OTHER)
    same_rows(store, read_features(fresh))  # the rows a build of the new settings alone gives
    assert "temp_gpu_c_mean_24h" not in read_features(store).columns


def test_a_store_built_before_specs_were_recorded_takes_the_spec_of_its_next_build(fleet, full, tmp_path):
    store = store_with(tmp_path / "data", fleet, until=T0 + 72 * H)
    build(store)
    state = store.read_state("features")
    store.write_state("features", {k: v for k, v in state.items() if k not in ("spec", "spec_fingerprint")})
    assert recorded_spec(store) is None
    tel, xids = fleet
    store.write("telemetry", tel.filter(pl.col("ts") >= T0 + 72 * H).to_arrow())
    store.write("xid_events", xids.filter(pl.col("ts") >= T0 + 72 * H).to_arrow())
    build(store)
    assert recorded_spec(store) == SPEC
    same_rows(store, full)
