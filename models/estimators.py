"""The models: a factory of scikit-learn estimators that take a feature matrix from
`models.frame.feature_matrix` (numeric float32 columns plus the string columns `gpu_model` and
`driver`) and expose `predict_proba`.

Single models (`SINGLE_KINDS`) are pipelines; the ensembles (`parallel`, `cascade`, see
`models.ensemble`) combine single models built here. The string columns are encoded inside
each pipeline, so the mapping learnt at fit time is the one used at scoring time and is saved
with the model:

- trees (`lightgbm`, `xgboost`, `random_forest`): `CategoryCodes` turns each string into the
  code of its category as learnt in `fit`; an unseen or missing category becomes NaN, which
  the trees route natively (as they do missing numeric values);
- `logistic` and `mlp`: one-hot encoding (unseen categories -> all zeros), median imputation
  with missing-value indicators (a telemetry gap is itself a signal), standard scaling.

Class imbalance (positives are ~0.1-1% of rows). Every kind weights the positive class by the
same factor `pos_weight` (use `balanced_pos_weight`: neg/pos capped at `MAX_POS_WEIGHT`):
`scale_pos_weight` (LightGBM, XGBoost), `class_weight={1: w}` (random forest, logistic
regression) and, for the MLP, which has no class weights, positive oversampling: each positive
row is repeated w times on average (`OversampledMLP`), which has the same expected loss as a
weight of w. A model fit so overstates the odds of failure by w; `prior_correction` divides it
out (the ranking is unchanged). `models.train` also subsamples negatives, which multiplies the
odds by a further 1/r; it records the product as the model's one correction factor.

LightGBM also needs `reg_lambda` (lambda_l2) = 1 and `min_child_weight`
(min_sum_hessian_in_leaf) = 1: with its defaults it produced useless models at 1:1000
imbalance (PERFORMANCE.md, "Correctness trap").

Monotone constraints (`monotone_increasing`: features whose rise must never lower the risk)
are native for LightGBM, XGBoost and the random forest; logistic regression keeps the sign of
their coefficients non-negative (`SignConstrainedLogistic`); the MLP cannot be constrained.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, ClassifierMixin, TransformerMixin
from sklearn.compose import ColumnTransformer, make_column_selector
from sklearn.impute import SimpleImputer
from sklearn.linear_model import LogisticRegression
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler
from sklearn.utils.multiclass import check_classification_targets, type_of_target
from sklearn.utils.validation import check_is_fitted, column_or_1d, validate_data

from models.frame import CATEGORICAL_COLUMNS, is_polars

Kind = Literal["lightgbm", "xgboost", "logistic", "random_forest", "mlp", "parallel", "cascade"]
SINGLE_KINDS: tuple[str, ...] = ("lightgbm", "xgboost", "logistic", "random_forest", "mlp")
ENSEMBLE_KINDS: tuple[str, ...] = ("parallel", "cascade")
KINDS: tuple[str, ...] = SINGLE_KINDS + ENSEMBLE_KINDS
TREE_KINDS: tuple[str, ...] = ("lightgbm", "xgboost", "random_forest")
MONOTONE_KINDS: tuple[str, ...] = ("lightgbm", "xgboost", "random_forest", "logistic")

MAX_POS_WEIGHT = 10.0
"""Cap on the positive-class weight. neg/pos is ~1000 at 1:1000 imbalance, and weighting ~100
positives that heavily makes the trees chase them: on the synthetic frame of tests/models
(240k rows, 1:1000, ~100 training positives) LightGBM's held-out ROC-AUC was 0.90-0.94 with
caps 1-10 and fell to 0.79-0.89 at 30 and 0.56-0.83 at 100."""

THREADS = 2

DEFAULT_PARAMS: dict[str, dict[str, Any]] = {
    # Sized for daily retrains: 100 trees at rate 0.1 on 63 bins instead of 200 at 0.05 on 255.
    # (Half the features per tree was faster still on the demo, but on a frame with one
    # informative feature of five it cut held-out ROC-AUC from 0.94 to 0.87.)
    "lightgbm": {
        "n_estimators": 100,
        "learning_rate": 0.1,
        "max_bin": 63,
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
        "n_estimators": 100,
        "learning_rate": 0.1,
        "max_bin": 64,
        "max_depth": 6,
        "tree_method": "hist",
        "min_child_weight": 1.0,
        "reg_lambda": 1.0,
        "n_jobs": THREADS,
        "random_state": 0,
        "verbosity": 0,
    },
    # C = 0.1 (stronger L2 than scikit-learn's 1.0): the ~590 standardised, correlated inputs
    # converge in ~260 L-BFGS iterations instead of ~660, half the fit time on the demo's 21-day
    # window, and the demo walk-forward ranked alike (daily precision@10 10.2% vs 10.3%,
    # recall@10 21 vs 20 of 41 failures).
    "logistic": {
        "C": 0.1,
        "max_iter": 1000,
    },
    "random_forest": {
        "n_estimators": 100,
        "min_samples_leaf": 5,
        "max_features": "sqrt",
        # Each tree sees a bootstrap of half the rows: as good here, and twice as fast.
        "max_samples": 0.5,
        "n_jobs": THREADS,
        "random_state": 0,
    },
    # One hidden layer of 32 and 10 epochs ranked the demo's held-out 14 days as well as
    # (64, 32) and 30 epochs (precision@10 0.094 / 0.092), several times faster.
    "mlp": {
        "hidden_layer_sizes": (32,),
        "alpha": 1e-3,
        "batch_size": 256,
        "learning_rate_init": 1e-3,
        "max_iter": 10,
        "random_state": 0,
    },
}

ENSEMBLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "parallel": {"members": ["lightgbm", "xgboost", "logistic"], "combine": "top_k_intersection", "top_k": 10},
    "cascade": {"first": "logistic", "second": "lightgbm", "target_recall": 0.95, "validation_fraction": 0.25},
}
"""Parameters of the ensembles: `make_model("parallel", members=[...], combine=..., top_k=...)`,
`make_model("cascade", first=..., second=..., target_recall=..., validation_fraction=...,
validation_gap=...)`."""


def balanced_pos_weight(y: np.ndarray, cap: float = MAX_POS_WEIGHT) -> float:
    """neg/pos of the labels `y`, capped at `cap` and at least 1."""
    y = np.asarray(y)
    pos = int((y == 1).sum())
    neg = int((y == 0).sum())
    if pos == 0:
        return 1.0
    return float(min(max(neg / pos, 1.0), cap))


def prior_correction(p: np.ndarray, pos_weight: float) -> np.ndarray:
    """Undo an odds factor `w` on probabilities (a positive-class weight w, or keeping only a
    share 1/w of the negatives): such a model estimates odds `w` times too high, so
    p = p' / (p' + w (1 - p')). Monotone: the ranking is unchanged, only the scale."""
    p = np.asarray(p, dtype=np.float64)
    if pos_weight == 1.0:
        return p
    return p / (p + pos_weight * (1.0 - p))


def binary_target(estimator: Any, y: Any) -> np.ndarray:
    """Check `y` is a binary target with both classes and record `estimator.classes_` (the
    second class is "fails"); returns y as a 1-d array."""
    if y is None:
        raise ValueError(f"{type(estimator).__name__} requires y to be passed, but the target y is None")
    y = column_or_1d(y, warn=True)
    check_classification_targets(y)
    target = type_of_target(y)
    if target != "binary":
        raise ValueError(
            f"Only binary classification is supported. {type(estimator).__name__} got a {target} target "
            "(expected failing / healthy labels)"
        )
    classes = np.unique(y)
    if len(classes) < 2:
        raise ValueError(
            f"{type(estimator).__name__} needs samples of 2 classes, but the data contains only one class: {classes[0]!r}"
        )
    estimator.classes_ = classes
    return y


def _binary_classes(estimator: Any, y: Any) -> np.ndarray:
    """`binary_target`, as a mask of the positive ("fails") rows."""
    y = binary_target(estimator, y)
    return np.asarray(y == estimator.classes_[-1])


class BinaryClassifierMixin(ClassifierMixin):
    """A binary classifier ("fails" is `classes_[-1]`): `predict` thresholds `predict_proba`
    at 0.5, and the tags say it is not multi-class."""

    def predict(self, X: Any) -> np.ndarray:
        positive = self.predict_proba(X)[:, 1] >= 0.5  # type: ignore[attr-defined]
        return np.asarray(self.classes_[positive.astype(int)])  # type: ignore[attr-defined]

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.classifier_tags.multi_class = False
        return tags


class CategoryCodes(TransformerMixin, BaseEstimator):
    """Replace string columns by the code of their category as learnt in `fit` (float32);
    categories not seen in `fit` become missing (NaN, or null in polars). Other columns pass
    through unchanged. Takes pandas or polars frames (polars stays polars: LightGBM reads it
    through Arrow, `models.frame.split_xy_polars`)."""

    def __init__(self, columns: Sequence[str] = CATEGORICAL_COLUMNS) -> None:
        self.columns = columns

    def fit(self, X: Any, y: Any = None) -> CategoryCodes:
        if is_polars(X):
            self.categories_ = {c: sorted(X[c].cast(str).unique().to_list()) for c in self.columns if c in X.columns}
        elif isinstance(X, pd.DataFrame):
            self.categories_ = {c: sorted(X[c].astype(str).unique().tolist()) for c in self.columns if c in X.columns}
        else:
            raise TypeError(f"CategoryCodes expects a pandas or polars DataFrame, got {type(X).__name__}")
        self.feature_names_in_ = np.asarray(X.columns, dtype=object)
        return self

    def transform(self, X: Any) -> Any:
        check_is_fitted(self, "categories_")
        if list(X.columns) != list(self.feature_names_in_):
            raise ValueError(f"CategoryCodes: expected columns {list(self.feature_names_in_)}, got {list(X.columns)}")
        if is_polars(X):
            import polars as pl

            return X.with_columns(
                pl.col(c)
                .cast(pl.String)
                .replace_strict(cats, list(range(len(cats))), default=None, return_dtype=pl.Float32)
                for c, cats in self.categories_.items()
            )
        codes = {}
        for c, cats in self.categories_.items():
            code = pd.Index(cats).get_indexer(X[c].astype(str)).astype(np.float32)
            code[code < 0] = np.nan  # unseen: routed like a missing value
            codes[c] = code
        return X.assign(**codes)

    def get_feature_names_out(self, input_features: Any = None) -> np.ndarray:
        return np.asarray(self.feature_names_in_, dtype=object)


class SignConstrainedLogistic(BinaryClassifierMixin, BaseEstimator):
    """L2 logistic regression whose coefficients on the inputs named in `increasing` are never
    negative, so a rise in those inputs never lowers the probability.

    Solved by an active set: fit, fix the offending coefficients at zero (their inputs are
    zeroed) and refit, until no constrained coefficient is negative; with a convex loss this
    reaches the constrained optimum's sign pattern in a few refits. An input name matches
    `increasing` when it equals one of them or ends with `__<name>` (the names a
    `ColumnTransformer` gives, such as `numeric__ecc_dbe_volatile_total_last`); the missing-value
    indicators of those inputs (`numeric__missingindicator_<name>`) are not constrained.
    `class_weight` as in `LogisticRegression`."""

    def __init__(
        self,
        C: float = 1.0,
        max_iter: int = 1000,
        class_weight: dict[Any, float] | str | None = None,
        increasing: Sequence[str] = (),
    ) -> None:
        self.C = C
        self.max_iter = max_iter
        self.class_weight = class_weight
        self.increasing = increasing

    def _constrained_mask(self) -> np.ndarray:
        n = self.n_features_in_
        names = getattr(self, "feature_names_in_", None)
        wanted = set(self.increasing)
        if not wanted:
            return np.zeros(n, dtype=bool)
        if names is None:
            raise ValueError("SignConstrainedLogistic: `increasing` names inputs, so X must be a DataFrame")
        return np.array([str(c) in wanted or str(c).rsplit("__", 1)[-1] in wanted for c in names], dtype=bool)

    def fit(self, X: Any, y: Any) -> SignConstrainedLogistic:
        X, y = validate_data(self, X, y, dtype=np.float64)
        _binary_classes(self, y)
        constrained = self._constrained_mask()
        zeroed = np.zeros(self.n_features_in_, dtype=bool)
        # Each refit starts from the previous solution (warm start): zeroing a few inputs moves
        # the optimum little, and on the demo's 21-day window the second fit took 140 L-BFGS
        # iterations instead of 640 (13 s -> 7.7 s of CPU for the whole fit).
        model = LogisticRegression(C=self.C, max_iter=self.max_iter, class_weight=self.class_weight, warm_start=True)
        for _ in range(self.n_features_in_ + 1):
            design = np.where(zeroed, 0.0, X) if zeroed.any() else X
            model.fit(design, y)
            negative = constrained & ~zeroed & (model.coef_[0] < 0)
            if not negative.any():
                break
            zeroed |= negative
        self.model_ = model
        self.n_iter_ = model.n_iter_
        self.zeroed_ = zeroed
        self.coef_ = np.where(zeroed, 0.0, model.coef_)
        self.intercept_ = model.intercept_
        return self

    def decision_function(self, X: Any) -> np.ndarray:
        check_is_fitted(self, "model_")
        X = validate_data(self, X, dtype=np.float64, reset=False)
        return np.asarray(X @ self.coef_[0] + self.intercept_[0], dtype=np.float64)

    def predict_proba(self, X: Any) -> np.ndarray:
        p = 1.0 / (1.0 + np.exp(-self.decision_function(X)))
        return np.column_stack([1.0 - p, p])

    def predict(self, X: Any) -> np.ndarray:
        positive = self.decision_function(X) > 0
        return np.asarray(self.classes_[positive.astype(int)])


class OversampledMLP(BinaryClassifierMixin, BaseEstimator):
    """scikit-learn's `MLPClassifier` with the positive class weighted by `pos_weight` through
    oversampling (it has no class or sample weights): each positive row is repeated
    floor(w) times, plus once more with probability w - floor(w) (seeded by `random_state`).
    The expected loss equals that of weighting positives by w, so its probabilities overstate
    the odds by w like every other kind's (`prior_correction`). The other parameters are
    `MLPClassifier`'s."""

    def __init__(
        self,
        hidden_layer_sizes: tuple[int, ...] = (64, 32),
        alpha: float = 1e-3,
        batch_size: int = 256,
        learning_rate_init: float = 1e-3,
        max_iter: int = 30,
        pos_weight: float = 1.0,
        random_state: int | None = 0,
    ) -> None:
        self.hidden_layer_sizes = hidden_layer_sizes
        self.alpha = alpha
        self.batch_size = batch_size
        self.learning_rate_init = learning_rate_init
        self.max_iter = max_iter
        self.pos_weight = pos_weight
        self.random_state = random_state

    def fit(self, X: Any, y: Any) -> OversampledMLP:
        X, y = validate_data(self, X, y, dtype=np.float64)
        positive = _binary_classes(self, y)
        if self.pos_weight < 1:
            raise ValueError(f"OversampledMLP: pos_weight must be at least 1, got {self.pos_weight}")
        rng = np.random.default_rng(self.random_state)
        whole, part = divmod(float(self.pos_weight), 1.0)
        copies = np.where(positive, int(whole) + (rng.random(len(y)) < part), 1)
        rows = np.repeat(np.arange(len(y)), copies)
        rng.shuffle(rows)  # MLP minibatches should not see the repeated positives in a block
        import warnings

        from sklearn.exceptions import ConvergenceWarning

        mlp = MLPClassifier(
            hidden_layer_sizes=self.hidden_layer_sizes,
            alpha=self.alpha,
            batch_size=min(self.batch_size, len(rows)),
            learning_rate_init=self.learning_rate_init,
            max_iter=self.max_iter,
            random_state=self.random_state,
        )
        with warnings.catch_warnings():
            # A fixed, small epoch budget is the point (speed); not converging is expected.
            warnings.simplefilter("ignore", ConvergenceWarning)
            mlp.fit(X[rows], positive[rows].astype(np.int8))
        self.mlp_ = mlp
        self.n_iter_ = mlp.n_iter_
        return self

    def predict_proba(self, X: Any) -> np.ndarray:
        check_is_fitted(self, "mlp_")
        X = validate_data(self, X, dtype=np.float64, reset=False)
        p = self.mlp_.predict_proba(X)[:, 1]
        return np.column_stack([1.0 - p, p])


_CATEGORICAL_PATTERN = "^(?:" + "|".join(CATEGORICAL_COLUMNS) + ")$"


def _dense_preparation() -> ColumnTransformer:
    """One-hot categoricals, median-imputed and scaled numerics with missing indicators; pandas
    output, so the final estimator knows the input names (`SignConstrainedLogistic`,
    `models.explain`)."""
    numeric = Pipeline(
        [
            ("impute", SimpleImputer(strategy="median", add_indicator=True, keep_empty_features=True)),
            ("scale", StandardScaler()),
        ]
    )
    prep = ColumnTransformer(
        [
            (
                "categorical",
                OneHotEncoder(handle_unknown="ignore", sparse_output=False),
                make_column_selector(pattern=_CATEGORICAL_PATTERN),
            ),
            ("numeric", numeric, make_column_selector(dtype_include=np.number)),
        ],
        sparse_threshold=0.0,
    )
    return prep.set_output(transform="pandas")


def monotone_positions(columns: Sequence[str], increasing: Sequence[str]) -> list[int]:
    """1 for each of `columns` named in `increasing`, else 0 (the trees' constraint vector)."""
    unknown = sorted(set(increasing) - set(columns))
    if unknown:
        raise ValueError(f"monotone_increasing: {unknown} are not feature columns; expected some of {list(columns)}")
    wanted = set(increasing)
    return [int(c in wanted) for c in columns]


def _single_model(
    kind: str, pos_weight: float, increasing: Sequence[str], columns: Sequence[str] | None, params: dict[str, Any]
) -> Pipeline:
    merged = {**DEFAULT_PARAMS[kind], **params}
    if increasing and kind not in MONOTONE_KINDS:
        raise ValueError(f"monotone_increasing: kind {kind!r} cannot be constrained; expected one of {MONOTONE_KINDS}")
    if increasing and kind in TREE_KINDS:
        if columns is None:
            raise ValueError("monotone_increasing: the trees need `columns`, the feature columns in fit order")
        positions = monotone_positions(columns, increasing)
        if kind == "lightgbm":
            merged["monotone_constraints"] = positions
        elif kind == "xgboost":
            merged["monotone_constraints"] = "(" + ",".join(map(str, positions)) + ")"  # XGBoost 3's form
        else:
            merged["monotonic_cst"] = positions
    if kind == "lightgbm":
        from lightgbm import LGBMClassifier

        clf: Any = LGBMClassifier(scale_pos_weight=pos_weight, **merged)
    elif kind == "xgboost":
        from xgboost import XGBClassifier

        clf = XGBClassifier(scale_pos_weight=pos_weight, **merged)
    elif kind == "random_forest":
        from sklearn.ensemble import RandomForestClassifier

        clf = RandomForestClassifier(class_weight={0: 1.0, 1: pos_weight}, **merged)
    elif kind == "logistic":
        clf = SignConstrainedLogistic(class_weight={0: 1.0, 1: pos_weight}, increasing=tuple(increasing), **merged)
    else:
        clf = OversampledMLP(pos_weight=pos_weight, **merged)
    if kind in TREE_KINDS:
        return Pipeline([("encode", CategoryCodes()), ("model", clf)])
    return Pipeline([("prepare", _dense_preparation()), ("model", clf)])


def make_model(
    kind: str,
    *,
    pos_weight: float = 1.0,
    monotone_increasing: Sequence[str] = (),
    columns: Sequence[str] | None = None,
    **params: Any,
) -> Any:
    """An unfitted scikit-learn estimator for `kind` (one of `KINDS`).

    `pos_weight` weights the positive class (use `balanced_pos_weight(y)`); every member of an
    ensemble gets the same weight, so one correction applies to the ensemble's output.
    `monotone_increasing` names features whose rise must never lower the risk (`columns`, the
    feature columns in fit order, is then needed for the trees).

    Single kinds: `params` override `DEFAULT_PARAMS[kind]` and go to the final estimator.
    Ensembles: `params` override `ENSEMBLE_DEFAULTS[kind]`; `n_jobs` goes to every member that
    takes it, and `member_params` ({kind: {param: value}}) to the members of that kind; the
    cascade's `first_params` and `second_params` go to one stage only (a small, cheap first
    stage of the same kind as the second, say).
    """
    if kind not in KINDS:
        raise ValueError(f"model kind: expected one of {list(KINDS)}, got {kind!r}")
    if kind in SINGLE_KINDS:
        return _single_model(kind, pos_weight, monotone_increasing, columns, params)
    from models.ensemble import CascadeEnsemble, ParallelEnsemble

    settings = {**ENSEMBLE_DEFAULTS[kind], **params}
    n_jobs = settings.pop("n_jobs", None)
    member_params: dict[str, dict[str, Any]] = settings.pop("member_params", None) or {}

    def member(member_kind: str, stage_params: dict[str, Any] | None = None) -> Pipeline:
        if member_kind not in SINGLE_KINDS:
            raise ValueError(f"{kind} ensemble member: expected one of {list(SINGLE_KINDS)}, got {member_kind!r}")
        extra = {**member_params.get(member_kind, {}), **(stage_params or {})}
        if n_jobs is not None and "n_jobs" in DEFAULT_PARAMS[member_kind]:
            extra.setdefault("n_jobs", n_jobs)
        return _single_model(member_kind, pos_weight, monotone_increasing, columns, extra)

    if kind == "parallel":
        kinds = list(settings.pop("members"))
        if len(kinds) < 2:
            raise ValueError(f"parallel ensemble members: expected at least two kinds, got {kinds}")
        names = [f"{k}_{i}" if kinds.count(k) > 1 else k for i, k in enumerate(kinds)]
        return ParallelEnsemble(estimators=[(n, member(k)) for n, k in zip(names, kinds, strict=True)], **settings)
    first, second = settings.pop("first"), settings.pop("second")
    first_params, second_params = settings.pop("first_params", None), settings.pop("second_params", None)
    return CascadeEnsemble(first=member(first, first_params), second=member(second, second_params), **settings)


def member_kinds(kind: str, params: dict[str, Any] | None = None) -> list[str]:
    """The single kinds a model of `kind` is made of (itself for a single kind)."""
    if kind in SINGLE_KINDS:
        return [kind]
    settings = {**ENSEMBLE_DEFAULTS.get(kind, {}), **(params or {})}
    if kind == "parallel":
        return list(settings["members"])
    return [settings["first"], settings["second"]]


def effective_pos_weight(kind: str, y: np.ndarray, pos_weight: float) -> float:
    """The factor by which a model of `kind` trained on `y` with positives weighted
    `pos_weight` overstates the odds of failure: `pos_weight`, for every kind (all of them,
    ensemble members included, weight positives the same way)."""
    return float(pos_weight)
