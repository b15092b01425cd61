"""models.treeshap computes the libraries' own TreeSHAP values, another way."""

import threading

import lightgbm
import numpy as np
import pandas as pd
import pytest
import xgboost

from models.explain import contributions
from models.frame import feature_matrix
from models.treeshap import Unsupported, tree_shap


def wide_data(n: int = 3000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Six features, missing values and zeros; the label depends on several of them at once, so
    that trees split the same feature more than once on a path."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 6))
    X[:, 2] = np.round(X[:, 2])  # many exact zeros (LightGBM's "zero" missing type)
    X[rng.random(n) < 0.1, 1] = np.nan
    X[rng.random(n) < 0.05, 3] = np.nan
    logit = 1.5 * X[:, 0] - np.abs(X[:, 0]) + np.nan_to_num(X[:, 1]) * X[:, 4] + 0.5 * X[:, 2]
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    return X.astype(np.float32), y


@pytest.mark.parametrize("zero_as_missing", [False, True])
def test_lightgbm_values_equal_pred_contrib(zero_as_missing):
    X, y = wide_data()
    clf = lightgbm.LGBMClassifier(
        n_estimators=40, num_leaves=31, min_child_samples=5, zero_as_missing=zero_as_missing, verbose=-1, n_jobs=1
    ).fit(X, y)
    expected = clf.predict(X[:500], pred_contrib=True)
    got = tree_shap(clf).contributions(X[:500])
    np.testing.assert_allclose(got, expected[:, :-1], rtol=1e-9, atol=1e-12)
    # Blocks of rows on threads: each block's values are the same arithmetic, to the bit.
    assert np.array_equal(tree_shap(clf).contributions(X[:500], threads=1), got)
    assert np.array_equal(tree_shap(clf).contributions(X[:500], threads=3), got)
    # A feature split again further down a path is credited once per path, as the library does.
    assert max(clf.booster_.dump_model()["tree_info"], key=lambda t: t["num_leaves"])["num_leaves"] > 20


def test_blocks_of_rows_are_computed_on_the_threads_asked_for(monkeypatch):
    X, y = wide_data()
    clf = lightgbm.LGBMClassifier(n_estimators=5, num_leaves=7, verbose=-1, n_jobs=1).fit(X, y)
    shap = tree_shap(clf)
    threads: set[str] = set()
    edge_values = type(shap)._edge_values

    def recorded(self, rows):
        threads.add(threading.current_thread().name)
        return edge_values(self, rows)

    monkeypatch.setattr(type(shap), "_edge_values", recorded)
    shap.contributions(X[:1000], threads=2)
    assert threads and all(name.startswith("treeshap") for name in threads)
    threads.clear()
    shap.contributions(X[:1000], threads=1)
    assert threads == {threading.current_thread().name}


def test_xgboost_values_equal_pred_contribs():
    X, y = wide_data(seed=1)
    clf = xgboost.XGBClassifier(n_estimators=40, max_depth=7, n_jobs=1, verbosity=0).fit(X, y)
    expected = clf.get_booster().predict(xgboost.DMatrix(X[:500], missing=np.nan), pred_contribs=True)
    got = tree_shap(clf).contributions(X[:500])
    # XGBoost sums in float32; ours in float64.
    np.testing.assert_allclose(got, expected[:, :-1], rtol=1e-4, atol=1e-5)
    raw = clf.get_booster().predict(xgboost.DMatrix(X[:500], missing=np.nan), output_margin=True)
    np.testing.assert_allclose(got.sum(axis=1) + expected[:, -1], raw, atol=1e-4)


def test_a_single_leaf_tree_credits_nothing_and_the_reading_is_cached():
    X = np.zeros((50, 3), dtype=np.float32)
    y = np.r_[np.zeros(25), np.ones(25)].astype(int)
    clf = lightgbm.LGBMClassifier(n_estimators=3, verbose=-1, n_jobs=1).fit(X, y)  # nothing to split on
    shap = tree_shap(clf)
    assert shap is tree_shap(clf)
    np.testing.assert_array_equal(shap.contributions(X), np.zeros((50, 3)))


def test_wrong_width_and_unsupported_models():
    X, y = wide_data(n=500)
    clf = lightgbm.LGBMClassifier(n_estimators=5, verbose=-1, n_jobs=1).fit(X, y)
    with pytest.raises(ValueError, match="6 columns"):
        tree_shap(clf).contributions(X[:, :5])
    frame = pd.DataFrame(X, columns=[f"x{i}" for i in range(6)]).assign(c=pd.Categorical(np.arange(500) % 7))
    by_category = np.isin(np.arange(500) % 7, [1, 3, 5]).astype(int)  # only the category tells
    categorical = lightgbm.LGBMClassifier(n_estimators=5, min_child_samples=5, verbose=-1, n_jobs=1)
    categorical.fit(frame, by_category)
    with pytest.raises(Unsupported):
        tree_shap(categorical)
    with pytest.raises(Unsupported):
        tree_shap(object())


def test_explain_uses_it_and_matches_the_library_on_a_trained_model():
    from tests.models import demo_frame
    from tests.models.test_explain import model

    lgbm = model("lightgbm")
    rows = demo_frame().sample(300, random_state=1)
    X = feature_matrix(rows, lgbm.feature_columns)
    expected = lgbm.estimator[-1].predict(lgbm.estimator[:-1].transform(X), pred_contrib=True)[:, :-1]
    np.testing.assert_allclose(contributions(lgbm.estimator, X), expected, rtol=1e-9, atol=1e-12)
