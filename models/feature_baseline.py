"""The best single raw feature as a baseline: a model has to beat the one counter an operator
could have alarmed on by hand.

The feature and its direction are chosen on the validation slice (the labelled rows just before
the test period that also set the operating points), never on the test period: the numeric
feature whose ROC-AUC there, taken in whichever direction is better, is highest. Nulls score as
the lowest value (a counter that was not read raises no alarm)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from scipy.stats import rankdata

from models.frame import feature_columns, labels


def _values(frame: pd.DataFrame, column: str) -> np.ndarray:
    return pd.to_numeric(frame[column], errors="coerce").astype("Float64").to_numpy(dtype=np.float64, na_value=np.nan)


def _roc_auc(y: np.ndarray, x: np.ndarray) -> float:
    """ROC-AUC as the Mann-Whitney statistic (ties count half): one ranking per feature, without
    the checks `sklearn.metrics.roc_auc_score` repeats for each of hundreds of columns."""
    ranks = rankdata(x)
    positive = y == 1
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def choose_feature(validation: pd.DataFrame) -> dict[str, Any] | None:
    """{"feature", "direction" (+1 or -1), "validation_roc_auc"} of the best single numeric
    feature on `validation`; None when it lacks either class or a numeric feature."""
    y = labels(validation).to_numpy()
    known = ~np.isnan(y)
    y = y[known]
    if len(np.unique(y)) < 2:
        return None
    best: dict[str, Any] | None = None
    for column in feature_columns(validation):
        if not (pd.api.types.is_numeric_dtype(validation[column]) or pd.api.types.is_bool_dtype(validation[column])):
            continue
        x = _values(validation, column)[known]
        finite = np.isfinite(x)
        if not finite.any() or np.nanmin(x) == np.nanmax(x):
            continue
        auc = _roc_auc(y, np.where(finite, x, np.nanmin(x[finite]) - 1.0))
        direction = 1 if auc >= 0.5 else -1
        auc = max(auc, 1.0 - auc)
        if best is None or auc > best["validation_roc_auc"]:
            best = {"feature": column, "direction": direction, "validation_roc_auc": auc}
    return best


def feature_scores(frame: pd.DataFrame, choice: dict[str, Any]) -> np.ndarray:
    """The chosen feature in its direction, nulls below every value."""
    x = choice["direction"] * _values(frame, choice["feature"])
    finite = np.isfinite(x)
    floor = np.min(x[finite]) - 1.0 if finite.any() else 0.0
    return np.where(finite, x, floor)
