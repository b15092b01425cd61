"""Bucket and window arithmetic on hand-made series, with values worked out by hand."""

from __future__ import annotations

import statistics
from datetime import timedelta

import numpy as np
import polars as pl
import pytest

from features.build import build_features
from features.schema import TS_DTYPE
from features.spec import FeatureSpec
from features.windows import RUN, dense_grid, grid_time, hourly_aggregate, in_gpu_and_time_order, sorted_by_gpu_and_time
from features.xids import xid_features
from tests.features import MIN, NO_XIDS, T0, US, H, at, every, samples, xids


def row(frame: pl.DataFrame, t, gpu: str = "GPU-a") -> dict:
    hit = frame.filter((pl.col("gpu_uuid") == gpu) & (pl.col("ts") == t))
    assert hit.height == 1, f"expected one row for {gpu} at {t}, got {hit.height}"
    return hit.row(0, named=True)


# -- buckets --------------------------------------------------------------------------------------


def test_rows_are_sorted_only_when_a_gpus_rows_are_apart_or_out_of_time_order():
    def frame(gpus: list[str], hours: list[int]) -> pl.DataFrame:
        return pl.DataFrame({"gpu_uuid": gpus, "ts": [T0 + timedelta(hours=h) for h in hours]})

    grouped = frame(["b", "b", "a", "a"], [0, 1, 0, 1])  # GPUs in any order, each in time order
    assert in_gpu_and_time_order(grouped)
    assert in_gpu_and_time_order(grouped.clear())
    assert not in_gpu_and_time_order(frame(["a", "b", "a"], [0, 0, 1]))  # a's rows apart
    assert not in_gpu_and_time_order(frame(["a", "a", "b"], [1, 0, 0]))  # a's rows back in time
    # Kept as it is when in order (the day's rows are not copied), put in order otherwise.
    kept = sorted_by_gpu_and_time(grouped)
    assert kept.drop(RUN).equals(grouped) and kept[RUN].to_list() == [0, 0, 1, 1]
    mixed = sorted_by_gpu_and_time(frame(["a", "b", "a", "b"], [1, 0, 0, 1]))
    assert in_gpu_and_time_order(mixed.drop(RUN))
    assert mixed.sort("gpu_uuid", "ts").drop(RUN).equals(frame(["a", "a", "b", "b"], [0, 1, 0, 1]))


def test_grid_time_puts_a_sample_exactly_at_t_in_t_and_one_microsecond_later_in_the_next():
    ts = pl.Series([at(1), at(1) + US, at(1) - US, at(0, 30)], dtype=pl.Datetime("us", "UTC"))
    got = pl.DataFrame({"ts": ts}).select(grid_time(pl.col("ts"), H))["ts"].to_list()
    assert got == [at(1), at(2), at(1), at(1)]


def test_hourly_aggregate_bucket_boundaries():
    tel = samples([at(1), at(1) + US, at(2)], temp_gpu_c=[10.0, 20.0, 30.0])
    agg = hourly_aggregate(tel, H)
    assert agg["ts"].to_list() == [at(1), at(2)]
    assert agg["n_samples_1h"].to_list() == [1, 2]
    assert agg["temp_gpu_c_mean_1h"].to_list() == [10.0, 25.0]
    assert agg["temp_gpu_c_last_1h"].to_list() == [10.0, 30.0]
    assert agg["temp_gpu_c_min_1h"].to_list() == [10.0, 20.0]


