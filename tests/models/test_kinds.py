"""The model kinds: every kind builds, fits and scores; defaults, weights, constraints and the
ensembles' member settings reach the estimators `make_model` builds."""

import numpy as np
import pandas as pd
import pytest
from sklearn.base import clone

from models.estimators import balanced_pos_weight
from models.kinds import KINDS, THREADED_KINDS, kind_params, make_model, member_kinds, member_params

FAST = {
    "lightgbm": {"n_jobs": 1, "n_estimators": 30},
    "xgboost": {"n_jobs": 1, "n_estimators": 30},
    "random_forest": {"n_jobs": 1, "n_estimators": 20},
    "logistic": {},
    "mlp": {"max_iter": 40},
    "parallel": {"n_jobs": 1, "member_params": {"lightgbm": {"n_estimators": 30}, "xgboost": {"n_estimators": 30}}},
    "cascade": {"n_jobs": 1, "member_params": {"lightgbm": {"n_estimators": 30}}},
}


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
    model = make_model(kind, pos_weight=balanced_pos_weight(y), **FAST[kind]).fit(X, y)
    proba = model.predict_proba(X)[:, 1]
    assert proba.shape == (len(X),) and np.all((proba >= 0) & (proba <= 1))
    # The categorical is learnt: H100 rows score higher on average.
    assert proba[X["gpu_model"] == "H100"].mean() > proba[X["gpu_model"] == "A100"].mean()
    unseen = X.head(5).assign(gpu_model="B200", driver="999")
    assert np.all(np.isfinite(model.predict_proba(unseen)[:, 1]))
    # clone gives an unfitted copy with the same parameters (the scikit-learn estimator contract).
    fresh = clone(model)
    assert type(fresh) is type(model) and sorted(fresh.get_params()) == sorted(model.get_params())
    if "model" in model.get_params():
        assert fresh.get_params()["model"].get_params() == model.get_params()["model"].get_params()


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
    with pytest.raises(ValueError, match="members: expected a list of at least two kinds"):
        make_model("parallel", members=["lightgbm", "svm"])
    with pytest.raises(ValueError, match="at least two"):
        make_model("parallel", members=["lightgbm"])


def test_every_kind_weights_positives_by_the_same_factor():
    models = {kind: make_model(kind, pos_weight=4.0).named_steps["model"] for kind in ("lightgbm", "xgboost")}
    assert models["lightgbm"].get_params()["scale_pos_weight"] == 4.0
    assert models["xgboost"].get_params()["scale_pos_weight"] == 4.0
    assert make_model("random_forest", pos_weight=4.0).named_steps["model"].class_weight == {0: 1.0, 1: 4.0}
    assert make_model("logistic", pos_weight=4.0).named_steps["model"].class_weight == {0: 1.0, 1: 4.0}
    assert make_model("mlp", pos_weight=4.0).named_steps["model"].pos_weight == 4.0
    parallel = make_model("parallel", pos_weight=4.0, members=["random_forest", "mlp"])
    assert [name for name, _ in parallel.estimators] == ["random_forest", "mlp"]
    assert parallel.estimators[1][1].named_steps["model"].pos_weight == 4.0
    cascade = make_model("cascade", pos_weight=4.0, first="lightgbm", second="logistic", n_jobs=1)
    assert cascade.first.named_steps["model"].get_params()["n_jobs"] == 1
    assert cascade.second.named_steps["model"].class_weight == {0: 1.0, 1: 4.0}


def test_monotone_constraints_reach_every_kind_that_supports_them():
    columns = ["x", "noise", "gpu_model", "driver"]
    lgbm = make_model("lightgbm", monotone_increasing=["x"], columns=columns).named_steps["model"]
    assert lgbm.get_params()["monotone_constraints"] == [1, 0, 0, 0]
    xgb = make_model("xgboost", monotone_increasing=["x"], columns=columns).named_steps["model"]
    assert xgb.get_params()["monotone_constraints"] == "(1,0,0,0)"
    forest = make_model("random_forest", monotone_increasing=["x"], columns=columns).named_steps["model"]
    assert forest.monotonic_cst == [1, 0, 0, 0]
    assert make_model("logistic", monotone_increasing=["x"]).named_steps["model"].increasing == ("x",)
    with pytest.raises(ValueError, match="cannot be constrained"):
        make_model("mlp", monotone_increasing=["x"], columns=columns)
    with pytest.raises(ValueError, match="need `columns`"):
        make_model("lightgbm", monotone_increasing=["x"])
    with pytest.raises(ValueError, match="not feature columns"):
        make_model("lightgbm", monotone_increasing=["y"], columns=columns)


def test_cascade_stage_params_reach_one_stage_only():
    cascade = make_model(
        "cascade",
        first="lightgbm",
        second="lightgbm",
        member_params={"lightgbm": {"num_leaves": 15}},
        first_params={"n_estimators": 20, "num_leaves": 7},
    )
    first, second = cascade.first.named_steps["model"], cascade.second.named_steps["model"]
    assert (first.n_estimators, first.num_leaves) == (20, 7)  # a small, cheap first stage
    assert (second.n_estimators, second.num_leaves) == (100, 15)


def test_ensemble_settings_resolve_into_each_members_parameters():
    params = {
        "members": ["lightgbm", "logistic", "lightgbm"],
        "n_jobs": 1,
        "member_params": {"lightgbm": {"num_leaves": 7}},
    }
    assert member_params("parallel", params) == [
        ("lightgbm", {"num_leaves": 7, "n_jobs": 1}),
        ("logistic", {}),  # takes no threads
        ("lightgbm", {"num_leaves": 7, "n_jobs": 1}),
    ]
    cascade = {"second": "xgboost", "first_params": {"C": 1.0}, "second_params": {"max_depth": 3}}
    assert member_params("cascade", cascade) == [("logistic", {"C": 1.0}), ("xgboost", {"max_depth": 3})]
    assert THREADED_KINDS == ("lightgbm", "xgboost", "random_forest")
    assert kind_params("lightgbm", {"n_estimators": 7})["n_estimators"] == 7
    assert kind_params("parallel")["members"] == ["lightgbm", "xgboost", "logistic"]
    with pytest.raises(ValueError, match="ensemble kind"):
        member_params("lightgbm")


def test_member_kinds_are_single_kinds_or_a_clear_error():
    assert member_kinds("mlp") == ["mlp"]
    assert member_kinds("parallel") == ["lightgbm", "xgboost", "logistic"]
    assert member_kinds("cascade", {"first": "lightgbm"}) == ["lightgbm", "lightgbm"]
    with pytest.raises(ValueError, match="model kind: expected one of"):
        member_kinds("svm")
    with pytest.raises(
        ValueError, match=r"members: expected a list of at least two kinds .*got \['lightgbm', 'cascade'\]"
    ):
        member_kinds("parallel", {"members": ["lightgbm", "cascade"]})
    with pytest.raises(ValueError, match="members: expected a list"):
        member_kinds("parallel", {"members": "lightgbm"})
    with pytest.raises(ValueError, match="second: expected one of"):
        member_kinds("cascade", {"second": "parallel"})
    with pytest.raises(ValueError, match="cascade ensemble first: expected one of"):
        make_model("cascade", first="svm")
