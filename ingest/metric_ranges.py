"""Readings outside the range a metric can have: counted by the importers and stored as missing.

A metric may declare a valid range (`valid_min`/`valid_max` in `ingest/metrics.csv`, `min`/`max`
of a `[metrics.<name>]` table). A value outside it is not a reading of that metric (a sentinel
such as 4294967295 for "not available", a column mapped to the wrong metric, a unit mix-up), so
an importer stores a null in its place, the same as a cell that was not a number, and counts it
per metric in its summary: a model never learns from it, and the user sees how many there were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ingest.schema import Metric

if TYPE_CHECKING:
    # The collector's install has no polars; it checks readings one by one (`in_range`).
    import polars as pl


def outside_range(value: pl.Expr, metric: Metric) -> pl.Expr | None:
    """True where `value` lies outside `metric`'s valid range (null stays null); None when the
    metric declares no range."""
    test: pl.Expr | None = None
    if metric.valid_min is not None:
        test = value < metric.valid_min
    if metric.valid_max is not None:
        above = value > metric.valid_max
        test = above if test is None else test | above
    return test


def in_range(value: float, metric: Metric) -> bool:
    """Whether one reading lies within `metric`'s valid range (`outside_range` for a frame)."""
    low, high = metric.valid_min, metric.valid_max
    return (low is None or value >= low) and (high is None or value <= high)


def describe_range(metric: Metric) -> str:
    """`[0, 100]`, `[0, ...)`, `(..., 5]`."""
    low = "(..." if metric.valid_min is None else f"[{metric.valid_min:g}"
    high = "...)" if metric.valid_max is None else f"{metric.valid_max:g}]"
    return f"{low}, {high}"
