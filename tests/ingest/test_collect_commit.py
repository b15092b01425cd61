"""The commit log: a flush's rows and the cursors covering them commit together. A process that
dies at every single filesystem step of a collection, then starts again, ends with exactly
the rows of an uninterrupted run."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest

from ingest.collect.commit import CommitLog
from ingest.collect.daemon import Daemon
from ingest.collect.kernel_log import KernelLogCollector
from ingest.errors import StoreError
from ingest.store import Store
from tests.ingest.test_collect_kernel_log import FakeClock, FakeLog, flood_log

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
    clock = FakeClock()
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
        assert not [p for p in (tmp_path / f"killed-{at}" / "_staging").rglob("*") if p.is_file()]


def test_recovery_moves_what_was_committed_and_removes_what_was_not(tmp_path):
    store = Store.create(str(tmp_path / "d"))
    log = CommitLog(store, "n1")
    staged = store.path("_staging", "collect-n1", "xid_events", "date=2026-03-01")
    store.fs.makedirs(staged, exist_ok=True)
    for name in ("part-committed.parquet", "part-orphan.parquet"):
        store.fs.pipe_file(f"{staged}/{name}", b"PAR1")
    store.write_state(
        "collect-n1",
        {"version": 1, "collectors": {"kernel-log": {"cursor": 7}}, "staged": ["xid_events/date=2026-03-01/part-committed.parquet", "xid_events/date=2026-03-01/part-moved-before.parquet"]},
    )  # fmt: skip
    assert log.recover() == {"kernel-log": {"cursor": 7}}
    assert store.fs.exists(store.path("xid_events", "date=2026-03-01", "part-committed.parquet"))
    assert not store.fs.exists(store.path("_staging", "collect-n1"))  # the orphan went with it


def test_a_commit_record_of_another_version_is_refused_by_name(tmp_path):
    store = Store.create(str(tmp_path / "d"))
    store.write_state("collect-n1", {"version": 9})
    with pytest.raises(StoreError, match=r"_state/collect-n1.json: not a commit record of this gpufail"):
        CommitLog(store, "n1").recover()
