"""`train_model_from_store` reads only the sampled rows' features and fits the model
`train_model` fits on the whole frame: same rows, same order, same predictions."""

from __future__ import annotations

import os
import re
import threading
from datetime import timedelta

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from features.dataset import feature_files, read_features, write_features
from features.sample_key import PRESAMPLED_FRACTION, SAMPLE_KEY, drawn, key_threshold
from features.spec import FeatureSpec, FeatureSpecMismatch
from ingest.errors import InputError
from ingest.store import Store
from models.train import TrainOptions, sample_negatives, train_model, training_rows, training_sample
from models.train_store import (
    SKEWED_DAYS,
    _train_from_store,
    calibrated_from_store,
    fits_side_by_side,
    sampled_training_rows,
    store_settled_until,
    store_training_bounds,
    train_model_from_store,
    window_label_counts,
    with_store_spec,
)
from tests.models import ONE_THREAD, demo_features_store

SETTINGS = dict(train_window="4d", horizon="12h", params=ONE_THREAD)


def sample_options(**window) -> TrainOptions:
    """Options that only choose rows (the window and the negative draw): any kind will do."""
    return TrainOptions(kind="lightgbm", **window)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    return demo_features_store(str(tmp_path_factory.mktemp("train-store") / "data"))


@pytest.mark.parametrize("seed", [0, 3], ids=["stored-key", "other-seed"])
@pytest.mark.parametrize("as_of", [None, "2026-01-08T12:00Z"])
def test_the_sample_is_the_rows_train_model_keeps(store, as_of, seed):
    everything = read_features(store)
    window = dict(train_window="4d", horizon="12h", as_of=as_of)
    expected = sample_negatives(training_rows(everything, **window), 0.2, seed=seed)
    keys = training_sample(
        everything.select("ts", "gpu_uuid", "label"), sample_options(**window, negative_fraction=0.2, seed=seed)
    )
    assert 0 < keys.height == len(expected)
    assert keys["gpu_uuid"].to_list() == expected["gpu_uuid"].tolist()
    rows = sampled_training_rows(store, sample_options(**window, negative_fraction=0.2, seed=seed))
    assert rows.columns == everything.columns
    assert rows.select("ts", "gpu_uuid").equals(keys)
    # A healthy share of the negatives only: the sample is much smaller than the window.
    assert rows["label"].sum() == expected["label"].sum() > 0
    assert rows.height < 0.5 * len(training_rows(everything, **window))


@pytest.mark.parametrize("as_of", [None, "2026-01-08T12:00Z"])
def test_the_model_from_the_store_is_the_model_from_all_rows(store, as_of):
    everything = read_features(store)
    ours = train_model_from_store(store, TrainOptions(kind="lightgbm", as_of=as_of, negative_fraction=0.2, **SETTINGS))
    theirs = train_model(everything, TrainOptions(kind="lightgbm", as_of=as_of, negative_fraction=0.2, **SETTINGS))
    assert ours.version == theirs.version
    assert (ours.n_rows, ours.n_positives, ours.pos_weight) == (theirs.n_rows, theirs.n_positives, theirs.pos_weight)
    probe = everything.tail(500)
    np.testing.assert_array_equal(ours.predict_risk(probe), theirs.predict_risk(probe))


@pytest.mark.parametrize("as_of", [None, "2026-01-09T00:00Z"])
def test_the_calibrated_model_from_the_store_is_the_calibrated_model_from_all_rows(store, as_of):
    everything = read_features(store)
    options = TrainOptions(
        kind="lightgbm", as_of=as_of, negative_fraction=0.2, calibration="platt", calibration_window="2d", **SETTINGS
    )
    ours, theirs = train_model_from_store(store, options), train_model(everything, options)
    assert ours.calibration_info() == theirs.calibration_info()
    assert ours.calibration_info()["negative_fraction"] == 0.2 and ours.version == theirs.version
    probe = everything.tail(500)
    np.testing.assert_array_equal(ours.predict_risk(probe), theirs.predict_risk(probe))


def test_the_negative_cap_gives_the_model_from_all_rows(store):
    everything = read_features(store)
    capped = dict(negative_fraction=0.5, max_negatives_per_positive=4, **SETTINGS)
    ours = train_model_from_store(store, TrainOptions(kind="lightgbm", **capped))
    theirs = train_model(everything, TrainOptions(kind="lightgbm", **capped))
    assert ours.negative_fraction == theirs.negative_fraction < 0.5
    assert (ours.n_rows, ours.n_positives) == (theirs.n_rows, theirs.n_positives)
    probe = everything.tail(500)
    np.testing.assert_array_equal(ours.predict_risk(probe), theirs.predict_risk(probe))