def test_a_bucket_without_a_known_spacing_has_a_null_interval_that_the_missing_fraction_skips():
    # 00:40 is the GPU's first sample and alone in its bucket: no spacing is known there.
    times = [at(0, 40), at(1, 10), at(1, 25), at(1, 40), at(1, 55), at(2, 10), at(2, 25), at(2, 40), at(2, 55)]
    tel = samples(times, temp_gpu_c=[40.0] * len(times))
    agg = hourly_aggregate(tel, H)
    assert agg["sample_interval_s_1h"][0] is None  # null, not NaN (0/0)
    assert agg["sample_interval_s_1h"][1] == pytest.approx((30 + 15 + 15 + 15) * 60 / 4)
    out = build_features(tel, NO_XIDS, data_end=at(3))
    # The rolling median of the spacing at 02:00 covers the null bucket and a known one: a NaN
    # there made the young GPU's missing fraction NaN.
    second_hour = row(out, at(2))
    assert second_hour["telemetry_missing_frac_1h"] == 0.0
    assert second_hour["telemetry_missing_frac_7d"] == 0.0


def test_counter_reset_counts_the_value_after_the_drop():
    # 5 -> 7 is +2; the drop to 0 is a reset (driver reload), 0 accrued; 0 -> 2 is +2: 4 in all.
    tel = samples([at(0, 10), at(0, 20), at(0, 30), at(0, 40)], ecc_dbe_volatile_total=[5, 7, 0, 2])
    agg = hourly_aggregate(tel, H)
    assert agg["ecc_dbe_volatile_total_increase_1h"].to_list() == [4]
    assert agg["ecc_dbe_volatile_total_last_1h"].to_list() == [2]
    # The bucket (00:00, 01:00] is complete only once the data reaches 01:00.
    assert build_features(tel, NO_XIDS).height == 0
    out = build_features(tel, NO_XIDS, data_end=at(1))
    assert out["ecc_dbe_volatile_total_increase_1h"].to_list() == [4.0]


def test_counter_reset_to_a_nonzero_value_and_across_buckets():
    # Buckets: (00:00, 01:00] 10 (a baseline, not an increase) | (01:00, 02:00] 12 (+2), 3 (reset:
    # +3), 4 at exactly 02:00 (+1) | (02:00, 03:00] 1 (reset: +1, the previous reading is in the
    # bucket before).
    tel = samples([at(0, 30), at(1, 10), at(1, 20), at(2, 0), at(2, 30)], pcie_replay_total=[10, 12, 3, 4, 1])
    agg = hourly_aggregate(tel, H)
    assert agg["pcie_replay_total_increase_1h"].to_list() == [0, 6, 1]
    out = build_features(tel, NO_XIDS, data_end=at(3))
    assert row(out, at(3))["pcie_replay_total_increase_6h"] == 7.0
    assert row(out, at(3))["pcie_replay_total_last"] == 1.0


def test_counter_null_readings_are_skipped_not_counted_as_resets():
    tel = samples([at(0, 10), at(0, 20), at(0, 30), at(0, 40)], ecc_sbe_volatile_total=[5, None, 8, 9])
    tel = pl.concat([tel, samples([at(0, 10)], gpu="GPU-b", gpu_index=1, ecc_sbe_volatile_total=[None])])
    agg = hourly_aggregate(tel, H)
    assert agg.filter(pl.col("gpu_uuid") == "GPU-a")["ecc_sbe_volatile_total_increase_1h"].to_list() == [4]
    # A bucket without a reading has no increase (null), not an increase of 0.
    assert agg.filter(pl.col("gpu_uuid") == "GPU-b")["ecc_sbe_volatile_total_increase_1h"].to_list() == [None]


def test_counter_increase_is_not_counted_across_a_gap_longer_than_max_gap():
    tel = samples([at(0, 30), at(30, 30)], pcie_replay_total=[10, 50])
    agg = hourly_aggregate(tel, H, max_gap=timedelta(hours=24))
    assert agg["pcie_replay_total_increase_1h"].to_list() == [0, 0]
    agg = hourly_aggregate(tel, H, max_gap=timedelta(hours=48))
    assert agg["pcie_replay_total_increase_1h"].to_list() == [0, 40]


# -- gauge windows --------------------------------------------------------------------------------


