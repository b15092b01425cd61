"""Failure episodes and labels: horizon, censoring, dropping rows after a failure, merging."""

from __future__ import annotations

from datetime import timedelta

import polars as pl
import pytest

from features.build import build_features
from features.labels import (
    attach_labels,
    failure_episodes,
    gpu_presence,
    lost_gpu_episodes,
    repair_episodes,
    resolve_xid_gpus,
)
from features.spec import FeatureSpec
from tests.features import MIN, NO_XIDS, H, at, every, samples, xids

DAY = timedelta(hours=24)


def labels_by_ts(out: pl.DataFrame, gpu: str = "GPU-a") -> dict:
    part = out.filter(pl.col("gpu_uuid") == gpu)
    return dict(zip(part["ts"].to_list(), part["label"].to_list(), strict=True))


def one_gpu_two_days(gpu: str = "GPU-a", **kw) -> pl.DataFrame:
    return samples(every(at(0, 10), at(48), 10 * MIN), gpu=gpu, temp_gpu_c=60.0, **kw)


def test_failure_labels_the_horizon_before_it_and_drops_rows_after_it():
    tel = one_gpu_two_days()
    fail = at(30, 30)  # XID 79, fallen off the bus
    out = build_features(tel, xids([{"ts": fail, "gpu_uuid": "GPU-a", "xid": 79}]), FeatureSpec(horizon=DAY))
    labels = labels_by_ts(out)
    # Label 1 for grid times in [T - horizon, T) = [06:30, 30:30): 07:00 ... 30:00.
    assert all(labels[at(h)] == 1 for h in range(7, 31))
    assert all(labels[at(h)] == 0 for h in range(1, 7))
    # No row at or after the failure: the GPU is out of service.
    assert max(labels) == at(30)
    r = out.filter(pl.col("ts") == at(30)).row(0, named=True)
    assert r["time_to_failure_h"] == 0.5
    r = out.filter(pl.col("ts") == at(7)).row(0, named=True)
    assert r["time_to_failure_h"] == 23.5
    assert out.filter(pl.col("label") == 0)["time_to_failure_h"].null_count() == out.filter(pl.col("label") == 0).height


def test_rows_whose_horizon_runs_past_the_data_end_are_censored():
    out = build_features(one_gpu_two_days(), NO_XIDS, FeatureSpec(horizon=6 * H))
    labels = labels_by_ts(out)
    assert max(labels) == at(48)
    assert labels[at(42)] == 0  # 42 + 6 = 48 = data end: fully observed
    assert all(labels[at(h)] is None for h in range(43, 49))
    assert out["time_to_failure_h"].null_count() == out.height


def test_a_failure_inside_the_censored_tail_is_still_a_positive():
    out = build_features(
        one_gpu_two_days(), xids([{"ts": at(47, 30), "gpu_uuid": "GPU-a", "xid": 48}]), FeatureSpec(horizon=DAY)
    )
    labels = labels_by_ts(out)
    assert labels[at(47)] == 1 and labels[at(30)] == 1
    assert labels[at(23)] == 0  # 23 + 24 < 47:30


def test_events_within_the_merge_window_are_one_episode_starting_at_the_first():
    events = xids(
        [
            {"ts": at(10), "gpu_uuid": "GPU-a", "xid": 48},
            {"ts": at(14), "last_ts": at(15), "gpu_uuid": "GPU-a", "xid": 95},  # 4 h later: merged
            {"ts": at(20), "gpu_uuid": "GPU-a", "xid": 79},  # 5 h after the last line: merged (chain)
            {"ts": at(27), "gpu_uuid": "GPU-a", "xid": 79},  # 7 h later: a new episode
            {"ts": at(12), "gpu_uuid": "GPU-b", "xid": 48},  # another GPU
        ]
    )
    ep = failure_episodes(events, failure_xids=[48, 79, 95], merge_window=timedelta(hours=6))
    a = ep.filter(pl.col("gpu_uuid") == "GPU-a")
    assert a["start"].to_list() == [at(10), at(27)]
    assert a["end"].to_list() == [at(20), at(27)]
    assert a["n_events"].to_list() == [3, 1]
    assert a["xids"].to_list() == [[48, 79, 95], [79]]
    assert ep.filter(pl.col("gpu_uuid") == "GPU-b")["start"].to_list() == [at(12)]
    # A shorter merge window splits the first episode.
    ep = failure_episodes(events, failure_xids=[48, 79, 95], merge_window=timedelta(hours=3))
    assert ep.filter(pl.col("gpu_uuid") == "GPU-a")["start"].to_list() == [at(10), at(14), at(20), at(27)]


