"""The fleet's recent past: risks from the predictions snapshots (one model per grid time),
alarms as entries into the alarm level, failed GPUs per day, and the cache that serves the
previous counts while new ones are computed."""

from __future__ import annotations

import threading
from datetime import UTC, date, datetime, timedelta

import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

from ingest.store import Store
from serving.policy import PolicyConfig, Tier
from serving.score import prediction_table
from serving.web import history
from tests.conftest import make_rows

T0 = datetime(2026, 3, 1, tzinfo=UTC)
TIERS = PolicyConfig(tiers=(Tier("watch", 0.2, 0.1), Tier("avoid", 0.35, 0.25), Tier("drain_now", 0.8, 0.6)))


def snapshot(ts: datetime, risks: dict[str, float], version: str = "lightgbm-20260301T0000Z-aaaaaaaa") -> pd.DataFrame:
    """Predictions of one grid time: GPU name -> risk; GPUs `n<k>-g<i>` sit on node `n<k>`."""
    rows = []
    for rank, (gpu, risk) in enumerate(sorted(risks.items(), key=lambda kv: -kv[1]), start=1):
        node = gpu.split("-")[0]
        rows.append(("c0", node, int(gpu.split("g")[-1]), gpu, risk, rank))
    frame = pd.DataFrame(rows, columns=["cluster", "node", "gpu_index", "gpu_uuid", "risk", "rank"])
    frame.insert(0, "ts", pd.Timestamp(ts))
    node_risk = 1 - frame.groupby("node")["risk"].transform(lambda r: (1 - r).prod())
    frame["node_risk"] = node_risk
    frame["model_kind"] = "lightgbm"
    frame["model_version"] = version
    return frame


def write(store: Store, frame: pd.DataFrame) -> None:
    store.write_owned("predictions", frame["ts"].iloc[0].date(), prediction_table(frame))


@pytest.fixture
def store(tmp_path):
    return Store.create(str(tmp_path / "data"))


def test_risk_history_reads_the_window_and_one_model_per_grid_time(store):
    write(store, snapshot(T0, {"n0-g0": 0.1, "n0-g1": 0.2}))
    old = snapshot(T0 + timedelta(hours=1), {"n0-g0": 0.5, "n0-g1": 0.6}, "lightgbm-20260201T0000Z-bbbbbbbb")
    new = snapshot(T0 + timedelta(hours=1), {"n0-g0": 0.3, "n0-g1": 0.4}, "lightgbm-20260228T0000Z-cccccccc")
    write(store, old)
    with_top = new.assign(top_features=[["temp_gpu_c_mean_1h"]] * len(new))  # a newer file has the optional column
    write(store, with_top)
    write(store, snapshot(T0 + timedelta(days=3), {"n1-g0": 0.9}))
    got = history.risk_history(store, T0, T0 + timedelta(days=1))
    assert got.columns == list(history.RISK_COLUMNS)
    assert got["ts"].to_list() == sorted(got["ts"].to_list())
    at_one = got.filter(pl.col("ts") == T0 + timedelta(hours=1)).sort("gpu_uuid")
    assert at_one["risk"].to_list() == [0.3, 0.4]  # the model trained latest
    assert set(at_one["model_version"]) == {"lightgbm-20260228T0000Z-cccccccc"}
    assert got.height == 4
    one_node = history.risk_history(store, T0, T0 + timedelta(days=5), cluster="c0", node="n1")
    assert one_node["gpu_uuid"].to_list() == ["n1-g0"]
    assert history.risk_history(store, T0 + timedelta(days=10), T0 + timedelta(days=11)).height == 0