def test_gauge_window_mean_max_min_std_slope_last_over_six_hours():
    # One sample every 30 minutes, value i at 00:30 * i. At t = 12:00 the 6 h window is
    # (06:00, 12:00]: samples 13..24 (the one exactly at 06:00, value 12, is outside).
    times = [at(0, 30 * i) for i in range(1, 25)]
    tel = samples(times, temp_gpu_c=[float(i) for i in range(1, 25)])
    out = build_features(tel, NO_XIDS)
    r = row(out, at(12))
    inside = list(range(13, 25))
    assert r["temp_gpu_c_mean_6h"] == pytest.approx(statistics.mean(inside))
    assert r["temp_gpu_c_max_6h"] == 24.0
    assert r["temp_gpu_c_std_6h"] == pytest.approx(statistics.stdev(inside), rel=1e-6)
    # The last bucket (11:00, 12:00] holds 23 and 24.
    assert r["temp_gpu_c_mean_1h"] == 23.5
    assert r["temp_gpu_c_std_1h"] == pytest.approx(statistics.stdev([23, 24]), rel=1e-6)
    assert r["temp_gpu_c_min_6h"] == 13.0 and r["temp_gpu_c_min_1h"] == 23.0
    assert r["temp_gpu_c_last"] == 24.0
    # Bucket means 13.5, 15.5, ..., 23.5 at 07:00 .. 12:00: a slope of 2 degC per hour.
    assert r["temp_gpu_c_slope_6h"] == pytest.approx(2.0)
    assert "temp_gpu_c_slope_1h" not in out.columns  # one bucket has no slope
    # 24 h window at 12:00 holds everything (the GPU is 11.5 h old).
    assert r["temp_gpu_c_mean_24h"] == pytest.approx(12.5)
    assert r["temp_gpu_c_max_7d"] == 24.0


def test_gauge_windows_ignore_null_readings_and_empty_buckets():
    tel = samples([at(0, 30), at(1, 30), at(1, 40), at(4, 30)], temp_gpu_c=[10.0, None, 30.0, 50.0])
    out = build_features(tel, NO_XIDS, data_end=at(5))
    r = row(out, at(3))  # buckets 1, 2 hold data; bucket 3 is empty
    assert r["temp_gpu_c_mean_1h"] is None
    assert r["temp_gpu_c_mean_6h"] == 20.0
    assert r["temp_gpu_c_max_6h"] == 30.0
    assert row(out, at(5))["temp_gpu_c_mean_6h"] == 30.0


def test_a_nan_reading_is_a_missing_reading_and_does_not_spoil_later_windows():
    # Telemetry imported from another system may carry NaN. Window sums are running sums, so a
    # NaN counted as a value would stay in every later window of the GPU.
    times = every(at(0, 30), at(30), 30 * MIN)
    temps = [60.0] * len(times)
    temps[2] = float("nan")  # in the bucket at 02:00
    out = build_features(samples(times, temp_gpu_c=temps), NO_XIDS, data_end=at(30))
    two = row(out, at(2))
    assert two["temp_gpu_c_mean_1h"] == 60.0 and two["temp_gpu_c_max_1h"] == 60.0
    later = row(out, at(30))
    assert later["temp_gpu_c_mean_24h"] == 60.0
    assert later["temp_gpu_c_std_24h"] == 0.0
    assert later["temp_gpu_c_slope_24h"] == 0.0


# -- telemetry health -----------------------------------------------------------------------------


def test_missing_sample_fraction_rises_when_samples_are_dropped():
    times = every(at(0, 1), at(48))
    full = samples(times, gpu="GPU-a", temp_gpu_c=60.0)
    # GPU-b loses 30 of the 60 samples of hour (39:00, 40:00].
    holey = [t for t in times if not (at(39, 30) <= t < at(40))]
    part = samples(holey, gpu="GPU-b", gpu_index=1, temp_gpu_c=60.0)
    out = build_features(pl.concat([full, part]), NO_XIDS)
    a, b = row(out, at(40), "GPU-a"), row(out, at(40), "GPU-b")
    assert a["telemetry_missing_frac_1h"] == 0.0
    assert a["telemetry_missing_frac_6h"] == 0.0
    assert b["telemetry_missing_frac_1h"] == pytest.approx(0.5)
    assert b["telemetry_missing_frac_6h"] == pytest.approx(30 / 360)
    # The GPU is 40 h - 1 min old at 40:00: 2399 one-minute samples expected, 2370 seen.
    assert b["telemetry_missing_frac_7d"] == pytest.approx(1 - 2370 / 2399, rel=1e-4)
    assert row(out, at(42), "GPU-b")["telemetry_missing_frac_1h"] == 0.0


