"""The training draw's features kept on disk a day at a time (`features.drawn_cache`): every read
gives the rows and bits the draw computed in full gives, the labels of now; a day is computed
again only when a file it depends on changed or the draw wants a row its file lacks."""

from __future__ import annotations

import os
from datetime import UTC, date, datetime, timedelta

import polars as pl
import pytest

from features import drawn_cache, on_demand
from features.aggregates import build_aggregates
from features.drawn_cache import KEPT_DAYS, day_file, drawn_rows_cached
from features.on_demand import drawn, features_on_demand, stored_fleet_facts
from features.sample_key import key_threshold
from features.schema import LABEL_COLUMNS
from ingest.failure_events import event_frame, write_failure_events
from ingest.store import Store
from tests.features.cached_stores import simulated_store, uncached_copy

SHARE = 0.1


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> str:
    """Ten days of telemetry, the aggregates of the first nine built."""
    return simulated_store(tmp_path_factory.mktemp("drawn") / "data", seed=5, nodes=4, days=10, last_day_built=False)


@pytest.fixture
def store(simulated, tmp_path) -> Store:
    return uncached_copy(simulated, tmp_path)


class ComputedDays:
    """The days whose candidate rows a read computed (rather than read from their files)."""

    def __init__(self, monkeypatch) -> None:
        self.days: list[date] = []
        real = drawn_cache.features_on_demand

        def recorded(store, start, end, **kwargs):
            if not kwargs.get("labels_only"):
                day = start
                while day < end:
                    self.days.append(day.date())
                    day += timedelta(days=1)
            return real(store, start, end, **kwargs)

        monkeypatch.setattr(drawn_cache, "features_on_demand", recorded)


def _window(store: Store, days: int = 7, moved: int = 0) -> tuple[datetime, datetime]:
    """`days` whole days ending the day before the data's last, `moved` days later."""
    facts = stored_fleet_facts(store, on_demand.on_demand_spec(store))
    assert facts is not None
    end = datetime.combine(facts.data_end.date(), datetime.min.time(), tzinfo=UTC) + timedelta(days=moved)
    return end - timedelta(days=days), end


def _in_full(store: Store, start: datetime, end: datetime, share: float = SHARE) -> pl.DataFrame:
    on_demand._FACTS.clear()
    return features_on_demand(store, start, end, rows=drawn(share))


def test_a_read_again_takes_every_day_from_its_file_and_gives_the_same_bits(store, monkeypatch):
    start, end = _window(store)
    expected = _in_full(store, start, end)
    assert expected.height > 0 and (expected["label"] == 1).sum() > 0
    computed = ComputedDays(monkeypatch)
    first = drawn_rows_cached(store, start, end, SHARE)
    assert first.equals(expected) and first.schema == expected.schema
    days = sorted(set(expected["ts"].dt.date().to_list()))
    assert computed.days == days
    threshold = key_threshold(drawn_cache.stored_fraction(SHARE))
    assert all(os.path.exists(day_file(day, threshold).path(store)) for day in days)
    on_demand._FACTS.clear()  # another process
    computed.days.clear()
    again = drawn_rows_cached(store, start, end, SHARE)
    assert computed.days == []
    assert again.equals(expected)
    # and the draw a retrain reads (`features.dataset.drawn_rows`) is this one, from the files
    from features.dataset import drawn_rows

    def refuse(*_args, **_kwargs):
        raise AssertionError("the draw was computed, not read from the day files")

    monkeypatch.setattr(on_demand, "features_on_demand", refuse)
    assert drawn_rows(store, start, end, SHARE).equals(expected)
    assert computed.days == []


def test_a_smaller_share_reads_the_days_a_larger_share_kept(store, monkeypatch):
    """A retrain's calibration slice, drawn at a larger share, keeps the last days of its
    training window, drawn at a smaller one: those are read, the others computed."""
    start, end = _window(store)
    slice_start = start + timedelta(days=4)
    drawn_rows_cached(store, slice_start, end, SHARE)
    computed = ComputedDays(monkeypatch)
    smaller = SHARE / 2
    assert drawn_cache.stored_fraction(smaller) < drawn_cache.stored_fraction(SHARE)
    window = drawn_rows_cached(store, start, end, smaller)
    assert computed.days == [start.date() + timedelta(days=i) for i in range(4)]
    assert window.equals(_in_full(store, start, end, smaller))
    assert window.filter(pl.col("ts") >= slice_start).height < _in_full(store, slice_start, end).height


def test_the_next_days_aggregates_compute_that_day_alone(store, monkeypatch):
    start, end = _window(store)
    drawn_rows_cached(store, start, end, SHARE)
    build_aggregates(store)  # the last day of telemetry
    on_demand._FACTS.clear()
    computed = ComputedDays(monkeypatch)
    # A window moved on by a day, as the nightly job's is
    moved = drawn_rows_cached(store, start + timedelta(days=1), end + timedelta(days=1), SHARE)
    assert computed.days == [end.date()]
    assert moved.equals(_in_full(store, start + timedelta(days=1), end + timedelta(days=1)))


