"""Every row's labels over a range, computed once per process for the readers of that range or
part of it (`features.label_rows`): the same rows as computing them for each reader, and
computed again when the store changed."""

from __future__ import annotations

from datetime import timedelta

import polars as pl
import pytest

from features import label_rows, on_demand
from features.dataset import label_counts, read_features
from features.labels import GPU
from features.on_demand import features_on_demand, stored_fleet_facts
from features.schema import LABEL_COLUMNS
from ingest.failure_events import event_frame, write_failure_events
from ingest.store import Store
from tests.features.cached_stores import simulated_store, uncached_copy


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> str:
    return simulated_store(tmp_path_factory.mktemp("labels") / "data", seed=5, nodes=4, days=8)


@pytest.fixture
def store(simulated, tmp_path) -> Store:
    return uncached_copy(simulated, tmp_path)


def _computed(store: Store, start, end) -> pl.DataFrame:
    """The labels computed for the range alone, as every reader computed them before."""
    return features_on_demand(store, start, end, labels_only=True).select(*label_rows.COLUMNS)


def _range(store: Store, days: int, offset: int = 0):
    facts = stored_fleet_facts(store, on_demand.on_demand_spec(store))
    assert facts is not None
    end = facts.data_end - timedelta(days=offset)
    return end - timedelta(days=days), end


def test_a_range_within_the_kept_one_is_read_from_it(store, monkeypatch):
    start, end = _range(store, days=6)
    whole = label_rows.label_rows(store, start, end)
    assert whole.schema[GPU] == pl.Categorical
    assert whole.with_columns(pl.col(GPU).cast(pl.String)).equals(_computed(store, start, end))

    def refuse(*_args, **_kwargs):
        raise AssertionError("the labels were computed again")

    monkeypatch.setattr(label_rows, "iter_features_on_demand", refuse)
    inner_start, inner_end = start + timedelta(hours=30, minutes=7), end - timedelta(days=2)
    part = label_rows.label_rows(store, inner_start, inner_end)
    monkeypatch.undo()
    assert part.with_columns(pl.col(GPU).cast(pl.String)).equals(_computed(store, inner_start, inner_end))
    # and what the readers of label columns get from it (neither computes any row)
    monkeypatch.setattr(label_rows, "iter_features_on_demand", refuse)
    monkeypatch.setattr(on_demand, "features_on_demand", refuse)
    keys = read_features(store, inner_start, inner_end, columns=["label"])
    negatives, positives = label_counts(store, inner_start, inner_end)
    monkeypatch.undo()
    expected = _computed(store, inner_start, inner_end)
    assert keys.equals(expected.select("ts", GPU, "label"))
    assert (negatives, positives) == (int((expected["label"] == 0).sum()), int((expected["label"] == 1).sum()))


def test_a_range_beyond_the_kept_one_or_a_changed_store_computes_them_again(store):
    start, end = _range(store, days=3, offset=2)
    label_rows.label_rows(store, start, end)
    wider = label_rows.label_rows(store, start - timedelta(days=1), end)
    assert wider.with_columns(pl.col(GPU).cast(pl.String)).equals(_computed(store, start - timedelta(days=1), end))
    before = label_rows.label_rows(store, start, end)
    row = before.filter(pl.col("label") == 0).row(before.height // 2, named=True)
    node = read_features(store, row["ts"], row["ts"] + timedelta(microseconds=1), columns=["cluster", "node"])
    node = node.filter(pl.col(GPU) == row[GPU]).row(0, named=True)
    write_failure_events(
        store,
        event_frame(
            [
                {
                    "ts": row["ts"] + timedelta(minutes=20),
                    "cluster": node["cluster"],
                    "node": node["node"],
                    "source": "record",
                    "ref": "t",
                }
            ]
        ),
    )
    on_demand._FACTS.clear()
    after = label_rows.label_rows(store, start, end)
    assert after.with_columns(pl.col(GPU).cast(pl.String)).equals(_computed(store, start, end))
    assert (after["label"] == 1).sum() > (before["label"] == 1).sum()
    assert set(LABEL_COLUMNS) <= set(after.columns)
