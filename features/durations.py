"""The duration grammar of the configuration and of stored feature specs: "30s", "5m", "24h", "7d", "1w".

`gpufail.config` parses its settings with it, and `features.spec` writes and reads the durations
of a `FeatureSpec` with it, so a spec in a model folder or a features manifest reads like the
configuration that made it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
DURATION_EXAMPLES = "'30s', '5m', '24h' or '7d'"


def parse_duration(value: Any) -> timedelta:
    """`"90s"`, `"5m"`, `"24h"`, `"7d"` or `"1w"` -> timedelta.

    A bare number is refused: `horizon = 12` could mean seconds, hours or days, and reading it
    as seconds silently gave a 12-second label horizon."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError(
            f"expected a duration with a unit such as {DURATION_EXAMPLES}, got {value!r} (a number without a unit)"
        )
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", value)
        if match:
            try:
                return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
            except OverflowError:
                raise ValueError(f"expected a duration of at most 999999999 days, got {value!r}") from None
    raise ValueError(f"expected a duration such as {DURATION_EXAMPLES}, got {value!r}")


def format_duration(value: timedelta) -> str:
    """The shortest way to write `value` in this grammar (`timedelta(days=7)` -> "7d")."""
    seconds = value.total_seconds()
    for unit in ("d", "h", "m"):
        if seconds and seconds % _UNITS[unit] == 0:
            return f"{int(seconds // _UNITS[unit])}{unit}"
    # Written exactly, so that a stored spec reads back as the same durations.
    return f"{int(seconds)}s" if seconds == int(seconds) else f"{seconds!r}s"


def format_durations(values: Sequence[timedelta]) -> str:
    """`["1h", "6h"]`: a list of durations as the configuration writes it."""
    return "[" + ", ".join(f'"{format_duration(v)}"' for v in values) + "]"
