import logging

import numpy as np
import pandas as pd
import pytest
from sklearn.base import BaseEstimator, ClassifierMixin, clone
from sklearn.linear_model import LogisticRegression
from sklearn.tree import DecisionTreeClassifier

from models.ensemble import (
    CascadeEnsemble,
    ParallelEnsemble,
    assign_by_rank,
    check_combination,
    combine_probabilities,
    combine_rankings,
    group_ranks,
    intersection_flags,
)


class FixedScores(ClassifierMixin, BaseEstimator):
    """A 'model' whose probability is the value of one column: hand-made rankings."""

    def __init__(self, column: str = "a") -> None:
        self.column = column

    def fit(self, X, y):
        self.classes_ = np.unique(y)
        return self

    def predict_proba(self, X):
        p = np.asarray(X[self.column], dtype=float)
        return np.column_stack([1 - p, p])


def test_group_ranks_are_within_each_scoring_time_with_shared_ties():
    scores = np.array([0.9, 0.1, 0.5, 0.5, 0.2, 0.7])
    groups = np.array([0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(group_ranks(scores, groups), [1, 3, 2, 2, 3, 1])
    np.testing.assert_array_equal(group_ranks(np.array([0.3, 0.3, 0.1]), np.zeros(3)), [1.5, 1.5, 3])


def test_top_k_intersection_puts_gpus_in_every_top_k_first_then_mean_rank():
    # Five GPUs, three members. Top 2 of each: m1 {0, 1}, m2 {1, 0}, m3 {1, 2}: only GPU 1 is
    # in all of them. GPU 2 has the best mean rank of the rest, though it is in one top 2 only.
    ranks = np.array(
        [
            [1, 2, 3, 4, 5],
            [2, 1, 4, 5, 3],
            [4, 1, 2, 3, 5],
        ],
        dtype=float,
    )
    key = combine_rankings(ranks, "top_k_intersection", top_k=2)
    assert np.argsort(key, kind="stable").tolist() == [1, 0, 2, 3, 4]
    # rank_average ignores membership of the top K: GPU 1 (mean 1.33) then 0 (2.33), 2 (3) ...
    assert np.argsort(combine_rankings(ranks, "rank_average", top_k=2), kind="stable").tolist() == [1, 0, 2, 3, 4]
    # A GPU in every top K outranks one with a better mean rank that misses one member's top K.
    ranks = np.array([[1, 3, 2], [1, 3, 2], [9, 3, 2]], dtype=float)
    assert np.argsort(combine_rankings(ranks, "top_k_intersection", top_k=3), kind="stable").tolist()[0] == 2
    assert np.argsort(combine_rankings(ranks, "rank_average", top_k=3), kind="stable").tolist()[0] == 2
    ranks = np.array([[1, 2], [1, 2], [3, 2]], dtype=float)
    assert np.argsort(combine_rankings(ranks, "rank_average", top_k=2)).tolist() == [0, 1]  # mean 1.67 < 2
    assert np.argsort(combine_rankings(ranks, "top_k_intersection", top_k=2)).tolist() == [1, 0]  # 0 misses m3
    with pytest.raises(ValueError, match="combine"):
        combine_rankings(ranks, "majority", top_k=2)


def test_the_intersection_flags_only_gpus_in_every_members_top_k_by_hand():
    # Two scoring times. At t0 (six GPUs), top 2 of m1 {0, 1}, m2 {1, 3}, m3 {1, 0}: only GPU 1
    # is in all three, so one GPU is flagged, not K = 2: nothing fills the second place.
    # At t1 (four GPUs), m1 {0, 1}, m2 {0, 1}, m3 {1, 0}: GPUs 0 and 1 both.
    m1 = [0.9, 0.8, 0.1, 0.2, 0.0, 0.3, 0.7, 0.6, 0.1, 0.2]
    m2 = [0.2, 0.9, 0.1, 0.8, 0.3, 0.0, 0.9, 0.5, 0.4, 0.1]
    m3 = [0.7, 0.9, 0.5, 0.1, 0.2, 0.3, 0.6, 0.8, 0.1, 0.0]
    time = np.array([0] * 6 + [1] * 4)
    flags = intersection_flags(np.array([m1, m2, m3]), time, top_k=2)
    assert np.flatnonzero(flags).tolist() == [1, 6, 7]
    # Top 1: at t0 no GPU is first for every member; at t1 none either (m3 puts GPU 7 first).
    assert not intersection_flags(np.array([m1, m2, m3]), time, top_k=1).any()
    # Ties: three GPUs tied at the top of m1 share rank 2, outside a top 1 and inside a top 2.
    tied = np.array([[0.5, 0.5, 0.5, 0.1], [0.9, 0.8, 0.1, 0.2]])
    assert intersection_flags(tied, None, top_k=1).tolist() == [False] * 4
    assert intersection_flags(tied, None, top_k=2).tolist() == [True, True, False, False]
    # The fitted ensemble flags the same rows, whatever it orders its probabilities by.
    X = hand_made(ts=time.tolist(), a=m1, b=m2, c=m3)
    for combine in ("top_k_intersection", "rank_average"):
        model = fixed_parallel(combine, top_k=2).fit(X, np.array([0, 1] * 5))
        np.testing.assert_array_equal(model.flags(X), flags)


def test_probabilities_are_handed_out_in_ranking_order_within_each_time():
    values = np.array([0.1, 0.4, 0.2, 0.9, 0.3])
    key = np.array([3.0, 1.0, 2.0, 1.0, 1.0])  # group 0: rows 0-2, group 1: rows 3-4 (tied)
    groups = np.array([0, 0, 0, 1, 1])
    out = assign_by_rank(values, key, groups)
    np.testing.assert_allclose(out, [0.1, 0.4, 0.2, 0.6, 0.6])
    assert sorted(out[:3]) == sorted(values[:3])  # the same set of probabilities per time


def hand_made(ts: list[int], a: list[float], b: list[float], c: list[float]) -> pd.DataFrame:
    return pd.DataFrame(
        {"a": a, "b": b, "c": c, "ts": pd.Timestamp("2026-01-01", tz="UTC") + pd.to_timedelta(ts, unit="h")}
    )


def two_scoring_times() -> pd.DataFrame:
    """Three GPUs at each of two scoring times, with hand-made member probabilities a, b, c."""
    return hand_made(
        ts=[0, 0, 0, 1, 1, 1],
        a=[0.9, 0.5, 0.1, 0.02, 0.01, 0.03],
        b=[0.8, 0.6, 0.2, 0.01, 0.03, 0.02],
        c=[0.1, 0.6, 0.5, 0.03, 0.02, 0.01],
    )


def fixed_parallel(combine: str, top_k: int) -> ParallelEnsemble:
    members = [("a", FixedScores("a")), ("b", FixedScores("b")), ("c", FixedScores("c"))]
    return ParallelEnsemble(estimators=members, combine=combine, top_k=top_k)


def test_parallel_ensemble_ranks_within_each_scoring_time():
    X = two_scoring_times()
    model = fixed_parallel("top_k_intersection", top_k=2).fit(X, np.array([1, 0, 0, 1, 0, 0]))
    p = model.predict_proba(X)[:, 1]
    # ts 0: top 2 of a {0, 1}, b {0, 1}, c {1, 2}: GPU 1 alone is in all, so it ranks first
    # although GPU 0 has the higher mean probability; it gets the highest mean probability.
    means = X[["a", "b", "c"]].mean(axis=1).to_numpy()
    assert p[1] == pytest.approx(means[0]) and p[0] == pytest.approx(means[1]) and p[2] == pytest.approx(means[2])
    # ts 1 is ranked on its own: its probabilities are its own members', not ts 0's.
    assert sorted(p[3:]) == pytest.approx(sorted(means[3:]))
    # A GPU scored alone gets its members' mean probability.
    assert model.predict_proba(X.iloc[[2]])[:, 1] == pytest.approx(means[2])
    soft = fixed_parallel("rank_average", top_k=2).fit(X, np.array([1, 0, 0, 1, 0, 0])).predict_proba(X)[:, 1]
    # Mean ranks at ts 0: GPUs 0 and 1 tie at 5/3 (they share their two mean probabilities), GPU 2 8/3.
    assert soft[0] == soft[1] == pytest.approx((means[0] + means[1]) / 2) and soft[2] == pytest.approx(means[2])


def test_parallel_ensemble_members_never_see_the_time_column():
    X = hand_made(ts=[0, 0, 1, 1], a=[0.1, 0.2, 0.3, 0.4], b=[0.5, 0.1, 0.2, 0.3], c=[0.1, 0.2, 0.3, 0.4])
    model = ParallelEnsemble(estimators=[("lr", LogisticRegression()), ("tree", DecisionTreeClassifier())])
    model.fit(X, [0, 1, 0, 1])
    assert [list(m.feature_names_in_) for m in model.estimators_] == [["a", "b", "c"]] * 2
    assert list(model.feature_names_in_) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="combine"):
        ParallelEnsemble(estimators=model.estimators, combine="vote").fit(X, [0, 1, 0, 1])
    with pytest.raises(ValueError, match="top_k"):
        ParallelEnsemble(estimators=model.estimators, top_k=0).fit(X, [0, 1, 0, 1])
    with pytest.raises(ValueError, match="top_k"):
        ParallelEnsemble(estimators=model.estimators, top_k=True).fit(X, [0, 1, 0, 1])


def test_the_combination_of_members_probabilities_is_what_the_fitted_ensemble_scores():
    X = two_scoring_times()
    members = X[["a", "b", "c"]].to_numpy().T
    for combine in ("top_k_intersection", "rank_average"):
        model = fixed_parallel(combine, top_k=2).fit(X, np.array([1, 0, 0, 1, 0, 0]))
        combined = combine_probabilities(members, X["ts"].to_numpy(), combine, 2)
        np.testing.assert_array_equal(combined, model.predict_proba(X)[:, 1])
        # Times given as integers (the walk-forward's nanoseconds) group the rows alike.
        by_ns = combine_probabilities(members, X["ts"].to_numpy().astype("datetime64[ns]").astype(np.int64), combine, 2)
        np.testing.assert_array_equal(by_ns, combined)
    # Without times, all rows are one scoring time.
    one = combine_probabilities(members, None, "top_k_intersection", 2)
    np.testing.assert_array_equal(one, combine_probabilities(members, np.zeros(6), "top_k_intersection", 2))


@pytest.mark.parametrize(
    ("combine", "top_k", "message"),
    [("vote", 3, "combine: expected one of"), ("rank_average", 0, "top_k"), ("rank_average", 2.5, "top_k")],
)
def test_a_bad_combination_is_refused_naming_the_setting(combine, top_k, message):
    with pytest.raises(ValueError, match=message):
        check_combination(combine, top_k)
    check_combination("rank_average", np.int64(3))  # numpy integers are whole numbers too


def planted(n_times: int = 60, n_gpus: int = 50, seed: int = 0) -> tuple[pd.DataFrame, np.ndarray]:
    """A time series of GPUs in which `signal` predicts failure noisily, `noise` does not."""
    rng = np.random.default_rng(seed)
    n = n_times * n_gpus
    signal = rng.normal(size=n)
    y = (signal + rng.normal(0, 0.7, n) > 2.0).astype(int)
    X = pd.DataFrame(
        {
            "signal": signal,
            "noise": rng.normal(size=n),
            "ts": np.repeat(pd.date_range("2026-01-01", periods=n_times, freq="h", tz="UTC"), n_gpus),
        }
    )
    return X, y


def cascade(**kwargs) -> CascadeEnsemble:
    return CascadeEnsemble(
        first=LogisticRegression(), second=DecisionTreeClassifier(max_depth=4, random_state=0), **kwargs
    )


def out_of_fold(X: pd.DataFrame, y: np.ndarray, gap: pd.Timedelta, folds: int = 3) -> np.ndarray:
    """The first stage's out-of-fold probabilities, by hand: blocks of whole scoring times,
    each scored by a logistic regression fit on the rows more than `gap` away from it."""
    times = np.sort(X["ts"].unique())
    block_of_time = {t: min(i * folds // len(times), folds - 1) for i, t in enumerate(times)}
    block = X["ts"].map(block_of_time).to_numpy()
    out = np.full(len(y), np.nan)
    for f in range(folds):
        inside = X["ts"][block == f]
        far = ((X["ts"] < inside.min() - gap) | (X["ts"] > inside.max() + gap)).to_numpy()
        model = LogisticRegression().fit(X.loc[far, ["signal", "noise"]], y[far])
        out[block == f] = model.predict_proba(X.loc[block == f, ["signal", "noise"]])[:, 1]
    return out


@pytest.mark.parametrize("target", [0.8, 0.95, 1.0])
def test_cascade_threshold_reaches_the_target_recall_out_of_fold(target, caplog):
    X, y = planted()
    with caplog.at_level(logging.INFO, logger="models.ensemble"):
        model = cascade(target_recall=target).fit(X, y)
    assert f"target {100 * target:.1f}%" in caplog.text and "threshold" in caplog.text
    p1 = out_of_fold(X, y, pd.Timedelta(0))
    kept = p1 >= model.threshold_
    recall = kept[y == 1].mean()
    assert recall >= target and recall == pytest.approx(model.validation_recall_)
    assert model.kept_fraction_ == pytest.approx(kept.mean())
    # The smallest such set: one notch higher and the recall falls below the target.
    above = np.sort(np.unique(p1[y == 1]))
    higher = above[above > model.threshold_]
    if len(higher):
        assert (p1[y == 1] >= higher[0]).mean() < target
    if target < 1.0:
        assert model.kept_fraction_ < 0.5  # it does prune


def test_cascade_second_stage_learns_from_scores_the_first_stage_did_not_train_on():
    X, y = planted()
    gap = pd.Timedelta(hours=5)
    model = cascade(validation_gap=gap).fit(X, y)
    # Each block is scored by a first stage that never saw it, nor the rows within the gap.
    masks = model.fold_masks(X["ts"].to_numpy(), len(y))
    assert np.array_equal(np.sum([scored for _, scored in masks], axis=0), np.ones(len(y)))
    for train, scored in masks:
        inside = X["ts"][scored]
        assert not (train & (X["ts"] >= inside.min() - gap) & (X["ts"] <= inside.max() + gap)).to_numpy().any()
    # The second stage learns on the rows kept out of fold, not on what the refit first stage keeps.
    kept = out_of_fold(X, y, gap) >= model.threshold_
    assert model.n_second_rows_ == int(kept.sum()) < len(X)
    reference = DecisionTreeClassifier(max_depth=4, random_state=0).fit(X.loc[kept, ["signal", "noise"]], y[kept])
    np.testing.assert_array_equal(
        model.second_.predict_proba(X[["signal", "noise"]]), reference.predict_proba(X[["signal", "noise"]])
    )
    in_sample = model.first_.predict_proba(X[["signal", "noise"]])[:, 1] >= model.threshold_
    assert not np.array_equal(in_sample, kept)  # the in-sample set is another (biased) one
    # The stage that serves is fit on every row.
    np.testing.assert_allclose(model.first_.coef_, LogisticRegression().fit(X[["signal", "noise"]], y).coef_)


def test_cascade_ranks_every_kept_gpu_above_every_dropped_one():
    X, y = planted()
    model = cascade(target_recall=0.9).fit(X, y)
    p1, kept, p2 = model.stage_probabilities(X)
    p = model.predict_proba(X)[:, 1]
    assert kept.any() and (~kept).any()
    assert p[kept].min() >= model.threshold_ > p[~kept].max()
    np.testing.assert_allclose(p[~kept], p1[~kept])
    # Within the kept tier, the second stage's order.
    order = np.argsort(p2[kept])
    assert np.all(np.diff(p[kept][order]) >= 0)


def test_cascade_refuses_folds_without_failures_and_bad_settings():
    X, y = planted()
    y = y.copy()
    y[(X["ts"] < np.sort(X["ts"].unique())[40]).to_numpy()] = 0  # failures only in the last block
    with pytest.raises(ValueError, match="fold 3 of 3 .* only one class"):
        cascade().fit(X, y)
    with pytest.raises(ValueError, match="target_recall"):
        cascade(target_recall=1.5).fit(X, y)
    with pytest.raises(ValueError, match="folds"):
        cascade(folds=1).fit(X, y)
    with pytest.raises(ValueError, match="3 blocks of scoring times, got 1"):
        cascade().fit(X.assign(ts=X["ts"].iloc[0]), y)


def test_cascade_without_a_second_stage_when_the_first_already_separates():
    X = pd.DataFrame({"signal": np.r_[np.zeros(30), np.ones(10), np.zeros(30), np.ones(10)]})
    y = X["signal"].to_numpy().astype(int)
    model = cascade().fit(X, y)
    assert model.second_ is None
    p = model.predict_proba(X)[:, 1]
    assert p[y == 1].min() > p[y == 0].max()


def test_ensembles_clone_to_unfitted_copies_with_the_same_parameters():
    model = fixed_parallel("rank_average", 3)
    fresh = clone(model)
    assert fresh.get_params()["combine"] == "rank_average" and not hasattr(fresh, "estimators_")
    assert clone(cascade(target_recall=0.8)).get_params()["target_recall"] == 0.8