def test_silence_makes_rows_with_growing_hours_since_last_sample_then_stops():
    times = every(at(0, 10), at(10), 10 * MIN) + every(at(14, 30), at(20), 10 * MIN)
    tel = samples(times, temp_gpu_c=60.0)
    out = build_features(tel, NO_XIDS, FeatureSpec(max_silence=timedelta(hours=3), lost_after=None))
    since = dict(zip(out["ts"].to_list(), out["telemetry_since_last_h"].to_list(), strict=True))
    assert since[at(10)] == 0.0
    assert since[at(11)] == 1.0 and since[at(13)] == 3.0
    assert at(14) not in since  # silent for more than max_silence: no row
    assert since[at(15)] == 0.0  # samples at 14:30 ... 15:00
    assert row(out, at(12))["telemetry_missing_frac_1h"] == 1.0
    assert row(out, at(12))["temp_gpu_c_mean_1h"] is None
    assert row(out, at(12))["temp_gpu_c_mean_6h"] == 60.0


def test_gpu_age_counts_from_the_first_sample():
    tel = samples(every(at(2, 30), at(6), 30 * MIN), temp_gpu_c=60.0)
    out = build_features(tel, NO_XIDS)
    assert row(out, at(3))["gpu_age_h"] == 0.5
    assert row(out, at(6))["gpu_age_h"] == 3.5


def test_a_gpu_appearing_mid_window_is_not_missing_samples_and_its_rates_use_its_age():
    # GPU-new joins at 10:00 (first sample 10:01) next to GPU-old, which reports from 00:01.
    old = samples(every(at(0, 1), at(12)), gpu="GPU-old", temp_gpu_c=50.0, ecc_sbe_volatile_total=0)
    new_times = every(at(10, 1), at(12))
    new = samples(
        new_times, gpu="GPU-new", gpu_index=1, temp_gpu_c=70.0, ecc_sbe_volatile_total=list(range(len(new_times)))
    )
    out = build_features(pl.concat([old, new]), NO_XIDS)
    assert out.filter(pl.col("gpu_uuid") == "GPU-new")["ts"].min() == at(11)
    r = row(out, at(12), "GPU-new")
    assert r["gpu_age_h"] == pytest.approx(2 - 1 / 60)
    # Younger than the 6 h window: only its own life counts as expected samples.
    assert r["telemetry_missing_frac_6h"] == 0.0 and r["telemetry_missing_frac_7d"] == 0.0
    assert r["temp_gpu_c_mean_6h"] == 70.0 and r["temp_gpu_c_std_6h"] == 0.0
    # One error a minute since 10:01 (the first reading is the baseline): 119 over 2 h of life.
    assert r["ecc_sbe_volatile_total_increase_6h"] == 119.0
    assert r["ecc_sbe_volatile_total_rate_6h"] == pytest.approx(119 / (2 - 1 / 60), rel=1e-6)
    assert r["ecc_sbe_volatile_total_rate_1h"] == 60.0
    assert r["temp_gpu_c_node_delta_1h"] == 20.0


# -- flags, bitmasks ------------------------------------------------------------------------------


