"""No leakage: appending telemetry or XID events after time t never changes a feature at t.

The most important property of the feature builder (docs/features.md): a model trained on
features that peeked past t looks good offline and fails in production. Each test builds once on
the data up to t0 and once on everything, and compares the feature columns of every row with
ts <= t0 exactly (labels may differ: they are about the future by definition). The last test
checks the other property a store build relies on: the order of the input rows never matters.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import numpy as np
import polars as pl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from features.build import build_features
from features.schema import feature_columns
from features.spec import FeatureSpec
from ingest.xid_catalog import default_failure_xids
from tests.features import T0, H
from tests.synthetic import synthetic_telemetry, synthetic_xids

WINDOWS = [H, 6 * H, 24 * H]


def messy_fleet(seed: int = 1) -> tuple[pl.DataFrame, pl.DataFrame]:
    """24 GPUs (3 nodes), 60 h at one sample a minute, with what makes window code go wrong:
    counter resets, null readings, a gap of a few hours, a GPU that goes silent for good, a GPU
    that appears late, and XIDs of every class including failures and long repeat runs."""
    rng = np.random.default_rng(seed)
    tel = synthetic_telemetry(24, 60, seed=seed, start=T0)
    ts = pl.col("ts")
    tel = tel.with_columns(
        # A driver reload on GPU 3 at 20:00 resets its volatile counters.
        pl.when((pl.col("gpu_uuid") == "GPU-00000003") & (ts > T0 + 20 * H))
        .then(pl.col("ecc_sbe_volatile_total") - pl.col("ecc_sbe_volatile_total").filter(ts > T0 + 20 * H).min())
        .otherwise(pl.col("ecc_sbe_volatile_total"))
        .alias("ecc_sbe_volatile_total"),
        pl.when(pl.Series(rng.random(tel.height) < 0.01))
        .then(None)
        .otherwise(pl.col("temp_gpu_c"))
        .alias("temp_gpu_c"),
    )
    gap = (pl.col("gpu_uuid") == "GPU-00000005") & (ts > T0 + 30 * H) & (ts <= T0 + 33 * H + timedelta(minutes=20))
    gone = (pl.col("gpu_uuid") == "GPU-00000009") & (ts > T0 + 41 * H)
    late = (pl.col("gpu_uuid") == "GPU-00000017") & (ts < T0 + 12 * H)
    tel = tel.filter(~(gap | gone | late))
    events = synthetic_xids(tel, per_gpu_day=2.0, seed=seed)
    # Failures on three GPUs only (the others' XIDs become non-failure memory XIDs), so that
    # most GPUs keep their rows to the end.
    doomed = ["GPU-00000001", "GPU-00000007", "GPU-00000011"]
    events = events.with_columns(
        pl.when(pl.col("xid").is_in(list(default_failure_xids())) & ~pl.col("gpu_uuid").is_in(doomed))
        .then(pl.lit(63, dtype=pl.Int32))
        .otherwise(pl.col("xid"))
        .alias("xid")
    )
    # An incident whose repeats run for hours past its first line.
    long_run = events.head(1).with_columns(
        ts=pl.lit(T0 + 25 * H, dtype=pl.Datetime("us", "UTC")),
        last_ts=pl.lit(T0 + 29 * H, dtype=pl.Datetime("us", "UTC")),
        xid=pl.lit(13, dtype=pl.Int32),
        repeat_count=pl.lit(9000, dtype=pl.Int32),
    )
    return tel, pl.concat([events, long_run])


def compare_up_to(tel: pl.DataFrame, events: pl.DataFrame, t0: datetime, *, lost_after: timedelta | None) -> int:
    spec = FeatureSpec(windows=WINDOWS, horizon=6 * H, lost_after=lost_after)
    past = build_features(tel.filter(pl.col("ts") <= t0), events.filter(pl.col("ts") <= t0), spec, data_end=t0)
    full = build_features(tel, events, spec)
    past = past.filter(pl.col("ts") <= t0)
    full = full.filter(pl.col("ts") <= t0)
    cols = ["gpu_uuid", "ts", "cluster", "node", "gpu_index", "gpu_model", "driver", *feature_columns(full)]
    assert feature_columns(past) == feature_columns(full)
    if lost_after is None:
        # Without lost-GPU labels (which look at the future to decide that a GPU is gone) the
        # same rows exist; with them, rows may differ but the features of shared rows may not.
        assert past.height == full.height
    shared = past.select(cols).join(full.select("gpu_uuid", "ts"), on=["gpu_uuid", "ts"], how="semi")
    other = full.select(cols).join(past.select("gpu_uuid", "ts"), on=["gpu_uuid", "ts"], how="semi")
    assert shared.height > 0
    assert_frame_equal(shared.sort("gpu_uuid", "ts"), other.sort("gpu_uuid", "ts"), check_exact=True)
    return shared.height


FLEET = messy_fleet()


def test_appending_data_never_changes_past_features():
    for t0 in (T0 + 20 * H, T0 + 31 * H + timedelta(minutes=7), T0 + 45 * H + timedelta(microseconds=1)):
        assert compare_up_to(*FLEET, t0, lost_after=None) > 24 * 15


def test_appending_data_never_changes_past_features_with_lost_gpu_labels():
    assert compare_up_to(*FLEET, T0 + 44 * H, lost_after=timedelta(hours=2)) > 24 * 30


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(minutes=st.integers(min_value=61, max_value=59 * 60), micro=st.sampled_from([0, 1, 999_999]))
def test_appending_data_never_changes_past_features_at_any_cut(minutes: int, micro: int):
    t0 = T0 + timedelta(minutes=minutes, microseconds=micro)
    compare_up_to(*FLEET, t0, lost_after=None)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_the_order_of_input_rows_never_changes_the_features(seed: int):
    tel, events = FLEET
    expected = build_features(tel, events, FeatureSpec(windows=WINDOWS, horizon=6 * H))
    shuffled = build_features(
        tel.sample(fraction=1.0, shuffle=True, seed=seed),
        events.sample(fraction=1.0, shuffle=True, seed=seed),
        FeatureSpec(windows=WINDOWS, horizon=6 * H),
    )
    assert_frame_equal(shuffled, expected, check_exact=True)