def test_a_window_with_no_labelled_rows_is_an_input_error(store):
    with pytest.raises(InputError, match="no labelled rows"):
        train_model_from_store(store, TrainOptions(kind="lightgbm", as_of="2025-01-01T00:00Z", **SETTINGS))


def test_a_store_without_features_is_an_input_error(tmp_path):
    empty = Store.create(str(tmp_path / "data"))
    with pytest.raises(InputError, match="features dataset is empty"):
        train_model_from_store(empty, TrainOptions(kind="lightgbm", **SETTINGS))


def test_an_unknown_kind_fails_before_anything_is_read(tmp_path):
    empty = Store.create(str(tmp_path / "data"))
    with pytest.raises(InputError, match="model kind"):
        train_model_from_store(empty, TrainOptions(kind="nope", **SETTINGS))


def test_each_features_file_holds_the_presampled_rows_in_its_first_row_group(store):
    """What lets a retrain skip ~90% of the bytes: group 0 is exactly the rows drawn at
    PRESAMPLED_FRACTION (every positive, and censored rows by their key), group 1 none of
    them, and its statistics say so."""
    files = feature_files(store)
    assert files
    for path in files:
        parquet = pq.ParquetFile(path)
        assert parquet.metadata.num_row_groups == 2, path
        for group, expect_drawn in ((0, True), (1, False)):
            table = pl.from_arrow(parquet.read_row_group(group, columns=["label", SAMPLE_KEY]))
            label = table["label"].fill_null(0).to_numpy()
            assert (drawn(label, table[SAMPLE_KEY].to_numpy(), PRESAMPLED_FRACTION) == expect_drawn).all(), path
        stats = parquet.metadata.row_group(1).column(parquet.schema_arrow.get_field_index(SAMPLE_KEY)).statistics
        assert stats.has_min_max and stats.min >= key_threshold(PRESAMPLED_FRACTION)
        stats = parquet.metadata.row_group(1).column(parquet.schema_arrow.get_field_index("label")).statistics
        assert stats.max == 0


def test_the_stored_key_path_never_reads_a_day_whole(store, monkeypatch):
    import models.train_store as module

    def no_day_reads(*args, **kwargs):
        raise AssertionError("the day-at-a-time path was taken")

    monkeypatch.setattr(module, "rows_at", no_day_reads)
    monkeypatch.setattr(module, "training_sample", no_day_reads)
    rows = sampled_training_rows(store, sample_options(train_window="4d", horizon="12h", negative_fraction=0.05))
    assert rows["label"].sum() > 0
    assert SAMPLE_KEY not in rows.columns


def test_files_written_before_the_stored_key_give_the_same_sample(store, tmp_path):
    """A store upgraded in place: some days were written without the key column."""
    old = Store.create(str(tmp_path / "old"))
    write_features(old, read_features(store))
    for path in feature_files(old)[::2]:
        table = pq.read_table(path)
        # As an older gpufail wrote them: without the key, and without a checksum in the name.
        pq.write_table(table.drop_columns([SAMPLE_KEY]), re.sub(r"-crc32-[0-9a-f]{8}\.parquet$", ".parquet", path))
        os.remove(path)
    assert read_features(old).equals(read_features(store))
    window = dict(train_window="4d", horizon="12h", negative_fraction=0.2)
    assert sampled_training_rows(old, sample_options(**window)).equals(
        sampled_training_rows(store, sample_options(**window))
    )


def test_the_wide_columns_are_read_one_day_at_a_time_for_days_with_sampled_rows(store, monkeypatch):
    """Without the stored key (another seed here), the draw is made on narrow columns and only
    the days with drawn rows are read wide."""
    import models.train_store as module

    narrow_calls, wide_calls = [], []
    real_narrow, real_wide = module.read_features, module.rows_at

    def narrow_spy(store, start=None, end=None, columns=None):
        narrow_calls.append((start, end, columns))
        return real_narrow(store, start=start, end=end, columns=columns)

    def wide_spy(store, day_start, wanted):
        wide_calls.append((day_start, wanted.height))
        return real_wide(store, day_start, wanted)

    monkeypatch.setattr(module, "read_features", narrow_spy)
    monkeypatch.setattr(module, "rows_at", wide_spy)
    rows = sampled_training_rows(store, sample_options(train_window="4d", horizon="12h", negative_fraction=0.2, seed=3))
    # The newest day's times (where labels settle), then the keys only, up to the newest day.
    assert narrow_calls[1:] == [(narrow_calls[1][0], None, ["label"])]
    per_day = rows.group_by(rows["ts"].dt.date().alias("day")).len().sort("day")
    assert [(start.date(), n) for start, n in wide_calls] == list(per_day.iter_rows())
    assert len(wide_calls) < len(store.dates("features"))  # days outside the window are not read wide