def test_flag_window_max_and_throttle_fraction():
    times = [at(0, 15), at(0, 30), at(0, 45), at(1)]
    tel = samples(times, retired_pages_pending=[0, 1, 0, 0], clock_event_reasons=[0, 0x40, 0x1, 0x4 | 0x8])
    out = build_features(tel, NO_XIDS)
    r = row(out, at(1))
    assert r["retired_pages_pending_max_1h"] == 1.0
    assert r["clock_event_reasons_hw_slowdown_frac_1h"] == 0.5  # 0x40 and 0x8
    assert r["clock_event_reasons_sw_power_cap_frac_1h"] == 0.25


# -- peers ----------------------------------------------------------------------------------------


def test_a_gpu_ten_degrees_hotter_than_its_seven_neighbours_has_node_delta_ten_and_a_model_delta():
    times = every(at(0, 1), at(3))
    parts = [
        samples(times, gpu=f"GPU-{i}", gpu_index=i, temp_gpu_c=60.0 + 0.1 * (i - 4), power_w=300.0) for i in range(1, 8)
    ]
    parts.append(samples(times, gpu="GPU-hot", gpu_index=0, temp_gpu_c=70.0, power_w=300.0))
    # Another node, much hotter: must not count as a peer.
    parts.append(samples(times, gpu="GPU-other", node="n1", temp_gpu_c=95.0, power_w=300.0))
    # A GPU of another model: not part of the H100 fleet median.
    parts.append(samples(times, gpu="GPU-v100", node="n2", gpu_model="V100", temp_gpu_c=20.0, power_w=200.0))
    out = build_features(pl.concat(parts), NO_XIDS)
    hot = row(out, at(2), "GPU-hot")
    assert hot["temp_gpu_c_node_delta_1h"] == pytest.approx(10.0, abs=1e-4)
    assert hot["power_w_node_delta_1h"] == 0.0
    assert abs(row(out, at(2), "GPU-3")["temp_gpu_c_node_delta_1h"]) < 0.2
    assert row(out, at(2), "GPU-other")["temp_gpu_c_node_delta_1h"] is None  # alone on its node
    # The H100 fleet at 02:00: 59.7 .. 60.3, 70 and 95; its median is 60.1.
    assert hot["temp_gpu_c_model_delta_1h"] == pytest.approx(70.0 - 60.1, abs=1e-4)
    assert row(out, at(2), "GPU-other")["temp_gpu_c_model_delta_1h"] == pytest.approx(95.0 - 60.1, abs=1e-4)
    v100 = row(out, at(2), "GPU-v100")
    assert v100["temp_gpu_c_model_delta_1h"] == 0.0 and v100["power_w_model_delta_1h"] == 0.0


# -- XIDs -----------------------------------------------------------------------------------------


def test_xid_counts_per_class_repeats_and_hours_since_last():
    tel = samples(every(at(0, 10), at(30), 10 * MIN), temp_gpu_c=60.0)
    events = xids(
        [
            {"ts": at(2, 30), "gpu_uuid": "GPU-a", "xid": 63},  # memory, not a failure
            {"ts": at(3), "gpu_uuid": "GPU-a", "xid": 63},  # exactly at a grid time: belongs to it
            {"ts": at(5, 10), "last_ts": at(7, 5), "gpu_uuid": "GPU-a", "xid": 13, "repeat_count": 40},
            {"ts": at(6, 1), "gpu_uuid": "GPU-a", "xid": 31, "repeat_count": 2},
            {"ts": at(6, 2), "gpu_uuid": "GPU-a", "xid": 145},  # nvlink, not a failure
            {"ts": at(6, 3), "gpu_uuid": "GPU-a", "xid": 999},  # unknown code: class "other"
            {"ts": at(6, 4), "gpu_uuid": "GPU-b", "xid": 13},  # another GPU
        ]
    )
    out = build_features(tel, events)
    r3 = row(out, at(3))
    assert r3["xid_memory_count_1h"] == 2.0
    assert r3["xid_memory_since_last_h"] == 0.0
    assert r3["xid_application_count_24h"] == 0.0
    assert r3["xid_application_since_last_h"] == 720.0  # none yet: the cap
    r7 = row(out, at(7))
    assert r7["xid_memory_count_6h"] == 2.0
    assert r7["xid_memory_count_1h"] == 0.0
    assert r7["xid_memory_since_last_h"] == 4.0
    assert r7["xid_application_count_6h"] == 2.0  # incidents, by their first line
    assert r7["xid_nvlink_count_6h"] == 1.0
    assert r7["xid_other_count_6h"] == 1.0
    assert r7["xid_bus_count_7d"] == 0.0
    assert r7["xid_application_since_last_h"] == pytest.approx(1 - 1 / 60)
    # Repeats are known only when the last one is logged: 2 (xid 31) by 07:00, 42 by 08:00.
    assert r7["xid_application_repeats_6h"] == 2.0
    assert row(out, at(8))["xid_application_repeats_6h"] == 42.0
    assert row(out, at(13))["xid_application_repeats_6h"] == 40.0
    assert row(out, at(14))["xid_application_repeats_6h"] == 0.0
    assert row(out, at(30))["xid_memory_since_last_h"] == 27.0


