"""Why a GPU is ranked where it is: each feature's contribution to a row's score, and the top
few per row (`explain`).

Contributions, by kind (each row's contributions are over the model's feature columns; the
two string columns count as one feature each):

- `lightgbm`, `xgboost`: TreeSHAP (path-dependent, as the libraries' `pred_contrib` /
  `pred_contribs`), in log-odds; they sum, with the bias, to the raw score. Computed by
  `models.treeshap` (same values, vectorised over rows and trees); models it does not cover
  (categorical splits, several classes) fall back to the library.
- `random_forest`: the decision-path attribution (Saabas): along each tree's path, the change
  of the node's failure probability is credited to the feature the parent split on; averaged
  over trees, in probability. Exact for the forest's output, cheaper than TreeSHAP, and
  biased towards features split near the leaves.
- `logistic`: coefficient x standardized (imputed) value as the model scores it (its tails
  compressed, held to the training range: `SignConstrainedLogistic.held_inputs`), in
  log-odds; one-hot columns and missing-value indicators are credited to the feature they
  come from.
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

import weakref
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp
from sklearn.pipeline import Pipeline

from ingest.errors import InputError
from models.ensemble import CascadeEnsemble, ParallelEnsemble
from models.estimators import CategoryCodes, OversampledMLP, SignConstrainedLogistic
from models.frame import CATEGORICAL_COLUMNS, feature_matrix, to_pandas
from models.train import TrainedModel
from models.treeshap import Unsupported, tree_shap

EXPLANATION_COLUMNS = ("gpu_uuid", "ts", "rank", "feature", "value", "contribution")


def _tree_contributions(pipeline: Pipeline, X: pd.DataFrame) -> np.ndarray:
    clf = pipeline[-1]
    name = type(clf).__name__
    if name in ("LGBMClassifier", "XGBClassifier") and isinstance(pipeline[0], CategoryCodes):
        try:
            shap = tree_shap(clf)
        except Unsupported:
            pass
        else:
            return shap.contributions(_category_coded(pipeline[0], X))
    encoded = pipeline[:-1].transform(X)
    if name == "LGBMClassifier":
        out = clf.predict(encoded, pred_contrib=True)
        return np.asarray(out, dtype=np.float64)[:, :-1]
    if name == "XGBClassifier":
        import xgboost

        out = clf.get_booster().predict(xgboost.DMatrix(encoded, missing=np.nan), pred_contribs=True)
        return np.asarray(out, dtype=np.float64)[:, :-1]
    return _forest_contributions(clf, encoded)


def _category_coded(encoder: CategoryCodes, X: pd.DataFrame) -> np.ndarray:
    """`encoder.transform(X)` as one float64 matrix, without building a DataFrame (the same
    codes: a category's position among those seen in fit, NaN when unseen)."""
    if list(X.columns) != list(encoder.feature_names_in_):
        raise InputError(f"explain: expected columns {list(encoder.feature_names_in_)}, got {list(X.columns)}")
    position = {c: i for i, c in enumerate(X.columns)}
    numeric = [c for c in X.columns if c not in encoder.categories_]
    out = np.empty(X.shape, dtype=np.float64)
    out[:, [position[c] for c in numeric]] = X[numeric].to_numpy(dtype=np.float64)
    for c, categories in encoder.categories_.items():
        code = pd.Index(categories).get_indexer(X[c].astype(str)).astype(np.float64)
        code[code < 0] = np.nan
        out[:, position[c]] = code
    return out


def _forest_contributions(forest: Any, X: pd.DataFrame) -> np.ndarray:
    """Saabas attribution of a scikit-learn random forest's probability of the positive class."""
    credit = _FOREST_CREDIT.get(forest)
    if credit is None:
        credit = _FOREST_CREDIT[forest] = _leaf_credit(forest, X.shape[1])
    # One sparse product over all trees: each row's leaf in each tree picks that leaf's credit.
    leaves = forest.apply(X) + np.asarray(credit.offsets)[None, :]
    rows = sp.csr_matrix(
        (np.ones(leaves.size), leaves.ravel(), np.arange(0, leaves.size + 1, leaves.shape[1])),
        shape=(len(X), credit.matrix.shape[0]),
    )
    return np.asarray((rows @ credit.matrix).todense()) / len(forest.estimators_)


class _LeafCredit:
    """Per node of every tree (stacked; `offsets` where each tree starts): the credit, per
    feature, summed along the path from the root to the node."""

    def __init__(self, matrix: sp.csr_matrix, offsets: list[int]) -> None:
        self.matrix, self.offsets = matrix, offsets


_FOREST_CREDIT: weakref.WeakKeyDictionary[Any, _LeafCredit] = weakref.WeakKeyDictionary()


def _leaf_credit(forest: Any, n_features: int) -> _LeafCredit:
    blocks, offsets, start = [], [], 0
    for tree in forest.estimators_:
        t = tree.tree_
        counts = t.value[:, 0, :]
        p = counts[:, -1] / np.maximum(counts.sum(axis=1), 1e-300)
        parent = np.full(t.node_count, -1)
        internal = np.flatnonzero(t.children_left >= 0)
        parent[t.children_left[internal]] = internal
        parent[t.children_right[internal]] = internal
        # Entering a node changes the probability by p[node] - p[parent], due to the parent's
        # split; a node's path credit is the sum of that over the node and its ancestors.
        node_rows, node_cols, node_vals = [], [], []
        here = np.arange(t.node_count)
        on_path = here.copy()
        while True:
            keep = parent[on_path] >= 0
            here, on_path = here[keep], on_path[keep]
            if not len(here):
                break
            node_rows.append(here)
            node_cols.append(t.feature[parent[on_path]])
            node_vals.append(p[on_path] - p[parent[on_path]])
            on_path = parent[on_path]
        rows = np.concatenate(node_rows) if node_rows else np.zeros(0, dtype=int)
        cols = np.concatenate(node_cols) if node_cols else np.zeros(0, dtype=int)
        vals = np.concatenate(node_vals) if node_vals else np.zeros(0)
        blocks.append(sp.csr_matrix((vals, (rows, cols)), shape=(t.node_count, n_features)))
        offsets.append(start)
        start += t.node_count
    return _LeafCredit(sp.vstack(blocks, format="csr"), offsets)


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
        per_input = clf.held_inputs(Z) * clf.coef_[0]
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
    estimator `models.kinds.make_model` builds (see the module docstring)."""
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


def top_contributions(contribution: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """The `top` largest contributions of each row by absolute value, largest first: (column
    index, contribution), each (rows x min(top, columns)). Ties keep the lower column first."""
    if top < 1:
        raise InputError(f"top: expected a positive number of features, got {top}")
    n, columns = contribution.shape
    width = min(top, columns)
    magnitude = np.abs(contribution)
    if width < columns:
        picked = np.argpartition(-magnitude, width - 1, axis=1)[:, :width]
        picked.sort(axis=1)  # ties then resolve by column, whatever argpartition returned
    else:
        picked = np.tile(np.arange(columns), (n, 1))
    order = np.argsort(-np.take_along_axis(magnitude, picked, axis=1), axis=1, kind="stable")
    picked = np.take_along_axis(picked, order, axis=1)
    return picked, np.take_along_axis(contribution, picked, axis=1)


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
    if len(X) == 0:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in EXPLANATION_COLUMNS})
    picked, contribution = top_contributions(contributions(model.estimator, X), top)
    n, width = picked.shape
    rows = np.repeat(np.arange(n), width)
    cols = picked.ravel()
    return pd.DataFrame(
        {
            "gpu_uuid": df["gpu_uuid"].to_numpy()[rows] if "gpu_uuid" in df.columns else None,
            "ts": df["ts"].to_numpy()[rows] if "ts" in df.columns else None,
            "rank": np.tile(np.arange(1, width + 1), n),
            "feature": np.asarray(model.feature_columns, dtype=object)[cols],
            "value": _values_at(X, rows, cols),
            "contribution": contribution.ravel(),
        }
    )


def _values_at(X: pd.DataFrame, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """X's values at (rows[i], cols[i]) as objects: floats, and strings for the categorical
    columns (without turning all of X into objects)."""
    values = np.empty(len(rows), dtype=object)
    for j in np.unique(cols):
        at = cols == j
        column = X.iloc[:, int(j)].to_numpy()
        values[at] = column[rows[at]].astype(object) if column.dtype == object else column[rows[at]].astype(float)
    return values
