"""The nightly's compact step: the settled days' small part files become a few before the
features step reads them; the day still being written is left alone."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpufail.nightly import STEPS, NightlyOptions, _Job
from ingest.store import Store
from models.train import TrainOptions
from tests.ingest.test_compact import collector_like, rows


def test_the_compact_step_runs_before_the_features_and_leaves_the_unsettled_day(tmp_path: Path) -> None:
    assert STEPS.index("ingest") < STEPS.index("compact") < STEPS.index("features")
    store = collector_like(tmp_path / "root")
    first, last = store.dates("telemetry")
    expected = rows(store)
    settled, unsettled = (len(store.files("telemetry", day, day)) for day in (first, last))
    # The newest day ended an hour ago: within a settle time of two hours.
    day_end = datetime(last.year, last.month, last.day, tzinfo=UTC) + timedelta(days=1)
    settle = datetime.now(UTC) - day_end + timedelta(hours=1)
    options = NightlyOptions(
        work_dir=tmp_path / "work",
        tracking_uri="unused",
        model_name="unused",
        experiment="unused",
        train=TrainOptions(kind="lightgbm", train_window=timedelta(days=10), horizon=timedelta(hours=24)),
        top_k=5,
        holdout_days=3.0,
        promotion_margin=0.01,
        recall_tolerance=0.05,
        precision_floor=0.0,
        compact_settle=settle,
    )
    job = _Job(Store.open(store.root), options, str(last), {"steps": {}}, publish=lambda *a: {}, sleep=lambda s: None)
    result = job.run("compact")
    assert result["compact"].startswith(f"compact: telemetry {settled} files -> 1 ")
    assert "left until settled: telemetry " + str(last) in result["compact"]
    assert len(store.files("telemetry", first, first)) == 1
    assert len(store.files("telemetry", last, last)) == unsettled > 1
    assert rows(store).equals(expected)
