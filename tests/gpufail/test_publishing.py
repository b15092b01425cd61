from datetime import UTC, date, datetime

import pandas as pd
import pyarrow as pa

from gpufail.publishing import latest_predictions, publish_mode
from ingest.store import Store


def _predictions(ts: datetime, version: str) -> pa.Table:
    frame = pd.DataFrame({"ts": [pd.Timestamp(ts)] * 2, "node": ["n1", "n2"], "model_version": [version] * 2})
    return pa.Table.from_pandas(frame, preserve_index=False)


def test_latest_predictions_reads_only_the_newest_grid_time_of_the_newest_day(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    assert latest_predictions(store) is None
    store.write_owned("predictions", date(2026, 1, 4), _predictions(datetime(2026, 1, 4, 23, tzinfo=UTC), "old"))
    store.write_owned("predictions", date(2026, 1, 5), _predictions(datetime(2026, 1, 5, 6, tzinfo=UTC), "a"))
    store.write_owned("predictions", date(2026, 1, 5), _predictions(datetime(2026, 1, 5, 12, tzinfo=UTC), "b"))
    # A day folder left empty by an interrupted write does not hide the days before it.
    store.fs.makedirs(store.path("predictions", "date=2026-01-06"), exist_ok=True)
    latest = latest_predictions(store)
    assert latest is not None
    assert set(latest["model_version"]) == {"b"} and len(latest) == 2
    assert (latest["ts"] == pd.Timestamp(datetime(2026, 1, 5, 12, tzinfo=UTC))).all()


def test_publish_mode_a_dry_run_wins_over_shadow():
    assert publish_mode(True, True) == "dry-run"
    assert publish_mode(False, True) == "shadow"
    assert publish_mode(False, False) == "live"