def test_non_failure_xids_never_make_a_label():
    events = xids(
        [
            {"ts": at(h), "gpu_uuid": "GPU-a", "xid": x, "repeat_count": 500}
            for h in (5, 10, 20, 30)
            for x in (13, 31, 43, 45, 63, 92)
        ]
    )
    out = build_features(one_gpu_two_days(), events, FeatureSpec(horizon=DAY))
    assert out.filter(pl.col("label") == 1).height == 0
    assert out.height == 48  # no row dropped
    assert out["xid_application_count_7d"].max() > 0  # the XIDs are features, not labels


def test_failure_xids_are_configuration():
    events = xids([{"ts": at(20, 30), "gpu_uuid": "GPU-a", "xid": 13}])
    out = build_features(one_gpu_two_days(), events, FeatureSpec(horizon=DAY, failure_xids=[13]))
    assert labels_by_ts(out)[at(20)] == 1
    assert max(labels_by_ts(out)) == at(20)


def test_a_replacement_gpu_starts_fresh():
    old = samples(every(at(0, 10), at(20), 10 * MIN), gpu="GPU-old", temp_gpu_c=60.0)
    new = samples(every(at(26, 10), at(48), 10 * MIN), gpu="GPU-new", temp_gpu_c=50.0)
    events = xids([{"ts": at(20, 5), "gpu_uuid": "GPU-old", "xid": 79}])
    out = build_features(pl.concat([old, new]), events, FeatureSpec(horizon=6 * H))
    assert labels_by_ts(out, "GPU-old")[at(20)] == 1
    assert min(labels_by_ts(out, "GPU-new")) == at(27)
    assert out.filter(pl.col("gpu_uuid") == "GPU-new")["label"].drop_nulls().unique().to_list() == [0]


def test_a_gpu_that_goes_silent_while_its_node_keeps_reporting_is_lost():
    lost = samples(every(at(0, 10), at(20, 20), 10 * MIN), gpu="GPU-a", gpu_index=0, temp_gpu_c=60.0)
    peer = samples(every(at(0, 10), at(48), 10 * MIN), gpu="GPU-b", gpu_index=1, temp_gpu_c=60.0)
    presence = gpu_presence(pl.concat([lost, peer]))
    ep = lost_gpu_episodes(presence, data_end=at(48), lost_after=timedelta(hours=6))
    assert ep.select("gpu_uuid", "start", "source").rows() == [
        ("GPU-a", at(20, 20) + timedelta(microseconds=1), "lost")
    ]
    out = build_features(pl.concat([lost, peer]), NO_XIDS, FeatureSpec(horizon=6 * H))
    labels = labels_by_ts(out, "GPU-a")
    assert max(labels) == at(20)
    assert labels[at(15)] == 1 and labels[at(14)] == 0
    # Turned off, the silent GPU is unlabelled data: rows continue while it is silent < max_silence.
    out = build_features(pl.concat([lost, peer]), NO_XIDS, FeatureSpec(horizon=6 * H, lost_after=None))
    assert max(labels_by_ts(out, "GPU-a")) == at(44)


def test_a_whole_node_going_silent_is_not_a_gpu_failure():
    a = samples(every(at(0, 10), at(20), 10 * MIN), gpu="GPU-a", gpu_index=0, temp_gpu_c=60.0)
    b = samples(every(at(0, 10), at(20), 10 * MIN), gpu="GPU-b", gpu_index=1, temp_gpu_c=60.0)
    elsewhere = samples(every(at(0, 10), at(48), 10 * MIN), gpu="GPU-c", node="n1", temp_gpu_c=60.0)
    presence = gpu_presence(pl.concat([a, b, elsewhere]))
    assert lost_gpu_episodes(presence, data_end=at(48), lost_after=timedelta(hours=6)).height == 0
    # Nor is a GPU that stopped recently (less than lost_after before the data end).
    late = samples(every(at(0, 10), at(45), 10 * MIN), gpu="GPU-d", node="n1", gpu_index=1, temp_gpu_c=60.0)
    presence = gpu_presence(pl.concat([elsewhere, late]))
    assert lost_gpu_episodes(presence, data_end=at(48), lost_after=timedelta(hours=6)).height == 0


