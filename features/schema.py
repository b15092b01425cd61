"""The data contract of the feature frame that `features` owns.

One row per (GPU, grid time `ts`). Columns, in this order:

- identity (`ID_COLUMNS`): `ts` (the grid time t, UTC, microseconds), `cluster`, `node`,
  `gpu_index`, `gpu_uuid`, `gpu_model`, `driver`. `gpu_model` and `driver` are strings and are
  also static features a model may use (as categories); `gpu_index` likewise.
- features: every other column, all `Float32`, each named after what it measures with its window
  and unit in the name (`temp_gpu_c_max_6h`, `xid_memory_count_24h`, `telemetry_since_last_h`).
  A feature at `ts` = t uses only data with timestamps <= t (see `features.windows`).
- labels (`LABEL_COLUMNS`): `label` (Int8; 1 = the GPU fails in (t, t + horizon], 0 = it does
  not, null = unknown because the data ends before t + horizon) and `time_to_failure_h`
  (Float32, hours from t to the failure; null when no failure falls within the horizon).

`(gpu_uuid, ts)` is unique.
"""

from __future__ import annotations

from datetime import timedelta

import polars as pl

FEATURES_SCHEMA_VERSION = 1

TS_DTYPE = pl.Datetime("us", "UTC")

ID_COLUMNS: list[str] = ["ts", "cluster", "node", "gpu_index", "gpu_uuid", "gpu_model", "driver"]
ID_DTYPES: dict[str, pl.DataType] = {
    "ts": TS_DTYPE,
    "cluster": pl.String(),
    "node": pl.String(),
    "gpu_index": pl.Int16(),
    "gpu_uuid": pl.String(),
    "gpu_model": pl.String(),
    "driver": pl.String(),
}
LABEL_COLUMNS: list[str] = ["label", "time_to_failure_h"]
LABEL_DTYPES: dict[str, pl.DataType] = {"label": pl.Int8(), "time_to_failure_h": pl.Float32()}
FEATURE_DTYPE = pl.Float32()

# Identity columns that must never be null (the grid key and where the GPU sits).
_REQUIRED = ("ts", "cluster", "node", "gpu_uuid")


class FeatureSchemaError(ValueError):
    """A feature frame does not match the contract above."""


def feature_columns(df: pl.DataFrame | pl.LazyFrame | list[str]) -> list[str]:
    """The feature columns of a feature frame (everything that is neither identity nor label),
    in frame order."""
    names = df if isinstance(df, list) else df.collect_schema().names()
    skip = set(ID_COLUMNS) | set(LABEL_COLUMNS)
    return [c for c in names if c not in skip]


def window_label(window: timedelta) -> str:
    """`timedelta(hours=6)` -> `"6h"`; the suffix every windowed feature name carries.

    Hours up to a day (`24h`, as in `xid_count_24h`), whole days beyond it (`7d`), minutes or
    seconds for sub-hour windows."""
    seconds = window.total_seconds()
    if seconds <= 0 or seconds != int(seconds):
        raise ValueError(f"window must be a positive whole number of seconds, got {window!r}")
    seconds = int(seconds)
    if seconds > 86400 and seconds % 86400 == 0:
        return f"{seconds // 86400}d"
    if seconds % 3600 == 0:
        return f"{seconds // 3600}h"
    if seconds % 60 == 0:
        return f"{seconds // 60}m"
    return f"{seconds}s"


def validate_features(df: pl.DataFrame) -> pl.DataFrame:
    """Check a feature frame against the contract; return it unchanged or raise
    `FeatureSchemaError` naming every problem (column, expected, received)."""
    problems: list[str] = []
    schema = df.schema
    names = list(schema.names())
    missing = [c for c in ID_COLUMNS + LABEL_COLUMNS if c not in schema]
    if missing:
        problems.append(f"missing columns {missing}")
    if names[: len(ID_COLUMNS)] != ID_COLUMNS and not missing:
        problems.append(f"identity columns must come first as {ID_COLUMNS}, got {names[: len(ID_COLUMNS)]}")
    if names[-len(LABEL_COLUMNS) :] != LABEL_COLUMNS and not missing:
        problems.append(f"label columns must come last as {LABEL_COLUMNS}, got {names[-len(LABEL_COLUMNS) :]}")
    for name, dtype in {**ID_DTYPES, **LABEL_DTYPES}.items():
        if name in schema and schema[name] != dtype:
            problems.append(f"column {name!r} is {schema[name]}, expected {dtype}")
    bad_features = [f"{c} ({schema[c]})" for c in feature_columns(names) if schema[c] != FEATURE_DTYPE]
    if bad_features:
        problems.append(
            f"feature columns must be {FEATURE_DTYPE}; got {bad_features[:10]}"
            + (" ..." if len(bad_features) > 10 else "")
        )
    if not problems:
        nulls = {c: df[c].null_count() for c in _REQUIRED}
        null_cols = {c: n for c, n in nulls.items() if n}
        if null_cols:
            problems.append(f"null values in required columns {null_cols}")
        labels = df["label"].drop_nulls()
        if len(labels) and not labels.is_in([0, 1]).all():
            problems.append(f"label must be 0, 1 or null; got values {sorted(labels.unique().to_list())[:10]}")
        dup = df.select("gpu_uuid", "ts").is_duplicated()
        if dup.any():
            first = df.filter(dup).row(0, named=True)
            problems.append(
                f"{int(dup.sum())} rows share a (gpu_uuid, ts) with another row, e.g. gpu_uuid={first['gpu_uuid']!r} ts={first['ts']}"
            )
    if problems:
        raise FeatureSchemaError("feature frame does not match the features schema: " + "; ".join(problems))
    return df
