"""Rows and the state that describes them, committed in one step (`Store.journal`).

Why: a writer such as the kernel-log ingest remembers how far it has read (its state), so that
a rerun reads only what is new. Written rows first and state second, a crash in between makes
the rerun write those rows again; the other order loses them. Exactly once needs both to take
effect at one instant, whatever point the process is killed at or the disk fills up.

How a commit goes:
1. Each part file of the batch is written under a hidden name,
   `.pending.<state name>.<commit id>.<part file name>`, which readers skip, and synced to disk.
2. The state file `_state/<name>.json` is replaced, in one synced rename, by the new state plus
   a commit record (`COMMIT_KEY`) naming the batch's files. That rename is the commit: before
   it the batch does not exist, after it the batch exists whole.
3. The files are renamed to their visible names.

A crash before 2 leaves hidden files that no commit names: readers never see them and the next
journal of that name deletes them. A crash after 2 leaves files the commit names: readers
already count them (`pending_visibility`), and the next journal renames them. Either way the
next run starts from the committed state, so it reads again exactly what was not committed.

One journal per name at a time: on a local store an exclusive lock (`flock`, released by the
kernel when the process dies, so a crash leaves no stale lock) refuses a second one. Other
filesystems have no lock; run one writer per name there.
"""

from __future__ import annotations

import fcntl
import os
import re
import uuid
from collections.abc import Mapping
from types import TracebackType
from typing import IO, Any

import pyarrow as pa

from ingest.errors import StoreError
from ingest.store import (
    COMMIT_KEY,
    Store,
    conform,
    describe_os_error,
    guarded,
    remove_quietly,
    split_by_day,
    temporary_prefix,
)

