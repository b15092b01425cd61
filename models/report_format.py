"""How the report, the pooled comparison and the command line write a share."""

from __future__ import annotations

from typing import Any


def pct(value: Any) -> str:
    """A share in [0, 1] as a percentage with one decimal; "-" when there is none."""
    return "-" if value is None else f"{100 * value:.1f}%"
