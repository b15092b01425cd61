"""`train_model_from_store` reads only the sampled rows' features and fits the model
`train_model` fits on the whole frame: same rows, same order, same predictions."""

from __future__ import annotations

import numpy as np
import pytest

from features.build import read_features
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

    calls = []
    real = module.read_features

    def spy(store, start=None, end=None, columns=None):
        calls.append((start, end, columns))
        return real(store, start=start, end=end, columns=columns)

    monkeypatch.setattr(module, "read_features", spy)
    rows = sampled_training_rows(store, train_window="4d", horizon="12h", negative_fraction=0.2)
    narrow, wide = calls[0], calls[1:]
    assert narrow[2] == ["label"] and narrow[1] is None  # keys only, up to the newest day
    assert all(columns is None and (end - start).days == 1 for start, end, columns in wide)
    assert [start.date() for start, _, _ in wide] == rows["ts"].dt.date().unique().sort().to_list()
    assert len(wide) < len(store.dates("features"))  # days outside the window are not read wide
