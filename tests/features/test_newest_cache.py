"""The newest grid time's rows kept on disk between processes (`features.newest_cache`): read by
the next process while the store, the spec and the code are unchanged, and otherwise (a new
day of aggregates, a new failure event, other code, a damaged or unwritable file) computed."""

from __future__ import annotations

import os
from datetime import timedelta

import polars as pl
import pytest

from features import newest_cache, on_demand
from features.aggregates import BUCKETS, build_aggregates
from features.on_demand import FACT_SOURCES, features_on_demand, newest_on_demand, on_demand_spec
from ingest.failure_events import event_frame, write_failure_events
from ingest.store import Store
from tests.features.cached_stores import simulated_store, uncached_copy


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> str:
    """Four days of telemetry, the aggregates of the first three built."""
    return simulated_store(tmp_path_factory.mktemp("newest") / "data", seed=5, nodes=2, days=4, last_day_built=False)


@pytest.fixture
def store(simulated, tmp_path) -> Store:
    return uncached_copy(simulated, tmp_path)


class Computations:
    """Counts the times the newest rows are computed rather than read."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        real = on_demand._newest_computed

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(on_demand, "_newest_computed", counted)


def _newest_hour_computed(store: Store) -> pl.DataFrame:
    """The newest hour's rows through the range reader, which never uses the cache."""
    hour = newest_on_demand(store)["ts"].max()
    return features_on_demand(store, hour, hour + timedelta(microseconds=1))


def test_the_next_process_reads_the_rows_the_first_one_computed(store, monkeypatch):
    computations = Computations(monkeypatch)
    first = newest_on_demand(store)
    assert first.height > 0 and computations.count == 1
    assert os.path.exists(newest_cache.ROWS_FILE.path(store))
    on_demand._FACTS.clear()  # another process
    again = newest_on_demand(store)
    assert computations.count == 1
    assert again.equals(first) and again.schema == first.schema
    assert again.equals(_newest_hour_computed(store))


def test_the_next_days_aggregates_make_the_rows_those_of_the_new_newest_hour(store, monkeypatch):
    computations = Computations(monkeypatch)
    before = newest_on_demand(store)
    build_aggregates(store)  # the last day of telemetry
    on_demand._FACTS.clear()
    after = newest_on_demand(store)
    assert computations.count == 2
    assert after["ts"].max() > before["ts"].max()
    assert after.equals(_newest_hour_computed(store))


def test_a_new_failure_event_makes_the_rows_stale(store, monkeypatch):
    computations = Computations(monkeypatch)
    before = newest_on_demand(store)
    first = before.row(0, named=True)
    # A failure of the first GPU's node, recorded since, half an hour before the newest hour:
    # its GPUs are out of service there.
    when = first["ts"] - timedelta(minutes=30)
    write_failure_events(
        store,
        event_frame([{"ts": when, "cluster": first["cluster"], "node": first["node"], "source": "record", "ref": "t"}]),
    )
    on_demand._FACTS.clear()
    after = newest_on_demand(store)
    assert computations.count == 2
    assert after.equals(_newest_hour_computed(store))
    assert not after.equals(before)


def test_rows_of_other_buckets_other_code_or_another_spec_are_not_used(store, monkeypatch):
    spec = on_demand_spec(store)
    newest_on_demand(store)
    key = newest_cache.rows_key(store, spec, FACT_SOURCES)
    assert newest_cache.load_rows(store, key) is not None
    # The bucket files alone differ (the fact files kept): another key.
    listed = store.files
    with monkeypatch.context() as patch:
        patch.setattr(
            store, "files", lambda dataset, *a, **k: listed(dataset, *a, **k)[: -1 if dataset == BUCKETS else None]
        )
        assert newest_cache.rows_key(store, spec, FACT_SOURCES) != key
    other_spec = type(spec)(**{**spec.__dict__, "horizon": spec.horizon * 2})
    assert newest_cache.load_rows(store, newest_cache.rows_key(store, other_spec, FACT_SOURCES)) is None
    monkeypatch.setattr(newest_cache, "code_digest", lambda: "another version of the code")
    assert newest_cache.rows_key(store, spec, FACT_SOURCES) != key
    computations = Computations(monkeypatch)
    newest_on_demand(store)
    assert computations.count == 1


def test_a_damaged_rows_file_is_ignored_and_written_again(store, monkeypatch):
    expected = newest_on_demand(store)
    path = newest_cache.ROWS_FILE.path(store)
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:
        fh.write(data[:-1] + bytes([data[-1] ^ 0xFF]))
    computations = Computations(monkeypatch)
    assert newest_on_demand(store).equals(expected)
    assert computations.count == 1
    with open(path, "rb") as fh:
        assert fh.read() == data  # written again, whole


def test_an_unwritable_cache_leaves_the_rows_computed(store, monkeypatch):
    def refuse(*_args, **_kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(store.fs, "mv", refuse)  # the rename that publishes a cache file
    computations = Computations(monkeypatch)
    first = newest_on_demand(store)
    assert first.height > 0 and not os.path.exists(newest_cache.ROWS_FILE.path(store))
    assert newest_on_demand(store).equals(first)
    assert computations.count == 2
