import numpy as np
import pandas as pd
import pytest
from sklearn.utils import get_tags
from sklearn.utils.estimator_checks import parametrize_with_checks

from models.ensemble import CascadeEnsemble, ParallelEnsemble
from models.estimators import (
    MAX_POS_WEIGHT,
    CategoryCodes,
    OversampledMLP,
    SignConstrainedLogistic,
    balanced_pos_weight,
    compress_tails,
    odds_factor,
    prior_correction,
)
from models.kinds import make_model


def test_oversampling_weights_the_mlp_like_a_class_weight():
    # With positives weighted w, the fitted odds are ~w times the true odds: the same
    # overstatement prior_correction divides out for the other kinds.
    rng = np.random.default_rng(0)
    X = rng.normal(size=(20_000, 2))
    y = (rng.random(20_000) < 0.05).astype(int)  # pure noise: the best model predicts the base rate
    plain = OversampledMLP(hidden_layer_sizes=(4,), max_iter=5, pos_weight=1.0).fit(X, y)
    weighted = OversampledMLP(hidden_layer_sizes=(4,), max_iter=5, pos_weight=5.0).fit(X, y)
    p1, p5 = plain.predict_proba(X)[:, 1].mean(), weighted.predict_proba(X)[:, 1].mean()
    assert 0.03 < p1 < 0.08
    assert 0.03 < prior_correction(np.array([p5]), 5.0)[0] < 0.08
    with pytest.raises(ValueError, match="pos_weight"):
        OversampledMLP(pos_weight=0.5).fit(X, y)


def test_sign_constrained_logistic_never_gives_a_named_input_a_negative_weight():
    rng = np.random.default_rng(1)
    X = pd.DataFrame({"good": rng.normal(size=2000), "numeric__bad": rng.normal(size=2000)})
    y = (X["good"] - X["numeric__bad"] + rng.normal(0, 0.5, 2000) > 0).astype(int)
    free = SignConstrainedLogistic().fit(X, y)
    assert free.coef_[0][1] < -1
    constrained = SignConstrainedLogistic(increasing=("bad",)).fit(X, y)
    assert constrained.coef_[0][1] == 0.0 and constrained.zeroed_.tolist() == [False, True]
    assert constrained.coef_[0][0] > 1  # the unconstrained input keeps its weight
    raised = X.assign(numeric__bad=X["numeric__bad"] + 3)
    assert np.all(constrained.predict_proba(raised)[:, 1] >= constrained.predict_proba(X)[:, 1])
    with pytest.raises(ValueError, match="DataFrame"):
        SignConstrainedLogistic(increasing=("bad",)).fit(X.to_numpy(), y)


def test_sign_constrained_logistic_unconstrained_is_scikit_learns_logistic_regression():
    # The same objective (class-weighted log loss times C plus half the squared coefficients),
    # solved by L-BFGS-B on float32 rows: the coefficients of LogisticRegression to solver precision.
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(2)
    X = pd.DataFrame(rng.normal(size=(4000, 6)), columns=[f"x{i}" for i in range(6)])
    y = (X["x0"] - 0.5 * X["x3"] + rng.normal(0, 1.0, 4000) > 1.5).astype(int)
    X.loc[:40, "x3"] *= 20.0  # some rows out in the tails
    weights = {0: 1.0, 1: 4.0}
    ours = SignConstrainedLogistic(C=0.3, class_weight=weights, tol=1e-8, tail_from=None).fit(X, y)
    theirs = LogisticRegression(C=0.3, class_weight=weights, tol=1e-10, max_iter=10_000).fit(X, y)
    np.testing.assert_allclose(ours.coef_, theirs.coef_, atol=1e-4)
    np.testing.assert_allclose(ours.intercept_, theirs.intercept_, atol=1e-4)
    assert not ours.zeroed_.any()
    # With the tails compressed (the default), the same model of the compressed inputs.
    compressed = pd.DataFrame(compress_tails(X.to_numpy(copy=True), 3.0), columns=X.columns)
    assert (compressed["x3"] != X["x3"]).sum() > 20
    tails = SignConstrainedLogistic(C=0.3, class_weight=weights, tol=1e-8).fit(X, y)
    theirs = LogisticRegression(C=0.3, class_weight=weights, tol=1e-10, max_iter=10_000).fit(compressed, y)
    np.testing.assert_allclose(tails.coef_, theirs.coef_, atol=1e-4)
    np.testing.assert_allclose(tails.decision_function(X), theirs.decision_function(compressed), atol=1e-3)
    assert not np.allclose(tails.coef_, ours.coef_, atol=1e-3)


