"""A small synthetic frame and a walk-forward plan that runs on it in seconds, for the
walk-forward and comparison tests."""

from __future__ import annotations

from functools import cache

import pandas as pd

from models.walk_forward import WalkForwardPlan
from tests.models import ONE_THREAD, make_synthetic_frame

FAST = {"n_estimators": 30, **ONE_THREAD}
PLAN = WalkForwardPlan(
    horizon="12h",
    test_days=3,
    train_window="4d",
    candidate_windows=("2d", "6d"),
    validation_window="1d",
    negative_fraction=0.3,
    calibration_window="1d",
)


@cache
def small_frame() -> pd.DataFrame:
    return make_synthetic_frame(n_gpus=120, n_hours=24 * 12, horizon_h=12, fail_fraction=0.4, seed=1)
