"""The training draw's key: stable, uniform, the same from polars and pandas, nested across
shares, and stored beside the features without becoming one."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import polars as pl
import pytest

from features.dataset import read_features, write_features
from features.sample_key import SAMPLE_KEY, drawn, key_threshold, sample_keys
from ingest.store import Store


def _grid(n_gpus: int = 200, hours: int = 500) -> pl.DataFrame:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    ts = pl.datetime_range(start, start.replace(day=1 + (hours - 1) // 24, hour=(hours - 1) % 24), "1h", eager=True)
    gpus = pl.Series("gpu_uuid", [f"GPU-{i:04d}" for i in range(n_gpus)])
    return gpus.to_frame().join(ts.alias("ts").to_frame(), how="cross")


def test_keys_do_not_change_between_versions():
    """Stored keys must match keys computed later: these values are the contract (a changed
    hash would silently draw other rows than the ones written first in each file)."""
    keys = sample_keys(
        pl.Series(["GPU-a", "GPU-a", "GPU-b"]),
        pl.Series(
            [datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 1, 1, tzinfo=UTC), datetime(2026, 1, 1, tzinfo=UTC)]
        ),
    )
    assert keys.dtype == np.uint32
    assert keys.tolist() == [829306654, 977242927, 3485356082]


def test_keys_are_uniform_and_independent_of_the_frame_around_them():
    grid = _grid()
    keys = sample_keys(grid["gpu_uuid"], grid["ts"])
    for share in (0.01, 0.1, 0.5):
        assert abs((keys < key_threshold(share)).mean() - share) < 0.01
    # Consecutive hours of one GPU are not correlated (the draw is not a run of hours).
    first_gpu = keys[: grid.filter(pl.col("gpu_uuid") == "GPU-0000").height].astype(float)
    assert abs(np.corrcoef(first_gpu[:-1], first_gpu[1:])[0, 1]) < 0.15
    shuffled = grid.sample(fraction=1.0, shuffle=True, seed=1)
    again = shuffled.with_columns(key=pl.Series(sample_keys(shuffled["gpu_uuid"], shuffled["ts"])))
    assert grid.join(again, on=["gpu_uuid", "ts"], maintain_order="left")["key"].to_list() == keys.tolist()


def test_pandas_and_polars_give_the_same_keys_and_seeds_give_other_ones():
    grid = _grid(20, 48)
    keys = sample_keys(grid["gpu_uuid"], grid["ts"])
    pandas = grid.to_pandas()
    assert np.array_equal(sample_keys(pandas["gpu_uuid"], pandas["ts"]), keys)
    other = sample_keys(grid["gpu_uuid"], grid["ts"], seed=7)
    assert (other != keys).mean() > 0.99


def test_a_row_drawn_at_a_share_is_drawn_at_every_larger_share():
    grid = _grid(50, 200)
    keys = sample_keys(grid["gpu_uuid"], grid["ts"])
    label = np.zeros(len(keys))
    label[::97] = 1
    label[5::101] = np.nan  # censored
    small, large = drawn(label, keys, 0.05), drawn(label, keys, 0.2)
    assert (small <= large).all() and small.sum() < large.sum()
    assert small[label == 1].all() and not large[np.isnan(label)].any()
    assert drawn(label, keys, 1.0)[label == 0].all()


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_share_outside_0_1_is_refused(fraction):
    with pytest.raises(ValueError, match=r"negative_fraction: expected a share in \(0, 1\]"):
        key_threshold(fraction)


def test_bad_key_columns_are_refused():
    with pytest.raises(ValueError, match="ts: expected datetimes"):
        sample_keys(pl.Series(["GPU-a"]), pl.Series([1]))
    with pytest.raises(ValueError, match="differ in length"):
        sample_keys(pl.Series(["GPU-a", "GPU-b"]), pl.Series([datetime(2026, 1, 1, tzinfo=UTC)]))
    with pytest.raises(ValueError, match="no nulls"):
        sample_keys(pl.Series(["GPU-a", None]), pl.Series([datetime(2026, 1, 1, tzinfo=UTC)] * 2))


def test_the_stored_key_is_read_only_when_asked_for(tmp_path):
    from tests.models import demo_features_store

    store = demo_features_store(str(tmp_path / "data"))
    everything = read_features(store)
    assert SAMPLE_KEY not in everything.columns
    stored = read_features(store, columns=[SAMPLE_KEY])
    assert np.array_equal(stored[SAMPLE_KEY].to_numpy(), sample_keys(stored["gpu_uuid"], stored["ts"]))
    # Writing what was read back (a copy, a rebuild) stores the same keys again.
    copy = Store.create(str(tmp_path / "copy"))
    write_features(copy, everything)
    assert read_features(copy, columns=[SAMPLE_KEY]).equals(stored)