def test_sign_constrained_logistic_warns_when_it_stops_before_converging():
    from sklearn.exceptions import ConvergenceWarning

    rng = np.random.default_rng(3)
    X = pd.DataFrame(rng.normal(size=(500, 4)), columns=list("abcd"))
    y = (X["a"] + rng.normal(0, 0.5, 500) > 0).astype(int)
    with pytest.warns(ConvergenceWarning, match=r"max_iter=2 before converging \(C=1.0\)"):
        SignConstrainedLogistic(max_iter=2).fit(X, y)


def test_category_codes_are_those_learnt_at_fit_whatever_the_score_order():
    enc = CategoryCodes().fit(pd.DataFrame({"gpu_model": ["H100", "A100", "V100"], "v": [1.0, 2.0, 3.0]}))
    out = enc.transform(pd.DataFrame({"gpu_model": ["V100", "X", "A100"], "v": [0.0, 0.0, 0.0]}))
    assert out["gpu_model"].tolist()[0] == 2.0 and out["gpu_model"].tolist()[2] == 0.0
    assert np.isnan(out["gpu_model"].tolist()[1])


def test_category_codes_of_a_polars_frame_are_those_of_pandas():
    import polars as pl

    train = pl.DataFrame({"gpu_model": ["H100", "A100", "V100"], "v": [1.0, 2.0, 3.0]})
    score = pl.DataFrame({"gpu_model": ["V100", "X", "A100"], "v": [0.0, None, 0.0]})
    polars_enc = CategoryCodes().fit(train)
    assert polars_enc.categories_ == CategoryCodes().fit(train.to_pandas()).categories_
    out = polars_enc.transform(score)
    assert isinstance(out, pl.DataFrame) and out["gpu_model"].dtype == pl.Float32
    assert out["gpu_model"].to_list() == [2.0, None, 0.0]  # unseen: missing
    assert out["v"].to_list() == [0.0, None, 0.0]  # other columns untouched
    with pytest.raises(ValueError, match="expected columns"):
        polars_enc.transform(score.select("v"))


def test_lightgbm_fitted_from_polars_is_lightgbm_fitted_from_pandas():
    """The retrain's Arrow route (`split_xy_polars`) must give the trees the pandas route
    gives, nulls and unseen categories included."""
    import polars as pl

    from models.frame import split_xy, split_xy_polars

    rng = np.random.default_rng(0)
    n = 4000
    frame = pl.DataFrame(
        {
            "ts": pl.datetime_range(
                pl.datetime(2026, 1, 1),
                pl.datetime(2026, 1, 1) + pl.duration(hours=n - 1),
                "1h",
                eager=True,
                time_zone="UTC",
            ),
            "gpu_uuid": [f"GPU-{i % 50}" for i in range(n)],
            "gpu_model": rng.choice(["H100", "A100", None], n).tolist(),
            "a": rng.normal(size=n).astype(np.float32),
            "b": np.where(rng.random(n) < 0.2, np.nan, rng.normal(size=n)).astype(np.float32),
            "label": (rng.random(n) < 0.05).astype(np.int8),
        }
    ).with_columns(
        pl.col("b").fill_nan(None),
        pl.when(pl.int_range(n) % 97 == 0).then(None).otherwise(pl.col("label")).alias("label"),
    )
    Xp, yp, _ = split_xy_polars(frame)
    Xd, yd, _ = split_xy(frame.to_pandas())
    assert list(Xp.columns) == list(Xd.columns) and np.array_equal(yp, yd)
    fitted = [make_model("lightgbm", n_estimators=20, n_jobs=1).fit(X, y) for X, y in ((Xp, yp), (Xd, yd))]
    probe = Xd.assign(gpu_model=np.where(np.arange(len(Xd)) % 3 == 0, "B200", Xd["gpu_model"]))
    np.testing.assert_array_equal(fitted[0].predict_proba(probe), fitted[1].predict_proba(probe))


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


