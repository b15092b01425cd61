"""Why a GPU is ranked where it is: each feature's contribution to a row's score, and the top
few per row (`explain`).

Contributions, by kind (each row's contributions are over the model's feature columns; the
two string columns count as one feature each):

- `lightgbm`, `xgboost`: TreeSHAP, from the libraries themselves (`pred_contrib`,
  `pred_contribs`), in log-odds; they sum, with the bias, to the raw score.
- `random_forest`: the decision-path attribution (Saabas): along each tree's path, the change
  of the node's failure probability is credited to the feature the parent split on; averaged
  over trees, in probability. Exact for the forest's output, cheaper than TreeSHAP, and
  biased towards features split near the leaves.
- `logistic`: coefficient x standardized (imputed) value, in log-odds; one-hot columns and
  missing-value indicators are credited to the feature they come from.
- `mlp`: gradient x input in the standardized space (the gradient of the output log-odds at
  the row, times the row's standardized values), credited like the logistic; a first-order
  approximation (the network is not linear).
- `parallel`: the mean over members of each member's contributions normalised to unit L1
  norm per row: both combination rules weigh members equally, and the members' units differ.
  A share, not a log-odds.
- `cascade`: for a GPU the first stage keeps, the second stage's contributions (it decides
  its rank among the kept); for a dropped one, the first stage's.

Contributions are signed: positive raises the risk. `explain` orders features by absolute
contribution.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp
from sklearn.pipeline import Pipeline

from ingest.errors import InputError
from models.ensemble import CascadeEnsemble, ParallelEnsemble
from models.estimators import OversampledMLP, SignConstrainedLogistic
from models.frame import CATEGORICAL_COLUMNS, feature_matrix, to_pandas
from models.train import TrainedModel

EXPLANATION_COLUMNS = ("gpu_uuid", "ts", "rank", "feature", "value", "contribution")


def _tree_contributions(pipeline: Pipeline, X: pd.DataFrame) -> np.ndarray:
    encoded = pipeline[:-1].transform(X)
    clf = pipeline[-1]
    name = type(clf).__name__
    if name == "LGBMClassifier":
        out = clf.predict(encoded, pred_contrib=True)
        return np.asarray(out, dtype=np.float64)[:, :-1]
    if name == "XGBClassifier":
        import xgboost

        out = clf.get_booster().predict(xgboost.DMatrix(encoded, missing=np.nan), pred_contribs=True)
        return np.asarray(out, dtype=np.float64)[:, :-1]
    return _forest_contributions(clf, np.asarray(encoded, dtype=np.float32))


def _forest_contributions(forest: Any, X: np.ndarray) -> np.ndarray:
    """Saabas attribution of a scikit-learn random forest's probability of the positive class."""
    total = np.zeros(X.shape, dtype=np.float64)
    for tree in forest.estimators_:
        t = tree.tree_
        counts = t.value[:, 0, :]
        p = counts[:, -1] / np.maximum(counts.sum(axis=1), 1e-300)
        parent = np.full(t.node_count, -1)
        internal = np.flatnonzero(t.children_left >= 0)
        parent[t.children_left[internal]] = internal
        parent[t.children_right[internal]] = internal
        child = np.flatnonzero(parent >= 0)
        # Entering `child` changes the probability by p[child] - p[parent], due to the parent's split.
        credit = sp.csr_matrix(
            (p[child] - p[parent[child]], (child, t.feature[parent[child]])), shape=(t.node_count, X.shape[1])
        )
        total += np.asarray((tree.decision_path(X) @ credit).todense())
    return total / len(forest.estimators_)


def _credit_matrix(names: list[str], columns: list[str]) -> np.ndarray:
    """0/1 matrix (prepared inputs x feature columns): which feature each prepared input comes
    from (`categorical__gpu_model_A100` -> gpu_model, `numeric__missingindicator_x` -> x)."""
    index = {c: i for i, c in enumerate(columns)}
    credit = np.zeros((len(names), len(columns)))
    for j, name in enumerate(names):
        block, _, rest = name.partition("__")
        if block == "categorical":
            source = next(c for c in CATEGORICAL_COLUMNS if rest.startswith(c + "_"))
        else:
            source = rest.removeprefix("missingindicator_")
        credit[j, index[source]] = 1.0
    return credit


