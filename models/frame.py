"""From a feature frame to the matrices a model sees.

The feature frame (owned by `features/`) has one row per (gpu_uuid, ts) on the grid:

- id columns `ID_COLUMNS`; of these, `gpu_model` and `driver` are also model inputs
  (`CATEGORICAL_COLUMNS`), encoded inside the model pipeline (see `models.estimators`);
- label columns `label` (1 = fails within the horizon after ts, 0 = does not, null = censored)
  and `time_to_failure_h`;
- the stored training-draw key (`features.sample_key.SAMPLE_KEY`), when a frame was read with
  it, is not a feature;
- every other numeric (or boolean) column is a feature. Columns of any other type (strings,
  timestamps) that are not ids are not features and are ignored.

Censored rows (null label) are never used for training or evaluation. The feature column order
is fixed when a model is trained and saved with it; at scoring time columns are selected by
name in that order, so a frame whose columns come in another order scores the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from features.sample_key import SAMPLE_KEY
from ingest.errors import InputError

ID_COLUMNS = ("ts", "cluster", "node", "gpu_index", "gpu_uuid", "gpu_model", "driver")
LABEL_COLUMNS = ("label", "time_to_failure_h")
CATEGORICAL_COLUMNS = ("gpu_model", "driver")
MISSING_CATEGORY = "unknown"
"""What a null `gpu_model` or `driver` becomes, so that it is one more category."""


NOT_FEATURES = frozenset(ID_COLUMNS) | frozenset(LABEL_COLUMNS) | {SAMPLE_KEY}
"""Numeric columns of a feature frame that are never model inputs."""


def is_polars(frame: Any) -> bool:
    return type(frame).__module__.startswith("polars")


def to_pandas(frame: Any) -> pd.DataFrame:
    """A polars or pandas DataFrame as pandas (polars is converted; pandas is returned as is)."""
    if isinstance(frame, pd.DataFrame):
        return frame
    if hasattr(frame, "to_pandas") and is_polars(frame):
        return frame.to_pandas()
    raise InputError(f"expected a polars or pandas DataFrame, got {type(frame).__name__}")


def require_columns(frame: pd.DataFrame, columns: Sequence[str], what: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise InputError(
            f"{what}: missing column(s) {missing}; expected a feature frame with {list(columns)}, "
            f"got columns {list(frame.columns)[:20]}{' ...' if frame.shape[1] > 20 else ''}"
        )


def feature_columns(frame: Any) -> list[str]:
    """The model inputs of a feature frame, in a stable order: the numeric feature columns in
    the frame's order, then the categorical id columns that are present."""
    df = to_pandas(frame)
    numeric = [
        c
        for c in df.columns
        if c not in NOT_FEATURES and (pd.api.types.is_numeric_dtype(df[c]) or pd.api.types.is_bool_dtype(df[c]))
    ]
    return numeric + [c for c in CATEGORICAL_COLUMNS if c in df.columns]


def labels(frame: Any) -> pd.Series:
    """The `label` column as float (1.0, 0.0, NaN for censored), checked to hold only 0/1/null."""
    df = to_pandas(frame)
    require_columns(df, ["label"], "labels")
    label = pd.to_numeric(df["label"], errors="coerce").astype("float64")
    bad = label.notna() & ~label.isin([0.0, 1.0])
    if bad.any():
        raise InputError(
            f"column label: expected 0, 1 or null, got {sorted(set(label[bad].tolist()))[:5]} "
            f"(first at row {int(np.flatnonzero(bad.to_numpy())[0])})"
        )
    return label


def feature_matrix(frame: Any, columns: Sequence[str]) -> pd.DataFrame:
    """The model inputs `columns` of `frame`, in that order: numeric columns as float32 (null ->
    NaN), categorical columns as Python strings (null -> `MISSING_CATEGORY`)."""
    df = to_pandas(frame)
    require_columns(df, columns, "feature frame")
    numeric = [c for c in columns if c not in CATEGORICAL_COLUMNS]
    # Columns that already hold numbers convert in one block (one copy into a float32 matrix:
    # per-column conversion of ~400 columns costs more than the model on a 1,000-row request);
    # anything else (strings from JSON, objects) goes through to_numeric one by one.
    dtypes = df.dtypes
    typed = [c for c in numeric if pd.api.types.is_numeric_dtype(dtypes[c]) or pd.api.types.is_bool_dtype(dtypes[c])]
    block = df[typed].to_numpy(dtype=np.float32, na_value=np.nan) if typed else np.empty((len(df), 0), np.float32)
    out = pd.DataFrame(block, index=df.index, columns=typed)
    for c in numeric:
        if c not in out.columns:
            out[c] = pd.to_numeric(df[c], errors="coerce").to_numpy(dtype=np.float32, na_value=np.nan)
    for c in columns:
        if c in CATEGORICAL_COLUMNS:
            values = df[c].astype(object)
            out[c] = values.where(values.notna(), MISSING_CATEGORY).astype(str).astype(object).to_numpy()
    return out if list(out.columns) == list(columns) else out[list(columns)]


def split_xy_polars(frame: Any) -> tuple[Any, np.ndarray, pd.DataFrame]:
    """`split_xy` of a polars frame with X left in polars: the same columns in the same order
    (numeric as Float32, nulls kept as nulls, which LightGBM reads as missing like NaN;
    categorical columns as strings, null -> `MISSING_CATEGORY`). LightGBM takes it through
    Arrow, column by column; the pandas route copies the matrix twice, row-major, on the way
    (on the paper fleet's 1.57M x 413 sample: ~29 s from polars to a built LightGBM dataset
    against ~85 s through pandas, with identical trees)."""
    import polars as pl

    require_columns(frame, ["ts", "gpu_uuid", "label"], "split_xy")
    numeric = [c for c, t in frame.schema.items() if c not in NOT_FEATURES and (t.is_numeric() or t == pl.Boolean)]
    categorical = [c for c in CATEGORICAL_COLUMNS if c in frame.columns]
    labelled = frame.filter(pl.col("label").is_not_null())
    bad = labelled.filter(~pl.col("label").is_in([0, 1]))
    if bad.height:
        raise InputError(f"column label: expected 0, 1 or null, got {sorted(bad['label'].unique().to_list())[:5]}")
    X = labelled.select(
        *[pl.col(c).cast(pl.Float32) for c in numeric],
        *[pl.col(c).cast(pl.String).fill_null(MISSING_CATEGORY) for c in categorical],
    )
    y = labelled["label"].cast(pl.Int8).to_numpy()
    ids = labelled.select([c for c in ID_COLUMNS if c in frame.columns]).to_pandas()
    return X, y, ids


def split_xy(frame: Any, columns: Sequence[str] | None = None) -> tuple[pd.DataFrame, np.ndarray, pd.DataFrame]:
    """Labelled rows of a feature frame as (X, y, ids).

    X holds `columns` (default: `feature_columns(frame)`), y the 0/1 labels as int8, ids the id
    columns present. Censored rows (null label) are dropped. The three share one index.
    """
    df = to_pandas(frame)
    require_columns(df, ["ts", "gpu_uuid", "label"], "split_xy")
    label = labels(df)
    keep = label.notna().to_numpy()
    df = df.loc[keep]
    columns = feature_columns(df) if columns is None else list(columns)
    X = feature_matrix(df, columns)
    y = label.to_numpy()[keep].astype(np.int8)
    ids = df[[c for c in ID_COLUMNS if c in df.columns]]
    return X, y, ids