def test_a_failure_recorded_since_makes_its_rows_positive(store, monkeypatch):
    start, end = _window(store)
    before = drawn_rows_cached(store, start, end, SHARE)
    # A failure of a node, recorded since, in the middle of the window: rows of its GPUs in the
    # horizon before it are positive now, most of them rows the day's file does not hold.
    row = before.filter(pl.col("label") == 0).row(before.height // 2, named=True)
    when = row["ts"] + timedelta(minutes=20)
    write_failure_events(
        store,
        event_frame([{"ts": when, "cluster": row["cluster"], "node": row["node"], "source": "record", "ref": "t"}]),
    )
    computed = ComputedDays(monkeypatch)
    after = drawn_rows_cached(store, start, end, SHARE)
    expected = _in_full(store, start, end)
    assert after.equals(expected)
    assert (after["label"] == 1).sum() > (before["label"] == 1).sum()
    assert computed.days and set(computed.days) <= {when.date(), (when - timedelta(days=1)).date()}


def test_an_xid_event_logged_late_computes_its_day_and_those_after(store, monkeypatch):
    start, end = _window(store)
    drawn_rows_cached(store, start, end, SHARE)
    # An incident of a GPU already known, logged now for the third day of the window.
    late = start + timedelta(days=2, hours=5)
    xid = pl.from_arrow(store.read("xid_events")).head(1)
    xid = xid.with_columns(pl.lit(late).cast(xid.schema[c]).alias(c) for c in ("ts", "last_ts") if c in xid.columns)
    store.write("xid_events", xid.to_arrow())
    on_demand._FACTS.clear()
    computed = ComputedDays(monkeypatch)
    after = drawn_rows_cached(store, start, end, SHARE)
    assert sorted(set(computed.days)) == [
        late.date() + timedelta(days=i) for i in range((end.date() - late.date()).days)
    ]
    assert after.equals(_in_full(store, start, end))


def test_a_damaged_day_file_is_computed_again(store, monkeypatch):
    start, end = _window(store)
    expected = drawn_rows_cached(store, start, end, SHARE)
    day = start.date() + timedelta(days=1)
    path = day_file(day, key_threshold(drawn_cache.stored_fraction(SHARE))).path(store)
    with open(path, "r+b") as fh:
        fh.seek(-10, os.SEEK_END)
        fh.write(b"\xff" * 10)
    computed = ComputedDays(monkeypatch)
    assert drawn_rows_cached(store, start, end, SHARE).equals(expected)
    assert computed.days == [day]


def test_days_long_before_the_newest_kept_of_their_share_are_removed(store):
    start, end = _window(store)
    folder = store.path("_cache")
    os.makedirs(folder, exist_ok=True)
    newest = end.date() - timedelta(days=1)  # the newest day the read keeps
    share = key_threshold(drawn_cache.stored_fraction(SHARE))
    other = key_threshold(0.03125)
    old, kept = newest - timedelta(days=KEPT_DAYS + 1), newest - timedelta(days=KEPT_DAYS)
    other_newest = newest - timedelta(days=30)  # another share's days, of another window
    planted = [(old, share), (kept, share), (other_newest, other), (other_newest - timedelta(days=KEPT_DAYS), other)]
    for day, threshold in planted:
        with open(day_file(day, threshold).path(store), "wb") as fh:
            fh.write(b"an old day")
    drawn_rows_cached(store, start, end, SHARE)
    left = {(day, threshold) for day, threshold in planted if os.path.exists(day_file(day, threshold).path(store))}
    assert left == set(planted) - {(old, share)}


def test_labels_come_from_the_store_as_it_is_never_from_a_days_file(store, monkeypatch):
    start, end = _window(store)
    expected = drawn_rows_cached(store, start, end, SHARE)
    # A day's file whose rows carry labels of another time (here: every one unknown), under
    # the day's current key: its features are current, its labels are not used.
    day = start.date() + timedelta(days=2)
    spec = on_demand.on_demand_spec(store)
    threshold = key_threshold(drawn_cache.stored_fraction(SHARE))
    listed = {d: store.files(d) for d in (drawn_cache.BUCKETS, drawn_cache.PRESENCE, drawn_cache.XID_EVENTS)}
    key = drawn_cache.day_key(store, spec, listed, day, threshold)
    cached = day_file(day, threshold).load(store, key)
    assert cached is not None
    rows = cached[1]["rows"]
    stale = rows.with_columns(pl.lit(None, dtype=rows.schema[c]).alias(c) for c in LABEL_COLUMNS)
    assert day_file(day, threshold).save(store, key, {}, {"rows": stale})
    computed = ComputedDays(monkeypatch)
    assert drawn_rows_cached(store, start, end, SHARE).equals(expected)
    assert computed.days == []


def test_draws_of_large_shares_are_computed_not_kept(store, monkeypatch):
    from features.on_demand import labelled

    start, end = _window(store, days=3)
    start += timedelta(hours=7)
    # Every labelled row: the draw at share 1.
    assert drawn_rows_cached(store, start, end, 1.0).equals(_in_full(store, start, end, 1.0))
    assert _in_full(store, start, end, 1.0).equals(features_on_demand(store, start, end, rows=labelled()))
    assert not [name for name in os.listdir(store.path("_cache")) if name.startswith("drawn-")]


def test_draws_at_nearby_shares_read_the_same_days(store, monkeypatch):
    # A retrain's share follows its window's label counts (2.46% and 2.78% on the paper fleet).
    start, end = _window(store)
    drawn_rows_cached(store, start, end, 0.025)
    computed = ComputedDays(monkeypatch)
    got = drawn_rows_cached(store, start, end, 0.028)
    assert computed.days == []
    assert got.equals(_in_full(store, start, end, 0.028))
    assert drawn_cache.stored_fraction(0.1) == 0.125 and drawn_cache.stored_fraction(1.0) == 1.0
    with pytest.raises(ValueError, match="negative_fraction"):
        drawn_cache.stored_fraction(0.0)
