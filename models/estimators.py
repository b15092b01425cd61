"""The estimators of the single model kinds that scikit-learn and the boosting libraries do not
provide, and the weighting of the rare positive class they all share. `models.kinds` builds a
model of every kind from these (`make_model`); `models.ensemble` combines them.

- `CategoryCodes`: the trees' encoding of the string columns `gpu_model` and `driver`;
  `dense_preparation`: the one-hot, impute and scale step of `logistic` and `mlp`.
- `SignConstrainedLogistic`: L2 logistic regression whose coefficients on named inputs are
  never negative (monotone constraints for the linear model).
- `OversampledMLP`: scikit-learn's MLP with the positive class weighted by oversampling.
- `BinaryClassifierMixin`, `binary_target`: what every gpufail classifier, the ensembles
  included, shares ("fails" is the second class).

Class imbalance (positives are ~0.1-1% of rows). Every kind weights the positive class by the
same factor `pos_weight` (use `balanced_pos_weight`: neg/pos capped at `MAX_POS_WEIGHT`); the
MLP, which has no class weights, repeats each positive row w times on average
(`OversampledMLP`), which has the same expected loss as a weight of w. A model fit so overstates
the odds of failure by w; training also subsamples negatives, which multiplies the odds by a
further 1/r. `odds_factor` is the product, recorded as the model's one correction factor, and
`prior_correction` divides it out (the ranking is unchanged).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy.special import expit
from sklearn.base import BaseEstimator, ClassifierMixin, TransformerMixin
from sklearn.compose import ColumnTransformer, make_column_selector
from sklearn.impute import SimpleImputer
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler
from sklearn.utils.multiclass import check_classification_targets, type_of_target
from sklearn.utils.validation import check_is_fitted, column_or_1d, validate_data

from models.frame import CATEGORICAL_COLUMNS, is_polars

MAX_POS_WEIGHT = 10.0
"""Cap on the positive-class weight. neg/pos is ~1000 at 1:1000 imbalance, and weighting ~100
positives that heavily makes the trees chase them: on the synthetic frame of tests/models
(240k rows, 1:1000, ~100 training positives) LightGBM's held-out ROC-AUC was 0.90-0.94 with
caps 1-10 and fell to 0.79-0.89 at 30 and 0.56-0.83 at 100."""


def balanced_pos_weight(y: np.ndarray, cap: float = MAX_POS_WEIGHT) -> float:
    """neg/pos of the labels `y`, capped at `cap` and at least 1."""
    y = np.asarray(y)
    pos = int((y == 1).sum())
    neg = int((y == 0).sum())
    if pos == 0:
        return 1.0
    return float(min(max(neg / pos, 1.0), cap))


def odds_factor(pos_weight: float, negative_fraction: float) -> float:
    """The factor by which a model overstates the odds of failure when trained with positives
    weighted `pos_weight` (for every kind, ensemble members included) on a share
    `negative_fraction` of the negative rows: w / r (`prior_correction` divides it out)."""
    return float(pos_weight) / negative_fraction


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


_COMPRESS_BLOCK_ROWS = 65_536


def compress_tails(X: np.ndarray, edge: float) -> np.ndarray:
    """Moves every value of the float array `X` beyond +-`edge` to +-(edge + log(1 + |x| -
    edge)), in place, and returns `X`: unchanged within, continuous with slope 1 at the edge,
    monotone, and a hundred times the edge becomes about edge + log(100 * edge)."""
    over = np.abs(X) > edge
    X[over] = np.copysign(edge + np.log1p(np.abs(X[over]) - edge), X[over])
    return X


class SignConstrainedLogistic(BinaryClassifierMixin, BaseEstimator):
    """L2 logistic regression whose coefficients on the inputs named in `increasing` are never
    negative, so a rise in those inputs never lowers the probability.

    It minimises scikit-learn's `LogisticRegression` objective (the class-weighted log loss
    times C plus half the squared coefficients, the intercept unpenalised) with L-BFGS-B, whose
    bounds hold the constrained coefficients at zero or above: one solve reaches the constrained
    optimum (a constrained coefficient the data would push negative ends at exactly 0). An input
    name matches `increasing` when it equals one of them or ends with `__<name>` (the names a
    `ColumnTransformer` gives, such as `numeric__ecc_dbe_volatile_total_last`); the
    missing-value indicators of those inputs (`numeric__missingindicator_<name>`) are not
    constrained. `class_weight` as in `LogisticRegression`.

    The rows are held in float32 while fitting: each L-BFGS iteration reads the whole design
    twice and is bound by memory traffic, so half the bytes is about half the time (the scored
    risks are computed in float64). `tol` bounds the projected gradient of the objective
    divided by C times the rows' total weight, as `LogisticRegression`'s does.

    The regularisation is chosen on validation when `C` lists several values: each is fit on the
    first `1 - validation_share` of the rows (the caller's rows come in time order, so that is
    the earlier part of the window) and the one with the lowest class-weighted log loss on the
    rest is refit on all of them (`C_`).

    The inputs are standardised counters with heavy tails, which a linear model extrapolates:
    a row a hundred standard deviations out on a few of them drove the decision function past
    37, where the probability is exactly 1.0 in float64 and every such row tied at the top
    risk, and rows far out on several added up to a risk the calibration slice never showed.
    So an input's tail beyond `tail_from` standard deviations grows with the logarithm of the
    distance (`compress_tails`: linear within, continuous with slope 1 at the edge, monotone, so
    the signs of the coefficients keep their meaning), and a scored input is then held within
    the range it had in training (`lower_`, `upper_`). `tail_from=None` leaves inputs linear."""

    def __init__(
        self,
        C: float | Sequence[float] = 1.0,
        max_iter: int = 1000,
        class_weight: dict[Any, float] | str | None = None,
        increasing: Sequence[str] = (),
        validation_share: float = 0.25,
        tol: float = 1e-4,
        tail_from: float | None = 3.0,
    ) -> None:
        self.C = C
        self.max_iter = max_iter
        self.class_weight = class_weight
        self.increasing = increasing
        self.validation_share = validation_share
        self.tol = tol
        self.tail_from = tail_from

    def _constrained_mask(self) -> np.ndarray:
        n = self.n_features_in_
        names = getattr(self, "feature_names_in_", None)
        wanted = set(self.increasing)
        if not wanted:
            return np.zeros(n, dtype=bool)
        if names is None:
            raise ValueError("SignConstrainedLogistic: `increasing` names inputs, so X must be a DataFrame")
        return np.array([str(c) in wanted or str(c).rsplit("__", 1)[-1] in wanted for c in names], dtype=bool)

    def _candidates(self) -> list[float]:
        values = [float(self.C)] if isinstance(self.C, int | float) else [float(c) for c in self.C]
        if not values or any(not c > 0 for c in values):
            raise ValueError(f"SignConstrainedLogistic: C expected a positive number or a list of them, got {self.C!r}")
        return sorted(values)

    def _fit_one(self, X: np.ndarray, y: np.ndarray, C: float) -> tuple[np.ndarray, float, int]:
        """(coefficients, intercept, iterations) of the constrained optimum for `C` on float32 `X`."""
        import warnings

        from scipy.optimize import minimize
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.utils.class_weight import compute_sample_weight

        target = (y == self.classes_[1]).astype(np.float64)
        weight = compute_sample_weight(self.class_weight, y)  # ones without class weights
        # Divided by C times the total weight, the objective's scale does not grow with the rows,
        # so one tolerance fits every window (`LogisticRegression` scales its objective alike).
        scale = float(weight.sum())
        share = weight / scale
        ridge = 1.0 / (C * scale)

        def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
            w = theta[:-1]
            z = (X @ w.astype(np.float32)).astype(np.float64) + theta[-1]
            loss = float(share @ (np.logaddexp(0.0, z) - target * z)) + 0.5 * ridge * float(w @ w)
            residual = share * (expit(z) - target)
            gradient = np.empty_like(theta)
            gradient[:-1] = (X.T @ residual.astype(np.float32)).astype(np.float64) + ridge * w
            gradient[-1] = residual.sum()
            return loss, gradient

        constrained = self._constrained_mask()
        bounds = [(0.0, None) if c else (None, None) for c in constrained] + [(None, None)]
        result = minimize(
            objective,
            np.zeros(X.shape[1] + 1),
            jac=True,
            method="L-BFGS-B",
            bounds=bounds,
            options={"maxiter": self.max_iter, "gtol": self.tol},
        )
        if result.nit >= self.max_iter:
            warnings.warn(
                f"SignConstrainedLogistic: L-BFGS-B stopped at max_iter={self.max_iter} before converging "
                f"(C={C}); raise max_iter or C's regularisation",
                ConvergenceWarning,
                stacklevel=3,
            )
        return result.x[:-1], float(result.x[-1]), int(result.nit)

    def _choose_C(self, X: np.ndarray, y: np.ndarray, candidates: list[float]) -> tuple[float, dict[float, float]]:
        """The candidate with the lowest class-weighted log loss on the last rows, and each loss."""
        from sklearn.metrics import log_loss
        from sklearn.utils.class_weight import compute_sample_weight

        if not 0.0 < self.validation_share < 1.0:
            raise ValueError(
                f"SignConstrainedLogistic: validation_share expected a share in (0, 1), got {self.validation_share!r}"
            )
        cut = round(len(y) * (1.0 - self.validation_share))
        fit_y, val_y = y[:cut], y[cut:]
        if len(np.unique(fit_y)) < 2 or len(np.unique(val_y)) < 2:
            # Too few failures to split: the middle candidate, unvalidated.
            return candidates[len(candidates) // 2], {}
        weight = compute_sample_weight(self.class_weight, val_y)
        lower, upper = X[:cut].min(axis=0), X[:cut].max(axis=0)
        held = np.clip(X[cut:], lower, upper).astype(np.float64)
        losses = {}
        for C in candidates:
            coef, intercept, _ = self._fit_one(X[:cut], fit_y, C)
            losses[C] = float(
                log_loss(val_y, expit(held @ coef + intercept), sample_weight=weight, labels=self.classes_)
            )
        return min(candidates, key=lambda c: (losses[c], c)), losses

    def fit(self, X: Any, y: Any) -> SignConstrainedLogistic:
        # copy=True copies only an array that is still the caller's: its tails are compressed in place.
        X, y = validate_data(self, X, y, dtype=np.float32, order="C", copy=True)
        _binary_classes(self, y)
        if self.tail_from is not None:
            if not self.tail_from > 0:
                raise ValueError(
                    f"SignConstrainedLogistic: tail_from expected a positive number of standard deviations "
                    f"or None, got {self.tail_from!r}"
                )
            for start in range(0, len(X), _COMPRESS_BLOCK_ROWS):  # in blocks: the mask of a whole window is large
                compress_tails(X[start : start + _COMPRESS_BLOCK_ROWS], self.tail_from)
        candidates = self._candidates()
        self.validation_loss_: dict[float, float] = {}
        if len(candidates) == 1:
            self.C_ = candidates[0]
        else:
            self.C_, self.validation_loss_ = self._choose_C(X, y, candidates)
        coef, intercept, self.n_iter_ = self._fit_one(X, y, self.C_)
        self.coef_ = coef[np.newaxis, :]
        self.intercept_ = np.array([intercept])
        self.zeroed_ = self._constrained_mask() & (coef == 0.0)
        self.lower_ = X.min(axis=0).astype(np.float64)
        self.upper_ = X.max(axis=0).astype(np.float64)
        return self

    def held_inputs(self, X: Any) -> np.ndarray:
        """`X` as the model scores it: tails compressed, each input held within its training
        range (what the contributions of `models.explain` must be computed on to add up to the
        logit)."""
        X = np.array(X, dtype=np.float64)  # a copy, compressed and held in place
        # getattr: a model pickled before the tails or the range were kept scores its inputs as
        # it was trained on them.
        tail_from = getattr(self, "tail_from", None)
        if tail_from is not None:
            compress_tails(X, tail_from)
        lower, upper = getattr(self, "lower_", None), getattr(self, "upper_", None)
        if lower is not None and upper is not None:
            np.clip(X, lower, upper, out=X)
        return X

    def decision_function(self, X: Any) -> np.ndarray:
        check_is_fitted(self, "coef_")
        X = self.held_inputs(validate_data(self, X, dtype=np.float64, reset=False))
        return np.asarray(X @ self.coef_[0] + self.intercept_[0], dtype=np.float64)

    def predict_proba(self, X: Any) -> np.ndarray:
        # expit, not 1 / (1 + exp(-z)): exp overflows (a RuntimeWarning) for z below about -709.
        p = expit(self.decision_function(X))
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


def dense_preparation() -> ColumnTransformer:
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
