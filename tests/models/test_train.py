import dataclasses
import json
import warnings
from datetime import timedelta
from functools import cache

import numpy as np
import pandas as pd
import pytest

from features.spec import FeatureSpec
from ingest.errors import InputError
from models.train import (
    METADATA_FILE,
    MODEL_FILE,
    ModelSpecWarning,
    ModelVersionWarning,
    TrainedModel,
    TrainOptions,
    UncalibratedModelWarning,
    capped_negative_fraction,
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
        demo_frame(),
        TrainOptions(kind="lightgbm", train_window="5d", horizon=HORIZON, params=ONE_THREAD, negative_fraction=1.0),
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
    clean, dirty = train_model(frame, TrainOptions(**kwargs)), train_model(poisoned, TrainOptions(**kwargs))
    assert dirty.n_rows == clean.n_rows
    probe = pd.concat([frame.sample(300, random_state=0), ghosts.head(20)])
    np.testing.assert_array_equal(clean.predict_score(probe), dirty.predict_score(probe))


def test_a_window_without_failures_is_a_clear_error():
    frame = demo_frame()
    healthy = frame[frame["label"] != 1]
    with pytest.raises(InputError, match="positives"):
        train_model(healthy, TrainOptions(kind="logistic", train_window="3d", horizon=HORIZON))


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


def test_scoring_on_more_threads_gives_the_same_scores_and_reaches_lightgbm(monkeypatch):
    from lightgbm import LGBMClassifier

    model = lightgbm_model()
    frame = demo_frame()
    one = model.predict_risk(frame)
    asked = []
    predict = LGBMClassifier.predict_proba

    def recorded(self, X, **kwargs):
        asked.append(kwargs.get("num_threads"))
        return predict(self, X, **kwargs)

    monkeypatch.setattr(LGBMClassifier, "predict_proba", recorded)
    for threads in (2, -1):
        np.testing.assert_array_equal(model.predict_risk(frame, threads=threads), one)
    assert asked == [2, -1]


def test_save_load_round_trip_gives_identical_predictions(tmp_path):
    model = lightgbm_model()
    folder = save_model(model, tmp_path / "model")
    assert (folder / MODEL_FILE).is_file() and (folder / METADATA_FILE).is_file()
    meta = json.loads((folder / METADATA_FILE).read_text())
    assert meta["version"] == model.version and meta["feature_columns"] == model.feature_columns
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelVersionWarning)  # same versions: no warning
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


def test_a_model_carries_its_feature_spec_through_save_and_load(tmp_path):
    spec = FeatureSpec(windows=[timedelta(hours=1), timedelta(hours=6)], horizon=timedelta(hours=12))
    model = train_model(
        demo_frame(),
        TrainOptions(kind="logistic", train_window="3d", horizon=HORIZON, negative_fraction=0.2, feature_spec=spec),
    )
    assert model.feature_spec == spec
    folder = save_model(model, tmp_path / "model")
    meta = json.loads((folder / METADATA_FILE).read_text())
    assert meta["feature_spec"] == spec.to_json() and meta["feature_spec_fingerprint"] == spec.fingerprint
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_model(folder).feature_spec == spec
    # No spec warning: the only one says the model was trained without a calibration.
    assert [w.category for w in caught] == [UncalibratedModelWarning]
    # Without a spec given, the default settings with the horizon trained on.
    assert lightgbm_model().feature_spec == FeatureSpec(horizon=timedelta(hours=12))


def test_a_model_saved_before_models_carried_a_spec_loads_with_the_evident_one_and_says_so(tmp_path):
    import joblib

    folder = save_model(lightgbm_model(), tmp_path / "model")
    old = dataclasses.replace(lightgbm_model())
    del old.__dict__["feature_spec"]  # what a TrainedModel pickled before the field existed holds
    joblib.dump(old, folder / MODEL_FILE)
    meta = json.loads((folder / METADATA_FILE).read_text())
    (folder / METADATA_FILE).write_text(json.dumps({k: v for k, v in meta.items() if not k.startswith("feature_spec")}))
    with pytest.warns(ModelSpecWarning, match=f"model {folder} records no feature spec .*default settings"):
        loaded = load_model(folder)
    assert loaded.feature_spec == FeatureSpec(horizon=timedelta(hours=12))  # its recorded horizon
    assert loaded.version == lightgbm_model().version


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