def test_xid_since_last_sees_incidents_older_than_the_gpus_first_bucket():
    tel = samples(every(at(10, 10), at(12), 10 * MIN), temp_gpu_c=60.0)
    events = xids([{"ts": at(1), "gpu_uuid": "GPU-a", "xid": 92}])
    out = build_features(tel, events)
    assert row(out, at(11))["xid_memory_since_last_h"] == 10.0
    assert row(out, at(11))["xid_memory_count_24h"] == 0.0  # before the GPU's first bucket


def test_key_xid_codes_and_application_bursts():
    tel = samples(every(at(0, 10), at(12), 10 * MIN), temp_gpu_c=60.0)
    events = xids(
        [
            # Three XID 13 incidents within the hour (05:00, 06:00]: a burst.
            {"ts": at(5, 10), "gpu_uuid": "GPU-a", "xid": 13},
            {"ts": at(5, 20), "gpu_uuid": "GPU-a", "xid": 13},
            {"ts": at(5, 40), "gpu_uuid": "GPU-a", "xid": 13, "repeat_count": 500},
            # Two in the next hour: not a burst.
            {"ts": at(6, 10), "gpu_uuid": "GPU-a", "xid": 31},
            {"ts": at(6, 20), "gpu_uuid": "GPU-a", "xid": 31},
            {"ts": at(6, 30), "gpu_uuid": "GPU-a", "xid": 92},
        ]
    )
    out = build_features(tel, events)
    r6, r7 = row(out, at(6)), row(out, at(7))
    assert r6["xid_13_count_1h"] == 3.0 and r6["xid_31_count_1h"] == 0.0
    assert r6["xid_application_burst_h_1h"] == 1.0
    assert r7["xid_application_burst_h_1h"] == 0.0
    assert r7["xid_application_burst_h_6h"] == 1.0
    assert r7["xid_31_count_1h"] == 2.0 and r7["xid_92_count_1h"] == 1.0 and r7["xid_memory_count_1h"] == 1.0
    assert r7["xid_13_count_6h"] == 3.0
    assert row(out, at(12))["xid_application_burst_h_6h"] == 0.0  # 05:00 .. 06:00 is out of (06:00, 12:00]


def test_xid_features_refuse_keys_with_a_gap_in_a_gpus_grid_times():
    # An incident's grid row is found by counting grid steps from the GPU's first row: keys
    # with a gap would put it on the wrong row, so they are refused.
    keys = pl.DataFrame({"gpu_uuid": ["GPU-a", "GPU-a"], "ts": [at(1), at(3)]}).with_columns(
        pl.col("ts").cast(TS_DTYPE)
    )
    events = xids([{"ts": at(2, 30), "gpu_uuid": "GPU-a", "xid": 63}])
    with pytest.raises(ValueError, match="xid_features keys: expected a dense grid"):
        xid_features(keys, events)
    dense = pl.DataFrame({"gpu_uuid": ["GPU-a"] * 3, "ts": [at(1), at(2), at(3)]}).with_columns(
        pl.col("ts").cast(TS_DTYPE)
    )
    assert xid_features(dense, events)["xid_memory_count_1h"].to_list() == [0.0, 0.0, 1.0]


