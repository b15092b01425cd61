"""`train_model_from_store` reads only the sampled rows' features and fits the model
`train_model` fits on the whole frame: same rows, same order, same predictions."""

from __future__ import annotations

import numpy as np
import pytest

from features.build import read_features, write_features
from ingest.errors import InputError
from ingest.store import Store
from models.train import sample_negatives, train_model, training_rows, training_sample
from models.train_store import sampled_training_rows, train_model_from_store
from tests.models import ONE_THREAD, demo_features_store

SETTINGS = dict(train_window="4d", horizon="12h", params=ONE_THREAD)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    return demo_features_store(str(tmp_path_factory.mktemp("train-store") / "data"))


@pytest.mark.parametrize("as_of", [None, "2026-01-08T12:00Z"])
def test_the_sample_is_the_rows_train_model_keeps(store, as_of):
    everything = read_features(store)
    window = dict(train_window="4d", horizon="12h", as_of=as_of)
    expected = sample_negatives(training_rows(everything, **window), 0.2, seed=3)
    keys = training_sample(everything.select("ts", "gpu_uuid", "label"), **window, negative_fraction=0.2, seed=3)
    assert 0 < keys.height == len(expected)
    assert keys["gpu_uuid"].to_list() == expected["gpu_uuid"].tolist()
    rows = sampled_training_rows(store, **window, negative_fraction=0.2, seed=3)
    assert rows.columns == everything.columns
    assert rows.select("ts", "gpu_uuid").equals(keys)
    # A healthy share of the negatives only: the sample is much smaller than the window.
    assert rows["label"].sum() == expected["label"].sum() > 0
    assert rows.height < 0.5 * len(training_rows(everything, **window))


@pytest.mark.parametrize("as_of", [None, "2026-01-08T12:00Z"])
def test_the_model_from_the_store_is_the_model_from_all_rows(store, as_of):
    everything = read_features(store)
    ours = train_model_from_store(store, kind="lightgbm", as_of=as_of, negative_fraction=0.2, **SETTINGS)
    theirs = train_model(everything, kind="lightgbm", as_of=as_of, negative_fraction=0.2, **SETTINGS)
    assert ours.version == theirs.version
    assert (ours.n_rows, ours.n_positives, ours.pos_weight) == (theirs.n_rows, theirs.n_positives, theirs.pos_weight)
    probe = everything.tail(500)
    np.testing.assert_array_equal(ours.predict_risk(probe), theirs.predict_risk(probe))


def test_a_window_with_no_labelled_rows_is_an_input_error(store):
    with pytest.raises(InputError, match="no labelled rows"):
        train_model_from_store(store, kind="lightgbm", as_of="2025-01-01T00:00Z", **SETTINGS)


def test_a_store_without_features_is_an_input_error(tmp_path):
    empty = Store.create(str(tmp_path / "data"))
    with pytest.raises(InputError, match="features dataset is empty"):
        train_model_from_store(empty, kind="lightgbm", **SETTINGS)


def test_an_unknown_kind_fails_before_anything_is_read(tmp_path):
    empty = Store.create(str(tmp_path / "data"))
    with pytest.raises(InputError, match="model kind"):
        train_model_from_store(empty, kind="nope", **SETTINGS)


def test_the_wide_columns_are_read_one_day_at_a_time_for_days_with_sampled_rows(store, monkeypatch):
    import models.train_store as module

    narrow_calls, wide_calls = [], []
    real_narrow, real_wide = module.read_features, module._read_rows

    def narrow_spy(store, start=None, end=None, columns=None):
        narrow_calls.append((start, end, columns))
        return real_narrow(store, start=start, end=end, columns=columns)

    def wide_spy(store, day_start, wanted):
        wide_calls.append((day_start, wanted.height))
        return real_wide(store, day_start, wanted)

    monkeypatch.setattr(module, "read_features", narrow_spy)
    monkeypatch.setattr(module, "_read_rows", wide_spy)
    rows = sampled_training_rows(store, train_window="4d", horizon="12h", negative_fraction=0.2)
    assert narrow_calls == [(narrow_calls[0][0], None, ["label"])]  # keys only, up to the newest day
    per_day = rows.group_by(rows["ts"].dt.date().alias("day")).len().sort("day")
    assert [(start.date(), n) for start, n in wide_calls] == list(per_day.iter_rows())
    assert len(wide_calls) < len(store.dates("features"))  # days outside the window are not read wide


def test_a_store_on_another_filesystem_gives_the_same_sample(store, tmp_path):
    """Non-local stores read a day whole and cut it, instead of scanning it with polars."""
    remote = Store.create(f"memory://gpufail-train-store-{tmp_path.name}")
    try:
        write_features(remote, read_features(store))
        window = dict(train_window="4d", horizon="12h", negative_fraction=0.2, seed=3)
        assert sampled_training_rows(remote, **window).equals(sampled_training_rows(store, **window))
    finally:
        remote.fs.rm(remote.path(), recursive=True)