# -- negative subsampling -------------------------------------------------------------------


def test_negative_subsampling_keeps_every_positive_and_corrects_the_odds():
    frame = demo_frame()
    full = lightgbm_model()
    sampled = train_model(
        frame,
        TrainOptions(kind="lightgbm", train_window="5d", horizon=HORIZON, params=ONE_THREAD, negative_fraction=0.2),
    )
    assert sampled.n_positives == full.n_positives
    negatives = full.n_rows - full.n_positives
    assert 0.15 * negatives < sampled.n_rows - sampled.n_positives < 0.25 * negatives
    # One factor: the class weight (neg/pos of the sample, capped) times 1 / r.
    assert sampled.pos_weight == pytest.approx(sampled.params["pos_weight"] / 0.2)
    assert sampled.negative_fraction == 0.2 and sampled.metadata()["negative_fraction"] == 0.2
    rows = frame[frame["label"].notna()]
    base_rate = float((rows["label"] == 1).mean())
    risk = sampled.predict_risk(rows)
    # Uncorrected, the sample's scores would sit ~5x above the full model's; corrected, near them.
    assert base_rate / 5 < risk.mean() < base_rate * 2
    assert sampled.predict_score(rows).mean() > 5 * risk.mean()


def test_negative_subsampling_is_seeded_and_works_on_polars_frames():
    import polars as pl

    frame = demo_frame()
    kwargs = dict(kind="logistic", train_window="3d", horizon=HORIZON, negative_fraction=0.1)
    a = train_model(frame, TrainOptions(**kwargs))
    b = train_model(pl.from_pandas(frame), TrainOptions(**kwargs))
    c = train_model(frame, TrainOptions(**kwargs, seed=1))
    probe = frame.tail(500)
    np.testing.assert_allclose(a.predict_risk(probe), b.predict_risk(probe))
    assert a.n_rows == b.n_rows
    assert not np.allclose(a.predict_risk(probe), c.predict_risk(probe))
    with pytest.raises(InputError, match="negative_fraction"):
        train_model(frame, TrainOptions(**{**kwargs, "negative_fraction": 0.0}))


def test_the_negative_cap_lowers_the_share_to_the_ratio_and_records_it():
    frame = demo_frame()
    kwargs = dict(kind="lightgbm", train_window="5d", horizon=HORIZON, params=ONE_THREAD, negative_fraction=0.5)
    window = training_rows(frame, train_window="5d", horizon=HORIZON)
    negatives, positives = int((window["label"] == 0).sum()), int((window["label"] == 1).sum())
    assert negatives > 10 * positives  # the cap below binds
    capped = train_model(frame, TrainOptions(**kwargs, max_negatives_per_positive=5))
    assert capped.n_positives == positives
    assert 4 * positives < capped.n_rows - positives < 6 * positives
    assert capped.negative_fraction == pytest.approx(5 * positives / negatives)
    assert capped.pos_weight == pytest.approx(capped.params["pos_weight"] / capped.negative_fraction)
    loose = train_model(frame, TrainOptions(**kwargs, max_negatives_per_positive=negatives))
    uncapped = train_model(frame, TrainOptions(**kwargs))
    assert loose.negative_fraction == uncapped.negative_fraction == 0.5
    assert loose.n_rows == uncapped.n_rows


