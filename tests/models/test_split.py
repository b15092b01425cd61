import pandas as pd
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.errors import InputError
from models.split import time_split
from tests.pandas_arrow import polars_from_pandas

T0 = pd.Timestamp("2026-01-01", tz="UTC")


def grid(n_hours: int = 100, n_gpus: int = 3) -> pd.DataFrame:
    ts = [T0 + pd.Timedelta(hours=h) for h in range(n_hours) for _ in range(n_gpus)]
    return pd.DataFrame({"ts": ts, "gpu_uuid": [f"g{i}" for _ in range(n_hours) for i in range(n_gpus)], "x": 1.0})


@settings(max_examples=40, deadline=None)
@given(
    test_hour=st.integers(min_value=0, max_value=120),
    horizon_h=st.integers(min_value=1, max_value=48),
    window_h=st.one_of(st.none(), st.integers(min_value=1, max_value=80)),
)
def test_no_training_label_reaches_the_test_window(test_hour, horizon_h, window_h):
    frame = grid()
    test_start = T0 + pd.Timedelta(hours=test_hour)
    horizon = pd.Timedelta(hours=horizon_h)
    window = None if window_h is None else pd.Timedelta(hours=window_h)
    train, test = time_split(frame, test_start, horizon, window)
    assert (train["ts"] + horizon < test_start).all()
    assert (test["ts"] >= test_start).all()
    # Nothing is lost that the rule allows: every row before the gap (and in the window) is in train.
    allowed = frame["ts"] < test_start - horizon
    if window is not None:
        allowed &= frame["ts"] >= test_start - horizon - window
    assert len(train) == int(allowed.sum())
    assert len(test) == int((frame["ts"] >= test_start).sum())
    # A grid time is never split across the two sides.
    assert not set(train["ts"]) & set(test["ts"])


def test_split_by_hand():
    frame = grid(n_hours=10, n_gpus=2)
    train, test = time_split(frame, T0 + pd.Timedelta("6h"), "2h", train_window="3h", test_end=T0 + pd.Timedelta("8h"))
    assert sorted(set((train["ts"] - T0) / pd.Timedelta("1h"))) == [1, 2, 3]
    assert sorted(set((test["ts"] - T0) / pd.Timedelta("1h"))) == [6, 7]


def test_polars_frame_gives_polars_back_with_the_same_rows():
    frame = grid(n_hours=30)
    train_pd, test_pd = time_split(frame, "2026-01-01T20:00Z", "6h", "5h")
    train_pl, test_pl = time_split(polars_from_pandas(frame), "2026-01-01T20:00Z", "6h", "5h")
    assert isinstance(train_pl, pl.DataFrame)
    assert len(train_pl) == len(train_pd) and len(test_pl) == len(test_pd)
    assert train_pl["ts"].max() < pd.Timestamp("2026-01-01T14:00Z")


def test_naive_timestamps_are_utc():
    frame = grid(n_hours=30)
    naive = frame.assign(ts=frame["ts"].dt.tz_localize(None))
    train_a, _ = time_split(frame, "2026-01-01T20:00", "6h")
    train_b, _ = time_split(naive, pd.Timestamp("2026-01-01T20:00Z"), "6h")
    assert len(train_a) == len(train_b) == 14 * 3


def test_non_positive_horizon_is_refused():
    with pytest.raises(InputError, match="horizon"):
        time_split(grid(), T0, "0h")
