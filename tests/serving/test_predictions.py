"""The predictions dataset: one snapshot per (grid time, model version), and the rule that picks
the newest one."""

from datetime import UTC, date, datetime, timedelta

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from ingest.errors import InputError, StoreError
from ingest.store import Store
from serving.predictions import check_predictions, newest_snapshot, write_snapshot
from serving.score import PREDICTION_COLUMNS, prediction_table

T0 = datetime(2026, 1, 5, 12, tzinfo=UTC)
WRITTEN = datetime(2026, 1, 6, tzinfo=UTC)


def scored(ts: datetime = T0, version: str = "lgbm-a", risk: float = 0.1, gpus: int = 4) -> pd.DataFrame:
    """Predictions as `serving.score.score_latest` returns them: 2 GPUs per node."""
    frame = pd.DataFrame(
        {
            "ts": pd.Timestamp(ts),
            "cluster": "c1",
            "node": [f"n{i // 2}" for i in range(gpus)],
            "gpu_index": np.arange(gpus, dtype=np.int32) % 2,
            "gpu_uuid": [f"g{i}" for i in range(gpus)],
            "risk": risk,
            "rank": np.arange(1, gpus + 1),
            "node_risk": 1 - (1 - risk) ** 2,
            "model_kind": "lightgbm",
            "model_version": version,
        }
    )
    return frame[list(PREDICTION_COLUMNS)]


@pytest.fixture
def store(tmp_path):
    return Store.create(str(tmp_path / "data"))


def test_scoring_a_grid_time_again_with_the_same_model_replaces_its_snapshot(store):
    _, replaced = write_snapshot(store, scored(risk=0.1), now=WRITTEN)
    assert replaced == 0
    second, replaced = write_snapshot(store, scored(risk=0.2), now=WRITTEN + timedelta(minutes=1))
    assert replaced == 1 and store.files("predictions") == [second]
    snapshot = newest_snapshot(store)
    assert snapshot.path == second and len(snapshot.frame) == 4 and (snapshot.frame["risk"] == 0.2).all()


def test_the_newest_snapshot_is_the_latest_grid_time_then_the_one_written_last(store):
    assert newest_snapshot(store) is None
    write_snapshot(store, scored(T0 + timedelta(hours=1), "old-model"), now=WRITTEN)
    # Written later, but for an earlier grid time: not the newest.
    write_snapshot(store, scored(T0, "new-model"), now=WRITTEN + timedelta(hours=1))
    assert newest_snapshot(store).key.model_version == "old-model"
    # The same grid time by another model, written later (a champion promoted): the newest.
    write_snapshot(store, scored(T0 + timedelta(hours=1), "new-model"), now=WRITTEN + timedelta(hours=2))
    snapshot = newest_snapshot(store)
    assert snapshot.key.model_version == "new-model" and snapshot.key.ts == T0 + timedelta(hours=1)
    assert len(store.files("predictions")) == 3  # one per (grid time, model version)
    # A day folder left empty does not hide the days before it.
    store.fs.makedirs(store.path("predictions", "date=2026-01-09"), exist_ok=True)
    assert newest_snapshot(store).key.model_version == "new-model"


def test_files_written_before_snapshots_are_read_one_at_a_time_never_combined(store):
    legacy = prediction_table(scored(risk=0.3))  # no snapshot metadata: as `gpufail score` appended them
    store.write_owned("predictions", T0.date(), legacy)
    store.write_owned("predictions", T0.date(), legacy)
    snapshot = newest_snapshot(store)
    assert len(snapshot.frame) == 4 and snapshot.key.written_at == ""
    # A snapshot of that key replaces both; any snapshot counts as written after them.
    path, replaced = write_snapshot(store, scored(risk=0.3), now=WRITTEN)
    assert replaced == 2 and store.files("predictions") == [path]


def test_scorings_of_one_data_root_take_turns_and_the_last_one_remains(store, monkeypatch):
    import serving.predictions

    monkeypatch.setattr(serving.predictions, "LOCK_WAIT_S", 0.0)
    with store.journal("predictions", ["predictions"]), pytest.raises(StoreError) as refused:
        write_snapshot(store, scored(risk=0.1), now=WRITTEN)
    assert "another `gpufail score` of this data root holds the lock" in str(refused.value)
    assert store.files("predictions") == []
    write_snapshot(store, scored(risk=0.2), now=WRITTEN + timedelta(seconds=1))
    last, replaced = write_snapshot(store, scored(risk=0.1), now=WRITTEN)
    assert replaced == 1 and store.files("predictions") == [last]
    assert newest_snapshot(store).frame["risk"].tolist() == [0.1] * 4


def test_a_scoring_of_a_frame_where_a_gpu_stopped_reporting_reads_as_the_grid_time(store):
    frame = scored()
    frame.loc[3, "ts"] = pd.Timestamp(T0 - timedelta(hours=5))  # its last row, older
    store.write_owned("predictions", T0.date(), prediction_table(frame))
    assert sorted(newest_snapshot(store).frame["gpu_uuid"]) == ["g0", "g1", "g2"]


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda f: f.assign(risk=np.nan), "4 null 'risk' values"),  # pandas' NaN is its missing value
        (
            lambda f: f.assign(risk=[0.1, 1.5, 0.1, 0.1]),
            "1 'risk' value not a probability in [0, 1] (e.g. 1.5 for GPU g1)",
        ),
        (lambda f: f.assign(ts=[pd.Timestamp(T0), *[pd.Timestamp(T0 + timedelta(hours=1))] * 3]), "2 distinct 'ts'"),
        (lambda f: f.assign(model_version=["a", "b", "a", "b"]), "2 distinct 'model_version'"),
        (lambda f: f.assign(gpu_index=np.array([0, -1, 0, 1], dtype=np.int32)), "1 negative 'gpu_index' value"),
    ],
)
def test_predictions_that_cannot_be_a_snapshot_are_refused_before_they_are_written(store, change, expected):
    with pytest.raises(InputError, match=r"^predictions to write: not usable predictions: ") as refused:
        write_snapshot(store, change(scored()))
    assert expected in str(refused.value)
    assert store.files("predictions") == []


def test_every_problem_of_a_file_is_named_at_once():
    table = prediction_table(scored()).set_column(2, "node", pa.array([None] * 4, pa.string()))
    table = table.set_column(5, "risk", pa.array([0.1, 7.5, 0.1, 0.1]))
    with pytest.raises(InputError) as refused:
        check_predictions(table, "f.parquet")
    assert str(refused.value) == (
        "f.parquet: not usable predictions: 4 null 'node' values; "
        "1 'risk' value not a probability in [0, 1] (e.g. 7.5 for GPU g1)"
    )


def test_a_file_that_is_not_parquet_is_named_and_never_skipped(store):
    write_snapshot(store, scored(), now=WRITTEN)
    bad = store.path("predictions", f"date={date(2026, 1, 5)}", "part-zzz.parquet")
    store.fs.pipe_file(bad, b"PAR1 and then nothing")
    with pytest.raises(InputError, match=rf"^{bad}: not a readable predictions file"):
        newest_snapshot(store)
