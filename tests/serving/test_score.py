import json

import numpy as np
import pandas as pd
import pytest

from ingest.errors import InputError
from ingest.store import Store
from models.explain import explain
from models.train import TrainedModel, TrainOptions, train_model
from serving.predictions import newest_snapshot
from serving.publishing import top_features_by_gpu
from serving.score import (
    FAIL_SLOW_FIELD,
    PREDICTION_COLUMNS,
    PREDICTION_SCHEMA,
    TOP_FEATURE_VALUES_FIELD,
    TOP_FEATURES_FIELD,
    node_risks,
    prediction_table,
    score_latest,
)
from tests.models import ONE_THREAD, demo_frame
from tests.pandas_arrow import arrow_from_pandas, polars_from_pandas

T0 = pd.Timestamp("2026-01-01", tz="UTC")


class ColumnAsProbability:
    """A stand-in estimator whose probability of failure is the feature `p`."""

    def predict_proba(self, X: pd.DataFrame) -> np.ndarray:
        p = X["p"].to_numpy(dtype=float)
        return np.column_stack([1 - p, p])


def fake_model(pos_weight: float = 1.0) -> TrainedModel:
    return TrainedModel(
        estimator=ColumnAsProbability(),
        feature_columns=["p"],
        kind="fake",
        params={},
        train_start=T0,
        train_end=T0,
        n_rows=1,
        n_positives=1,
        horizon=pd.Timedelta("24h"),
        pos_weight=pos_weight,
    )


def hand_frame() -> pd.DataFrame:
    rows = [
        # (hour, node, index, uuid, p)
        (0, "n1", 0, "a", 0.9),  # old row of a: not scored
        (1, "n1", 0, "a", 0.5),
        (1, "n1", 1, "b", 0.2),
        (1, "n2", 0, "c", 0.1),
        (0, "n2", 1, "d", 0.7),  # d stopped reporting after hour 0: its last row is scored
    ]
    frame = pd.DataFrame(rows, columns=["hour", "node", "gpu_index", "gpu_uuid", "p"])
    frame["ts"] = T0 + pd.to_timedelta(frame.pop("hour"), unit="h")
    frame["cluster"] = "c1"
    return frame


def test_score_latest_by_hand():
    predictions = score_latest(fake_model(), hand_frame())
    assert list(predictions.columns) == list(PREDICTION_COLUMNS)
    assert predictions["gpu_uuid"].tolist() == ["d", "a", "b", "c"]
    assert predictions["rank"].tolist() == [1, 2, 3, 4]
    assert predictions["risk"].tolist() == pytest.approx([0.7, 0.5, 0.2, 0.1])
    assert predictions.loc[predictions["gpu_uuid"] == "d", "ts"].item() == T0  # stale, and says so
    node = dict(zip(predictions["gpu_uuid"], predictions["node_risk"], strict=True))
    assert node["a"] == node["b"] == pytest.approx(1 - 0.5 * 0.8)
    assert node["c"] == node["d"] == pytest.approx(1 - 0.9 * 0.3)
    assert set(predictions["model_version"]) == {fake_model().version}
    arrow_from_pandas(predictions, PREDICTION_SCHEMA)  # fits the schema


def test_risk_divides_out_the_class_weight():
    predictions = score_latest(fake_model(pos_weight=9.0), hand_frame())
    # p' = 0.5 from a model fit with positives weighted 9 -> p = 0.5 / (0.5 + 9 * 0.5) = 0.1
    assert predictions.loc[predictions["gpu_uuid"] == "a", "risk"].item() == pytest.approx(0.1)