def test_the_odds_factor_is_the_class_weight_over_the_share_of_negatives_kept():
    assert odds_factor(4.0, 1.0) == 4.0
    assert odds_factor(4.0, 0.1) == pytest.approx(40.0)
    # A model trained so and corrected by it gives back the probability of the full data.
    true_p = np.array([0.002, 0.05])
    odds = true_p / (1 - true_p) * odds_factor(4.0, 0.1)
    np.testing.assert_allclose(prior_correction(odds / (1 + odds), odds_factor(4.0, 0.1)), true_p)


def _tiny_members() -> list[tuple[str, object]]:
    from sklearn.linear_model import LogisticRegression
    from sklearn.tree import DecisionTreeClassifier

    return [("logistic", LogisticRegression()), ("tree", DecisionTreeClassifier(max_depth=3, random_state=0))]


_CASCADE_EXPECTED_FAILURES = {
    "check_positive_only_tag_during_fit": (
        "the cascade fits its first stage out of fold, on the rows outside each block; with one class "
        "only it refuses with a ValueError naming the fold (tested in test_ensemble) instead of the "
        "error the check looks for"
    ),
}


def _expected_failures(estimator: object) -> dict[str, str]:
    return _CASCADE_EXPECTED_FAILURES if isinstance(estimator, CascadeEnsemble) else {}


@parametrize_with_checks(
    [
        ParallelEnsemble(estimators=_tiny_members(), combine="rank_average", top_k=3),
        ParallelEnsemble(estimators=_tiny_members(), combine="top_k_intersection", top_k=3),
        CascadeEnsemble(first=_tiny_members()[0][1], second=_tiny_members()[1][1], target_recall=0.9),
        SignConstrainedLogistic(),
        OversampledMLP(hidden_layer_sizes=(8,), max_iter=50, pos_weight=2.0),
    ],
    expected_failed_checks=_expected_failures,
)
def test_the_ensembles_and_custom_estimators_keep_the_scikit_learn_contract(estimator, check):
    check(estimator)
    assert get_tags(estimator).classifier_tags.multi_class is False  # binary: "fails" or not


def test_sign_constrained_logistic_gives_extreme_rows_a_risk_without_an_overflow_warning():
    import warnings

    rng = np.random.default_rng(2)
    X = pd.DataFrame({"a": rng.normal(size=500), "b": rng.normal(size=500)})
    y = (X["a"] + rng.normal(0, 0.5, 500) > 0).astype(int)
    model = SignConstrainedLogistic().fit(X, y)
    extreme = pd.DataFrame({"a": [-1e6, 1e6], "b": [0.0, 0.0]})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        p = model.predict_proba(extreme)[:, 1]
    # Held to the training range: the risk of the most extreme row trained on, not 0 or 1.
    edges = model.predict_proba(pd.DataFrame({"a": [X["a"].min(), X["a"].max()], "b": [0.0, 0.0]}))[:, 1]
    np.testing.assert_allclose(p, edges)
    assert p[0] < 0.05 and 0.95 < p[1] < 1.0


def test_sign_constrained_logistic_never_saturates_on_rows_far_outside_its_training_range():
    # A heavy-tailed counter: rows of a scored week reach a hundred times the training maximum.
    # Without holding inputs to their training range the decision function passed 37, where
    # the probability is exactly 1.0 and every such row shared one risk.
    rng = np.random.default_rng(4)
    X = pd.DataFrame({"count": rng.exponential(1.0, 2000), "temp": rng.normal(size=2000)})
    y = (X["count"] + X["temp"] + rng.normal(0, 1.0, 2000) > 3).astype(int)
    model = SignConstrainedLogistic(C=10.0).fit(X, y)
    scored = pd.DataFrame({"count": [400.0, 500.0, 600.0], "temp": [-1.0, 0.0, 1.0]})
    z = model.decision_function(scored)
    assert z.max() < 37.0
    p = model.predict_proba(scored)[:, 1]
    assert p.max() < 1.0 and len(np.unique(p)) == 3  # ordered by their other input, not tied
    assert np.all(np.diff(p) > 0)