def test_xid_events_without_a_uuid_are_attributed_by_pci_bus_id():
    a = samples(every(at(0, 10), at(48), 10 * MIN), gpu="GPU-a", gpu_index=0, pci_bus_id="0000:3b:00", temp_gpu_c=60.0)
    b = samples(every(at(0, 10), at(48), 10 * MIN), gpu="GPU-b", gpu_index=1, pci_bus_id="0000:5e:00", temp_gpu_c=60.0)
    events = xids([{"ts": at(30, 30), "gpu_uuid": None, "pci_bus_id": "0000:5e:00", "gpu_index": None, "xid": 79}])
    resolved = resolve_xid_gpus(events, gpu_presence(pl.concat([a, b])))
    assert resolved["gpu_uuid"].to_list() == ["GPU-b"]
    out = build_features(pl.concat([a, b]), events, FeatureSpec(horizon=DAY))
    assert labels_by_ts(out, "GPU-b")[at(10)] == 1
    assert labels_by_ts(out, "GPU-a")[at(10)] == 0


def test_attach_labels_keeps_row_order_and_types():
    rows = pl.DataFrame({"gpu_uuid": ["b", "a", "a"], "ts": [at(2), at(1), at(3)]}).with_columns(
        pl.col("ts").cast(pl.Datetime("us", "UTC"))
    )
    ep = failure_episodes(xids([{"ts": at(2, 30), "gpu_uuid": "a", "xid": 79}]), failure_xids=[79])
    out = attach_labels(rows, ep, horizon=H, data_end=at(10))
    assert out.rows() == [("b", at(2), 0, None), ("a", at(1), 0, None)]
    assert out.schema["label"] == pl.Int8 and out.schema["time_to_failure_h"] == pl.Float32
    with pytest.raises(AssertionError):
        assert out.height == 3  # the row at 03:00 is after the failure


def test_a_failure_xid_soon_after_the_telemetry_stops_dates_the_failure():
    lost = samples(every(at(0, 10), at(20, 20), 10 * MIN), gpu="GPU-a", gpu_index=0, temp_gpu_c=60.0)
    peer = samples(every(at(0, 10), at(48), 10 * MIN), gpu="GPU-b", gpu_index=1, temp_gpu_c=60.0)
    events = xids([{"ts": at(23, 30), "gpu_uuid": "GPU-a", "xid": 79}])
    out = build_features(pl.concat([lost, peer]), events, FeatureSpec(horizon=6 * H))
    a = out.filter(pl.col("gpu_uuid") == "GPU-a")
    # Rows continue through the silence, labelled by the XID, until it is logged.
    assert a["ts"].max() == at(23)
    last = a.row(-1, named=True)
    assert last["label"] == 1 and last["time_to_failure_h"] == 0.5
    assert last["telemetry_since_last_h"] == pytest.approx(23 - (20 + 20 / 60))
    assert labels_by_ts(out, "GPU-a")[at(17)] == 0  # 17 + 6 < 23:30


# -- repairs --------------------------------------------------------------------------------------


def repairs(rows: list[tuple]) -> pl.DataFrame:
    """Repair records (ts, old_gpu_uuid, action) in the `repairs` schema's columns."""
    return pl.DataFrame(
        [
            {
                "ts": ts,
                "cluster": "c0",
                "node": "n0",
                "gpu_index": 0,
                "old_gpu_uuid": gpu,
                "new_gpu_uuid": None,
                "action": a,
            }
            for ts, gpu, a in rows
        ],
        schema={
            "ts": pl.Datetime("us", "UTC"),
            "cluster": pl.String,
            "node": pl.String,
            "gpu_index": pl.Int16,
            "old_gpu_uuid": pl.String,
            "new_gpu_uuid": pl.String,
            "action": pl.String,
        },
    )