def test_the_served_risk_is_the_calibrated_one_in_the_models_order():
    from dataclasses import replace

    from models.calibration import Calibration

    # An isotonic map that puts 0.5 and 0.7 at the same risk: the model's order still ranks them.
    flat = Calibration("isotonic", {"x": [-3.0, -0.5, 1.0], "y": [0.05, 0.3, 0.3]}, T0, T0, 10, 2)
    model = replace(fake_model(), calibration=flat)
    predictions = score_latest(model, hand_frame())
    assert predictions["gpu_uuid"].tolist() == ["d", "a", "b", "c"]
    np.testing.assert_allclose(predictions["risk"], flat.apply(np.array([0.7, 0.5, 0.2, 0.1])))
    assert predictions["risk"].iloc[0] == predictions["risk"].iloc[1] == pytest.approx(0.3)
    node = dict(zip(predictions["gpu_uuid"], predictions["node_risk"], strict=True))
    risk = dict(zip(predictions["gpu_uuid"], predictions["risk"], strict=True))
    assert node["a"] == pytest.approx(1 - (1 - risk["a"]) * (1 - risk["b"]))  # from the calibrated risks


def test_node_risks_one_row_per_node_highest_first():
    nodes = node_risks(score_latest(fake_model(), hand_frame()))
    assert nodes[["node", "n_gpus"]].values.tolist() == [["n2", 2], ["n1", 2]]
    assert nodes["node_risk"].tolist() == pytest.approx([0.73, 0.6])
    assert nodes.loc[0, "gpu_uuids"] == ["d", "c"]


def test_node_risk_stays_accurate_for_tiny_probabilities():
    frame = pd.DataFrame(
        {"ts": T0, "cluster": "c", "node": "n", "gpu_index": range(8), "gpu_uuid": list("abcdefgh"), "p": 1e-12}
    )
    predictions = score_latest(fake_model(), frame)
    assert predictions["node_risk"].iloc[0] == pytest.approx(8e-12, rel=1e-6)


def test_empty_frame_gives_empty_predictions_with_the_schema():
    predictions = score_latest(fake_model(), hand_frame().iloc[0:0])
    assert len(predictions) == 0 and list(predictions.columns) == list(PREDICTION_COLUMNS)


def test_a_trained_model_scores_every_gpu_once_from_a_polars_frame():
    frame = demo_frame()
    model = train_model(frame, TrainOptions(kind="logistic", train_window="5d", horizon="12h"))
    predictions = score_latest(model, polars_from_pandas(frame))
    assert len(predictions) == frame["gpu_uuid"].nunique()
    assert predictions["gpu_uuid"].is_unique
    assert predictions["risk"].between(0, 1).all()
    assert (np.diff(predictions["risk"].to_numpy()) <= 0).all()
    assert predictions["model_kind"].unique().tolist() == ["logistic"]


def test_lightgbm_model_scores_too():
    frame = demo_frame()
    model = train_model(frame, TrainOptions(kind="lightgbm", train_window="3d", horizon="12h", params=ONE_THREAD))
    predictions = score_latest(model, frame)
    assert len(predictions) == frame["gpu_uuid"].nunique()
    assert np.isfinite(predictions["node_risk"]).all()


def test_top_features_name_each_gpus_largest_contributions_and_fit_the_table():
    frame = demo_frame()
    model = train_model(frame, TrainOptions(kind="lightgbm", train_window="3d", horizon="12h", params=ONE_THREAD))
    predictions = score_latest(model, frame, top_features=3)
    assert list(predictions.columns) == [*PREDICTION_COLUMNS, "top_features", "top_feature_values"]
    assert all(len(names) == 3 and set(names) <= set(model.feature_columns) for names in predictions["top_features"])
    # The same names, in the same order, as explain gives for the GPU's latest row, and their
    # values in that row.
    gpu = predictions.iloc[0]
    row = frame[(frame["gpu_uuid"] == gpu["gpu_uuid"]) & (frame["ts"] == gpu["ts"])]
    assert list(gpu["top_features"]) == explain(model, row, top=3)["feature"].tolist()
    expected = [row[f].iloc[0] for f in gpu["top_features"]]
    recorded = [json.loads(v) for v in gpu["top_feature_values"]]
    assert recorded == [None if pd.isna(v) else v if isinstance(v, str) else float(v) for v in expected]
    table = prediction_table(predictions)
    assert table.schema == PREDICTION_SCHEMA.append(TOP_FEATURES_FIELD).append(TOP_FEATURE_VALUES_FIELD)
    assert table.column("top_features").to_pylist() == [list(n) for n in predictions["top_features"]]
    assert table.column("top_feature_values").to_pylist() == [list(v) for v in predictions["top_feature_values"]]