def test_windows_must_be_multiples_of_the_grid():
    tel = samples([at(0, 10)], temp_gpu_c=60.0)
    with pytest.raises(ValueError, match="multiple of the grid"):
        build_features(tel, NO_XIDS, FeatureSpec(windows=[timedelta(minutes=90)]))


def test_a_finer_grid_names_columns_after_it():
    tel = samples(every(at(0, 1), at(2)), temp_gpu_c=60.0, power_w=100.0)
    out = build_features(tel, NO_XIDS, FeatureSpec(grid=timedelta(minutes=15), windows=[timedelta(minutes=15), H]))
    assert "temp_gpu_c_mean_15m" in out.columns and "temp_gpu_c_node_delta_15m" in out.columns
    assert row(out, at(1, 15))["telemetry_missing_frac_15m"] == 0.0
    assert out["ts"].diff().drop_nulls().unique().to_list() == [timedelta(minutes=15)]


def test_window_sums_and_extremes_match_a_plain_rolling_computation():
    # Two GPUs, one reading every 20 minutes for 9 days with random values and gaps; the window
    # sums (running sums) and extremes (built from shorter windows) must equal plain per-GPU
    # rolling windows over the hourly buckets.
    rng = np.random.default_rng(4)
    parts = []
    for i, gpu in enumerate(["GPU-a", "GPU-b"]):
        times = [t for t in every(at(i * 30), at(216), 20 * MIN) if rng.random() > 0.1]
        temps = rng.normal(60, 10, len(times)).round(1).tolist()
        parts.append(samples(times, gpu=gpu, gpu_index=i, temp_gpu_c=temps))
    tel = pl.concat(parts)
    out = build_features(tel, NO_XIDS, FeatureSpec(max_silence=timedelta(hours=48))).sort("gpu_uuid", "ts")
    hourly = (
        tel.with_columns(grid_time(pl.col("ts"), H).alias("t"))
        .group_by("gpu_uuid", "t")
        .agg(
            pl.col("temp_gpu_c").max().alias("mx"),
            pl.col("temp_gpu_c").min().alias("mn"),
            pl.len().alias("n"),
            pl.col("temp_gpu_c").cast(pl.Float64).sum().alias("s"),
        )
    )
    grid = out.select("gpu_uuid", pl.col("ts").alias("t")).join(hourly, on=["gpu_uuid", "t"], how="left")
    for k, wl in [(6, "6h"), (24, "24h"), (168, "7d")]:
        expected = grid.select(
            pl.col("mx").rolling_max(k, min_samples=1).over("gpu_uuid").alias("mx"),
            pl.col("mn").rolling_min(k, min_samples=1).over("gpu_uuid").alias("mn"),
            pl.col("n").fill_null(0).rolling_sum(k, min_samples=1).over("gpu_uuid").alias("n"),
            pl.col("s").fill_null(0).rolling_sum(k, min_samples=1).over("gpu_uuid").alias("s"),
        )
        assert out[f"temp_gpu_c_max_{wl}"].to_list() == expected["mx"].cast(pl.Float32).to_list()
        assert out[f"temp_gpu_c_min_{wl}"].to_list() == expected["mn"].cast(pl.Float32).to_list()
        mean = expected.select(pl.when(pl.col("n") > 0).then(pl.col("s") / pl.col("n"))).to_series()
        assert ((out[f"temp_gpu_c_mean_{wl}"].cast(pl.Float64) - mean).abs() < 1e-3).all()
        assert out[f"temp_gpu_c_mean_{wl}"].null_count() == mean.null_count()


