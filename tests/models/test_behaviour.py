"""Behavioural tests on trained models (CONVENTIONS.md 11)."""

import numpy as np
import pytest

from models.train import train_model
from tests.models import ONE_THREAD, PRECURSOR, demo_frame


def risk_after_raising_the_precursor(**kwargs) -> tuple[np.ndarray, np.ndarray]:
    frame = demo_frame()
    model = train_model(frame, train_window="5d", horizon="12h", **kwargs)
    rows = frame.sample(3000, random_state=1)
    raised = rows.assign(**{PRECURSOR: rows[PRECURSOR] + 0.5})
    return model.predict_risk(rows), model.predict_risk(raised)


@pytest.mark.parametrize("kind", ["lightgbm", "xgboost"])
def test_with_a_monotone_constraint_a_rising_precursor_never_lowers_the_risk(kind):
    before, after = risk_after_raising_the_precursor(kind=kind, params=ONE_THREAD, monotone_increasing=[PRECURSOR])
    assert np.all(after >= before - 1e-12)
    assert after.mean() > 1.5 * before.mean()


def test_without_it_trees_can_lower_the_risk_of_a_rising_precursor():
    # Why the constraint exists: the unconstrained trees learn bumps from ~150 failures.
    before, after = risk_after_raising_the_precursor(kind="lightgbm", params=ONE_THREAD)
    assert after.mean() > 1.5 * before.mean()
    assert np.max(before - after) > 1e-3


def test_logistic_regression_raises_the_risk_with_the_precursor():
    before, after = risk_after_raising_the_precursor(kind="logistic")
    assert np.all(after > before)
