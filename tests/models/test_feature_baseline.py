"""The best single feature baseline: chosen on the validation rows, in its better direction."""

from __future__ import annotations

import numpy as np
import pandas as pd

from models.feature_baseline import choose_feature, feature_scores


def frame(label, **columns):
    return pd.DataFrame({"ts": pd.Timestamp("2026-01-01", tz="UTC"), "gpu_uuid": "g", "label": label, **columns})


def test_the_feature_that_separates_best_is_chosen_in_its_better_direction():
    label = pd.array([0, 0, 0, 1, 1, None], dtype="Int8")
    validation = frame(
        label,
        weak=[0.0, 1.0, 2.0, 1.5, 0.5, 9.0],
        falls=[5.0, 4.0, 6.0, 1.0, 0.0, 9.0],  # lower is riskier: perfect once turned around
        constant=[1.0] * 6,
    )
    choice = choose_feature(validation)
    assert choice == {"feature": "falls", "direction": -1, "validation_roc_auc": 1.0}
    scores = feature_scores(frame(label, falls=[3.0, np.nan, 1.0, 0.0, 2.0, 4.0]), choice)
    assert list(np.argsort(-scores)) == [3, 2, 4, 0, 5, 1]  # the null is lowest


def test_no_feature_is_chosen_without_both_classes_or_without_numeric_features():
    assert choose_feature(frame(pd.array([0, 0, None], dtype="Int8"), x=[1.0, 2.0, 3.0])) is None
    assert choose_feature(frame(pd.array([0, 1], dtype="Int8"), x=[1.0, 1.0])) is None
    # a boolean flag is a feature too; its nulls count as not set
    flag = pd.array([False, True, None, True], dtype="boolean")
    assert choose_feature(frame(pd.array([0, 1, 0, 1], dtype="Int8"), flag=flag))["feature"] == "flag"