def test_capped_negative_fraction():
    assert capped_negative_fraction(1000, 10, 0.1, None) == 0.1
    assert capped_negative_fraction(1000, 10, 0.1, 20) == 0.1  # 100 negatives: 10 per positive
    assert capped_negative_fraction(10_000, 10, 0.1, 20) == pytest.approx(0.02)
    assert capped_negative_fraction(10_000, 0, 0.1, 20) == 0.1  # nothing to measure against
    assert capped_negative_fraction(0, 10, 0.1, 20) == 0.1
    with pytest.raises(InputError, match="max_negatives_per_positive: expected a positive number"):
        capped_negative_fraction(1000, 10, 0.1, 0)


def test_train_options_draw_at_the_capped_share_and_name_their_window():
    options = TrainOptions(kind="lightgbm", train_window="5d", horizon=HORIZON, max_negatives_per_positive=20)
    assert options.negative_fraction == 0.1 and options.seed == 0 and dict(options.params) == {}
    drawn = options.drawn_from(10_000, 10)
    assert drawn.negative_fraction == pytest.approx(0.02)
    assert drawn == dataclasses.replace(options, negative_fraction=drawn.negative_fraction)
    assert options.negative_fraction == 0.1  # frozen: drawing makes new options
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.kind = "xgboost"  # type: ignore[misc]
    assert options.window_name == "training window of 5d before the last settled label"
    at = dataclasses.replace(options, as_of="2026-01-05T00:00Z")
    assert at.window_name == f"training window of 5d before 2026-01-05T00:00Z - {HORIZON}"
    with pytest.raises(TypeError):
        TrainOptions("lightgbm", "5d", HORIZON)  # type: ignore[misc]  # keywords only


# -- every kind ------------------------------------------------------------------------------

FAST = {
    "lightgbm": {"n_jobs": 1},
    "xgboost": {"n_jobs": 1},
    "random_forest": {"n_jobs": 1, "n_estimators": 40},
    "logistic": {},
    "mlp": {"hidden_layer_sizes": [16], "max_iter": 15},
    "parallel": {"n_jobs": 1},
    "cascade": {"n_jobs": 1},
}


@cache
def shuffled() -> pd.DataFrame:
    frame = demo_frame()
    return frame.assign(label=frame["label"].sample(frac=1.0, random_state=0).to_numpy())


@cache
def trained(kind: str, shuffled_labels: bool = False) -> TrainedModel:
    frame = shuffled() if shuffled_labels else demo_frame()
    return train_model(
        frame, TrainOptions(kind=kind, train_window="6d", horizon=HORIZON, as_of="2026-01-08T12:00Z", params=FAST[kind])
    )


def held_out() -> pd.DataFrame:
    frame = demo_frame()
    test = frame[(frame["ts"] >= pd.Timestamp("2026-01-08T12:00Z")) & frame["label"].notna()]
    return test.reset_index(drop=True)


@pytest.mark.parametrize("kind", list(FAST))
def test_planted_precursor_is_found_by_every_kind(kind):
    from models.evaluate import score_metrics

    test = held_out()
    metrics = score_metrics(test, trained(kind).predict_risk(test), k=5)
    # The precursor ramps up over the day before each failure: every kind catches almost all.
    assert metrics["recall_at_k"] >= 0.9, metrics
    assert metrics["roc_auc"] >= 0.9, metrics


@pytest.mark.parametrize("kind", ["lightgbm", "parallel", "cascade"])
def test_shuffled_labels_give_precision_near_the_base_rate(kind):
    from models.evaluate import precision_at_k

    # Labels shuffled over the whole frame, held-out period included: nothing links features
    # to labels any more, so no model (nor any leak of labels into features) can beat chance.
    shuffled_frame = shuffled()
    test = shuffled_frame[(shuffled_frame["ts"] >= pd.Timestamp("2026-01-08T12:00Z")) & shuffled_frame["label"].notna()]
    model = trained(kind, shuffled_labels=True)
    precision = precision_at_k(test.assign(score=model.predict_risk(test)), 5)["precision_at_k_pooled"]
    base_rate = float((test["label"] == 1).mean())
    assert precision < base_rate + 0.03
    real = held_out()
    assert precision_at_k(real.assign(score=trained(kind).predict_risk(real)), 5)["precision_at_k_pooled"] > 0.1


