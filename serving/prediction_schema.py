"""The predictions' Arrow schema, apart from the scoring code so that a reader of snapshots
(`gpufail at-risk`, the pages) does not load the models to know it. `serving.score` owns what
the columns mean."""

from __future__ import annotations

import pyarrow as pa

PREDICTION_SCHEMA = pa.schema(
    [
        ("ts", pa.timestamp("us", tz="UTC")),
        ("cluster", pa.string()),
        ("node", pa.string()),
        ("gpu_index", pa.int32()),
        ("gpu_uuid", pa.string()),
        ("risk", pa.float64()),
        ("rank", pa.int64()),
        ("node_risk", pa.float64()),
        ("model_kind", pa.string()),
        ("model_version", pa.string()),
    ]
)
PREDICTION_COLUMNS = tuple(PREDICTION_SCHEMA.names)
TOP_FEATURES_FIELD = pa.field("top_features", pa.list_(pa.string()))
"""Optional column of the predictions, after `PREDICTION_COLUMNS`: each GPU's top features."""
TOP_FEATURE_VALUES_FIELD = pa.field("top_feature_values", pa.list_(pa.string()))
"""Optional column after `TOP_FEATURES_FIELD`: the value of each of those features in the row
that was scored, as JSON text (a number, a string for a categorical feature, null where the
row had none), so that a reader shows what the model saw without computing features again."""
FAIL_SLOW_FIELD = pa.field("fail_slow_score", pa.float64())
"""Optional column: the GPU's fail-slow score at the scored grid time (`features.fail_slow`;
null where it has no reading or no peers), which the `fail_slow` alarm class of the policy acts
on (`serving.policy.PolicyConfig.fail_slow_threshold`)."""
OPTIONAL_FIELDS = (TOP_FEATURES_FIELD, TOP_FEATURE_VALUES_FIELD, FAIL_SLOW_FIELD)


def prediction_schema(columns: list[str] | tuple[str, ...]) -> pa.Schema:
    """The schema of predictions with `columns`: the required fields, then the optional ones
    `columns` has."""
    schema = PREDICTION_SCHEMA
    for f in OPTIONAL_FIELDS:
        if f.name in columns:
            schema = schema.append(f)
    return schema
