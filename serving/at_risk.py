"""The riskiest GPUs of the newest predictions snapshot, for readers that have the data root but
no served model (`gpufail at-risk`).

The answer has the shape of `GET /v1/gpus/at-risk` (`serving.api_schemas.AtRiskResponse`), so a
reader formats both the same way: `model_version`, `ts`, `n_gpus` and `gpus`, riskiest first,
each with its rank, risk, tier, node risk and node tier (the tiers its risk enters, as the API
gives them: no hysteresis) and its top features. A snapshot records the names of each GPU's top
features (`serving.score`), not their contributions: here each carries its value at the
snapshot's grid time, read from the features dataset, and a `contribution` of null. Snapshots
written without top features give empty lists.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import numpy as np
import pandas as pd

from ingest.errors import InputError
from ingest.store import Store
from serving.api_state import _json_value
from serving.policy import PolicyConfig
from serving.predictions import newest_snapshot


def snapshot_at_risk(store: Store, tiers: PolicyConfig, *, top: int, top_features: int = 3) -> dict[str, Any]:
    """The `top` riskiest GPUs of the newest snapshot in `store`, each with at most
    `top_features` features. Raises `InputError` when the store has no predictions."""
    if top < 1:
        raise InputError(f"top: expected at least 1 GPU, got {top}")
    snapshot = newest_snapshot(store)
    if snapshot is None:
        raise InputError(f"{store.root}: no predictions; run `gpufail score` first")
    frame = snapshot.frame.sort_values(["rank", "gpu_uuid"], kind="stable", ignore_index=True)
    chosen = frame.head(top)
    risk = chosen["risk"].to_numpy(dtype=np.float64)
    node_risk = chosen["node_risk"].to_numpy(dtype=np.float64)
    names = _top_feature_names(chosen, top_features)
    values = _feature_values(store, snapshot.key.ts, chosen["gpu_uuid"].tolist(), names)
    records: list[dict[Any, Any]] = chosen.to_dict("records")
    gpus = [
        {
            "gpu_uuid": str(row["gpu_uuid"]),
            "cluster": str(row["cluster"]),
            "node": str(row["node"]),
            "gpu_index": int(row["gpu_index"]),
            "ts": pd.Timestamp(row["ts"]).isoformat(),
            "risk": float(row["risk"]),
            "rank": i + 1,
            "fleet_rank": int(row["rank"]),
            "tier": str(tier),
            "node_risk": float(row["node_risk"]),
            "node_tier": str(node_tier),
            "top_features": [
                {"feature": f, "value": values.get((str(row["gpu_uuid"]), f)), "contribution": None} for f in features
            ],
            "model_version": str(row["model_version"]),
        }
        for i, (row, tier, node_tier, features) in enumerate(
            zip(records, tiers.entered_tiers(risk), tiers.entered_tiers(node_risk), names, strict=True)
        )
    ]
    return {
        "model_version": snapshot.key.model_version,
        "ts": snapshot.key.ts.isoformat(),
        "n_gpus": len(frame),
        "gpus": gpus,
        "source": snapshot.path,
    }


def _top_feature_names(chosen: pd.DataFrame, top_features: int) -> list[list[str]]:
    if "top_features" not in chosen or top_features <= 0:
        return [[] for _ in range(len(chosen))]
    return [[str(f) for f in (fs if fs is not None else [])][:top_features] for fs in chosen["top_features"]]


def _feature_values(
    store: Store, ts: Any, gpus: list[str], names: list[list[str]]
) -> dict[tuple[str, str], float | str | None]:
    """(gpu_uuid, feature) -> the GPU's value at grid time `ts`; pairs with no row or column
    are left out (read as unknown)."""
    import polars as pl

    from features.dataset import scan_features

    wanted = sorted({f for fs in names for f in fs})
    if not wanted or not store.dates("features"):
        return {}
    day = scan_features(store, ts, ts + timedelta(microseconds=1))
    present = [f for f in wanted if f in day.collect_schema().names()]
    if not present:
        return {}
    rows = day.select(["gpu_uuid", *present]).filter(pl.col("gpu_uuid").is_in(gpus)).collect()
    out: dict[tuple[str, str], float | str | None] = {}
    for record in rows.iter_rows(named=True):
        for f in present:
            out[(record["gpu_uuid"], f)] = _json_value(record[f])
    return out
