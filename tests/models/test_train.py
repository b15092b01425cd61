import json
import warnings
from functools import cache

import numpy as np
import pandas as pd
import pytest

from ingest.errors import InputError
from models.train import (
    METADATA_FILE,
    MODEL_FILE,
    ModelVersionWarning,
    TrainedModel,
    load_model,
    save_model,
    settled_until,
    train_model,
    training_rows,
)
from tests.models import ONE_THREAD, PRECURSOR, demo_frame

HORIZON = "12h"


@cache
def lightgbm_model() -> TrainedModel:
    return train_model(
        demo_frame(), kind="lightgbm", train_window="5d", horizon=HORIZON, params=ONE_THREAD, negative_fraction=1.0
    )


def test_default_window_ends_at_the_last_settled_grid_time():
    frame = demo_frame()
    model = lightgbm_model()
    settled = frame["ts"].max() - pd.Timedelta(HORIZON)
    assert settled_until(frame, HORIZON) == settled
    assert model.train_end == settled
    assert model.train_start == settled - pd.Timedelta(days=5) + pd.Timedelta("1h")
    window = frame[(frame["ts"] > settled - pd.Timedelta(days=5)) & (frame["ts"] <= settled)]
    assert model.n_rows == int(window["label"].notna().sum())
    assert model.n_positives == int((window["label"] == 1).sum())
    assert model.feature_columns[-2:] == ["gpu_model", "driver"]
    assert model.versions["lightgbm"] and model.versions["scikit-learn"]


def test_as_of_stops_training_a_horizon_before_it():
    frame = demo_frame()
    as_of = pd.Timestamp("2026-01-07T00:00Z")
    rows = training_rows(frame, train_window="2d", horizon=HORIZON, as_of=as_of)
    assert rows["ts"].max() == as_of - pd.Timedelta(HORIZON) - pd.Timedelta("1h")
    assert rows["ts"].min() == as_of - pd.Timedelta(HORIZON) - pd.Timedelta(days=2)
    assert (rows["ts"] + pd.Timedelta(HORIZON) < as_of).all()


def test_censored_rows_never_influence_the_model():
    frame = demo_frame()
    # Censored rows inside the training window that look like certain failures: a model that
    # used them in any way would change.
    ghosts = frame[frame["ts"] == pd.Timestamp("2026-01-05T04:00Z")].copy()
    ghosts["gpu_uuid"] = ghosts["gpu_uuid"] + "-ghost"
    ghosts["label"] = pd.array([None] * len(ghosts), dtype="Int8")
    ghosts[PRECURSOR] = 50.0
    ghosts["temp_gpu_c_mean_1h"] = -40.0
    poisoned = pd.concat([frame, ghosts], ignore_index=True)
    kwargs = dict(kind="lightgbm", train_window="4d", horizon=HORIZON, as_of="2026-01-08T12:00Z", params=ONE_THREAD)
    clean, dirty = train_model(frame, **kwargs), train_model(poisoned, **kwargs)
    assert dirty.n_rows == clean.n_rows
    probe = pd.concat([frame.sample(300, random_state=0), ghosts.head(20)])
    np.testing.assert_array_equal(clean.predict_score(probe), dirty.predict_score(probe))


def test_a_window_without_failures_is_a_clear_error():
    frame = demo_frame()
    healthy = frame[frame["label"] != 1]
    with pytest.raises(InputError, match="positives"):
        train_model(healthy, kind="logistic", train_window="3d", horizon=HORIZON)


def test_predict_risk_is_calibrated_roughly_and_ranks_like_predict_score():
    model = lightgbm_model()
    frame = demo_frame()
    rows = frame[frame["label"].notna()]
    score, risk = model.predict_score(rows), model.predict_risk(rows)
    assert np.array_equal(np.argsort(score, kind="stable"), np.argsort(risk, kind="stable"))
    base_rate = float((rows["label"] == 1).mean())
    # Class weighting alone would put the mean near pos_weight * base rate.
    assert base_rate / 5 < risk.mean() < base_rate * 2
    assert score.mean() > 2 * risk.mean()


def test_save_load_round_trip_gives_identical_predictions(tmp_path):
    model = lightgbm_model()
    folder = save_model(model, tmp_path / "model")
    assert (folder / MODEL_FILE).is_file() and (folder / METADATA_FILE).is_file()
    meta = json.loads((folder / METADATA_FILE).read_text())
    assert meta["version"] == model.version and meta["feature_columns"] == model.feature_columns
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same versions: no warning
        loaded = load_model(folder)
    frame = demo_frame().tail(2000)
    np.testing.assert_array_equal(loaded.predict_risk(frame), model.predict_risk(frame))
    assert loaded.version == model.version
    # Columns in another order score the same: features are taken by name.
    np.testing.assert_array_equal(loaded.predict_risk(frame[frame.columns[::-1]]), model.predict_risk(frame))


def test_load_warns_when_library_versions_differ(tmp_path):
    folder = save_model(lightgbm_model(), tmp_path / "model")
    meta = json.loads((folder / METADATA_FILE).read_text())
    meta["versions"]["lightgbm"] = "3.0.0"
    (folder / METADATA_FILE).write_text(json.dumps(meta))
    with pytest.warns(ModelVersionWarning, match=r"lightgbm 3\.0\.0 \(installed"):
        load_model(folder)


def test_corrupt_model_file_is_an_error_naming_the_path(tmp_path):
    folder = save_model(lightgbm_model(), tmp_path / "model")
    (folder / MODEL_FILE).write_bytes(b"not a pickle at all")
    with pytest.raises(InputError, match=str(folder / MODEL_FILE)):
        load_model(folder)


def test_missing_model_is_an_error_naming_the_path(tmp_path):
    with pytest.raises(InputError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    folder = save_model(lightgbm_model(), tmp_path / "model")
    (folder / METADATA_FILE).write_text("{truncated")
    with pytest.raises(InputError, match=METADATA_FILE):
        load_model(folder)