def test_the_spread_of_a_large_steady_gauge_survives_weeks_of_running_sums():
    """Window sums are running sums over the whole frame; a memory gauge near 80,000 MiB that
    moves by 0.125 MiB must keep its standard deviation after three weeks of them."""
    times = every(at(0, 7.5), at(21 * 24), 15 * MIN)
    values = [80_000.0 + 0.125 * (i % 2) for i in range(len(times))]
    tel = samples(times, fb_used_mib=values)
    out = build_features(tel, NO_XIDS, FeatureSpec(windows=[H, 6 * H, 24 * H])).sort("ts")
    last = out.row(-1, named=True)
    exact = statistics.stdev(values[-4:])  # the four samples of the last hour
    assert exact == pytest.approx(0.0722, abs=1e-4)
    assert last["fb_used_mib_std_1h"] == pytest.approx(exact, rel=1e-3)
    assert last["fb_used_mib_std_24h"] == pytest.approx(statistics.stdev(values[-96:]), rel=1e-3)
    assert last["fb_used_mib_mean_24h"] == pytest.approx(80_000.0625, abs=1e-3)


def _buckets(rows: list[tuple[str, float, float | None]]) -> pl.DataFrame:
    """(gpu, hours after T0, value) buckets with a node and last sample time."""
    return pl.DataFrame(
        {
            "gpu_uuid": [g for g, _, _ in rows],
            "ts": [at(h) for _, h, _ in rows],
            "node": [f"node-{g}" for g, _, _ in rows],
            "last_sample_ts": [at(h) for _, h, _ in rows],
            "v": [v for _, _, v in rows],
        },
        schema_overrides={"ts": TS_DTYPE, "last_sample_ts": TS_DTYPE},
    )


def test_dense_grid_places_each_bucket_on_its_gpus_grid_and_carries_identity_into_the_gaps():
    hourly = _buckets(
        [
            ("GPU-b", 9, 9.0),  # after the data's end: not on the grid
            ("GPU-a", 4, 4.0),
            ("GPU-b", 2, 2.0),
            ("GPU-a", 0, 0.0),
            ("GPU-a", 0.5, 99.0),  # off the grid: no grid row has it
            ("GPU-a", 1, None),
        ]
    )
    dense = dense_grid(hourly, H, data_end=at(6.5), max_silence=2 * H)
    assert dense.columns == hourly.columns
    got = [
        (r["gpu_uuid"], (r["ts"] - T0) / H, r["v"], r["node"], (r["last_sample_ts"] - T0) / H)
        for r in dense.iter_rows(named=True)
    ]
    assert got == [
        ("GPU-a", 0, 0.0, "node-GPU-a", 0),
        ("GPU-a", 1, None, "node-GPU-a", 1),
        ("GPU-a", 2, None, "node-GPU-a", 1),  # an empty bucket: identity and last sample carried
        ("GPU-a", 3, None, "node-GPU-a", 1),
        ("GPU-a", 4, 4.0, "node-GPU-a", 4),
        ("GPU-a", 5, None, "node-GPU-a", 4),
        ("GPU-a", 6, None, "node-GPU-a", 4),  # the last bucket + the silence, up to the data's end
        ("GPU-b", 2, 2.0, "node-GPU-b", 2),
        ("GPU-b", 3, None, "node-GPU-b", 2),
        ("GPU-b", 4, None, "node-GPU-b", 2),
        ("GPU-b", 5, None, "node-GPU-b", 2),
        ("GPU-b", 6, None, "node-GPU-b", 2),
    ]
    # Two buckets of one (GPU, time) both keep a grid row there, as a join on the keys gives.
    twice = dense_grid(pl.concat([hourly, hourly.filter(pl.col("v") == 4.0)]), H, data_end=at(6.5), max_silence=2 * H)
    assert twice.height == dense.height + 1
    assert twice.filter(pl.col("ts") == at(4))["v"].to_list() == [4.0, 4.0, None]
