"""Drift events that the features themselves show, and how the contenders' precision moves
across the ones that fall inside the walk-forward's test period.

Retraining only earns its cost when the fleet changes under a model, so the comparison names
each change it can see and splits the test period at it:

- a **driver rollout**: a driver version absent at the first grid time of the data; it starts at
  the first row on it, and reaches half the fleet at the first grid time where at least half of
  the rows run it (a reload resets the volatile counters, and a new driver moves power readings
  and XID rates: a model trained before it has never seen its rows);
- **new nodes**: nodes whose first row comes a day or more after the data's first, grouped by
  the day they appear (a rack brought up at once), at least `MIN_NEW_NODES` of them.

For each event inside the test period, `before_after` gives each scorer's daily precision@K
(mean over the days before the event's first day, and over that day and the ones after) and
its alarm precision at the headline quota (alarms and hits summed over the same days). The
split is at the event's start: from then on a static model scores rows unlike its training's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

MIN_NEW_NODES = 2
"""Fewer nodes appearing on one day are repairs and returns, not new hardware."""


def _utc(values: Any) -> pd.Series:
    return pd.to_datetime(pd.Series(values), utc=True)


@dataclass(frozen=True)
class DriftFacts:
    """What the events are found from, small whatever the fleet: rows per (grid time, driver)
    and each node's first grid time. Facts of consecutive parts of the data (a store read a
    day at a time) merge into the facts of the whole (`merged`)."""

    drivers: pd.DataFrame
    """Rows per grid time (index, sorted) and driver version (columns)."""
    first_seen: pd.Series
    """node -> its first grid time."""
    first: pd.Timestamp | None
    """The data's first grid time (None: no rows)."""

    @classmethod
    def of(cls, frame: pd.DataFrame) -> DriftFacts:
        """The facts of a frame with ts and, where present, driver and node."""
        if not len(frame):
            return cls(pd.DataFrame(), pd.Series(dtype="datetime64[ns, UTC]"), None)
        ts = _utc(frame["ts"]).reset_index(drop=True)
        drivers = pd.DataFrame()
        if "driver" in frame.columns:
            # Rows per (grid time, driver): a few thousand counts instead of a pass over every row per version.
            drivers = (
                pd.DataFrame({"ts": ts, "driver": frame["driver"].astype("string").reset_index(drop=True)})
                .groupby(["ts", "driver"], observed=True)
                .size()
                .unstack(fill_value=0)
                .sort_index()
            )
        first_seen = pd.Series(dtype="datetime64[ns, UTC]")
        if "node" in frame.columns:
            first_seen = ts.groupby(frame["node"].astype("string").reset_index(drop=True)).min()
        return cls(drivers, first_seen, ts.min())

    @classmethod
    def merged(cls, parts: list[DriftFacts]) -> DriftFacts:
        """The facts of the data whose parts (in time order, no grid time in two) are `parts`."""
        parts = [p for p in parts if p.first is not None]
        if not parts:
            return cls.of(pd.DataFrame({"ts": []}))
        drivers = pd.concat([p.drivers for p in parts]).fillna(0).astype(np.int64).sort_index()
        seen = pd.concat([p.first_seen for p in parts])
        return cls(drivers, seen.groupby(level=0).min(), min(p.first for p in parts if p.first is not None))


def driver_rollouts(frame: pd.DataFrame | DriftFacts) -> list[dict[str, Any]]:
    """Driver versions absent at the data's first grid time: their first row and the grid time
    at which half the rows first run them (None if they never reach half)."""
    counts = (frame if isinstance(frame, DriftFacts) else DriftFacts.of(frame)).drivers
    if counts.empty:
        return []
    share = counts.div(counts.sum(axis=1), axis=0)
    known = set(counts.columns[counts.iloc[0].to_numpy() > 0])
    events = []
    for version in sorted(set(counts.columns) - known):
        on = share[version].to_numpy()
        half = np.flatnonzero(on >= 0.5)
        events.append(
            {
                "kind": "driver rollout",
                "what": f"driver {version}",
                "start": _utc([share.index[np.flatnonzero(on > 0)[0]]])[0].isoformat(),
                "half": _utc([share.index[half[0]]])[0].isoformat() if len(half) else None,
                "final_share": float(on[-1]),
            }
        )
    return events


def new_nodes(frame: pd.DataFrame | DriftFacts) -> list[dict[str, Any]]:
    """Nodes first seen a day or more after the data's first grid time, grouped by that day."""
    facts = frame if isinstance(frame, DriftFacts) else DriftFacts.of(frame)
    if facts.first is None or facts.first_seen.empty:
        return []
    seen = facts.first_seen
    late = seen[seen >= facts.first + pd.Timedelta(days=1)]
    events = []
    for day, nodes in late.groupby(late.dt.floor("D")):
        if len(nodes) >= MIN_NEW_NODES:
            events.append(
                {
                    "kind": "new nodes",
                    "what": f"{len(nodes)} nodes join",
                    "start": nodes.min().isoformat(),
                    "half": None,
                    "n_nodes": len(nodes),
                    "day": day.isoformat(),
                }
            )
    return events


def drift_events(frame: pd.DataFrame | DriftFacts) -> list[dict[str, Any]]:
    """Every event `driver_rollouts` and `new_nodes` find, in time order."""
    facts = frame if isinstance(frame, DriftFacts) else DriftFacts.of(frame)
    return sorted(driver_rollouts(facts) + new_nodes(facts), key=lambda e: e["start"])


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.mean(kept)) if kept else None


def _split(daily: list[float | None], cut: int) -> dict[str, Any]:
    return {"before": _mean(daily[:cut]), "after": _mean(daily[cut:])}


def _alarm_split(daily: dict[str, list[float]], cut: int) -> dict[str, Any]:
    alarms, hits = np.asarray(daily["alarms"], dtype=float), np.asarray(daily["hits"], dtype=float)
    out = {}
    for side, part in (("before", slice(None, cut)), ("after", slice(cut, None))):
        n = float(alarms[part].sum())
        out[side] = float(hits[part].sum() / n) if n else None
        out[f"n_alarms_{side}"] = int(n)
    return out


def before_after(
    events: list[dict[str, Any]],
    test_start: pd.Timestamp,
    test_end: pd.Timestamp,
    daily_precision: dict[str, list[float | None]],
    alarm_days: dict[str, dict[str, list[float]]],
) -> list[dict[str, Any]]:
    """`events`, each with `in_test` and, when inside the test period, `day` (its first day,
    counted from the test start) and per scorer the daily precision@K and the alarm precision
    before and after it. `daily_precision`: per scorer, the precision of each test day;
    `alarm_days`: per scorer, the alarms and hits of each test day at the headline quota."""
    out = []
    for event in events:
        start = pd.Timestamp(event["start"])
        inside = bool(test_start <= start < test_end)
        row = {**event, "in_test": inside}
        if inside:
            cut = int((start - test_start) // pd.Timedelta(days=1))
            row["day"] = cut
            row["scorers"] = {
                name: {
                    "precision_at_k": _split(days, cut),
                    **({"alarm_precision": _alarm_split(alarm_days[name], cut)} if name in alarm_days else {}),
                }
                for name, days in daily_precision.items()
            }
        out.append(row)
    return out