def test_without_top_features_the_table_has_the_required_columns_only():
    table = prediction_table(score_latest(fake_model(), hand_frame()))
    assert table.schema == PREDICTION_SCHEMA
    empty = score_latest(fake_model(), hand_frame().iloc[0:0], top_features=5)
    assert list(empty.columns) == [*PREDICTION_COLUMNS, "top_features", "top_feature_values"]


def test_top_features_need_an_explainable_model_and_a_count():
    with pytest.raises(InputError, match="top_features"):
        score_latest(fake_model(), hand_frame(), top_features=-1)
    with pytest.raises(InputError, match="explain"):
        score_latest(fake_model(), hand_frame(), top_features=2)  # not a models.estimators model


def test_predictions_written_before_top_features_still_publish_their_reasons_as_empty(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    old = score_latest(fake_model(), hand_frame())
    day = old["ts"].max().date()
    store.write_owned("predictions", day, prediction_table(old))  # as written before the column existed
    latest = newest_snapshot(store).frame
    assert "top_features" not in latest.columns and len(latest) == 3  # a, b, c at the newest hour
    assert top_features_by_gpu(latest) == {}
    # The next day's predictions carry the column: their GPUs get their reasons.
    new = old.assign(ts=old["ts"] + pd.Timedelta("1D"), top_features=[["p"]] * len(old))
    store.write_owned("predictions", day + pd.Timedelta("1D"), prediction_table(new))
    latest = newest_snapshot(store).frame
    assert top_features_by_gpu(latest) == {gpu: ["p"] for gpu in "abc"}


def test_the_fail_slow_score_is_scored_from_the_same_rows_as_the_evaluation_computes_it():
    from features.fail_slow import fail_slow_columns, fail_slow_features
    from tests.serving.api_server import fleet, trained_model

    features = fleet()[2].to_pandas()
    latest = features[features["ts"] == features["ts"].max()].reset_index(drop=True)
    predictions = score_latest(trained_model(), latest, top_features=2)
    assert list(predictions.columns)[-1] == FAIL_SLOW_FIELD.name
    expected = dict(zip(latest["gpu_uuid"], fail_slow_features(latest)[fail_slow_columns()[-1]], strict=True))
    got = dict(zip(predictions["gpu_uuid"], predictions[FAIL_SLOW_FIELD.name], strict=True))
    assert got.keys() == expected.keys()
    assert all((np.isnan(v) and np.isnan(expected[u])) or v == pytest.approx(expected[u]) for u, v in got.items())
    assert prediction_table(predictions).schema.field(FAIL_SLOW_FIELD.name).type == FAIL_SLOW_FIELD.type
    # A frame without the fail-slow inputs scores without the column.
    assert FAIL_SLOW_FIELD.name not in score_latest(fake_model(), hand_frame()).columns


def test_a_model_whose_spec_computes_no_fail_slow_features_scores_without_the_column():
    import dataclasses

    from tests.serving.api_server import fleet, trained_model

    features = fleet()[2].to_pandas()
    latest = features[features["ts"] == features["ts"].max()].reset_index(drop=True)
    model = trained_model()
    off = dataclasses.replace(model, feature_spec=dataclasses.replace(model.feature_spec, fail_slow_window=None))
    assert FAIL_SLOW_FIELD.name not in score_latest(off, latest).columns
    assert FAIL_SLOW_FIELD.name in score_latest(model, latest).columns
