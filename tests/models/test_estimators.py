import numpy as np
import pandas as pd
import pytest
from sklearn.base import clone

from models.estimators import (
    KINDS,
    MAX_POS_WEIGHT,
    CategoryCodes,
    balanced_pos_weight,
    make_model,
    prior_correction,
)


def small_xy(n: int = 600, seed: int = 0) -> tuple[pd.DataFrame, np.ndarray]:
    rng = np.random.default_rng(seed)
    model = rng.choice(["A100", "H100"], n)
    x = rng.normal(size=n).astype(np.float32)
    x[rng.random(n) < 0.1] = np.nan
    y = ((np.nan_to_num(x) + (model == "H100") * 1.5 + rng.normal(0, 0.5, n)) > 1.8).astype(int)
    X = pd.DataFrame({"x": x, "noise": rng.normal(size=n).astype(np.float32), "gpu_model": model.astype(object)})
    X["driver"] = np.array(["550"] * n, dtype=object)
    return X, y


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_fits_and_scores_with_nan_and_unseen_categories(kind):
    X, y = small_xy()
    model = make_model(kind, pos_weight=balanced_pos_weight(y), **({} if kind == "logistic" else {"n_jobs": 1})).fit(
        X, y
    )
    proba = model.predict_proba(X)[:, 1]
    assert proba.shape == (len(X),) and np.all((proba >= 0) & (proba <= 1))
    # The categorical is learnt: H100 rows score higher on average.
    assert proba[X["gpu_model"] == "H100"].mean() > proba[X["gpu_model"] == "A100"].mean()
    unseen = X.head(5).assign(gpu_model="B200", driver="999")
    assert np.all(np.isfinite(model.predict_proba(unseen)[:, 1]))
    # clone gives an unfitted copy with the same parameters (CONVENTIONS.md 6).
    assert clone(model).get_params()["model"].get_params() == model.get_params()["model"].get_params()


def test_lightgbm_gets_the_parameters_that_avoid_the_imbalance_trap():
    X, y = small_xy()
    model = make_model("lightgbm", pos_weight=7.0, n_estimators=5).fit(X, y)
    # The parameters as LightGBM resolved them (aliases included) are in the model text.
    text = model.named_steps["model"].booster_.model_to_string().splitlines()
    for line in ["[lambda_l2: 1]", "[min_sum_hessian_in_leaf: 1]", "[scale_pos_weight: 7]", "[num_threads: 2]"]:
        assert line in text


def test_xgboost_is_hist_with_the_given_weight():
    model = make_model("xgboost", pos_weight=5.0)
    clf = model.named_steps["model"]
    assert clf.get_params()["tree_method"] == "hist"
    assert clf.get_params()["scale_pos_weight"] == 5.0
    assert clf.get_params()["n_jobs"] == 2


def test_user_params_override_defaults():
    assert make_model("lightgbm", n_estimators=7).named_steps["model"].get_params()["n_estimators"] == 7


def test_unknown_kind_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="lightgbm"):
        make_model("forest")


def test_category_codes_are_those_learnt_at_fit_whatever_the_score_order():
    enc = CategoryCodes().fit(pd.DataFrame({"gpu_model": ["H100", "A100", "V100"], "v": [1.0, 2.0, 3.0]}))
    out = enc.transform(pd.DataFrame({"gpu_model": ["V100", "X", "A100"], "v": [0.0, 0.0, 0.0]}))
    assert out["gpu_model"].tolist()[0] == 2.0 and out["gpu_model"].tolist()[2] == 0.0
    assert np.isnan(out["gpu_model"].tolist()[1])


def test_balanced_pos_weight_is_capped():
    assert balanced_pos_weight(np.array([0] * 30 + [1] * 10)) == 3.0
    assert balanced_pos_weight(np.array([0] * 100_000 + [1] * 10)) == MAX_POS_WEIGHT
    assert balanced_pos_weight(np.array([0, 0])) == 1.0


def test_prior_correction_undoes_the_weight_and_keeps_the_order():
    true_p = np.array([0.001, 0.01, 0.2])
    w = 10.0
    weighted = w * true_p / (w * true_p + 1 - true_p)  # what a w-weighted fit estimates
    np.testing.assert_allclose(prior_correction(weighted, w), true_p)
    assert np.all(np.diff(prior_correction(np.array([0.1, 0.5, 0.9]), 50.0)) > 0)