def test_an_alarm_is_an_entry_into_the_alarm_level():
    hours = [T0 + timedelta(hours=6 * i) for i in range(6)]
    series = {
        # already above when the window opens (day 0): not counted; stays above: not counted again
        "n0-g0": [0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
        # enters, leaves, enters again: two alarms
        "n1-g0": [0.1, 0.4, 0.1, 0.1, 0.9, 0.9],
        # reaches watch only: no alarm
        "n2-g0": [0.1, 0.3, 0.3, 0.3, 0.3, 0.3],
    }
    frames = [snapshot(ts, {g: v[i] for g, v in series.items()}) for i, ts in enumerate(hours)]
    # n3 appears on day 1 above the threshold: a new GPU entering counts
    frames[4] = pd.concat([frames[4], snapshot(hours[4], {"n3-g0": 0.6})], ignore_index=True)
    hist = pl.from_pandas(pd.concat(frames, ignore_index=True)).select(history.RISK_COLUMNS).sort("ts")
    day0, day1 = T0.date(), (T0 + timedelta(days=1)).date()
    got = history.alarms_per_day(hist, TIERS, day0)
    assert got["gpu"] == {day0: 2, day1: 2}  # n0 at T0 has no earlier row: it entered then
    assert history.alarms_per_day(hist, TIERS, day1)["gpu"] == {day1: 2}
    assert got["node"] == got["gpu"]  # one GPU per node here


def test_without_an_acting_tier_nothing_is_an_alarm():
    watch_only = PolicyConfig(tiers=(Tier("watch", 0.2, 0.1),))
    hist = pl.from_pandas(snapshot(T0, {"n0-g0": 0.99})).select(history.RISK_COLUMNS)
    assert history.alarm_threshold(watch_only) is None
    assert history.alarms_per_day(hist, watch_only, T0.date()) == {"gpu": {}, "node": {}}
    assert history.alarm_threshold(TIERS) == ("avoid", 0.35)
    drain_only = PolicyConfig(tiers=(Tier("watch", 0.2, 0.1), Tier("drain_now", 0.8, 0.6)))
    assert history.alarm_threshold(drain_only) == ("drain_now", 0.8)


def xid_rows(rows: list[tuple[datetime, str, str | None, int]]) -> pa.Table:
    times = [r[0] for r in rows]
    return make_rows(
        "xid_events",
        times,
        node=[r[1] for r in rows],
        pci_bus_id=["0000:18:00.0"] * len(rows),
        gpu_uuid=[r[2] for r in rows],
        xid=[r[3] for r in rows],
    )


def test_failed_gpus_per_day_count_each_gpu_once_a_day(store):
    day1, day2 = T0 + timedelta(hours=2), T0 + timedelta(days=1, hours=2)
    store.write(
        "xid_events",
        xid_rows(
            [
                (day1, "n0", "GPU-a", 79),
                (day1 + timedelta(hours=1), "n0", "GPU-a", 79),  # the same GPU again
                (day1, "n1", None, 48),  # no uuid: counted by node and bus
                (day1, "n2", "GPU-c", 13),  # not a failure XID
                (day2, "n0", "GPU-a", 79),
            ]
        ),
    )
    got = history.failed_gpus_per_day(store, (48, 79), T0, T0 + timedelta(days=3))
    assert got == {day1.date(): 2, day2.date(): 1}
    assert history.failed_gpus_per_day(store, (), T0, T0 + timedelta(days=3)) == {}


def test_daily_counts_fill_every_day_of_the_window(store):
    write(store, snapshot(T0, {"n0-g0": 0.1}))
    write(store, snapshot(T0 + timedelta(days=2), {"n0-g0": 0.5}))
    counts = history.daily_counts(store, TIERS, (79,), (T0 + timedelta(days=3)).date(), 7)
    assert len(counts.days) == 7 and counts.days[-1] == (T0 + timedelta(days=3)).date()
    assert dict(zip(counts.days, counts.gpu_alarms, strict=True))[(T0 + timedelta(days=2)).date()] == 1
    assert sum(counts.gpu_alarms) == 1 and counts.snapshots == 2 and counts.alarm_tier == "avoid"


def test_the_history_ends_where_the_data_ends(store):
    assert history.last_data_day(store, date(2026, 1, 1)) == date(2026, 1, 1)
    write(store, snapshot(T0 + timedelta(days=4), {"n0-g0": 0.1}))
    assert history.last_data_day(store, date(2026, 1, 1)) == (T0 + timedelta(days=4)).date()
    assert history.last_data_day(store, date(2026, 6, 1)) == date(2026, 6, 1)


def test_the_cache_recomputes_only_when_the_inputs_change_and_serves_stale_counts_meanwhile(store, monkeypatch):
    write(store, snapshot(T0, {"n0-g0": 0.5}))
    calls, release = [], threading.Event()
    real = history.daily_counts

    def counted(*args):
        calls.append(args)
        if len(calls) > 1:
            release.wait(10)
        return real(*args)

    monkeypatch.setattr(history, "daily_counts", counted)
    cache = history.DailyCountsCache()
    last = (T0 + timedelta(days=1)).date()
    first, stale = cache.get(store, TIERS, (79,), last, 7)
    assert not stale and sum(first.gpu_alarms) == 1
    again, stale = cache.get(store, TIERS, (79,), last, 7)
    assert again is first and not stale and len(calls) == 1
    write(store, snapshot(T0 + timedelta(days=1), {"n0-g0": 0.1, "n1-g0": 0.9}))
    during, stale = cache.get(store, TIERS, (79,), last, 7)
    assert during is first and stale  # served while the new counts are computed
    release.set()
    cache.join(10)
    after, stale = cache.get(store, TIERS, (79,), last, 7)
    assert not stale and sum(after.gpu_alarms) == 2 and len(calls) == 2


def test_a_failed_refresh_keeps_the_previous_counts_and_says_why(store, monkeypatch):
    write(store, snapshot(T0, {"n0-g0": 0.5}))
    cache = history.DailyCountsCache()
    last = (T0 + timedelta(days=1)).date()
    before, _ = cache.get(store, TIERS, (79,), last, 7)
    real = history.daily_counts

    tries = []

    def broken(*args):
        tries.append(args)
        raise OSError("disk gone")

    monkeypatch.setattr(history, "daily_counts", broken)
    write(store, snapshot(T0 + timedelta(days=1), {"n0-g0": 0.1}))
    served, stale = cache.get(store, TIERS, (79,), last, 7)
    cache.join(10)
    assert served is before and stale
    assert cache.error == "OSError: disk gone"
    assert cache.get(store, TIERS, (79,), last, 7) == (before, True)
    cache.join(10)
    assert len(tries) == 1  # the same inputs are not tried again on every view
    monkeypatch.setattr(history, "daily_counts", real)
    write(store, snapshot(T0 + timedelta(days=1, hours=1), {"n0-g0": 0.6}))
    cache.get(store, TIERS, (79,), last, 7)
    cache.join(10)
    recovered, stale = cache.get(store, TIERS, (79,), last, 7)
    assert not stale and cache.error == "" and sum(recovered.gpu_alarms) == 2
