"""What the false alarms are: the riskiest alarms of one operating point whose GPU did not fail
within the long window, each with its node, the failure nearest to it on its node (and that
failure's mode), and the features that stood out most in its row.

"Stood out": the row's value in standard deviations from the test period's mean of that
feature, the largest first. It says which readings made the alarm unusual, not how the model
weighed them (a model-free view, the same for every kind of model)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from models.alarms import AlarmFrame, alarm_table
from models.frame import feature_columns, labels, to_pandas


@dataclass(frozen=True)
class Moments:
    """Per numeric feature column: the count, mean and sum of squared deviations of its values
    (nulls left out). The moments of consecutive parts of the test rows merge into those of the
    whole (`merged`, Chan et al.'s pairwise update), so a store read a day at a time gives the
    spread the rows in memory give."""

    columns: dict[str, tuple[int, float, float]]

    @classmethod
    def of(cls, frame: pd.DataFrame) -> Moments:
        out = {}
        for c in [c for c in feature_columns(frame) if pd.api.types.is_numeric_dtype(frame[c])]:
            x = pd.to_numeric(frame[c], errors="coerce").astype("Float64").to_numpy(dtype=np.float64, na_value=np.nan)
            x = x[~np.isnan(x)]
            mean = float(x.mean()) if len(x) else 0.0
            out[c] = (len(x), mean, float(((x - mean) ** 2).sum()) if len(x) else 0.0)
        return cls(out)

    @classmethod
    def merged(cls, parts: list[Moments]) -> Moments:
        out: dict[str, tuple[int, float, float]] = {}
        for part in parts:
            for c, (n_b, mean_b, m2_b) in part.columns.items():
                n_a, mean_a, m2_a = out.get(c, (0, 0.0, 0.0))
                n = n_a + n_b
                if n == 0:
                    out[c] = (0, 0.0, 0.0)
                    continue
                delta = mean_b - mean_a
                out[c] = (n, mean_a + delta * n_b / n, m2_a + m2_b + delta * delta * n_a * n_b / n)
        return cls(out)

    def spread(self) -> dict[str, tuple[float, float]]:
        """feature -> (mean, standard deviation with one degree of freedom) where defined."""
        return {c: (mean, math.sqrt(m2 / (n - 1))) for c, (n, mean, m2) in self.columns.items() if n > 1}


@dataclass(frozen=True)
class FeatureView:
    """What the false alarms are explained by: the test period's spread of each feature, and
    the test rows at given positions with every feature (from memory, or read from the store:
    `models.store_evaluation`)."""

    spread: dict[str, tuple[float, float]]
    rows: Callable[[np.ndarray], pd.DataFrame]

    @classmethod
    def of(cls, test: Any) -> FeatureView:
        """The view of test rows held in memory with their features."""
        test = to_pandas(test)
        return cls(Moments.of(test).spread(), lambda positions: test.iloc[positions])


def top_false_alarms(
    frame: AlarmFrame,
    test: pd.DataFrame,
    alarm: np.ndarray,
    scores: np.ndarray,
    *,
    features: FeatureView | None = None,
    failure_modes: Any = None,
    nodes: pd.Series | None = None,
    n: int = 10,
    n_features: int = 3,
) -> list[dict[str, Any]]:
    """Up to `n` false alarms (not right within the long window, the data reaching that far) of
    `alarm` (sorted order of `frame`, the AlarmFrame of `test`), highest `scores` (sorted order)
    first: ts, gpu_uuid, node, score, the nearest failure on its node (`nearest_failure`: mode,
    gpu_uuid, hours from the alarm, negative before it; None when its node has none) and the
    `n_features` most unusual features of its row (`leading_features`, from `features`:
    default `test`'s own)."""
    table = alarm_table(frame, alarm)
    false = table.loc[~table["hit_long"].to_numpy() & table["known_long"].to_numpy()].copy()
    if len(false) == 0:
        return []
    false["score"] = scores[false["row"].to_numpy()]
    false = false.sort_values(["score", "ts"], ascending=[False, True]).head(n)
    test = to_pandas(test)
    features = features or FeatureView.of(test)
    labelled = np.flatnonzero(labels(test).notna().to_numpy())
    positions = labelled[frame.order[false["row"].to_numpy()]]
    rows = features.rows(positions)
    truth = _truth(failure_modes, nodes)
    out = []
    for (_, alarm_row), (_, row) in zip(false.iterrows(), rows.iterrows(), strict=True):
        gpu = str(alarm_row["gpu_uuid"])
        node = str(row["node"]) if "node" in rows.columns else (None if nodes is None else nodes.get(gpu))
        out.append(
            {
                "ts": alarm_row["ts"].isoformat(),
                "gpu_uuid": gpu,
                "node": node,
                "score": float(alarm_row["score"]),
                "nearest_failure": _nearest(truth, node, alarm_row["ts"]),
                "leading_features": _leading(features.spread, row, n_features),
            }
        )
    return out


def _truth(failure_modes: Any, nodes: pd.Series | None) -> pd.DataFrame | None:
    """The ground-truth failures (ts, gpu_uuid, mode) with their node, where both are known."""
    if failure_modes is None:
        return None
    truth = to_pandas(failure_modes)
    if "node" not in truth.columns:
        if nodes is None:
            return None
        truth = truth.assign(node=truth["gpu_uuid"].astype(str).map(nodes))
    ts = pd.to_datetime(truth["ts"], utc=True)
    return pd.DataFrame(
        {"ts": ts, "gpu_uuid": truth["gpu_uuid"].astype(str), "node": truth["node"].astype(str), "mode": truth["mode"]}
    ).dropna(subset=["node"])


def _nearest(truth: pd.DataFrame | None, node: str | None, ts: pd.Timestamp) -> dict[str, Any] | None:
    if truth is None or node is None:
        return None
    same = truth.loc[truth["node"] == node]
    if len(same) == 0:
        return None
    hours = (same["ts"] - ts) / pd.Timedelta(hours=1)
    i = int(np.argmin(np.abs(hours.to_numpy())))
    return {
        "mode": str(same["mode"].iloc[i]),
        "gpu_uuid": str(same["gpu_uuid"].iloc[i]),
        "hours_after_alarm": float(hours.iloc[i]),
    }


def _leading(spread: dict[str, tuple[float, float]], row: pd.Series, n: int) -> list[dict[str, Any]]:
    """The `n` features of `row` farthest from the test period's mean, in standard deviations
    (`spread`: feature -> (mean, standard deviation) over the test period)."""
    found: list[tuple[float, str, float]] = []
    for c, (mean, std) in spread.items():
        value = pd.to_numeric(row[c], errors="coerce")
        if pd.isna(value) or not std > 0:
            continue
        found.append(((float(value) - mean) / std, c, float(value)))
    found.sort(key=lambda f: -abs(f[0]))
    return [{"feature": c, "value": value, "z": z} for z, c, value in found[:n]]