def _dense_contributions(pipeline: Pipeline, X: pd.DataFrame) -> np.ndarray:
    prepared = pipeline[:-1].transform(X)
    Z = np.asarray(prepared, dtype=np.float64)
    clf = pipeline[-1]
    if isinstance(clf, SignConstrainedLogistic):
        per_input = Z * clf.coef_[0]
    elif isinstance(clf, OversampledMLP):
        per_input = Z * _mlp_logit_gradient(clf.mlp_, Z)
    else:
        raise InputError(f"explain: no contributions for a {type(clf).__name__}")
    return per_input @ _credit_matrix([str(c) for c in prepared.columns], list(X.columns))


def _mlp_logit_gradient(mlp: Any, Z: np.ndarray) -> np.ndarray:
    """Gradient of a ReLU MLPClassifier's output log-odds with respect to its inputs, per row."""
    if mlp.activation != "relu":
        raise InputError(f"explain: expected an MLP with ReLU activations, got {mlp.activation!r}")
    masks = []
    a = Z
    for W, b in zip(mlp.coefs_[:-1], mlp.intercepts_[:-1], strict=True):
        h = a @ W + b
        masks.append(h > 0)
        a = np.maximum(h, 0.0)
    grad = np.broadcast_to(mlp.coefs_[-1][:, 0], (len(Z), mlp.coefs_[-1].shape[0]))
    for W, mask in zip(reversed(mlp.coefs_[:-1]), reversed(masks), strict=True):
        grad = (grad * mask) @ W.T
    return np.asarray(grad)


def _normalised(c: np.ndarray) -> np.ndarray:
    norm = np.abs(c).sum(axis=1, keepdims=True)
    return c / np.where(norm > 0, norm, 1.0)


def contributions(estimator: Any, X: pd.DataFrame) -> np.ndarray:
    """Contributions (rows x columns of `X`) of each feature to each row's score, for any
    estimator `models.estimators.make_model` builds (see the module docstring)."""
    if isinstance(estimator, ParallelEnsemble):
        members = [_normalised(contributions(member, X)) for member in estimator.estimators_]
        return np.mean(members, axis=0)
    if isinstance(estimator, CascadeEnsemble):
        _, kept, _ = estimator.stage_probabilities(X)
        out = contributions(estimator.first_, X)
        if kept.any():
            out[kept] = contributions(estimator.second_, X.iloc[np.flatnonzero(kept)])
        return out
    if not isinstance(estimator, Pipeline):
        raise InputError(f"explain: expected a model built by models.estimators, got {type(estimator).__name__}")
    if estimator.steps[0][0] == "encode":
        return _tree_contributions(estimator, X)
    return _dense_contributions(estimator, X)


def explain(model: TrainedModel, frame: Any, top: int = 5) -> pd.DataFrame:
    """For each row of `frame` (a scored GPU at a grid time), the `top` features that
    contributed most to its score (by absolute contribution), one row each:
    gpu_uuid, ts, rank (1 = largest), feature, value (the row's value of that feature: a
    float, or a string for gpu_model and driver; NaN when missing) and contribution (signed;
    positive raises the risk; units per kind, see the module docstring)."""
    if top < 1:
        raise InputError(f"top: expected a positive number of features, got {top}")
    df = to_pandas(frame)
    X = feature_matrix(df, model.feature_columns)
    n, width = len(X), min(top, X.shape[1])
    if n == 0:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in EXPLANATION_COLUMNS})
    C = contributions(model.estimator, X)
    magnitude = np.abs(C)
    picked = (
        np.argpartition(-magnitude, width - 1, axis=1)[:, :width]
        if width < C.shape[1]
        else np.tile(np.arange(C.shape[1]), (n, 1))
    )
    order = np.argsort(-np.take_along_axis(magnitude, picked, axis=1), axis=1, kind="stable")
    picked = np.take_along_axis(picked, order, axis=1)
    rows = np.repeat(np.arange(n), width)
    cols = picked.ravel()
    values = X.to_numpy(dtype=object)[rows, cols]
    return pd.DataFrame(
        {
            "gpu_uuid": df["gpu_uuid"].to_numpy()[rows] if "gpu_uuid" in df.columns else None,
            "ts": df["ts"].to_numpy()[rows] if "ts" in df.columns else None,
            "rank": np.tile(np.arange(1, width + 1), n),
            "feature": np.asarray(model.feature_columns, dtype=object)[cols],
            "value": values,
            "contribution": C[rows, cols],
        }
    )