def test_compress_tails_leaves_the_bulk_and_grows_the_tails_with_the_log_of_the_distance():
    x = np.array([-103.0, -4.0, -3.0, -1.5, 0.0, 2.999, 3.0, 3.5, 13.0, 1e6], dtype=np.float32)
    z = compress_tails(x.copy(), 3.0)
    np.testing.assert_array_equal(z[2:7], x[2:7])  # within the edge: unchanged
    np.testing.assert_allclose(z[[0, 1, 8]], [-(3 + np.log(101)), -(3 + np.log(2)), 3 + np.log(11)], rtol=1e-6)
    assert np.all(np.diff(z) > 0)  # monotone, so a sign constraint keeps its meaning
    assert z[-1] < 20.0  # a million standard deviations out is about 16.8
    # Continuous with slope 1 at the edge.
    assert compress_tails(np.array([3.0 + 1e-6]), 3.0)[0] == pytest.approx(3.0 + 1e-6, abs=1e-9)
    assert x[0] == -103.0  # the copy was written, not x
    assert compress_tails(x, 3.0) is x and x[0] == z[0]  # in place


def test_sign_constrained_logistic_keeps_the_risks_of_rows_far_out_on_several_counters_apart():
    from sklearn.metrics import roc_auc_score

    # Rare failures and counters that are zero on most rows: a few rows lie a hundred or more
    # standard deviations out on several at once. The linear model extrapolates them to a
    # decision function of hundreds (probability exactly 1.0, every such row tied); with the
    # tails compressed the same rows keep distinct risks below 1, in the same order.
    rng = np.random.default_rng(6)
    n = 20_000
    counts = (rng.random((n, 4)) < 0.003) * np.ceil(rng.pareto(0.8, size=(n, 4)))  # mostly 1-3, a few thousands
    z = (counts - counts.mean(axis=0)) / counts.std(axis=0)
    X = pd.DataFrame(z, columns=["xid", "dbe", "sbe", "retired"])
    y = (rng.random(n) < np.where((counts > 0).any(axis=1), 0.6, 0.003)).astype(int)
    linear = SignConstrainedLogistic(C=1.0, tail_from=None).fit(X, y)
    compressed = SignConstrainedLogistic(C=1.0).fit(X, y)
    far = np.unique(z[np.argsort(-np.abs(z).sum(axis=1))[:20]], axis=0)  # the distinct rows furthest out
    assert linear.decision_function(far).max() > 37.0
    assert (linear.predict_proba(far)[:, 1] == 1.0).any()
    risk = compressed.predict_proba(far)[:, 1]
    assert compressed.decision_function(far).max() < 10.0
    assert len(np.unique(risk)) == len(far) and risk.max() < 1.0
    # Ranking all rows as well as before.
    assert roc_auc_score(y, compressed.decision_function(X)) > roc_auc_score(y, linear.decision_function(X)) - 0.01
    with pytest.raises(ValueError, match=r"tail_from expected a positive number of standard deviations or None, got 0"):
        SignConstrainedLogistic(tail_from=0).fit(X, y)


def test_sign_constrained_logistic_chooses_its_regularisation_on_the_last_rows():
    from sklearn.metrics import log_loss

    rng = np.random.default_rng(5)
    n = 3000
    X = pd.DataFrame(rng.normal(size=(n, 30)), columns=[f"x{i}" for i in range(30)])
    y = (X["x0"] + rng.normal(0, 1.5, n) > 2.0).astype(int).to_numpy()
    candidates = [1e-4, 0.03, 100.0]
    model = SignConstrainedLogistic(C=candidates, validation_share=0.25).fit(X, y)
    cut = round(n * 0.75)
    losses = {}
    for C in candidates:
        alone = SignConstrainedLogistic(C=C).fit(X.iloc[:cut], y[:cut])
        losses[C] = log_loss(y[cut:], alone.predict_proba(X.iloc[cut:])[:, 1])
    assert model.validation_loss_ == pytest.approx(losses, rel=1e-6)
    assert model.C_ == min(losses, key=losses.__getitem__) != 1e-4
    # Then refit on every row with the chosen value.
    np.testing.assert_allclose(model.coef_, SignConstrainedLogistic(C=model.C_).fit(X, y).coef_)
    with pytest.raises(ValueError, match=r"C expected a positive number or a list of them, got \[0.1, -1.0\]"):
        SignConstrainedLogistic(C=[0.1, -1.0]).fit(X, y)
