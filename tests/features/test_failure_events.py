"""Failure events (records, scheduler-seen failures) as a label source beside the XIDs."""

from __future__ import annotations

from datetime import datetime, timedelta

import polars as pl

from features.labels import episodes_for, gpu_presence, label_rows, positives_by_source, with_returns
from ingest.failure_events import event_frame
from tests.features import MIN, NO_XIDS, at, every, samples, xids

HORIZON = timedelta(hours=24)


def node_of_two(node: str = "n0", hours: float = 48) -> pl.DataFrame:
    times = every(at(0, 10), at(hours), 10 * MIN)
    return pl.concat(
        [
            samples(times, gpu=f"{node}-g0", node=node, gpu_index=0),
            samples(times, gpu=f"{node}-g1", node=node, gpu_index=1),
        ]
    )


def episodes(telemetry: pl.DataFrame, events: pl.DataFrame, xid: pl.DataFrame = NO_XIDS) -> pl.DataFrame:
    presence = gpu_presence(telemetry)
    return episodes_for(
        xid,
        presence,
        failure_xids=[79],
        data_end=telemetry["ts"].max(),  # type: ignore[arg-type]
        failure_events=events,
    )


def event(ts: datetime, node: str = "n0", gpu: str | None = None, source: str = "slurm", **more) -> pl.DataFrame:
    return event_frame([{"ts": ts, "cluster": "c0", "node": node, "gpu_uuid": gpu, "source": source, **more}])


def test_a_node_wide_scheduler_failure_starts_an_episode_on_every_gpu_the_node_was_reporting_from():
    tel = pl.concat([node_of_two("n0"), node_of_two("n1")])
    eps = episodes(tel, event(at(30)))
    assert sorted(eps["gpu_uuid"]) == ["n0-g0", "n0-g1"]
    assert set(eps["source"]) == {"slurm"} and set(eps["start"]) == {at(30)}


def test_a_record_naming_a_gpu_labels_that_gpu_only_and_counts_as_a_record():
    tel = node_of_two()
    eps = episodes(tel, event(at(30), gpu="n0-g1", source="record"))
    assert eps.select("gpu_uuid", "source").rows() == [("n0-g1", "record")]
    keys = tel.select("gpu_uuid", "ts").filter(pl.col("ts").dt.minute() == 0)
    facts = pl.concat([keys, label_rows(keys, eps, horizon=HORIZON, data_end=at(48))], how="horizontal")
    positive = facts.filter(pl.col("label") == 1)
    assert set(positive["gpu_uuid"]) == {"n0-g1"}
    assert positives_by_source(positive, eps) == {"record": positive.height}


def test_an_event_within_the_merge_window_of_a_failure_xid_is_the_same_failure():
    tel = node_of_two()
    xid = xids([{"ts": at(30), "gpu_uuid": "n0-g1", "gpu_index": 1, "xid": 79}])
    # The node failed two hours after GPU 1's Xid 79: that GPU explains it, GPU 0 is not blamed.
    eps = episodes(tel, event(at(32)), xid)
    assert eps.select("gpu_uuid", "source").rows() == [("n0-g1", "xid")]
    # Ten hours later it is another failure, of the whole node.
    eps = episodes(tel, event(at(40)), xid)
    assert sorted(eps.select("gpu_uuid", "source").rows()) == [("n0-g0", "slurm"), ("n0-g1", "slurm"), ("n0-g1", "xid")]


def test_a_node_that_was_back_returns_its_gpus_to_service_and_one_that_was_not_stays_out():
    tel = node_of_two()
    keys = tel.select("gpu_uuid", "ts").filter(pl.col("ts").dt.minute() == 0)
    back = episodes(tel, event(at(20), end=at(22)))
    facts = label_rows(keys, back, horizon=HORIZON, data_end=at(48), repairs=with_returns(None, back))
    rows = pl.concat([keys, facts], how="horizontal")
    assert rows.filter(pl.col("ts") == at(30))["in_service"].to_list() == [True, True]
    assert rows.filter(pl.col("ts") == at(21))["in_service"].to_list() == [False, False]
    down = episodes(tel, event(at(20)))
    facts = label_rows(keys, down, horizon=HORIZON, data_end=at(48), repairs=with_returns(None, down))
    assert not pl.concat([keys, facts], how="horizontal").filter(pl.col("ts") == at(30))["in_service"].any()


def test_an_event_on_a_node_without_telemetry_then_gives_no_episode():
    tel = node_of_two(hours=10)  # silent from 10:00 on
    assert episodes(tel, event(at(30))).height == 0
    assert episodes(tel, event(at(5), node="elsewhere")).height == 0


def test_the_same_gpu_reported_twice_within_the_merge_window_is_one_failure():
    tel = node_of_two()
    both = pl.concat([event(at(30), gpu="n0-g0", source="record"), event(at(31), source="kubernetes")])
    eps = episodes(tel, both)
    assert sorted(eps.select("gpu_uuid", "start", "source").rows()) == [
        ("n0-g0", at(30), "record"),
        ("n0-g1", at(31), "kubernetes"),
    ]
