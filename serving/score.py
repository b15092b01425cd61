"""Scoring: the risk of each GPU now, from its most recent row of the feature frame.

The prediction schema (`PREDICTION_COLUMNS`) is owned here. `risk` is the model's calibrated
probability that the GPU fails within the model's horizon (`TrainedModel.predict_risk`: class
weighting and negative subsampling divided out, then the model's calibration; a model saved
without a calibration serves its uncalibrated risk, and says so when it loads); `node_risk` = 1 - prod(1 - risk) over the GPUs of the node, the
chance that at least one fails if they fail independently (they do not quite: a node's GPUs
share power, cooling and a baseboard, so read it as a ranking of nodes more than a probability).

With `top_features=k`, the predictions also carry `TOP_FEATURES_FIELD`: each GPU's k features
of largest absolute contribution to its score (`models.explain`), largest first, so that the
audit log records why a node was acted on, and `TOP_FEATURE_VALUES_FIELD`: their values in the
scored row, so that `gpufail at-risk` shows them without building features. The columns are
optional: predictions written before them, or without explanations, lack them, and readers take
them as absent (see `serving.publishing.top_features_by_gpu`). Where the frame has the
fail-slow score of the model's spec (`features.fail_slow.fail_slow_score`), each GPU's is kept
too (`FAIL_SLOW_FIELD`), for the policy's `fail_slow` alarm class. The schema lives in
`serving.prediction_schema`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from features.fail_slow import fail_slow_score
from ingest.errors import InputError
from models.explain import contributions, top_contributions
from models.frame import feature_matrix, require_columns, to_pandas
from models.train import TrainedModel
from serving.prediction_schema import (
    FAIL_SLOW_FIELD,
    PREDICTION_COLUMNS,
    PREDICTION_SCHEMA,
    TOP_FEATURE_VALUES_FIELD,
    TOP_FEATURES_FIELD,
    prediction_schema,
)

__all__ = [
    "FAIL_SLOW_FIELD",
    "PREDICTION_COLUMNS",
    "PREDICTION_SCHEMA",
    "TOP_FEATURES_FIELD",
    "TOP_FEATURE_VALUES_FIELD",
    "node_risk",
    "prediction_table",
    "score_latest",
]


def latest_rows(frame: Any) -> pd.DataFrame:
    """Each GPU's most recent row (a GPU that stopped reporting keeps its last row: compare its
    `ts` with the others' to see that it is stale)."""
    df = to_pandas(frame)
    require_columns(df, ["ts", "cluster", "node", "gpu_index", "gpu_uuid"], "scoring frame")
    if len(df) == 0:
        return df
    last = df.groupby("gpu_uuid", sort=False)["ts"].transform("max")
    latest = df.loc[(df["ts"] == last).to_numpy()]
    return latest.drop_duplicates("gpu_uuid", keep="last")


def node_risk(risk: np.ndarray | pd.Series, cluster: Any, node: Any) -> np.ndarray:
    """1 - prod(1 - risk) over the rows of each (cluster, node), aligned with the inputs."""
    keys = pd.DataFrame({"cluster": np.asarray(cluster), "node": np.asarray(node)})
    per_node = pd.Series(_log_survival(risk)).groupby([keys["cluster"], keys["node"]]).transform("sum")
    return -np.expm1(per_node.to_numpy())


def _log_survival(risk: Any) -> np.ndarray:
    # Summing log(1 - p) keeps the product accurate for small p (1 - prod would round to 0).
    return np.log1p(-np.clip(np.asarray(risk, dtype=np.float64), 0.0, 1.0 - 1e-15))