@pytest.mark.parametrize("kind", ["parallel", "cascade", "random_forest", "mlp"])
def test_same_seed_same_predictions(kind):
    frame = demo_frame()
    kwargs = dict(kind=kind, train_window="6d", horizon=HORIZON, as_of="2026-01-08T12:00Z", params=FAST[kind])
    probe = held_out().head(2000)
    again = train_model(frame, TrainOptions(**kwargs))
    np.testing.assert_array_equal(again.predict_risk(probe), trained(kind).predict_risk(probe))


@pytest.mark.parametrize("kind", ["parallel", "cascade"])
def test_ensembles_save_load_and_score(tmp_path, kind):
    from serving.score import score_latest

    model = trained(kind)
    folder = save_model(model, tmp_path / kind)
    meta = json.loads((folder / METADATA_FILE).read_text())
    assert meta["kind"] == kind and meta["versions"]["lightgbm"] and meta["versions"]["scikit-learn"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelVersionWarning)
        loaded = load_model(folder)
    probe = held_out()
    np.testing.assert_array_equal(loaded.predict_risk(probe), model.predict_risk(probe))
    latest = probe[probe["ts"] == probe["ts"].max()]
    scored = score_latest(loaded, latest)
    assert len(scored) == len(latest) and scored["risk"].between(0, 1).all()


def test_cascade_records_its_learnt_threshold():
    model = trained("cascade")
    assert 0 < model.params["threshold"] < 1 and model.params["validation_recall"] >= 0.95
    assert 0 < model.params["kept_fraction"] < 0.5
    assert model.params["validation_gap"] == pd.Timedelta(HORIZON)
    assert model.estimator.threshold_ == model.params["threshold"]


def test_bad_ensemble_settings_are_input_errors():
    frame = demo_frame()
    with pytest.raises(InputError, match="svm"):
        train_model(
            frame, TrainOptions(kind="parallel", train_window="3d", horizon=HORIZON, params={"members": ["svm", "mlp"]})
        )
    with pytest.raises(InputError, match="cannot be constrained"):
        train_model(
            frame,
            TrainOptions(
                kind="parallel",
                train_window="3d",
                horizon=HORIZON,
                params={"members": ["lightgbm", "mlp"]},
                monotone_increasing=[PRECURSOR],
            ),
        )
    with pytest.raises(InputError, match="model kind"):
        train_model(frame, TrainOptions(kind="svm", train_window="3d", horizon=HORIZON))
    # Failures only in the first of the cascade's three blocks: the first stage that scores it
    # out of fold has none to learn from.
    healthy_late = frame.assign(label=frame["label"].where(frame["ts"] < pd.Timestamp("2026-01-06T00:00Z"), 0))
    with pytest.raises(InputError, match="fold 1 of 3 .* only one class"):
        train_model(
            healthy_late,
            TrainOptions(
                kind="cascade", train_window="2d", horizon=HORIZON, as_of="2026-01-08T00:00Z", params=FAST["cascade"]
            ),
        )


@pytest.mark.parametrize("kind", ["lightgbm", "cascade", "parallel"])
def test_a_model_that_scores_each_row_alone_scores_any_split_of_the_gpus_as_the_whole(kind):
    # What the nightly relies on to score a held-out window in parts of whole GPUs: the cascade
    # uses its time column only to fit; the parallel ensemble ranks a grid time's GPUs together.
    model = trained(kind)
    probe = held_out()
    gpus = probe["gpu_uuid"].unique()
    half = probe["gpu_uuid"].isin(gpus[::2]).to_numpy()
    apart = np.empty(len(probe))
    for side in (half, ~half):
        apart[side] = model.predict_risk(probe[side])
    whole = model.predict_risk(probe)
    assert model.scores_each_row_alone is (kind != "parallel")
    if model.scores_each_row_alone:
        np.testing.assert_array_equal(apart, whole)
    else:
        assert not np.array_equal(apart, whole)
