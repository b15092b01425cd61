import numpy as np
import pandas as pd
import pytest

from ingest.errors import InputError
from models.frame import MISSING_CATEGORY, feature_columns, feature_matrix, split_xy
from tests.pandas_arrow import polars_from_pandas


def tiny_frame() -> pd.DataFrame:
    ts = pd.Timestamp("2026-01-01", tz="UTC")
    return pd.DataFrame(
        {
            "ts": [ts, ts, ts + pd.Timedelta("1h"), ts + pd.Timedelta("1h")],
            "temp_gpu_c_mean_1h": np.array([50.0, np.nan, 52.0, 53.0], dtype=np.float32),
            "cluster": "c1",
            "node": ["n1", "n1", "n1", "n1"],
            "gpu_index": [0, 1, 0, 1],
            "gpu_uuid": ["GPU-a", "GPU-b", "GPU-a", "GPU-b"],
            "gpu_model": ["H100", None, "H100", "A100"],
            "driver": ["550", "550", "550", "550"],
            "label": pd.array([0, 1, None, 0], dtype="Int8"),
            "time_to_failure_h": np.array([np.nan, 3.0, np.nan, np.nan], dtype=np.float32),
            "xid_count_24h": pd.array([0, 2, 1, None], dtype="Int32"),
            "note": ["a", "b", "c", "d"],
            "has_gap_1h": [False, True, False, False],
        }
    )


def test_feature_columns_are_numeric_non_id_non_label_columns_then_categoricals():
    assert feature_columns(tiny_frame()) == [
        "temp_gpu_c_mean_1h",
        "xid_count_24h",
        "has_gap_1h",
        "gpu_model",
        "driver",
    ]


def test_split_xy_drops_censored_rows_and_keeps_ids_aligned():
    X, y, ids = split_xy(tiny_frame())
    assert len(X) == len(y) == len(ids) == 3
    assert y.tolist() == [0, 1, 0]
    assert y.dtype == np.int8
    assert ids["gpu_uuid"].tolist() == ["GPU-a", "GPU-b", "GPU-b"]
    assert (X.index == ids.index).all()
    assert X["temp_gpu_c_mean_1h"].dtype == np.float32
    assert np.isnan(X["temp_gpu_c_mean_1h"].iloc[1])
    assert np.isnan(X["xid_count_24h"].iloc[2])  # a null Int32 becomes NaN, not 0
    assert X["gpu_model"].tolist() == ["H100", MISSING_CATEGORY, "A100"]


def test_polars_and_pandas_frames_give_the_same_matrices():
    frame = tiny_frame().drop(columns=["xid_count_24h"])
    Xp, yp, _ = split_xy(frame)
    Xl, yl, _ = split_xy(polars_from_pandas(frame))
    pd.testing.assert_frame_equal(Xp.reset_index(drop=True), Xl.reset_index(drop=True))
    assert (yp == yl).all()


def test_feature_matrix_selects_by_name_in_the_given_order():
    frame = tiny_frame()
    columns = ["xid_count_24h", "gpu_model", "temp_gpu_c_mean_1h"]
    shuffled = frame[list(reversed(frame.columns))]
    assert list(feature_matrix(shuffled, columns).columns) == columns


def test_missing_feature_column_is_an_error_naming_it():
    with pytest.raises(InputError, match="power_w"):
        feature_matrix(tiny_frame(), ["temp_gpu_c_mean_1h", "power_w"])


def test_a_label_other_than_0_1_null_is_refused():
    frame = tiny_frame()
    frame["label"] = pd.array([0, 2, None, 0], dtype="Int8")
    with pytest.raises(InputError, match="label"):
        split_xy(frame)
