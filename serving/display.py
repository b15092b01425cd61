"""How risks and feature values read to an operator, on the pages and in `gpufail at-risk`'s
table alike. No heavy imports: the terminal command loads this and the snapshot, nothing else."""

from __future__ import annotations

import math
from typing import Any

EXPLAINED = 3
"""Top features shown per GPU in the tables."""


def fmt_value(value: Any) -> str:
    """A feature value as an operator reads it: 3 significant digits, integers whole."""
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    v = float(value)
    if not math.isfinite(v):
        return "—"
    if v == int(v) and abs(v) < 1e9:
        return f"{int(v):,}"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def fmt_risk(risk: float) -> str:
    return f"{risk:.3f}" if risk >= 0.001 or risk == 0 else f"{risk:.1e}"
