from functools import cache

import numpy as np
import pandas as pd
import pytest

from ingest.errors import InputError
from models.explain import EXPLANATION_COLUMNS, contributions, explain
from models.frame import feature_matrix
from models.train import TrainedModel, TrainOptions, train_model
from tests.models import ONE_THREAD, PRECURSOR, demo_frame

PARAMS = {
    "lightgbm": ONE_THREAD,
    "xgboost": ONE_THREAD,
    "random_forest": {"n_jobs": 1, "n_estimators": 30},
    "logistic": {},
    "mlp": {"hidden_layer_sizes": [16], "max_iter": 15},
    "parallel": ONE_THREAD,
    "cascade": ONE_THREAD,
}


@cache
def model(kind: str) -> TrainedModel:
    return train_model(demo_frame(), TrainOptions(kind=kind, train_window="5d", horizon="12h", params=PARAMS[kind]))


def about_to_fail() -> pd.DataFrame:
    frame = demo_frame()
    return frame[frame["time_to_failure_h"] < 6].head(40)


@pytest.mark.parametrize("kind", list(PARAMS))
def test_the_planted_precursor_explains_the_gpus_about_to_fail(kind):
    rows = about_to_fail()
    out = explain(model(kind), rows, top=3)
    assert list(out.columns) == list(EXPLANATION_COLUMNS)
    assert len(out) == 3 * len(rows) and out["rank"].tolist() == [1, 2, 3] * len(rows)
    first = out[out["rank"] == 1]
    # The precursor is the top reason for most of them, and it raises their risk.
    assert (first["feature"] == PRECURSOR).mean() >= 0.8
    assert (first.loc[first["feature"] == PRECURSOR, "contribution"] > 0).mean() >= 0.9
    # Ordered by absolute contribution within each row; values are the row's own.
    magnitude = out["contribution"].abs().to_numpy().reshape(len(rows), 3)
    assert np.all(np.diff(magnitude, axis=1) <= 1e-12)
    hit = first[first["feature"] == PRECURSOR]
    expected = rows[PRECURSOR].to_numpy()[hit.index.to_numpy() // 3]  # three output rows per input row
    np.testing.assert_allclose(hit["value"].astype(float), expected, rtol=1e-6)
    assert out["gpu_uuid"].tolist()[::3] == rows["gpu_uuid"].tolist()
    assert out["ts"].tolist()[::3] == rows["ts"].tolist()


def test_tree_shap_and_logistic_contributions_add_up_to_the_raw_score():
    rows = demo_frame().sample(200, random_state=0)
    lgbm = model("lightgbm")
    X = feature_matrix(rows, lgbm.feature_columns)
    encoded = lgbm.estimator[:-1].transform(X)
    raw = lgbm.estimator[-1].predict(encoded, raw_score=True)
    bias = lgbm.estimator[-1].predict(encoded, pred_contrib=True)[:, -1]
    np.testing.assert_allclose(contributions(lgbm.estimator, X).sum(axis=1) + bias, raw, rtol=1e-6, atol=1e-6)
    logistic = model("logistic")
    X = feature_matrix(rows, logistic.feature_columns)
    clf = logistic.estimator[-1]
    logit = clf.decision_function(logistic.estimator[:-1].transform(X))
    np.testing.assert_allclose(contributions(logistic.estimator, X).sum(axis=1) + clf.intercept_[0], logit, atol=1e-8)


def test_forest_contributions_add_up_to_the_probability():
    rows = demo_frame().sample(200, random_state=0)
    forest = model("random_forest")
    X = feature_matrix(rows, forest.feature_columns)
    clf = forest.estimator[-1]
    root = np.mean([t.tree_.value[0, 0, 1] / t.tree_.value[0, 0].sum() for t in clf.estimators_])
    proba = forest.estimator.predict_proba(X)[:, 1]
    np.testing.assert_allclose(contributions(forest.estimator, X).sum(axis=1) + root, proba, atol=1e-9)


def test_ensemble_contributions_follow_their_members():
    rows = demo_frame().sample(300, random_state=0)
    parallel = model("parallel")
    X = feature_matrix(rows, parallel.feature_columns)
    c = contributions(parallel.estimator, X)
    # The mean of unit-L1 member contributions: at most 1 in L1 per row.
    assert np.all(np.abs(c).sum(axis=1) <= 1 + 1e-9)
    cascade = model("cascade")
    _, kept, _ = cascade.estimator.stage_probabilities(X)
    c = contributions(cascade.estimator, X)
    np.testing.assert_allclose(c[kept], contributions(cascade.estimator.second_, X.loc[kept]))
    np.testing.assert_allclose(c[~kept], contributions(cascade.estimator.first_, X.loc[~kept]))


def test_one_row_categorical_values_and_empty_frames():
    row = about_to_fail().head(1)
    out = explain(model("logistic"), row, top=400)  # more than there are features: all of them
    assert len(out) == len(model("logistic").feature_columns)
    assert out.loc[out["feature"] == "gpu_model", "value"].item() == row["gpu_model"].item()
    assert len(explain(model("lightgbm"), row.head(0))) == 0
    with pytest.raises(InputError, match="top"):
        explain(model("lightgbm"), row, top=0)
