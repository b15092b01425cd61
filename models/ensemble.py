"""Parallel and cascade ensembles (Liu et al., docs/evaluation.md), as scikit-learn estimators
(`__init__` only stores parameters, `fit` validates and returns self, fitted parts
end in `_`), so `clone`, pipelines and the save/load of `models.train` work on them.

Both take the feature matrix of their members, optionally with one extra column,
`time_column` (default `ts`), that no member sees:

- `ParallelEnsemble` ranks GPUs within each scoring time: many GPUs share a `ts`, and a GPU is
  compared only with the fleet at the same moment. Without the column, the rows passed to
  `predict_proba` are one scoring time.
- `CascadeEnsemble` cuts its training rows into blocks of time (`models.split`: many GPUs share a timestamp), so that
  its threshold and its second stage come from first-stage scores made out of fold. Without
  the column, rows are taken to be in time order.

Probabilities. Members are fit with the same positive-class weight, so their probabilities
share one scale, which `models.train` corrects once (`prior_correction`). The parallel
ensemble's ranking comes from ranks, but serving needs a probability: within each scoring
time it takes the members' mean probabilities, sorts them, and hands them out in the order of
the ensemble's ranking (the best-ranked GPU gets the highest mean probability, and so on;
GPUs tied in the ranking share the mean of theirs). The set of probabilities of a scoring
time is the members' consensus; only who gets which follows the combination rule. A GPU scored
alone gets the mean of its members' probabilities. The cascade's probabilities are the first
stage's for the GPUs it drops and, for the GPUs it keeps, the second stage's, lifted above the
threshold so every kept GPU ranks above every dropped one (see `CascadeEnsemble`).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, clone
from sklearn.utils import get_tags
from sklearn.utils.validation import check_consistent_length, check_is_fitted, validate_data

from models.estimators import BinaryClassifierMixin, binary_target

log = logging.getLogger(__name__)

Combine = Literal["top_k_intersection", "rank_average"]
COMBINE_RULES: tuple[str, ...] = ("top_k_intersection", "rank_average")


def _split_time(estimator: Any, X: Any, reset: bool) -> tuple[Any, np.ndarray | None]:
    """(member input, time of each row or None): the time column is taken out of a DataFrame;
    feature names and counts are checked against fit as scikit-learn's own estimators do."""
    column = estimator.time_column
    if isinstance(X, pd.DataFrame) and column is not None and column in X.columns:
        time = pd.to_datetime(X[column]).to_numpy()
        X = X.drop(columns=[column])
        validate_data(estimator, X, skip_check_array=True, reset=reset)
        return X, time
    if isinstance(X, pd.DataFrame):
        validate_data(estimator, X, skip_check_array=True, reset=reset)
        return X, None
    # Members validate the values themselves (NaN allowed for trees, strings for encoders).
    return validate_data(estimator, X, dtype=None, ensure_all_finite=False, reset=reset), None


def _group_codes(time: np.ndarray | None, n: int) -> np.ndarray:
    """An integer per scoring time (all zeros without times)."""
    if time is None:
        return np.zeros(n, dtype=np.int64)
    return np.asarray(pd.factorize(time)[0], dtype=np.int64)


