"""Paired differences with the power to read them: one fleet or several pooled.

Two operating points on the same days (a contender and a baseline at the same daily quota) give,
per day, (hits, alarms) for precision and (caught, failures) for recall. Their difference is
drawn by a paired percentile bootstrap: the same days are drawn for both, days are drawn within
each fleet (a stratum) and the counts summed over the fleets, so a pooled interval keeps every
fleet's share of the alarms.

A difference is only worded as a finding when the data could have shown it:

- `higher` / `lower`: the 95% interval lies wholly above / below zero;
- `no difference`: it includes zero and lies within +-`EQUIVALENCE_MARGIN`, and so does 1.96
  standard errors (below);
- `not shown`: it includes zero and is wider than that: too few alarms to tell.

`detectable` is the smallest true difference the comparison would find with 80% power at the
5% level, (z_0.975 + z_0.8) x the standard error: what "not shown" could have missed. The
standard error is the bootstrap's, at least that of two binomial shares with the same counts
(`_binomial_se`): a few alarms all right on both sides have no spread to resample, not a
precise difference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

EQUIVALENCE_MARGIN = 0.10
"""A difference within +-10 points is "no difference" (the issue's bar for a decisive interval)."""
POWER_FACTOR = 1.959964 + 0.841621
"""z for a two-sided 5% test plus z for 80% power."""

Stratum = tuple[np.ndarray, np.ndarray]
"""Per day of one fleet, (numerator, denominator) of the first and the second operating point."""


def paired_difference(strata: Sequence[Stratum], *, samples: int, seed: int) -> dict[str, Any]:
    """first - second of the pooled ratios sum(numerator) / sum(denominator) over `strata`,
    with its paired bootstrap interval, standard error, detectable difference and verdict
    (module docstring). None figures where a side has no denominator."""
    if not strata:
        return _empty()
    a = [np.asarray(s[0], dtype=np.float64).reshape(-1, 2) for s in strata]
    b = [np.asarray(s[1], dtype=np.float64).reshape(-1, 2) for s in strata]
    point = _ratio(sum(x.sum(axis=0) for x in a)) - _ratio(sum(x.sum(axis=0) for x in b))
    if math.isnan(point):
        return _empty()
    if samples < 1 or all(len(x) < 2 for x in a):
        return {**_empty(), "difference": point}
    rng = np.random.default_rng(seed)
    totals = np.zeros((samples, 4))
    for first, second in zip(a, b, strict=True):
        if len(first) != len(second):
            raise ValueError(f"paired difference: {len(first)} days against {len(second)}; expected the same days")
        draws = rng.integers(0, len(first), size=(samples, len(first)))
        totals += np.column_stack([first[draws].sum(axis=1), second[draws].sum(axis=1)])
    with np.errstate(invalid="ignore", divide="ignore"):
        stats = totals[:, 0] / totals[:, 1] - totals[:, 2] / totals[:, 3]
    stats = stats[np.isfinite(stats)]
    if len(stats) < 2:
        return {**_empty(), "difference": point}
    low, high = (float(v) for v in np.quantile(stats, [0.025, 0.975]))
    se = max(float(stats.std(ddof=1)), _binomial_se(a, b))
    return {
        "difference": point,
        "ci": [low, high],
        "se": se,
        # A share differs by at most 1: 100 points means no difference could be found.
        "detectable": min(POWER_FACTOR * se, 1.0),
        "verdict": verdict(low, high, half_width=1.959964 * se),
    }


def _binomial_se(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """The standard error two independent binomial shares with these counts would have, each
    share taken as (x + 1) / (n + 2): the floor of the bootstrap's, which sees no spread where
    every alarm of a few was right (or wrong) and would call 2 of 2 against 3 of 3 certain."""
    total = 0.0
    for side in (a, b):
        x, n = (float(v) for v in sum(d.sum(axis=0) for d in side))
        p = (x + 1.0) / (n + 2.0)
        total += p * (1.0 - p) / n
    return math.sqrt(total)


def verdict(low: float | None, high: float | None, margin: float = EQUIVALENCE_MARGIN, half_width: float = 0.0) -> str:
    """`higher`, `lower`, `no difference` or `not shown` for a 95% interval (module docstring);
    `no difference` also needs `half_width` (1.96 standard errors) within the margin."""
    if low is None or high is None:
        return "not shown"
    if low > 0:
        return "higher"
    if high < 0:
        return "lower"
    if -margin <= low and high <= margin and half_width <= margin:
        return "no difference"
    return "not shown"


def _ratio(sums: Any) -> float:
    num, den = float(sums[0]), float(sums[1])
    return num / den if den > 0 else math.nan


def _empty() -> dict[str, Any]:
    return {"difference": None, "ci": [None, None], "se": None, "detectable": None, "verdict": "not shown"}


def day_pairs(first: dict[str, Any], second: dict[str, Any], figure: str, suffix: str = "") -> Stratum:
    """The per-day (numerator, denominator) of `figure` ("precision" or "recall") of two
    operating points' `day_counts` (`models.alarms.alarm_metrics`), within window `suffix`."""
    num, den = {"precision": (f"hits{suffix}", f"known{suffix}"), "recall": (f"caught{suffix}", "failures")}[figure]
    return tuple(  # type: ignore[return-value]
        np.column_stack([np.asarray(p["day_counts"][num]), np.asarray(p["day_counts"][den])]) for p in (first, second)
    )


def compare_points(
    first: Sequence[dict[str, Any]], second: Sequence[dict[str, Any]], *, samples: int, seed: int
) -> dict[str, Any]:
    """first - second, operating points of the same fleets in the same order (one each for a
    single fleet): precision and recall within both windows (`precision`, `precision_long`,
    `recall`, `recall_long`), each a `paired_difference`."""
    out = {}
    for figure in ("precision", "recall"):
        for suffix in ("", "_long"):
            strata = [day_pairs(a, b, figure, suffix) for a, b in zip(first, second, strict=True)]
            out[f"{figure}{suffix}"] = paired_difference(strata, samples=samples, seed=seed)
    return out
