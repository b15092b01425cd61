"""Behavioural tests on trained models: properties a trained model must have, whatever its data."""

import numpy as np
import pandas as pd
import pytest

from models.train import TrainOptions, train_model
from tests.models import ONE_THREAD, PRECURSOR, demo_frame


def risk_after_raising_the_precursor(**kwargs) -> tuple[np.ndarray, np.ndarray]:
    frame = demo_frame()
    model = train_model(frame, TrainOptions(train_window="5d", horizon="12h", **kwargs))
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
    # The logistic model holds each input within its training range (no logit past what it
    # saw), so a precursor raised beyond that range stops raising the risk but never lowers it.
    before, after = risk_after_raising_the_precursor(kind="logistic")
    assert np.all(after >= before)
    assert np.mean(after > before) > 0.9
    assert after.mean() > 1.5 * before.mean()


def test_the_default_ensemble_never_lowers_the_risk_of_a_rising_precursor():
    # The default ensemble (parallel: LightGBM, XGBoost, logistic regression; top-K
    # intersection) with every member constrained. A GPU's place in each member's ranking can
    # only improve when its precursor rises, and so can its place in the combined ranking.
    frame = demo_frame()
    model = train_model(
        frame,
        TrainOptions(
            kind="parallel", train_window="5d", horizon="12h", params=ONE_THREAD, monotone_increasing=[PRECURSOR]
        ),
    )
    rows = frame.sample(3000, random_state=1).reset_index(drop=True)
    raised = rows.assign(**{PRECURSOR: rows[PRECURSOR] + 0.5})
    # Each row its own scoring time: its risk is its members' mean probability.
    alone = pd.date_range("2030-01-01", periods=len(rows), freq="h", tz="UTC")
    before = model.predict_risk(rows.assign(ts=alone))
    after = model.predict_risk(raised.assign(ts=alone))
    assert np.all(after >= before - 1e-12)
    assert after.mean() > 1.5 * before.mean()
    # Within a scoring time, raising one GPU's precursor (its peers unchanged) never lowers
    # its risk, though the combined ranking reorders it against the others.
    for ts in frame["ts"].drop_duplicates().sample(3, random_state=2):
        fleet = frame[frame["ts"] == ts].reset_index(drop=True)
        base = model.predict_risk(fleet)
        for i in fleet.sample(8, random_state=3).index:
            bumped = fleet.copy()
            bumped.loc[i, PRECURSOR] += 1.0
            assert model.predict_risk(bumped)[i] >= base[i] - 1e-12


def test_the_cascade_with_constrained_stages_never_lowers_the_risk_of_a_rising_precursor():
    before, after = risk_after_raising_the_precursor(kind="cascade", params=ONE_THREAD, monotone_increasing=[PRECURSOR])
    assert np.all(after >= before - 1e-12)
    assert after.mean() > 1.5 * before.mean()


def test_monotone_features_may_be_named_by_glob_and_a_glob_matching_nothing_is_refused():
    from ingest.errors import InputError
    from models.train import matching_features

    columns = ["pcie_replay_rate_1h", "pcie_replay_rate_6h", "temp_gpu_c_mean_1h"]
    assert matching_features(["pcie_replay_rate_*"], columns) == ["pcie_replay_rate_1h", "pcie_replay_rate_6h"]
    assert matching_features(["temp_gpu_c_mean_1h", "temp_*"], columns) == ["temp_gpu_c_mean_1h"]
    with pytest.raises(InputError, match=r"'ecc_dbe_\*' matches no feature column"):
        matching_features(["ecc_dbe_*"], columns)


def test_the_model_the_default_settings_train_never_lowers_the_risk_of_a_rising_error_counter():
    # The CLI trains `[model] kind` with `[model] monotone_increasing` (globs over the error
    # counters); here the synthetic frame's precursor is a PCIe replay rate, named by a glob.
    from gpufail.config import Settings

    settings = Settings()
    assert settings.model.monotone_increasing  # the default constrains the error counters
    before, after = risk_after_raising_the_precursor(
        kind=settings.model.kind, params=ONE_THREAD, monotone_increasing=["pcie_replay_rate_*"]
    )
    assert np.all(after >= before - 1e-12)
    assert after.mean() > 1.5 * before.mean()
