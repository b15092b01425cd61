"""The collector's commits (the store's journal `collect-<node>`): a flush's rows and the cursors
covering them commit together. A process that dies at every single filesystem step of a
collection, then starts again, ends with exactly the rows of an uninterrupted run."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta

import pyarrow.parquet as pq
import pytest

from ingest.collect.daemon import Daemon
from ingest.collect.kernel_log_collector import KernelLogCollector
from ingest.errors import StoreError
from ingest.store import Store
from tests.conftest import make_rows
from tests.ingest.test_collect_kernel_log import T0, FakeClock, FakeLog, flood_log

MUTATIONS = ("open", "mv", "rm", "makedirs")
FLUSH_ROWS = 6


class Killed(BaseException):
    """The process died here: nothing after it runs, not even clean-up."""


class DyingFilesystem:
    """Makes the store's filesystem die at its `at`-th change (a file opened, renamed, removed,
    a folder made) and at every call after that, as a killed process would."""

    def __init__(self, fs, at: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.changes = 0
        self.dead = False
        for name in (*MUTATIONS, "exists", "ls", "cat_file"):
            monkeypatch.setattr(fs, name, self._wrap(getattr(fs, name), name in MUTATIONS, at))

    def _wrap(self, call, mutates: bool, at: int):
        def wrapper(*args, **kwargs):
            if self.dead:
                raise Killed
            if mutates:
                self.changes += 1
                if self.changes == at:
                    self.dead = True
                    raise Killed
            return call(*args, **kwargs)

        return wrapper


def collect_once(store: Store) -> None:
    clock = FakeClock(T0)  # after the log's lines: lines a day past the clock are left out
    kernel_log = KernelLogCollector(
        store,
        FakeLog(flood_log()),
        cluster="c1",
        node="gpu-node-017",
        dedup_window=timedelta(minutes=5),
        clock=clock,
        read_lines=FLUSH_ROWS,  # as the daemon's registry sets it
    )
    daemon = Daemon(
        store,
        [kernel_log],
        cluster="c1",
        node="gpu-node-017",
        interval=timedelta(seconds=30),
        flush_rows=FLUSH_ROWS,
        flush_interval=timedelta(minutes=5),
        clock=clock,
    )
    daemon.run(max_ticks=1)


def xid_rows(store: Store) -> Counter:
    table = store.read("xid_events")
    return Counter(tuple(sorted(r.items())) for r in table.to_pylist())


def test_a_kill_at_every_filesystem_step_then_a_restart_gives_exactly_the_clean_rows(tmp_path, monkeypatch):
    clean = Store.create(str(tmp_path / "clean"))
    counting = DyingFilesystem(clean.fs, at=0, monkeypatch=monkeypatch)
    collect_once(clean)
    steps = counting.changes
    monkeypatch.undo()
    expected = xid_rows(clean)
    assert sum(expected.values()) > 30 and steps > 50  # many flushes, each several steps

    for at in range(1, steps + 1):
        store = Store.create(str(tmp_path / f"killed-{at}"))
        with monkeypatch.context() as patch:
            DyingFilesystem(store.fs, at, patch)
            with pytest.raises(Killed):
                collect_once(store)
        if store.exists("xid_events"):
            assert not xid_rows(store) - expected, f"killed at step {at}: a row twice or unknown"
        collect_once(store)  # the restart
        assert xid_rows(store) == expected, f"killed at step {at} of {steps}"
        hidden = list((tmp_path / f"killed-{at}").rglob(".*"))
        assert hidden == [], f"killed at step {at}: {hidden}"


def test_files_an_earlier_gpufail_staged_and_committed_are_moved_into_place_at_the_first_flush(tmp_path):
    # gpufail before the store's journal staged a flush under _staging/collect-<node>/ and
    # listed the files in its state; a kill could leave them there, committed.
    store = Store.create(str(tmp_path / "d"))
    rows = xid_table()
    staged = tmp_path / "d" / "_staging" / "collect-gpu-node-017" / "xid_events" / "date=2026-03-01"
    staged.mkdir(parents=True)
    pq.write_table(rows, staged / "part-committed.parquet")
    pq.write_table(rows, staged / "part-orphan.parquet")
    store.write_state(
        "collect-gpu-node-017",
        {"version": 1, "collectors": {}, "staged": ["xid_events/date=2026-03-01/part-committed.parquet"]},
    )
    collect_once(store)
    assert (tmp_path / "d" / "xid_events" / "date=2026-03-01" / "part-committed.parquet").exists()
    assert not (tmp_path / "d" / "_staging" / "collect-gpu-node-017").exists()  # the orphan went with it
    assert "staged" not in store.read_state("collect-gpu-node-017")


def test_a_state_of_another_version_is_refused_by_name(tmp_path):
    store = Store.create(str(tmp_path / "d"))
    store.write_state("collect-gpu-node-017", {"version": 9})
    with pytest.raises(StoreError, match=r"_state/collect-gpu-node-017.json: not a collector state of this gpufail"):
        collect_once(store)


def test_a_second_daemon_for_the_same_node_is_refused_at_its_first_flush(tmp_path):
    store = Store.create(str(tmp_path / "d"))
    with store.journal("collect-gpu-node-017", ["xid_events"]), pytest.raises(StoreError) as refused:
        collect_once(store)
    assert "another gpufail writer of collect-gpu-node-017 holds the lock" in str(refused.value)
    assert not store.exists("xid_events")
    collect_once(store)  # once the first has stopped
    assert store.exists("xid_events")


def xid_table():
    return make_rows("xid_events", [datetime(2026, 3, 1, 1, tzinfo=UTC)], xid=79)
