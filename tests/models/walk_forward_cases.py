"""A small synthetic frame and a walk-forward plan that runs on it in seconds, for the
walk-forward and comparison tests."""

from __future__ import annotations

from functools import cache

import pandas as pd

from models.walk_forward import Contender, WalkForwardPlan
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

STORE_CONTENDERS = [
    Contender("lgb static", "lightgbm", "static", FAST),
    Contender("lgb sliding", "lightgbm", "sliding", FAST),
    Contender("lgb auto", "lightgbm", "auto", FAST),
    Contender("logistic sliding", "logistic", "sliding"),
    Contender(
        "pair",
        "parallel",
        "sliding",
        {"members": ["lightgbm", "logistic"], "member_params": {"lightgbm": FAST}, "top_k": 5, **ONE_THREAD},
    ),
]
"""A contender of every kind of work the walk-forward shares (static, sliding and auto trees, a
linear model, the parallel ensemble over both), for the store-against-memory tests."""


@cache
def small_frame() -> pd.DataFrame:
    return make_synthetic_frame(n_gpus=120, n_hours=24 * 12, horizon_h=12, fail_fraction=0.4, seed=1)