def test_a_repaired_gpu_returns_to_service_and_can_fail_again():
    tel = one_gpu_two_days()
    events = xids(
        [
            {"ts": at(10, 30), "gpu_uuid": "GPU-a", "xid": 79},
            {"ts": at(40, 30), "gpu_uuid": "GPU-a", "xid": 48},
        ]
    )
    out = build_features(tel, events, FeatureSpec(horizon=6 * H), repairs=repairs([(at(14), "GPU-a", "reseat")]))
    labels = labels_by_ts(out)
    # Out of service from the failure at 10:30 until the reseat at 14:00.
    assert at(10) in labels and not any(at(h) in labels for h in (11, 12, 13))
    assert labels[at(14)] == 0 and labels[at(34)] == 0
    # The second failure at 40:30 labels (34:30, 40:30) again, then the GPU is out for good.
    assert all(labels[at(h)] == 1 for h in range(35, 41))
    assert max(labels) == at(40)
    # Without the repair record the GPU never comes back.
    assert max(labels_by_ts(build_features(tel, events, FeatureSpec(horizon=6 * H)))) == at(10)


def test_a_repair_of_a_gpu_in_service_is_a_failure_at_its_last_sample():
    tel = samples(every(at(0, 10), at(20), 10 * MIN), temp_gpu_c=60.0)
    out = build_features(
        tel,
        NO_XIDS,
        FeatureSpec(horizon=6 * H, lost_after=None),
        data_end=at(48),
        repairs=repairs([(at(30), "GPU-a", "replace")]),
    )
    labels = labels_by_ts(out)
    # Failed just after its last sample at 20:00: label 1 for (14:00, 20:00].
    assert labels[at(14)] == 0
    assert all(labels[at(h)] == 1 for h in range(15, 21))
    assert max(labels) == at(20)
    assert out.filter(pl.col("ts") == at(20))["time_to_failure_h"].item() == pytest.approx(1 / 3_600_000_000)


def test_a_repair_closing_a_known_failure_adds_no_second_episode():
    events = xids([{"ts": at(10, 30), "gpu_uuid": "GPU-a", "xid": 79}])
    fixes = repairs([(at(12), "GPU-a", "reset")])
    presence = gpu_presence(one_gpu_two_days())
    known = failure_episodes(events, [79])
    assert repair_episodes(fixes, known, presence).height == 0
    # A second repair while in service again is a new failure.
    assert (
        repair_episodes(repairs([(at(12), "GPU-a", "reset"), (at(40), "GPU-a", "reset")]), known, presence).height == 1
    )


def test_a_failure_exactly_at_the_horizon_edge_is_a_positive_and_one_just_past_it_is_not():
    tel = one_gpu_two_days()
    edge = build_features(tel, xids([{"ts": at(30), "gpu_uuid": "GPU-a", "xid": 79}]), FeatureSpec(horizon=6 * H))
    labels = labels_by_ts(edge)
    assert labels[at(24)] == 1  # failure at 24:00 + 6 h exactly: inside (t, t + horizon]
    assert labels[at(23)] == 0
    assert max(labels) == at(29)  # the row at the failure time itself is dropped
    past = build_features(
        tel,
        xids([{"ts": at(30) + timedelta(microseconds=1), "gpu_uuid": "GPU-a", "xid": 79}]),
        FeatureSpec(horizon=6 * H),
    )
    assert labels_by_ts(past)[at(24)] == 0


def test_repairs_without_the_needed_columns_are_refused():
    with pytest.raises(ValueError, match="repairs: missing required columns"):
        build_features(one_gpu_two_days(), NO_XIDS, repairs=pl.DataFrame({"ts": [at(1)]}))


def _presence(last: dict[str, object]) -> pl.DataFrame:
    return pl.DataFrame({"gpu_uuid": list(last), "last_ts": list(last.values())})


@pytest.mark.parametrize(
    ("lasts", "end"),
    [
        # one GPU of eight a day and a half ahead: the other seven make the end
        ({**{f"g{i}": at(48) for i in range(7)}, "fast": at(84)}, at(48)),
        # collectors that flushed an hour apart are one fleet
        ({**{f"g{i}": at(48) for i in range(7)}, "late": at(49)}, at(49)),
        # a fleet that shrank a month ago to two GPUs: the two make the end
        ({**{f"old{i}": at(0) for i in range(40)}, "a": at(800), "b": at(800, minutes=-10)}, at(800)),
        # two GPUs, one ahead: nothing to tell them apart, the newest makes the end
        ({"a": at(10), "b": at(40)}, at(40)),
    ],
)
def test_the_fleets_data_end_is_its_bulks(lasts: dict[str, object], end: object) -> None:
    from features.labels import fleet_data_end

    assert fleet_data_end(_presence(lasts)) == end
