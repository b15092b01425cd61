"""The riskiest GPUs of the newest predictions snapshot, for readers that have the data root but
no served model (`gpufail at-risk`).

The answer has the shape of `GET /v1/gpus/at-risk` (`serving.api_schemas.AtRiskResponse`), so a
reader formats both the same way: `model_version`, `ts`, `n_gpus` and `gpus`, riskiest first,
each with its rank, risk, tier, node risk and node tier (the tiers its risk enters, as the API
gives them: no hysteresis) and its top features. A snapshot records each GPU's top features
(`serving.score`) with their values in the scored row, not their contributions: `contribution`
is null. Of a snapshot written before the values were recorded, the values are read from the
features dataset at the snapshot's grid time (where the store has one); snapshots written
without top features give empty lists.

Only the snapshot is read, with pyarrow's Parquet reader alone: the command answers in a fraction
of a second without loading pandas, pyarrow's compute module, the models or the web app.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa

from ingest.errors import InputError
from ingest.store import Store
from serving.policy import PolicyConfig
from serving.prediction_schema import TOP_FEATURE_VALUES_FIELD, TOP_FEATURES_FIELD
from serving.predictions import newest_snapshot_table, time_integers


def snapshot_at_risk(store: Store, tiers: PolicyConfig, *, top: int, top_features: int = 3) -> dict[str, Any]:
    """The `top` riskiest GPUs of the newest snapshot in `store`, each with at most
    `top_features` features. Raises `InputError` when the store has no predictions."""
    if top < 1:
        raise InputError(f"top: expected at least 1 GPU, got {top}")
    found = newest_snapshot_table(store)
    if found is None:
        raise InputError(f"{store.root}: no predictions; run `gpufail score` first")
    key, table = found
    chosen = pa.concat_tables([table.slice(i, 1) for i in _riskiest(table, top)])
    rows = _rows(chosen)
    risk = np.asarray([r["risk"] for r in rows], dtype=np.float64)
    node_risk = np.asarray([r["node_risk"] for r in rows], dtype=np.float64)
    names = _top_feature_names(chosen, top_features)
    values = _recorded_values(chosen, names)
    if values is None:
        values = _features_dataset_values(store, key.ts, [str(r["gpu_uuid"]) for r in rows], names)
    gpus = [
        {
            "gpu_uuid": str(row["gpu_uuid"]),
            "cluster": str(row["cluster"]),
            "node": str(row["node"]),
            "gpu_index": int(row["gpu_index"]),
            "ts": row["ts"],
            "risk": float(row["risk"]),
            "rank": i + 1,
            "fleet_rank": int(row["rank"]),
            "tier": str(tier),
            "node_risk": float(row["node_risk"]),
            "node_tier": str(node_tier),
            "top_features": [
                {"feature": f, "value": v, "contribution": None} for f, v in zip(features, gpu_values, strict=True)
            ],
            "model_version": str(row["model_version"]),
        }
        for i, (row, tier, node_tier, features, gpu_values) in enumerate(
            zip(rows, tiers.entered_tiers(risk), tiers.entered_tiers(node_risk), names, values, strict=True)
        )
    ]
    return {
        "model_version": key.model_version,
        "ts": key.ts.isoformat(),
        "n_gpus": table.num_rows,
        "gpus": gpus,
        "source": key.path,
    }


def _riskiest(table: pa.Table, top: int) -> list[int]:
    """The indices of the `top` first rows by rank, then GPU uuid (a snapshot has no null uuid;
    a null rank comes last)."""
    ranks, gpus = table["rank"].to_pylist(), table["gpu_uuid"].to_pylist()
    return sorted(range(table.num_rows), key=lambda i: (ranks[i] is None, ranks[i] or 0, gpus[i]))[:top]


def _rows(chosen: pa.Table) -> list[dict[str, Any]]:
    """The rows of `chosen` as dicts, times as ISO text (`time_integers`)."""
    columns = {n: chosen[n].to_pylist() for n in chosen.column_names if n != "ts"}
    micros = time_integers(chosen["ts"])
    columns["ts"] = [
        (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=us)).isoformat() if us is not None else None
        for us in micros
    ]
    return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def _top_feature_names(chosen: pa.Table, top_features: int) -> list[list[str]]:
    if TOP_FEATURES_FIELD.name not in chosen.column_names or top_features <= 0:
        return [[] for _ in range(chosen.num_rows)]
    return [[str(f) for f in (fs or [])][:top_features] for fs in chosen[TOP_FEATURES_FIELD.name].to_pylist()]


def _number(v: Any) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None


def _recorded_values(chosen: pa.Table, names: list[list[str]]) -> list[list[float | str | None]] | None:
    """The values the snapshot recorded for `names` (None: it recorded none)."""
    if TOP_FEATURE_VALUES_FIELD.name not in chosen.column_names:
        return None
    out: list[list[float | str | None]] = []
    for fs, texts in zip(names, chosen[TOP_FEATURE_VALUES_FIELD.name].to_pylist(), strict=True):
        values = [json.loads(t) if t is not None else None for t in (texts or [])][: len(fs)]
        out.append([v if v is None or isinstance(v, str) else _number(v) for v in values])
        out[-1] += [None] * (len(fs) - len(out[-1]))
    return out


def _features_dataset_values(
    store: Store, ts: datetime, gpus: list[str], names: list[list[str]]
) -> list[list[float | str | None]]:
    """Per GPU, the values of its `names` at grid time `ts` in the features dataset (a
    snapshot written before values were recorded); None where it has no row or column."""
    wanted = sorted({f for fs in names for f in fs})
    found: dict[tuple[str, str], float | str | None] = {}
    if wanted and store.dates("features"):
        import polars as pl

        from features.dataset import scan_features

        day = scan_features(store, ts, ts + timedelta(microseconds=1))
        present = [f for f in wanted if f in day.collect_schema().names()]
        if present:
            frame = day.select(["gpu_uuid", *present]).filter(pl.col("gpu_uuid").is_in(gpus)).collect()
            for record in frame.iter_rows(named=True):
                for f in present:
                    v = record[f]
                    found[(record["gpu_uuid"], f)] = v if v is None or isinstance(v, str) else _number(v)
    return [[found.get((gpu, f)) for f in fs] for gpu, fs in zip(gpus, names, strict=True)]
