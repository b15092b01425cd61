"""`ingest.journal`: files, the files they replace and a writer's state committed in one step, and
what readers see at every point of it. A crash is stood in for by an exception at the chosen
step with the clean-up a killed process would not get switched off (`killed_process`), so the
store is left as a killed process leaves it (tests/faults kill real processes)."""

from __future__ import annotations

import pickle
from datetime import date
from pathlib import Path

import fsspec.implementations.local as local
import pytest

from ingest.errors import StoreError
from ingest.journal import Journal
from ingest.store import COMMIT_KEY, Store
from tests.conftest import make_rows

DAY = date(2026, 1, 5)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.create(str(tmp_path / "root"))


def killed_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, an exception out of a journal does what kill -9 does: the lock goes (the
    kernel releases it), nothing is cleaned up."""

    def exit_as_killed(self: Journal, *exc: object) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    monkeypatch.setattr(Journal, "__exit__", exit_as_killed)
    monkeypatch.setattr("ingest.journal.remove_quietly", lambda fs, path: None)


def crash(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt


def hidden(root: Path) -> list[str]:
    return sorted(p.name.split(".")[1] for p in root.rglob(".*"))


def xids(store: Store) -> list[int]:
    return sorted(store.read("xid_events")["xid"].to_pylist()) if store.exists("xid_events") else []


def test_a_commit_makes_rows_and_state_visible_together(store: Store, hours: object) -> None:
    rows = make_rows("xid_events", hours(1, 25), xid=[79, 48])  # type: ignore[operator]
    with store.journal("cursor", ["xid_events"]) as journal:
        assert journal.state is None
        written = journal.commit({"offset": 2}, {"xid_events": rows})
    assert len(written) == 2 and all("/part-" in p for p in written)
    assert xids(store) == [48, 79]
    assert store.read_state("cursor") == {"offset": 2}  # the commit record is the store's
    with store.journal("cursor", ["xid_events"]) as journal:
        assert journal.state == {"offset": 2}


def test_a_crash_before_the_state_is_written_leaves_nothing_a_reader_sees(
    store: Store, hours: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    killed_process(monkeypatch)
    monkeypatch.setattr(Store, "write_state", crash)
    with pytest.raises(KeyboardInterrupt), store.journal("cursor", ["xid_events"]) as journal:
        journal.commit({"offset": 2}, {"xid_events": make_rows("xid_events", hours(1, 25), xid=[79, 48])})  # type: ignore[operator]
    monkeypatch.undo()
    assert hidden(tmp_path / "root") == ["pending", "pending"]
    assert xids(store) == [] and store.dates("xid_events") == []  # uncommitted files are not rows
    with store.journal("cursor", ["xid_events"]) as journal:
        assert journal.state is None
    assert hidden(tmp_path / "root") == []  # and the next journal deletes them


def test_a_crash_after_the_state_is_written_keeps_the_rows_and_the_next_journal_names_them(
    store: Store, hours: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    killed_process(monkeypatch)
    real_write_state = Store.write_state

    def commit_then_crash(self: Store, name: str, state: dict, **kwargs: object) -> None:
        real_write_state(self, name, state, **kwargs)  # type: ignore[arg-type]
        monkeypatch.setattr(local.LocalFileSystem, "mv", crash)  # before the first rename

    monkeypatch.setattr(Store, "write_state", commit_then_crash)
    with pytest.raises(KeyboardInterrupt), store.journal("cursor", ["xid_events"]) as journal:
        journal.commit({"offset": 2}, {"xid_events": make_rows("xid_events", hours(1, 25), xid=[79, 48])})  # type: ignore[operator]
    monkeypatch.undo()
    assert hidden(tmp_path / "root") == ["pending", "pending"]
    assert xids(store) == [48, 79]  # committed: readers count them under their hidden names
    with store.journal("cursor", ["xid_events"]) as journal:
        assert journal.state == {"offset": 2}
    assert hidden(tmp_path / "root") == []
    assert xids(store) == [48, 79] and len(store.files("xid_events")) == 2
    assert not (tmp_path / "root" / "_state" / "cursor.inflight").exists()


def test_hidden_files_of_an_older_commit_are_not_rows(store: Store, hours: object, tmp_path: Path) -> None:
    with store.journal("cursor", ["xid_events"]) as journal:
        journal.commit({"offset": 1}, {"xid_events": make_rows("xid_events", hours(1), xid=79)})  # type: ignore[operator]
    folder = tmp_path / "root" / "xid_events" / "date=2026-01-05"
    (visible,) = folder.iterdir()
    # A hidden file whose commit is not the last one: left by a run that never committed.
    (folder / f".pending.cursor.{'0' * 32}.{visible.name}").write_bytes(visible.read_bytes())
    (tmp_path / "root" / "_state" / "cursor.inflight").write_text("x")  # even while a commit is in flight
    assert xids(store) == [79]
    state = store.read_state_raw("cursor")
    assert state is not None and COMMIT_KEY in state


def test_files_a_commit_replaces_leave_at_the_instant_of_the_commit(
    store: Store, hours: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with store.journal("snap", ["xid_events"]) as journal:
        (old,) = journal.commit(tables={"xid_events": make_rows("xid_events", hours(1), xid=79)})  # type: ignore[operator]
    killed_process(monkeypatch)
    real_finish = Journal._finish

    def killed_after_the_commit(self: Journal, record: dict) -> None:
        if record.get("replaces"):
            raise KeyboardInterrupt
        real_finish(self, record)

    monkeypatch.setattr(Journal, "_finish", killed_after_the_commit)
    with pytest.raises(KeyboardInterrupt), store.journal("snap", ["xid_events"]) as journal:
        staged = journal.staging().write("xid_events", make_rows("xid_events", hours(2), xid=48))  # type: ignore[operator]
        assert xids(store) == [79]  # staged: not yet there
        journal.commit(staged=staged, replaces=[old])
    monkeypatch.undo()
    assert Path(old).exists()  # not yet deleted, but no longer counted
    assert xids(store) == [48]
    with store.journal("snap", ["xid_events"]):
        pass
    assert not Path(old).exists() and xids(store) == [48] and hidden(tmp_path / "root") == []


def test_a_writer_without_state_commits_files_only(store: Store, hours: object) -> None:
    with store.journal("snap", ["xid_events"]) as journal:
        journal.commit(tables={"xid_events": make_rows("xid_events", hours(1), xid=79)})  # type: ignore[operator]
        assert journal.state is None
    assert store.read_state("snap") is None and xids(store) == [79]
    with store.journal("snap", ["xid_events"]) as journal:
        journal.commit({"n": 1})
        journal.commit(tables={"xid_events": make_rows("xid_events", hours(2), xid=48)})  # type: ignore[operator]
    assert store.read_state("snap") == {"n": 1}  # a commit without a state keeps the state


def test_files_staged_elsewhere_are_committed_by_the_journal_and_only_those_of_its_commit(
    store: Store, hours: object
) -> None:
    table = make_rows("xid_events", hours(1), xid=79)  # type: ignore[operator]
    with store.journal("build", ["xid_events"]) as journal:
        staging = pickle.loads(pickle.dumps(journal.staging()))  # as a Dask worker gets it
        staged = staging.write_owned("xid_events", DAY, table)
        assert xids(store) == []
        (written,) = journal.commit(staged=[staged])
        assert written == staging.visible(staged) and xids(store) == [79]
        with pytest.raises(ValueError, match="was not staged for this commit"):
            journal.commit(staged=[staging.write_owned("xid_events", DAY, table)])  # the last commit's staging
        with pytest.raises(ValueError, match="cannot remove telemetry/"):
            journal.commit(replaces=[store.path("telemetry", "date=2026-01-05", "part-x.parquet")])


def test_a_failure_inside_the_journal_leaves_the_last_commit_whole_and_nothing_else(
    store: Store, hours: object, tmp_path: Path
) -> None:
    with pytest.raises(RuntimeError), store.journal("build", ["xid_events"]) as journal:
        journal.commit({"n": 1}, {"xid_events": make_rows("xid_events", hours(1), xid=79)})  # type: ignore[operator]
        journal.staging().write("xid_events", make_rows("xid_events", hours(2), xid=48))  # type: ignore[operator]
        raise RuntimeError("the build failed")
    assert hidden(tmp_path / "root") == [] and xids(store) == [79] and store.read_state("build") == {"n": 1}


def test_the_next_writer_sweeps_what_a_killed_one_left_half_written_and_nothing_of_others(
    store: Store, hours: object, tmp_path: Path
) -> None:
    with store.journal("mine", ["xid_events"]) as journal:
        journal.commit({"n": 1}, {"xid_events": make_rows("xid_events", hours(1), xid=79)})  # type: ignore[operator]
    folder = tmp_path / "root" / "xid_events" / "date=2026-01-05"
    state = tmp_path / "root" / "_state"
    left = [
        folder / f".pending.mine.{'1' * 32}.tmp-{'2' * 32}.parquet",  # a part file cut short
        state / ".tmp-mine.json-0123",  # a state file cut short
    ]
    others = [folder / f".pending.mine-too.{'1' * 32}.tmp-{'2' * 32}.parquet", state / ".tmp-other.json-0123"]
    for path in left + others:
        path.write_bytes(b"PAR1")
    with store.journal("mine", ["xid_events"]) as journal:
        assert journal.state == {"n": 1}
    assert [p.exists() for p in left + others] == [False, False, True, True]


def test_one_journal_per_lock_at_a_time(store: Store) -> None:
    with store.journal("cursor", ["xid_events"]):
        with pytest.raises(StoreError, match=r"another gpufail writer of cursor holds the lock .*_state/cursor\.lock"):
            store.journal("cursor", ["xid_events"]).__enter__()
        with store.journal("other", ["xid_events"]):
            pass  # another name is another writer
        with pytest.raises(StoreError, match=r"another `x` holds the lock .*_state/cursor\.lock"):
            store.journal("shares-the-lock", ["xid_events"], lock="cursor", holder="`x`").__enter__()
    with store.journal("cursor", ["xid_events"]):
        pass  # released on exit


def test_a_journal_writes_only_its_own_datasets_and_has_a_plain_name(store: Store, hours: object) -> None:
    with pytest.raises(ValueError, match="expected letters, digits"):
        store.journal("../escape", ["xid_events"])
    with store.journal("cursor", ["xid_events"]) as journal, pytest.raises(ValueError, match="not one of its datasets"):
        journal.commit({}, {"telemetry": make_rows("telemetry", hours(1))})  # type: ignore[operator]


def test_a_reader_lists_again_when_a_writer_commits_while_it_lists(
    store: Store, hours: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    with store.journal("snap", ["xid_events"]) as journal:
        (old,) = journal.commit(tables={"xid_events": make_rows("xid_events", hours(1), xid=79)})  # type: ignore[operator]
    real_partitions = Store._partitions
    calls = []

    def listing_while_a_commit_lands(self: Store, *args: object) -> object:
        listed = real_partitions(self, *args)  # type: ignore[arg-type]
        calls.append(1)
        if len(calls) == 1:  # the commit lands after this listing, its finish still to come
            real_finish = Journal._finish
            monkeypatch.setattr(Journal, "_finish", lambda journal, record: None)
            with store.journal("snap", ["xid_events"]) as journal:
                staged = journal.staging().write("xid_events", make_rows("xid_events", hours(2), xid=48))  # type: ignore[operator]
                journal.commit(staged=staged, replaces=[old])
            monkeypatch.setattr(Journal, "_finish", real_finish)
        return listed

    monkeypatch.setattr(Store, "_partitions", listing_while_a_commit_lands)
    (seen,) = store.files("xid_events")  # the new commit's file only, under its hidden name
    assert seen != old and Path(seen).name.startswith(".pending.snap.")
    monkeypatch.undo()
    assert xids(store) == [48]


def test_a_data_root_whose_first_write_was_killed_is_created_again(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / ".tmp-gpufail.json-0123").write_bytes(b'{"form')  # the marker's write, cut short
    Store.create(str(root))
    assert sorted(p.name for p in root.iterdir()) == ["gpufail.json"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="is not empty and is not a gpufail dataset"):
        Store.create(str(tmp_path / "other"))


def test_an_append_killed_part_way_shows_no_row_and_the_next_append_deletes_what_it_left(
    store: Store, hours: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Store.write over two days, killed after the first day's file: neither day is readable,
    # and the next append to the dataset sweeps the file the killed one left.
    killed_process(monkeypatch)
    real = Store.write_part
    written: list[str] = []

    def second_file_killed(self: Store, *args: object, **kwargs: object) -> str:
        if written:
            raise KeyboardInterrupt
        written.append(real(self, *args, **kwargs))  # type: ignore[arg-type]
        return written[-1]

    monkeypatch.setattr(Store, "write_part", second_file_killed)
    two_days = make_rows("xid_events", hours(23, 25), xid=[79, 48])  # type: ignore[operator]
    with pytest.raises(KeyboardInterrupt):
        store.write("xid_events", two_days)
    monkeypatch.undo()
    assert len(written) == 1 and Path(written[0]).exists() and hidden(tmp_path / "root") == ["pending"]
    assert xids(store) == [] and store.dates("xid_events") == []
    store.write("xid_events", make_rows("xid_events", hours(2), xid=31))  # type: ignore[operator]
    assert not Path(written[0]).exists() and hidden(tmp_path / "root") == []
    assert xids(store) == [31]