def group_ranks(scores: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """1-based rank of each score within its group, highest first; ties share their mean rank."""
    return np.asarray(pd.Series(scores).groupby(groups).rank(ascending=False, method="average"), dtype=np.float64)


def combine_rankings(member_ranks: np.ndarray, rule: str, top_k: int) -> np.ndarray:
    """The ensemble's ordering key from members' ranks (shape members x rows; ranks taken
    within each scoring time): lower is better, compared within a scoring time.

    `rank_average`: the mean of the members' ranks (a soft vote). `top_k_intersection` (the
    paper's rule): a GPU is flagged when it is in the top `top_k` of every member
    (`in_every_top_k`); flagged GPUs come first, ordered by mean rank, then the rest by mean
    rank. The order is for the probabilities; the rule's alarms are the flagged GPUs alone,
    however few (`intersection_flags`), never topped up to K."""
    mean_rank = member_ranks.mean(axis=0)
    if rule == "rank_average":
        return mean_rank
    if rule == "top_k_intersection":
        flagged = in_every_top_k(member_ranks, top_k)
        # A mean rank is at most its group's size <= all rows: the offset puts unflagged GPUs last.
        return mean_rank + np.where(flagged, 0.0, member_ranks.shape[1] + 1.0)
    raise ValueError(f"combine: expected one of {list(COMBINE_RULES)}, got {rule!r}")


def in_every_top_k(member_ranks: np.ndarray, top_k: int) -> np.ndarray:
    """Whether each row is in the top `top_k` of every member (ranks: members x rows, taken
    within each scoring time). With ties, a GPU is in a member's top K when its (mean) rank is
    at most K, so a member may put fewer than K GPUs there, never more."""
    return np.asarray((member_ranks <= top_k).all(axis=0), dtype=bool)


def intersection_flags(member_probs: np.ndarray, time: np.ndarray | None, top_k: int) -> np.ndarray:
    """The paper's parallel rule: the rows (GPUs at a scoring time, `time` of each row; None:
    one scoring time) that are in the top `top_k` of every member's probabilities
    (members x rows). At most `top_k` per scoring time, and often fewer: its alarm volume is
    its own, set by how much the members agree."""
    groups = _group_codes(time, member_probs.shape[1])
    ranks = np.vstack([group_ranks(p, groups) for p in member_probs])
    return in_every_top_k(ranks, top_k)


def assign_by_rank(values: np.ndarray, key: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Within each group, hand out `values` sorted high to low in the order of `key` (low
    first); rows tied in `key` share the mean of what they were handed."""
    by_value = np.lexsort((-values, groups))
    by_key = np.lexsort((key, groups))
    out = np.empty_like(values, dtype=np.float64)
    # Both orders sort groups alike, so position i of each holds the same group.
    out[by_key] = values[by_value]
    return np.asarray(pd.Series(out).groupby([groups, key]).transform("mean"), dtype=np.float64)


def check_combination(combine: str, top_k: Any) -> None:
    """ValueError naming the setting unless `combine` is one of `COMBINE_RULES` and `top_k` a
    positive whole number of GPUs."""
    if combine not in COMBINE_RULES:
        raise ValueError(f"combine: expected one of {list(COMBINE_RULES)}, got {combine!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or top_k < 1:
        raise ValueError(f"top_k: expected a positive number of GPUs, got {top_k!r}")


def combine_probabilities(member_probs: np.ndarray, time: np.ndarray | None, combine: str, top_k: int) -> np.ndarray:
    """The parallel ensemble's probability of each row from its members' (members x rows):
    within each scoring time (`time` of each row; None: one scoring time), the members' ranks
    are combined by `combine` (`combine_rankings`) and the members' mean probabilities handed
    out in that order (`assign_by_rank`). The one implementation of the combination: the
    fitted ensemble and the walk-forward comparison both score through it."""
    groups = _group_codes(time, member_probs.shape[1])
    ranks = np.vstack([group_ranks(p, groups) for p in member_probs])
    return assign_by_rank(member_probs.mean(axis=0), combine_rankings(ranks, combine, top_k), groups)


class ParallelEnsemble(BinaryClassifierMixin, BaseEstimator):
    """Members of different kinds each rank all GPUs at a scoring time; `combine` turns their
    rankings into one (`combine_probabilities`: `top_k_intersection` or `rank_average`).

    `estimators`: list of (name, unfitted estimator); each is cloned and fit on the same rows.
    `time_column`: the column of X that groups rows into scoring times (not a member input).
    Fitted: `estimators_`, `classes_`. See the module docstring for the probabilities."""

    def __init__(
        self,
        estimators: list[tuple[str, Any]],
        combine: Combine = "top_k_intersection",
        top_k: int = 10,
        time_column: str | None = "ts",
    ) -> None:
        self.estimators = estimators
        self.combine = combine
        self.top_k = top_k
        self.time_column = time_column

    def fit(self, X: Any, y: Any) -> ParallelEnsemble:
        check_combination(self.combine, self.top_k)
        if len(self.estimators) < 1:
            raise ValueError("estimators: expected at least one (name, estimator) pair, got none")
        X, _ = _split_time(self, X, reset=True)
        y = binary_target(self, y)
        check_consistent_length(X, y)
        self.estimators_ = [clone(est).fit(X, y) for _, est in self.estimators]
        return self

    @property
    def named_estimators_(self) -> dict[str, Any]:
        check_is_fitted(self, "estimators_")
        return {name: est for (name, _), est in zip(self.estimators, self.estimators_, strict=True)}

    def member_probabilities(self, X: Any) -> np.ndarray:
        """Each member's probability of the positive class (members x rows)."""
        check_is_fitted(self, "estimators_")
        X, _ = _split_time(self, X, reset=False)
        return self._member_probabilities(X)

    def _member_probabilities(self, X: Any) -> np.ndarray:
        return np.vstack([np.asarray(est.predict_proba(X)[:, 1], dtype=np.float64) for est in self.estimators_])

    def predict_proba(self, X: Any) -> np.ndarray:
        check_is_fitted(self, "estimators_")
        X, time = _split_time(self, X, reset=False)
        p = combine_probabilities(self._member_probabilities(X), time, self.combine, self.top_k)
        return np.column_stack([1.0 - p, p])

    def flags(self, X: Any) -> np.ndarray:
        """The GPUs in every member's top `top_k` at their scoring time (`intersection_flags`):
        the paper's alarms, whatever `combine` orders the probabilities by."""
        check_is_fitted(self, "estimators_")
        X, time = _split_time(self, X, reset=False)
        return intersection_flags(self._member_probabilities(X), time, self.top_k)

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = all(get_tags(est).input_tags.allow_nan for _, est in self.estimators)
        return tags


class CascadeEnsemble(BinaryClassifierMixin, BaseEstimator):
    """Two stages: `first` scores every GPU and keeps those at or above a threshold; `second`,
    fit only on rows the first keeps, ranks them.

    Fit, so that the second stage learns from first-stage scores the first stage did not see
    in training (a first stage scoring its own training rows keeps their failures more easily
    than it will keep new ones, and the second stage would learn from a biased set):

    1. Out of fold: the training rows are cut by time into `folds` consecutive blocks of
       scoring times; each block is scored by a copy of `first` fit on the other blocks,
       leaving out the rows within `validation_gap` (the label horizon) of the block on either
       side, whose labels share failures with it.
    2. The threshold is the highest out-of-fold probability that keeps at least
       `target_recall` of the positive rows; it is logged and stored (`threshold_`), with the
       recall and the share of rows it keeps out of fold (`validation_recall_`,
       `kept_fraction_`).
    3. `second` learns on the rows whose out-of-fold probability reaches the threshold.
    4. `first` is fit again on every row (`first_`): the stage that serves.

    Probability: p1 (first stage) for a dropped GPU, which is below the threshold t;
    t + (1 - t) p2 for a kept one, p2 being the second stage's. Kept GPUs thus rank above
    dropped ones, each tier in its own stage's order; t is a small probability, so the kept
    probabilities are p2 lifted by at most t.

    `time_column` (default `ts`) orders the rows in time; without it, rows are taken to be in
    time order and `validation_gap` is ignored."""

    def __init__(
        self,
        first: Any,
        second: Any,
        target_recall: float = 0.95,
        folds: int = 3,
        validation_gap: Any = None,
        time_column: str | None = "ts",
    ) -> None:
        self.first = first
        self.second = second
        self.target_recall = target_recall
        self.folds = folds
        self.validation_gap = validation_gap
        self.time_column = time_column

    def _check_params(self) -> None:
        if not 0.0 < self.target_recall <= 1.0:
            raise ValueError(f"target_recall: expected a share in (0, 1], got {self.target_recall!r}")
        if isinstance(self.folds, bool) or not isinstance(self.folds, int | np.integer) or self.folds < 2:
            raise ValueError(f"folds: expected a whole number of blocks >= 2, got {self.folds!r}")

    def fold_masks(self, time: np.ndarray | None, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(training rows, scored rows) of each fold: the scored rows are one block of
        consecutive scoring times; the training rows are the others, less those within
        `validation_gap` of the block."""
        if time is None:
            block = np.minimum(np.arange(n) * self.folds // max(n, 1), self.folds - 1)
            return [(block != f, block == f) for f in range(self.folds)]
        times = np.unique(time)
        if len(times) < self.folds:
            raise ValueError(
                f"{self.time_column}: the cascade cuts its rows into {self.folds} blocks of scoring times, "
                f"got {len(times)} scoring time(s)"
            )
        block_of_time = np.minimum(np.arange(len(times)) * self.folds // len(times), self.folds - 1)
        block = block_of_time[np.searchsorted(times, time)]
        gap = np.timedelta64(0, "ns") if self.validation_gap is None else pd.Timedelta(self.validation_gap).to_numpy()
        out = []
        for f in range(self.folds):
            scored = block == f
            first, last = times[block_of_time == f][[0, -1]]
            near = (time >= first - gap) & (time <= last + gap)
            out.append((~scored & ~near, scored))
        return out

    def fit(self, X: Any, y: Any) -> CascadeEnsemble:
        self._check_params()
        X, time = _split_time(self, X, reset=True)
        y = binary_target(self, y)
        check_consistent_length(X, y)
        positive = y == self.classes_[-1]
        rows = _rows(X)
        p1_oof = np.full(len(y), np.nan)
        for f, (train, scored) in enumerate(self.fold_masks(time, len(y))):
            if len(np.unique(y[train])) < 2:
                raise ValueError(
                    f"CascadeEnsemble: the first stage's training rows for fold {f + 1} of {self.folds} "
                    f"({int(train.sum())} rows, {int(positive[train].sum())} positive) hold only one class; "
                    "expected failing and healthy rows outside every fold (a longer training window)"
                )
            model = clone(self.first).fit(rows(train), y[train])
            p1_oof[scored] = np.asarray(model.predict_proba(rows(scored))[:, 1], dtype=np.float64)
        if not positive.any():
            raise ValueError(
                "CascadeEnsemble: the training rows hold only one class; expected failing and healthy rows"
            )
        scores = np.sort(p1_oof[positive])[::-1]
        keep_n = int(np.ceil(self.target_recall * len(scores)))
        self.threshold_ = float(scores[keep_n - 1])
        self.validation_recall_ = float((scores >= self.threshold_).mean())
        self.kept_fraction_ = float((p1_oof >= self.threshold_).mean())
        log.info(
            "cascade: first-stage threshold %.6g keeps %.1f%% of the rows and %.1f%% of the positives out of fold "
            "(target %.1f%%)",
            self.threshold_,
            100 * self.kept_fraction_,
            100 * self.validation_recall_,
            100 * self.target_recall,
        )
        kept = p1_oof >= self.threshold_
        self.n_second_rows_ = int(kept.sum())
        self.first_ = clone(self.first).fit(X, y)
        if len(np.unique(y[kept])) < 2:
            # The first stage already separates the classes out of fold: the second has nothing
            # to learn, and the kept rows keep the first stage's order.
            log.warning(
                "cascade: the %d rows the first stage keeps are all of one class; no second stage",
                self.n_second_rows_,
            )
            self.second_ = None
            return self
        self.second_ = clone(self.second).fit(rows(kept), y[kept])
        return self

    def stage_probabilities(self, X: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first-stage probability, kept mask, second-stage probability (NaN where dropped)).
        Without a second stage (`second_` is None), the kept rows keep their first-stage
        probability."""
        check_is_fitted(self, "first_")
        X, _ = _split_time(self, X, reset=False)
        p1 = np.asarray(self.first_.predict_proba(X)[:, 1], dtype=np.float64)
        kept = p1 >= self.threshold_
        p2 = np.full(len(p1), np.nan)
        if self.second_ is None:
            p2[kept] = (p1[kept] - self.threshold_) / (1.0 - self.threshold_)
        elif kept.any():
            p2[kept] = self.second_.predict_proba(_rows(X)(kept))[:, 1]
        return p1, kept, p2

    def predict_proba(self, X: Any) -> np.ndarray:
        p1, kept, p2 = self.stage_probabilities(X)
        t = self.threshold_
        p = np.where(kept, t + (1.0 - t) * np.nan_to_num(p2), p1)
        return np.column_stack([1.0 - p, p])

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = (
            get_tags(self.first).input_tags.allow_nan and get_tags(self.second).input_tags.allow_nan
        )
        return tags


def _rows(X: Any) -> Any:
    """A row selector by boolean mask for a DataFrame or an array."""
    if isinstance(X, pd.DataFrame):
        return lambda mask: X.iloc[np.flatnonzero(mask)]
    return lambda mask: X[mask]
