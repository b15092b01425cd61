"""Time-based splits: by timestamp, never by row position.

Many GPUs share each grid time, so a split by row position (scikit-learn's `TimeSeriesSplit`)
would put one grid time on both sides. And a label at time t looks up to t + horizon into the
future, so training rows must stop a full horizon before the test window starts: a training
row at ts has ts + horizon < test_start, and no training label has seen the test period.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

import pandas as pd

from ingest.errors import InputError

TimeLike = datetime | pd.Timestamp | str
DurationLike = timedelta | pd.Timedelta | str


def as_utc(moment: TimeLike) -> pd.Timestamp:
    """A point in time as a UTC pandas Timestamp (naive values are taken to be UTC)."""
    ts = pd.Timestamp(moment)
    return ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")


_UNITS = {"s": "s", "m": "min", "h": "h", "d": "D", "w": "W"}


def as_timedelta(duration: DurationLike, what: str = "duration") -> pd.Timedelta:
    """`timedelta`, `pd.Timedelta` or a string in the configuration's grammar ("90s", "5m",
    "24h", "7d", "1w"), checked to be positive."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", duration) if isinstance(duration, str) else None
    if match:
        # Not pd.Timedelta("7d"): pandas 3.1 deprecates the lower-case day unit.
        value = pd.Timedelta(float(match.group(1)), unit=_UNITS[match.group(2)])  # type: ignore[arg-type]
    else:
        try:
            value = pd.Timedelta(duration)
        except (TypeError, ValueError):
            raise InputError(f"{what}: expected a duration such as '24h' or '7d', got {duration!r}") from None
    if value <= pd.Timedelta(0):
        raise InputError(f"{what}: expected a positive duration, got {duration!r}")
    return value


def _ts_between(frame: Any, start: pd.Timestamp | None, end: pd.Timestamp | None) -> Any:
    """Rows with start <= ts < end (either bound optional), same frame type as given."""
    if isinstance(frame, pd.DataFrame):
        ts = pd.to_datetime(frame["ts"])
        ts = ts.dt.tz_localize("UTC") if ts.dt.tz is None else ts.dt.tz_convert("UTC")
        mask = pd.Series(True, index=frame.index)
        if start is not None:
            mask &= ts >= start
        if end is not None:
            mask &= ts < end
        return frame.loc[mask.to_numpy()]
    import polars as pl

    if not isinstance(frame, pl.DataFrame):
        raise InputError(f"expected a polars or pandas DataFrame, got {type(frame).__name__}")
    dtype = frame.schema["ts"]
    tz = getattr(dtype, "time_zone", None)

    def bound(moment: pd.Timestamp) -> datetime:
        # polars compares like with like: aware bounds for an aware column, naive UTC otherwise.
        return moment.tz_convert(tz).to_pydatetime() if tz else moment.tz_localize(None).to_pydatetime()

    expr = pl.lit(True)
    if start is not None:
        expr = expr & (pl.col("ts") >= bound(start))
    if end is not None:
        expr = expr & (pl.col("ts") < bound(end))
    return frame.filter(expr)


def rows_between(frame: Any, start: TimeLike | None, end: TimeLike | None) -> Any:
    """The rows of a polars or pandas frame with start <= ts < end (either bound optional), in
    the type of `frame`."""
    return _ts_between(frame, None if start is None else as_utc(start), None if end is None else as_utc(end))


def time_split(
    frame: Any,
    test_start: TimeLike,
    horizon: DurationLike,
    train_window: DurationLike | None = None,
    test_end: TimeLike | None = None,
) -> tuple[Any, Any]:
    """Split a feature frame (polars or pandas; the same type comes back) by time.

    train: test_start - horizon - train_window <= ts < test_start - horizon (no lower bound
    without `train_window`); test: test_start <= ts (< test_end if given). Rows in
    [test_start - horizon, test_start) are in neither: their labels reach into the test window.
    """
    if "ts" not in frame.columns:
        raise InputError(f"time_split: expected a feature frame with a ts column, got {list(frame.columns)[:20]}")
    start = as_utc(test_start)
    gap = as_timedelta(horizon, "horizon")
    train_end = start - gap
    train_start = None if train_window is None else train_end - as_timedelta(train_window, "train_window")
    end = None if test_end is None else as_utc(test_end)
    return _ts_between(frame, train_start, train_end), _ts_between(frame, start, end)