def test_a_store_on_another_filesystem_gives_the_same_sample(store, tmp_path):
    """A store on another filesystem is read through the same scans (pyarrow underneath)."""
    remote = Store.create(f"memory://gpufail-train-store-{tmp_path.name}")
    try:
        write_features(remote, read_features(store))
        window = dict(train_window="4d", horizon="12h", negative_fraction=0.2, seed=3)
        assert sampled_training_rows(remote, sample_options(**window)).equals(
            sampled_training_rows(store, sample_options(**window))
        )
        span = dict(train_window="4d", horizon="12h")
        negatives, positives = window_label_counts(store, *store_training_bounds(store, **span))
        assert window_label_counts(remote, *store_training_bounds(remote, **span)) == (negatives, positives)
        labels = training_rows(read_features(store), **span)["label"]
        assert (negatives, positives) == (int((labels == 0).sum()), int((labels == 1).sum()))
    finally:
        remote.fs.rm(remote.path(), recursive=True)


def test_newest_days_without_rows_are_passed_over_then_refused(store, tmp_path):
    # Days dated only by GPUs whose clocks run ahead of the fleet's hold no grid time of it.
    copy = Store.create(str(tmp_path / "data"))
    write_features(copy, read_features(store))
    settled = store_settled_until(copy, "12h")
    newest = copy.dates("features")[-1]
    empty = pq.read_table(feature_files(copy, newest, newest)[0]).slice(0, 0)
    for ahead in range(1, SKEWED_DAYS + 2):
        folder = tmp_path / "data" / "features" / f"date={newest + timedelta(days=ahead)}"
        folder.mkdir()
        pq.write_table(empty, folder / "part-empty.parquet")
        if ahead <= SKEWED_DAYS:
            assert store_settled_until(copy, "12h") == settled
    with pytest.raises(InputError, match="newest features days .* have no rows"):
        sampled_training_rows(copy, sample_options(train_window="4d", horizon="12h"))


# -- the feature spec the model carries -----------------------------------------------------------


def with_recorded_spec(store: Store, folder, spec: FeatureSpec) -> Store:
    """A copy of `store` whose features manifest records `spec` (as a build with it would)."""
    import shutil

    from features.manifest import open_manifest

    shutil.copytree(store.root, folder)
    copy = Store.open(str(folder))
    with open_manifest(copy) as manifest:  # takes the copied files as complete
        manifest.spec = spec  # as a build with it records it
        manifest._save()
    return copy


def test_the_model_carries_the_spec_its_features_record(store, tmp_path):
    spec = FeatureSpec(windows=[timedelta(hours=1), timedelta(hours=6)], horizon=timedelta(hours=12))
    data = with_recorded_spec(store, tmp_path / "data", spec)
    assert train_model_from_store(data, TrainOptions(kind="lightgbm", **SETTINGS)).feature_spec == spec
    model = train_model_from_store(data, TrainOptions(kind="lightgbm", **SETTINGS, feature_spec=spec))
    assert model.feature_spec == spec


def test_training_settings_of_another_spec_than_the_features_are_refused(store, tmp_path):
    built = FeatureSpec(horizon=timedelta(hours=12))
    data = with_recorded_spec(store, tmp_path / "data", built)
    asked = FeatureSpec(horizon=timedelta(hours=12), lost_after=timedelta(hours=3))
    with pytest.raises(FeatureSpecMismatch) as refused:
        train_model_from_store(data, TrainOptions(kind="lightgbm", **SETTINGS, feature_spec=asked))
    assert str(refused.value).startswith(
        f"{data.root}: the features were built with feature spec {built.fingerprint}, but the training settings "
        f'ask for feature spec {asked.fingerprint}; they differ in lost_after ("6h" against "3h"); rebuild'
    )


