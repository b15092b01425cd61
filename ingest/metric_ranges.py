"""Readings outside the range a metric can have: counted by the importers and the collectors,
and stored as missing.

Whatever the metric, NaN, infinities and magnitudes its column cannot hold (or beyond
`MAX_MAGNITUDE`) are not readings: `inf` or `1e308` in a table would otherwise be stored as
infinity and make every window feature of that GPU infinite.

A metric may declare a valid range (`valid_min`/`valid_max` in `ingest/metrics.csv`, `min`/`max`
of a `[metrics.<name>]` table). A value outside it is not a reading of that metric (a sentinel
such as 4294967295 for "not available", a column mapped to the wrong metric, a unit mix-up), so
an importer stores a null in its place, the same as a cell that was not a number, and counts it
per metric in its summary: a model never learns from it, and the user sees how many there were.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ingest.schema import Metric

if TYPE_CHECKING:
    # The collector's install has no polars; it checks readings one by one (`in_range`).
    import polars as pl


# The largest magnitude a reading may have: beyond it a window's sum of squares (standard
# deviations, slopes) overflows float64 to infinity. No metric's real reading comes near.
MAX_MAGNITUDE = 1e150
_TYPE_MAGNITUDE = {"float": 3.4028234663852886e38, "int64": 2.0**63, "int32": 2.0**31, "int16": 2.0**15}


def largest_magnitude(metric: Metric) -> float:
    """The magnitude from which `metric`'s column cannot store a reading, at most `MAX_MAGNITUDE`."""
    return min(MAX_MAGNITUDE, _TYPE_MAGNITUDE.get(str(metric.arrow_type), MAX_MAGNITUDE))


def outside_range(value: pl.Expr, metric: Metric) -> pl.Expr:
    """True where `value` is not a reading of `metric` (null stays null): NaN, an infinity, a
    magnitude its column cannot hold (1e308 would be stored in float32 as infinity) or beyond
    `MAX_MAGNITUDE`, or outside its declared valid range."""
    test = value.is_nan() | (value.abs() >= largest_magnitude(metric))
    if metric.valid_min is not None:
        test = test | (value < metric.valid_min)
    if metric.valid_max is not None:
        test = test | (value > metric.valid_max)
    return test


def in_range(value: float, metric: Metric) -> bool:
    """Whether one reading is a reading of `metric` (`outside_range` for a frame)."""
    if math.isnan(value) or abs(value) >= largest_magnitude(metric):
        return False
    low, high = metric.valid_min, metric.valid_max
    return (low is None or value >= low) and (high is None or value <= high)


def describe_range(metric: Metric) -> str:
    """`[0, 100]`, `[0, ...)`, `(..., 5]`."""
    low = "(..." if metric.valid_min is None else f"[{metric.valid_min:g}"
    high = "...)" if metric.valid_max is None else f"{metric.valid_max:g}]"
    return f"{low}, {high}"
