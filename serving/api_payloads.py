"""The slower paths of `POST /v1/predict`: model inputs or raw telemetry sent in the request.

Feature rows are put into a feature frame with the model's columns (a feature the row does not
give is missing, as a null in the store would be); telemetry rows and XID events go through
`features.build.build_features`, the code that builds the training features, with the served
model's feature spec (the settings its training features were built with, whatever the
configuration says today), and each GPU's newest grid row is scored. For GPUs the server's
store knows, the features that need the fleet or the GPU's history (its age, its XID history,
the fleet median of its GPU model) come from the store's fleet facts (`features.payload`), so
they equal the store's row of the same GPU-hour; the node medians see the GPUs of the request:
send a node's GPUs together.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd

from features.spec import FeatureSpec
from ingest.errors import InputError
from ingest.store import Store
from models.frame import CATEGORICAL_COLUMNS
from models.train import TrainedModel
from serving.api_state import explanation_lists
from serving.policy import PolicyConfig
from serving.score import latest_rows, node_risk


def feature_frame(rows: list[Any], model: TrainedModel) -> pd.DataFrame:
    """A feature frame (ids + the model's columns) from `FeatureRow`s; unknown names are an error."""
    known = set(model.feature_columns)
    now = pd.Timestamp(datetime.now(UTC)).floor("s")
    numeric = [c for c in model.feature_columns if c not in CATEGORICAL_COLUMNS]
    matrix = np.full((len(rows), len(numeric)), np.nan, dtype=np.float32)
    position = {c: j for j, c in enumerate(numeric)}
    for i, row in enumerate(rows):
        for name, value in row.values.items():
            if name not in known or name in CATEGORICAL_COLUMNS:
                where = f"features[{i}].values.{name}"
                if name in CATEGORICAL_COLUMNS:
                    raise InputError(f"{where}: {name} is a field of the row, not a value; expected a numeric feature")
                raise InputError(
                    f"{where}: not a feature of model {model.version}; expected one of its "
                    f"{len(numeric)} numeric features (GET /v1/model lists them)"
                )
            if value is not None:
                matrix[i, position[name]] = value
    frame = pd.DataFrame(matrix, columns=numeric)
    frame.insert(0, "ts", [pd.Timestamp(r.ts) if r.ts is not None else now for r in rows])
    frame.insert(1, "cluster", [r.cluster for r in rows])
    frame.insert(2, "node", [r.node for r in rows])
    frame.insert(3, "gpu_index", np.array([r.gpu_index for r in rows], dtype=np.int32))
    frame.insert(4, "gpu_uuid", [r.gpu_uuid for r in rows])
    frame["gpu_model"] = [r.gpu_model for r in rows]
    frame["driver"] = [r.driver for r in rows]
    frame["ts"] = pd.to_datetime(frame["ts"], utc=True)
    return frame


def telemetry_frame(
    telemetry: list[Any], xid_events: list[Any], spec: FeatureSpec, store: Store | None = None
) -> tuple[pd.DataFrame, set[str], dict[str, list[str]]]:
    """Each GPU's newest feature row built from raw samples with `spec` (the served model's),
    with `store`'s fleet facts for the GPUs it knows (`features.payload`); the uuids sent; and
    per GPU scored, the features that came from the payload alone."""
    import polars as pl
    import pyarrow as pa

    from features.payload import payload_features
    from ingest.schema import schema_for

    xid_rows = []
    for e in xid_events:
        row = e.model_dump()
        row["last_ts"] = row["last_ts"] or row["ts"]
        xid_rows.append(row)
    try:
        tel = pa.Table.from_pylist([r.model_dump() for r in telemetry], schema=schema_for("telemetry"))
        xids = pa.Table.from_pylist(xid_rows, schema=schema_for("xid_events"))
        built = payload_features(pl.from_arrow(tel), pl.from_arrow(xids), spec, store)  # type: ignore[arg-type]
    except (ValueError, TypeError, ArithmeticError, pa.ArrowException, pl.exceptions.PolarsError) as exc:
        # The rows passed validation one by one; this is about them together (or their values).
        raise InputError(f"telemetry: cannot build features from these rows ({type(exc).__name__}: {exc})") from exc
    latest = latest_rows(built.frame.to_pandas()).reset_index(drop=True)
    return latest, {r.gpu_uuid for r in telemetry}, built.payload_only


def score_rows(
    model: TrainedModel, frame: pd.DataFrame, tiers: PolicyConfig, top_features: int, version: str
) -> list[dict[str, Any]]:
    """Predictions for every row of `frame` (one per GPU), riskiest first; rank and node risk
    are within these rows."""
    if len(frame) == 0:
        return []
    if frame["gpu_uuid"].duplicated().any():
        dup = frame.loc[frame["gpu_uuid"].duplicated(), "gpu_uuid"].iloc[0]
        raise InputError(f"features: GPU {dup!r} appears more than once; expected one row per GPU")
    missing = [c for c in model.feature_columns if c not in frame.columns]
    if missing:
        raise InputError(
            f"telemetry: the features built lack {len(missing)} the model needs (e.g. {missing[:3]}); "
            "expected the [features] settings the model was trained with"
        )
    risk = model.predict_risk(frame)
    if not np.all(np.isfinite(risk)):
        raise InputError(f"model {version}: non-finite risk for the given features")
    order = np.lexsort((frame["gpu_uuid"].to_numpy(dtype=str), -risk))
    frame = frame.iloc[order].reset_index(drop=True)
    risk = risk[order]
    nrisk = node_risk(risk, frame["cluster"].astype(str), frame["node"].astype(str))
    tier, node_tier = tiers.entered_tiers(risk), tiers.entered_tiers(nrisk)
    explanations = explanation_lists(model, frame, top_features)
    out = []
    for i in range(len(frame)):
        ts = frame["ts"].iloc[i]
        out.append(
            {
                "gpu_uuid": str(frame["gpu_uuid"].iloc[i]),
                "cluster": str(frame["cluster"].iloc[i]),
                "node": str(frame["node"].iloc[i]),
                "gpu_index": int(frame["gpu_index"].iloc[i]),
                "ts": None if pd.isna(ts) else pd.Timestamp(ts).isoformat(),
                "risk": float(risk[i]),
                "rank": i + 1,
                "fleet_rank": None,
                "tier": tier[i],
                "node_risk": float(nrisk[i]),
                "node_tier": node_tier[i],
                "top_features": explanations[i],
                "model_version": version,
            }
        )
    return out
