"""`ingest.journal`: rows and state committed in one step. A crash is stood in for by an
exception at the chosen step, with the cleanup it would have prevented also failing, so the
store is left as a killed process leaves it (tests/faults kill real processes)."""

from __future__ import annotations

from pathlib import Path

import fsspec.implementations.local as local
import pytest

from ingest.errors import StoreError
from ingest.store import COMMIT_KEY, Store
from tests.conftest import make_rows


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.create(str(tmp_path / "root"))


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
    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Store, "write_state", crash)
    monkeypatch.setattr("ingest.journal.remove_quietly", lambda fs, path: None)  # killed: no cleanup
    with pytest.raises(KeyboardInterrupt), store.journal("cursor", ["xid_events"]) as journal:
        journal.commit({"offset": 2}, {"xid_events": make_rows("xid_events", hours(1, 25), xid=[79, 48])})  # type: ignore[operator]
    monkeypatch.undo()
    assert hidden(tmp_path / "root") == ["pending", "pending"]
    assert xids(store) == []  # uncommitted files are not rows
    with store.journal("cursor", ["xid_events"]) as journal:
        assert journal.state is None
    assert hidden(tmp_path / "root") == []  # and the next journal deletes them


def test_a_crash_after_the_state_is_written_keeps_the_rows_and_the_next_journal_names_them(
    store: Store, hours: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

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
    assert xids(store) == [48, 79]
    assert len(store.files("xid_events")) == 2


def test_hidden_files_of_an_older_commit_are_not_rows(store: Store, hours: object, tmp_path: Path) -> None:
    with store.journal("cursor", ["xid_events"]) as journal:
        journal.commit({"offset": 1}, {"xid_events": make_rows("xid_events", hours(1), xid=79)})  # type: ignore[operator]
    folder = tmp_path / "root" / "xid_events" / "date=2026-01-05"
    (visible,) = folder.iterdir()
    # A hidden file whose commit is not the last one: left by a run that never committed.
    (folder / f".pending.cursor.{'0' * 32}.{visible.name}").write_bytes(visible.read_bytes())
    assert xids(store) == [79]
    state = store.read_state_raw("cursor")
    assert state is not None and COMMIT_KEY in state


def test_a_second_journal_of_the_same_name_is_refused_while_the_first_is_open(store: Store) -> None:
    with store.journal("cursor", ["xid_events"]):
        with pytest.raises(StoreError, match=r"_state/cursor\.lock: another process is writing cursor"):
            store.journal("cursor", ["xid_events"]).__enter__()
        with store.journal("other", ["xid_events"]):
            pass  # another name is another writer
    with store.journal("cursor", ["xid_events"]):
        pass  # released on exit


def test_a_journal_writes_only_its_own_datasets_and_has_a_plain_name(store: Store, hours: object) -> None:
    with pytest.raises(ValueError, match="expected letters, digits"):
        store.journal("../escape", ["xid_events"])
    with store.journal("cursor", ["xid_events"]) as journal, pytest.raises(ValueError, match="not one of its datasets"):
        journal.commit({}, {"telemetry": make_rows("telemetry", hours(1))})  # type: ignore[operator]
