"""K of "precision at the top K": a count, a share of the fleet, or the expected failures.

A module of its own, without numpy or pandas, so that the configuration can check `[evaluate]
top_k` when it loads without importing the evaluation."""

from __future__ import annotations

import math

from ingest.errors import InputError


def parse_top_k(spec: str | int) -> tuple[str, float]:
    """A K specification: a count ("10" or 10) -> ("count", 10); a share of the GPUs present at
    each grid time ("2%" or "0.02") -> ("fraction", 0.02); "expected" -> ("expected", 0): as
    many GPUs as failures are expected per day (see `models.evaluate.expected_failures_per_day`)."""
    text = str(spec).strip().lower()
    if text == "expected":
        return "expected", 0.0
    try:
        if text.endswith("%"):
            value = float(text[:-1]) / 100.0
            kind = "fraction"
        else:
            value = float(text)
            kind = "count" if math.isfinite(value) and value >= 1 and value == int(value) else "fraction"
    except ValueError:
        value, kind = math.nan, "bad"
    if kind == "bad" or not (value > 0) or (kind == "fraction" and value >= 1):
        raise InputError(
            f"top_k {spec!r}: expected a number of GPUs ('10'), a share of the fleet ('2%' or '0.02') or 'expected'"
        )
    return kind, value
