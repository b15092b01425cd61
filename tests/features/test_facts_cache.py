"""The fleet facts kept on disk between processes (`features.facts_cache`): used when current and
whole, and otherwise (stale, corrupt, half-written, unwritable) ignored and computed again."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from features import facts_cache, on_demand
from features.on_demand import FACT_SOURCES, features_on_demand, on_demand_spec, stored_fleet_facts
from features.plan import FleetFacts
from ingest.failure_events import event_frame, write_failure_events
from ingest.store import Store
from tests.features.cached_stores import simulated_store, uncached_copy


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> str:
    return simulated_store(tmp_path_factory.mktemp("facts") / "data", seed=3, nodes=2, days=4)


@pytest.fixture
def store(built, tmp_path) -> Store:
    return uncached_copy(built, tmp_path)


def _computed_fleet_facts_forbidden(monkeypatch) -> None:
    def refuse(*_args, **_kwargs):
        raise AssertionError("the fleet facts were computed, not read from the cache")

    monkeypatch.setattr(on_demand, "fleet_facts", refuse)


def _cache_bytes(store: Store) -> bytes:
    with open(facts_cache.cache_path(store), "rb") as fh:
        return fh.read()


def _key(store: Store, spec) -> str:
    return facts_cache.facts_key(store, spec, {d: store.files(d) for d in FACT_SOURCES})


def assert_same_facts(got: FleetFacts, expected: FleetFacts) -> None:
    for name in ("presence", "xid", "episodes"):
        assert getattr(got, name).equals(getattr(expected, name)), name
    if expected.repairs is None:
        assert got.repairs is None
    else:
        assert got.repairs is not None and got.repairs.equals(expected.repairs)
    assert (got.data_end, got.first_data, got.events_by_source) == (
        expected.data_end,
        expected.first_data,
        expected.events_by_source,
    )


def test_a_new_process_reads_the_facts_the_first_one_wrote(store, monkeypatch):
    spec = on_demand_spec(store)
    first = stored_fleet_facts(store, spec)
    assert first is not None and os.path.exists(facts_cache.cache_path(store))
    assert first.xid.height > 0 and first.episodes.height > 0
    expected_rows = features_on_demand(store)
    on_demand._FACTS.clear()  # another process
    _computed_fleet_facts_forbidden(monkeypatch)
    again = stored_fleet_facts(store, spec)
    assert again is not None and again is not first
    assert_same_facts(again, first)
    assert features_on_demand(store).equals(expected_rows)


def test_facts_of_files_since_replaced_are_stale_and_computed_again(store):
    spec = on_demand_spec(store)
    before = stored_fleet_facts(store, spec)
    assert before is not None
    node = before.presence["node"][0]
    cluster = before.presence["cluster"][0]
    # A failure event recorded since: a new file of `failure_events`, so the cached facts are stale.
    when = before.data_end - timedelta(hours=3)
    write_failure_events(
        store, event_frame([{"ts": when, "cluster": cluster, "node": node, "source": "record", "ref": "t-1"}])
    )
    on_demand._FACTS.clear()
    after = stored_fleet_facts(store, spec)
    assert after is not None and after.events_by_source.get("record", 0) == before.events_by_source.get("record", 0) + 1
    # and the file now holds the new facts
    on_demand._FACTS.clear()
    cached = facts_cache.load_facts(store, _key(store, spec))
    assert cached is not None
    assert_same_facts(cached, after)


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # cut short
        lambda data: data[:-1] + bytes([data[-1] ^ 0xFF]),  # a flipped byte in a table
        lambda data: b"not the facts at all",
        lambda data: b"",
    ],
    ids=["truncated", "flipped-byte", "garbage", "empty"],
)
def test_a_corrupt_cache_is_ignored_and_written_again(store, damage):
    spec = on_demand_spec(store)
    expected = stored_fleet_facts(store, spec)
    assert expected is not None
    data = _cache_bytes(store)
    with open(facts_cache.cache_path(store), "wb") as fh:
        fh.write(damage(data))
    on_demand._FACTS.clear()
    got = stored_fleet_facts(store, spec)
    assert got is not None
    assert_same_facts(got, expected)
    on_demand._FACTS.clear()
    cached = facts_cache.load_facts(store, _key(store, spec))  # written again, whole
    assert cached is not None
    assert_same_facts(cached, expected)


def test_a_write_killed_half_way_leaves_the_old_cache_and_no_visible_file(store, monkeypatch):
    spec = on_demand_spec(store)
    facts = stored_fleet_facts(store, spec)
    assert facts is not None
    path = facts_cache.cache_path(store)
    before = _cache_bytes(store)
    written: list[str] = []
    real_fsync = os.fsync

    def killed(fd):
        written.append(os.readlink(f"/proc/self/fd/{fd}"))
        raise KeyboardInterrupt  # the process stops between the bytes and the rename

    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        facts_cache.save_facts(store, "another key", facts)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert written and not os.path.exists(written[0])  # the temporary file is removed on the way out
    assert _cache_bytes(store) == before
    # A process killed outright leaves its temporary file: never read, removed by a later write.
    folder = os.path.dirname(path)
    leftover = os.path.join(folder, f"{facts_cache._TEMPORARY}1-dead")
    with open(leftover, "wb") as fh:
        fh.write(before[:100])
    os.utime(leftover, (0, 0))
    on_demand._FACTS.clear()
    os.remove(path)
    got = stored_fleet_facts(store, spec)
    assert got is not None
    assert_same_facts(got, facts)
    assert sorted(os.listdir(folder)) == [facts_cache.CACHE_FILE]


def test_an_unwritable_cache_leaves_the_facts_computed(store, monkeypatch):
    def refuse(*_args, **_kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(store.fs, "mv", refuse)  # the rename that publishes the cache file
    spec = on_demand_spec(store)
    facts = stored_fleet_facts(store, spec)
    assert facts is not None and not os.path.exists(facts_cache.cache_path(store))
    assert os.listdir(os.path.dirname(facts_cache.cache_path(store))) == []
    assert features_on_demand(store).height > 0


def test_a_cache_of_another_spec_is_not_used(store):
    spec = on_demand_spec(store)
    facts = stored_fleet_facts(store, spec)
    assert facts is not None
    other = type(spec)(**{**spec.__dict__, "merge_window": spec.merge_window * 2})
    assert _key(store, other) != _key(store, spec)
    assert facts_cache.load_facts(store, _key(store, other)) is None
    assert facts_cache.load_facts(store, _key(store, spec)) is not None


def test_a_source_file_replaced_while_the_key_is_taken_leaves_the_facts_computed(store, monkeypatch):
    spec = on_demand_spec(store)
    real = os.path.getsize

    def replaced(path):
        if "bucket_presence" in str(path):
            raise FileNotFoundError(2, "No such file or directory", path)
        return real(path)

    monkeypatch.setattr(os.path, "getsize", replaced)
    assert _key(store, spec) is None
    facts = stored_fleet_facts(store, spec)
    assert facts is not None and facts.presence.height > 0
    assert not os.path.exists(facts_cache.cache_path(store))