def test_features_that_record_no_spec_give_the_spec_of_the_options(store):
    spec = FeatureSpec(horizon=timedelta(hours=12))
    assert (
        train_model_from_store(store, TrainOptions(kind="lightgbm", **SETTINGS, feature_spec=spec)).feature_spec == spec
    )
    assert train_model_from_store(store, TrainOptions(kind="lightgbm", **SETTINGS)).feature_spec == spec  # horizon 12h


# -- the two fits of a calibrated retrain ---------------------------------------------------------

CALIBRATED = dict(negative_fraction=0.2, calibration="platt", calibration_window="2d", **SETTINGS)


def _recording_fit(store: Store, threads: list[str], fail_on: str | None = None):
    """`_train_from_store`, recording the thread of each fit (and raising on the thread named
    `fail_on`)."""

    def fit(options, window):
        name = threading.current_thread().name
        threads.append(name)
        if fail_on is not None and name.startswith(fail_on):
            raise InputError(f"{options.window_name}: no rows (a planted failure)")
        return _train_from_store(store, options, window)

    return fit


def test_the_fits_side_by_side_give_the_model_of_the_fits_one_after_the_other(store):
    options = with_store_spec(store, TrainOptions(kind="lightgbm", **CALIBRATED))
    assert fits_side_by_side(options)
    threads: list[str] = []
    together = calibrated_from_store(store, options, _recording_fit(store, threads), side_by_side=True)
    assert sorted(t.startswith("served-fit") for t in threads) == [False, True]
    threads.clear()
    apart = calibrated_from_store(store, options, _recording_fit(store, threads))
    assert [t.startswith("served-fit") for t in threads] == [False, False]
    assert together.version == apart.version
    assert together.calibration_info() == apart.calibration_info()
    probe = read_features(store).tail(500)
    np.testing.assert_array_equal(together.predict_risk(probe), apart.predict_risk(probe))


def test_a_failing_served_fit_beside_the_other_fails_the_retrain(store):
    options = with_store_spec(store, TrainOptions(kind="lightgbm", **CALIBRATED))
    with pytest.raises(InputError, match="a planted failure"):
        calibrated_from_store(store, options, _recording_fit(store, [], fail_on="served-fit"), side_by_side=True)


@pytest.mark.parametrize(
    ("kind", "params", "side_by_side"),
    [
        ("lightgbm", {"n_jobs": 1}, True),
        ("xgboost", {"n_jobs": 1}, True),
        ("lightgbm", {"n_jobs": 2}, False),  # two fits of two threads on two cores wait on each other
        ("lightgbm", {}, False),  # the kind's default: two threads
        ("logistic", {}, False),  # BLAS's thread limit is the process's
        ("parallel", {"n_jobs": 1}, False),
    ],
)
def test_only_one_thread_fits_of_trees_run_side_by_side(kind, params, side_by_side):
    options = TrainOptions(kind=kind, **{**CALIBRATED, "params": params})
    assert fits_side_by_side(options) is side_by_side


def test_a_calibrated_retrain_computes_its_labels_once(tmp_path_factory, monkeypatch):
    """On a store whose rows are computed, the labels of the two windows and the slice are
    computed in one pass (and the first and newest days' for where the data starts and where
    labels settle), not once per window."""
    from features import label_rows, on_demand
    from tests.features.cached_stores import simulated_store

    computed = Store.open(simulated_store(tmp_path_factory.mktemp("labels-once") / "data", seed=3, nodes=3, days=10))
    passes: list[tuple] = []
    real = label_rows.iter_features_on_demand

    def counted(store, start, end, **kwargs):
        passes.append((start, end))
        return real(store, start, end, **kwargs)

    monkeypatch.setattr(label_rows, "iter_features_on_demand", counted)
    options = TrainOptions(
        kind="lightgbm",
        train_window="6d",
        horizon=on_demand.on_demand_spec(computed).horizon,
        params={"n_estimators": 10, "n_jobs": 1},
        negative_fraction=0.5,
        calibration="platt",
        calibration_window="2d",
    )
    model = train_model_from_store(computed, options)
    # (a read of the newest day, for where labels settle, runs to the end: None)
    longer_than_a_day = [(s, e) for s, e in passes if e is not None and e - s > timedelta(days=1)]
    assert len(longer_than_a_day) == 1 and len(passes) <= 3
    start, end = longer_than_a_day[0]
    assert start <= model.train_start.to_pydatetime() - timedelta(days=1)  # the scorer's window, a slice earlier
    assert end > model.train_end.to_pydatetime()