PENDING = ".pending."
_STATE_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class Journal:
    """Commits of rows (to `datasets`) together with the state `name`; a context manager.

    On entry: take the lock, finish or discard what a crashed run left (see the module
    docstring) and load `state`, the last committed state (None when there is none)."""

    def __init__(self, store: Store, name: str, datasets: tuple[str, ...]) -> None:
        if not _STATE_NAME.match(name):
            raise ValueError(f"journal name {name!r}: expected letters, digits, '_' or '-'")
        self.store = store
        self.name = name
        self.datasets = datasets
        self.state: dict[str, Any] | None = None
        self._lock_file: IO[str] | None = None

    def __enter__(self) -> Journal:
        self._lock()
        try:
            raw = self.store.read_state_raw(self.name)
            self._recover(_commit_record(raw))
        except BaseException:
            self._unlock()
            raise
        self.state = _without_commit(raw)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._unlock()

    def commit(self, state: dict[str, Any], tables: Mapping[str, pa.Table]) -> list[str]:
        """Append `tables` (dataset -> rows, one file per UTC date) and replace the state with
        `state`, as one step. Returns the paths of the files written."""
        commit_id = uuid.uuid4().hex
        prefix = f"{PENDING}{self.name}.{commit_id}."
        pending: list[str] = []
        try:
            for dataset, table in tables.items():
                if dataset not in self.datasets:
                    raise ValueError(f"journal {self.name}: {dataset!r} is not one of its datasets {self.datasets}")
                for day, rows in split_by_day(conform(table, dataset)):
                    pending.append(self.store.write_part(dataset, day, rows, hidden_prefix=prefix, durable=True))
            for folder in sorted({path.rsplit("/", 1)[0] for path in pending}):
                self.store.sync_folder(folder)
            record = {"id": commit_id, "files": [self._relative(_visible_name(p, prefix)) for p in pending]}
            self.store.write_state(self.name, {**state, COMMIT_KEY: record}, durable=True)
        except BaseException:
            # Not committed (checked, not assumed: an interruption may land just after the
            # rename): its files must go. Should that fail, the next journal deletes them.
            if not self._committed(commit_id):
                for path in pending:
                    remove_quietly(self.store.fs, path)
            raise
        self.state = state
        visible = []
        for path in pending:
            final = _visible_name(path, prefix)
            with guarded("rename a committed file (the next run finishes it)", path):
                self.store.fs.mv(path, final)
            visible.append(final)
        return visible

    # -- recovery --------------------------------------------------------------------------

    def _recover(self, commit: dict[str, Any]) -> None:
        """Rename the files of the last commit that a crash left hidden; delete the hidden
        files of commits that never happened, and a state file a crash left half written."""
        state_folder = self.store.path("_state")
        if self.store.fs.exists(state_folder):
            stale = temporary_prefix(f"{self.name}.json")
            for name in _names(self.store, state_folder):
                if name.startswith(stale):
                    _delete(self.store, f"{state_folder}/{name}")
        committed = set(commit.get("files", []))
        prefix = f"{PENDING}{self.name}."
        for dataset in self.datasets:
            for day in self.store.dates(dataset):
                folder = self.store.path(dataset, f"date={day.isoformat()}")
                names = _names(self.store, folder)
                for name in names:
                    if not name.startswith(prefix):
                        continue
                    commit_id, _, final = name.removeprefix(prefix).partition(".")
                    path = f"{folder}/{name}"
                    done = commit_id == commit.get("id") and self._relative(f"{folder}/{final}") in committed
                    if done and final not in names:
                        _rename(self.store, path, f"{folder}/{final}")
                    else:
                        _delete(self.store, path)

    def _committed(self, commit_id: str) -> bool:
        try:
            return _commit_record(self.store.read_state_raw(self.name)).get("id") == commit_id
        except StoreError:
            return True  # unknown: keep the files; the next journal decides from the state

    def _relative(self, path: str) -> str:
        return path.removeprefix(self.store.path() + "/")

    # -- the lock --------------------------------------------------------------------------

    def _lock(self) -> None:
        if not self.store.is_local:
            return
        folder = self.store.path("_state")
        path = f"{folder}/{self.name}.lock"
        try:
            os.makedirs(folder, exist_ok=True)
            handle = open(path, "a")  # noqa: SIM115 - held until __exit__
        except OSError as exc:
            raise StoreError(describe_os_error(exc, "create the lock file", path)) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise StoreError(
                f"{path}: another process is writing {self.name} (it holds this lock); wait for it to finish"
            ) from None
        self._lock_file = handle

    def _unlock(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None


def pending_visibility(store: Store, names: list[str]) -> list[str]:
    """Of a partition folder's file names, the hidden ones a commit names and a crash left
    unrenamed: readers count them (they are committed rows); every other hidden file is not."""
    hidden = [n for n in names if n.startswith(PENDING) and n.endswith(".parquet")]
    if not hidden:
        return []
    commits: dict[str, dict[str, Any]] = {}
    visible = []
    for name in hidden:
        writer, _, rest = name.removeprefix(PENDING).partition(".")
        commit_id, _, final = rest.partition(".")
        if writer not in commits:
            known = _STATE_NAME.match(writer) is not None
            commits[writer] = _commit_record(store.read_state_raw(writer)) if known else {}
        commit = commits[writer]
        named = any(f.endswith(f"/{final}") for f in commit.get("files", []))
        if commit.get("id") == commit_id and named and final not in names:
            visible.append(name)
    return visible


def _commit_record(state: dict[str, Any] | None) -> dict[str, Any]:
    record = (state or {}).get(COMMIT_KEY)
    return record if isinstance(record, dict) else {}


def _without_commit(state: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if state is None else {k: v for k, v in state.items() if k != COMMIT_KEY}


def _visible_name(path: str, prefix: str) -> str:
    folder, name = path.rsplit("/", 1)
    return f"{folder}/{name.removeprefix(prefix)}"


def _names(store: Store, folder: str) -> list[str]:
    with guarded("list the partition", folder):
        return [f.rsplit("/", 1)[-1] for f in store.fs.ls(folder, detail=False)]


def _rename(store: Store, source: str, target: str) -> None:
    with guarded("rename a committed file", source):
        store.fs.mv(source, target)


def _delete(store: Store, path: str) -> None:
    with guarded("remove an uncommitted file", path):
        store.fs.rm(path)
