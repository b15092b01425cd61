"""The single models: a factory of scikit-learn pipelines that take a feature matrix from
`models.frame.feature_matrix` (numeric float32 columns plus the string columns `gpu_model` and
`driver`) and expose `predict_proba`.

The string columns are encoded inside the pipeline, so the mapping learnt at fit time is the
one used at scoring time and is saved with the model:

- trees (`lightgbm`, `xgboost`): `CategoryCodes` turns each string into the code of its
  category as learnt in `fit`; an unseen or missing category becomes NaN, which trees route
  natively (as they do missing numeric values);
- `logistic`: one-hot encoding (unseen categories -> all zeros), median imputation with
  missing-value indicators (a telemetry gap is itself a signal), standard scaling.

Class imbalance (positives are ~0.1-1% of rows) is handled by weighting positives explicitly:
`scale_pos_weight` for the trees (neg/pos capped at `MAX_POS_WEIGHT`, see
`balanced_pos_weight`), `class_weight="balanced"` for logistic regression. Weighting inflates
predicted probabilities; `prior_correction` undoes it for a known weight (ranking is unchanged).

LightGBM also needs `reg_lambda` (lambda_l2) = 1 and `min_child_weight`
(min_sum_hessian_in_leaf) = 1: with its defaults it produced useless models at 1:1000
imbalance (PERFORMANCE.md, "Correctness trap").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.compose import ColumnTransformer, make_column_selector
from sklearn.impute import SimpleImputer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler
from sklearn.utils.validation import check_is_fitted

from models.frame import CATEGORICAL_COLUMNS

Kind = Literal["lightgbm", "xgboost", "logistic"]
KINDS: tuple[str, ...] = ("lightgbm", "xgboost", "logistic")

MAX_POS_WEIGHT = 10.0
"""Cap on the positive-class weight of the trees. neg/pos is ~1000 at 1:1000 imbalance, and
weighting ~100 positives that heavily makes the trees chase them: on the synthetic frame of
tests/models (240k rows, 1:1000, ~100 training positives) LightGBM's held-out ROC-AUC was
0.90-0.94 with caps 1-10 and fell to 0.79-0.89 at 30 and 0.56-0.83 at 100."""

THREADS = 2

DEFAULT_PARAMS: dict[str, dict[str, Any]] = {
    "lightgbm": {
        "n_estimators": 200,
        "learning_rate": 0.05,
        "num_leaves": 31,
        "min_child_samples": 20,
        "reg_lambda": 1.0,  # lambda_l2: the PERFORMANCE.md imbalance trap
        "min_child_weight": 1.0,  # min_sum_hessian_in_leaf: same
        "subsample_freq": 0,
        "n_jobs": THREADS,
        "verbose": -1,
        "random_state": 0,
    },
    "xgboost": {
        "n_estimators": 200,
        "learning_rate": 0.1,
        "max_depth": 6,
        "tree_method": "hist",
        "min_child_weight": 1.0,
        "reg_lambda": 1.0,
        "n_jobs": THREADS,
        "random_state": 0,
        "verbosity": 0,
    },
    "logistic": {
        "C": 1.0,
        "max_iter": 1000,
    },
}


def balanced_pos_weight(y: np.ndarray, cap: float = MAX_POS_WEIGHT) -> float:
    """neg/pos of the labels `y`, capped at `cap` and at least 1."""
    y = np.asarray(y)
    pos = int((y == 1).sum())
    neg = int((y == 0).sum())
    if pos == 0:
        return 1.0
    return float(min(max(neg / pos, 1.0), cap))


def prior_correction(p: np.ndarray, pos_weight: float) -> np.ndarray:
    """Undo a positive-class weight `w` on probabilities: a model fit with positives weighted
    `w` estimates odds `w` times too high, so p = p' / (p' + w (1 - p')). Monotone: the ranking
    is unchanged, only the scale."""
    p = np.asarray(p, dtype=np.float64)
    if pos_weight == 1.0:
        return p
    return p / (p + pos_weight * (1.0 - p))


class CategoryCodes(TransformerMixin, BaseEstimator):
    """Replace string columns by the code of their category as learnt in `fit` (float32);
    categories not seen in `fit` become NaN. Other columns pass through unchanged."""

    def __init__(self, columns: Sequence[str] = CATEGORICAL_COLUMNS) -> None:
        self.columns = columns

    def fit(self, X: pd.DataFrame, y: Any = None) -> CategoryCodes:
        if not isinstance(X, pd.DataFrame):
            raise TypeError(f"CategoryCodes expects a pandas DataFrame, got {type(X).__name__}")
        self.categories_ = {c: sorted(X[c].astype(str).unique().tolist()) for c in self.columns if c in X.columns}
        self.feature_names_in_ = np.asarray(X.columns, dtype=object)
        return self

    def transform(self, X: pd.DataFrame) -> pd.DataFrame:
        check_is_fitted(self, "categories_")
        if list(X.columns) != list(self.feature_names_in_):
            raise ValueError(f"CategoryCodes: expected columns {list(self.feature_names_in_)}, got {list(X.columns)}")
        codes = {}
        for c, cats in self.categories_.items():
            code = pd.Index(cats).get_indexer(X[c].astype(str)).astype(np.float32)
            code[code < 0] = np.nan  # unseen: routed like a missing value
            codes[c] = code
        return X.assign(**codes)

    def get_feature_names_out(self, input_features: Any = None) -> np.ndarray:
        return np.asarray(self.feature_names_in_, dtype=object)


_CATEGORICAL_PATTERN = "^(?:" + "|".join(CATEGORICAL_COLUMNS) + ")$"


def make_model(kind: str, *, pos_weight: float = 1.0, **params: Any) -> Pipeline:
    """An unfitted scikit-learn pipeline for `kind` ("lightgbm", "xgboost" or "logistic").

    `pos_weight` weights the positive class of the trees (`scale_pos_weight`; use
    `balanced_pos_weight(y)`); logistic regression always uses `class_weight="balanced"`.
    `params` override `DEFAULT_PARAMS[kind]` and go to the final estimator.
    """
    if kind not in DEFAULT_PARAMS:
        raise ValueError(f"model kind: expected one of {list(KINDS)}, got {kind!r}")
    merged = {**DEFAULT_PARAMS[kind], **params}
    if kind == "lightgbm":
        from lightgbm import LGBMClassifier

        clf: Any = LGBMClassifier(scale_pos_weight=pos_weight, **merged)
        return Pipeline([("encode", CategoryCodes()), ("model", clf)])
    if kind == "xgboost":
        from xgboost import XGBClassifier

        clf = XGBClassifier(scale_pos_weight=pos_weight, **merged)
        return Pipeline([("encode", CategoryCodes()), ("model", clf)])
    numeric = Pipeline(
        [
            ("impute", SimpleImputer(strategy="median", add_indicator=True, keep_empty_features=True)),
            ("scale", StandardScaler()),
        ]
    )
    prep = ColumnTransformer(
        [
            ("categorical", OneHotEncoder(handle_unknown="ignore"), make_column_selector(pattern=_CATEGORICAL_PATTERN)),
            ("numeric", numeric, make_column_selector(dtype_include=np.number)),
        ],
        sparse_threshold=0.0,
    )
    clf = LogisticRegression(class_weight="balanced", **merged)
    return Pipeline([("prepare", prep), ("model", clf)])


def effective_pos_weight(kind: str, y: np.ndarray, pos_weight: float) -> float:
    """The factor by which a model of `kind` trained on `y` overstates the odds of failure:
    `pos_weight` for the trees, neg/pos (uncapped, `class_weight="balanced"`) for logistic."""
    if kind == "logistic":
        y = np.asarray(y)
        pos = int((y == 1).sum())
        return float((y == 0).sum() / pos) if pos else 1.0
    return float(pos_weight)