def score_latest(model: TrainedModel, frame: Any, top_features: int = 0) -> pd.DataFrame:
    """Score each GPU's most recent row of `frame` with `model`.

    One row per GPU with `PREDICTION_COLUMNS`, sorted by rank (1 = highest calibrated risk; ties
    broken by the uncalibrated risk, then gpu_uuid, so that the order is the model's and
    reproducible); with `top_features` > 0, also the column
    `top_features` (lists of that many feature names)."""
    if top_features < 0:
        raise InputError(f"top_features: expected 0 (none) or a positive number of features, got {top_features}")
    latest = latest_rows(frame)
    optional = [TOP_FEATURES_FIELD.name, TOP_FEATURE_VALUES_FIELD.name] if top_features else []
    if len(latest) == 0:
        return prediction_schema(optional).empty_table().to_pandas()
    uncalibrated, risk = model.predict_risks(latest)
    if not np.all(np.isfinite(risk)):
        raise InputError(f"model {model.version} returned non-finite risks for {int((~np.isfinite(risk)).sum())} GPUs")
    out = pd.DataFrame(
        {
            "ts": latest["ts"].to_numpy(),
            "cluster": latest["cluster"].astype(str).to_numpy(),
            "node": latest["node"].astype(str).to_numpy(),
            "gpu_index": latest["gpu_index"].to_numpy(dtype=np.int32),
            "gpu_uuid": latest["gpu_uuid"].astype(str).to_numpy(),
            "risk": risk,
            "_uncalibrated": uncalibrated,
        }
    )
    if top_features:
        out["top_features"], out["top_feature_values"] = _top_features(model, latest, top_features)
    window = model.feature_spec.fail_slow_label
    scores = None if window is None else fail_slow_score(latest, window)
    if scores is not None:
        # The model's spec says which window; the feature build computed the score for the
        # whole grid time (the model peers' median needs every GPU of the model), as for the
        # evaluation's fail-slow alarm class.
        out[FAIL_SLOW_FIELD.name] = scores
        optional.append(FAIL_SLOW_FIELD.name)
    # GPUs a calibration puts at the same risk (a flat stretch of an isotonic map) keep the
    # model's own order.
    out = out.sort_values(["risk", "_uncalibrated", "gpu_uuid"], ascending=[False, False, True], ignore_index=True)
    out["rank"] = np.arange(1, len(out) + 1, dtype=np.int64)
    out["node_risk"] = node_risk(out["risk"], out["cluster"], out["node"])
    out["model_kind"] = model.kind
    out["model_version"] = model.version
    return out[list(PREDICTION_COLUMNS) + optional]


def _top_features(model: TrainedModel, rows: pd.DataFrame, top: int) -> tuple[list[list[str]], list[list[str]]]:
    """Per row: the names of its `top` features, and their values in the row as JSON text
    (`TOP_FEATURE_VALUES_FIELD`)."""
    matrix = feature_matrix(rows, model.feature_columns)
    picked, _ = top_contributions(contributions(model.estimator, matrix), top)
    names = np.asarray(model.feature_columns, dtype=object)[picked]
    columns = {f: rows[f].tolist() for f in set(names.ravel())}
    return (
        [list(r) for r in names],
        [[_json_text(columns[f][i]) for f in r] for i, r in enumerate(names)],
    )


def _json_text(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if value is None or pd.isna(value):
        return "null"
    number = float(value)
    return json.dumps(number) if math.isfinite(number) else "null"


def prediction_table(predictions: pd.DataFrame) -> pa.Table:
    """`score_latest`'s output as an Arrow table of the predictions schema (with the optional
    columns it has), for `Store.write_owned`."""
    schema = prediction_schema(list(predictions.columns))
    require_columns(predictions, schema.names, "predictions")
    return pa.Table.from_pandas(predictions[schema.names], schema=schema, preserve_index=False)


def node_risks(predictions: pd.DataFrame) -> pd.DataFrame:
    """One row per (cluster, node) of `score_latest`'s output: node_risk, n_gpus, and the
    node's GPUs as lists of gpu_uuid / gpu_index / risk ordered by risk, highest first;
    sorted by node_risk, highest first."""
    require_columns(predictions, ["cluster", "node", "gpu_uuid", "gpu_index", "risk"], "predictions")
    ordered = predictions.sort_values(["risk", "gpu_uuid"], ascending=[False, True])
    ordered = ordered.assign(_log_survival=_log_survival(ordered["risk"]))
    nodes = ordered.groupby(["cluster", "node"], sort=False).agg(
        log_survival=("_log_survival", "sum"),
        n_gpus=("gpu_uuid", "size"),
        gpu_uuids=("gpu_uuid", list),
        gpu_indices=("gpu_index", list),
        gpu_risks=("risk", list),
    )
    nodes.insert(0, "node_risk", -np.expm1(nodes.pop("log_survival")))
    nodes = nodes.reset_index()
    return nodes.sort_values(["node_risk", "cluster", "node"], ascending=[False, True, True], ignore_index=True)
