"""No leakage through the store: a copy of a data root cut at time t (every raw dataset kept up to
t, as the root was then), rebuilt, gives every feature of every row at or before t exactly as the
full root does. `test_leakage` holds the same for the in-memory build; this is the path the
served features take (the stored aggregates, the fleet facts, features computed on demand)."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from features.aggregates import build_aggregates
from features.on_demand import features_on_demand
from features.schema import ID_COLUMNS, feature_columns
from ingest.store import Store
from tests.features.cached_stores import simulated_store

RAW_DATASETS = ("telemetry", "xid_events", "repairs", "failure_events")
US = timedelta(microseconds=1)


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return Store.open(simulated_store(tmp_path_factory.mktemp("leak") / "data", seed=7, nodes=2, days=6))


def cut_copy(store: Store, t: datetime, root: Path) -> Store:
    """A new data root holding the raw datasets of `store` up to `t`, aggregates built."""
    cut = Store.create(str(root))
    for name in RAW_DATASETS:
        if not store.exists(name):
            continue
        table = pl.from_arrow(store.read(name))
        assert isinstance(table, pl.DataFrame)
        kept = table.filter(pl.col("ts") <= t)
        if kept.height:
            cut.write(name, kept.to_arrow())
    build_aggregates(cut)
    return cut


def last_sample(store: Store) -> datetime:
    return pl.from_arrow(store.read("telemetry")).select(pl.col("ts").max()).item()  # type: ignore[union-attr]


@pytest.mark.parametrize("before_end", [timedelta(days=2, minutes=23), timedelta(days=3, hours=5)])
def test_a_root_cut_at_t_and_rebuilt_gives_every_feature_at_or_before_t(
    full: Store, before_end: timedelta, tmp_path: Path
) -> None:
    t = last_sample(full) - before_end
    cut = cut_copy(full, t, tmp_path / "cut")
    assert last_sample(cut) <= t < last_sample(full)
    past = features_on_demand(cut, end=t + US)
    now = features_on_demand(full, end=t + US)
    assert past["ts"].max() <= t and now["ts"].max() <= t  # type: ignore[operator]
    columns = [*ID_COLUMNS, *feature_columns(now)]
    assert feature_columns(past) == feature_columns(now)
    # The same rows (labels aside: they are about what came after t), every feature to the bit.
    assert past.height == now.height > 2 * 8 * 24
    assert_frame_equal(past.select(columns), now.select(columns), check_exact=True)
    # The cut root does not know what came after t: the labels of its last horizon are unsettled.
    assert past["label"].null_count() > now["label"].null_count()
