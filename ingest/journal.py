"""Files and the state that describes them, committed in one step (`Store.journal`): the one way
gpufail commits what it writes.

Why: a writer remembers what it has done (its state: how far each log was read, which feature
days are complete, the tiers a publish policy has set), so that a rerun does only what is left.
Files written first and state second, a crash in between makes the rerun write those files
again; the other order loses them. Exactly once needs both to take effect at one instant,
whatever point the process is killed at or the disk fills up. A commit may also remove files
(the old files of a rebuilt features day, an older snapshot of the same predictions): they
leave at the same instant.

The writers: the kernel-log ingest (`kernel_log_ingest`), each node's collector
(`collect-<node>`), the features build (`features`: its state is the features manifest),
scoring (`predictions`), publishing (`publish-<target>[-shadow]`: the audit file with the
policy state) and the appends of `Store.write` (`append-<dataset>`: imports, the simulator).

How a commit of writer `name` goes:
1. Each new file is written under a hidden name in its partition folder,
   `.pending.<name>.<commit id>.<file name>` (`Staging`), which readers skip. While it is being
   written it is `.pending.<name>.<commit id>.tmp-...`.
2. The marker `_state/<name>.inflight` is written: while it exists, readers apply the writer's
   last commit record (below).
3. The state file `_state/<name>.json` is replaced, in one rename, by the new state plus a
   commit record (`COMMIT_KEY`) naming the commit's new files and the files it removes. That
   rename is the commit: before it the commit does not exist, after it it exists whole.
4. The removed files are deleted, the new ones renamed to their visible names, the marker
   removed. A journal with `linger_s` (compaction, `ingest.compact`) keeps the removed files, the
   new files' hidden names (the visible one is a second name) and the marker for that long after
   the commit: a reader that listed them before or during the commit can still open them, and
   readers that list after it skip them (the marker's record). The next
   commit of that journal carries the files still lingering into its own record, and the first
   entry of it after the time has passed deletes them.

Readers (`Store.files`, and so every read of the store) take the visible files, and for each
marker the record applied: the record's new files count under their hidden names, the files it
removes do not. So a crash before 3 leaves nothing a reader sees, and a crash after 3 leaves
the commit whole to readers. The next journal of the same name, on entry and under its lock,
finishes step 4 of the last commit and deletes every other hidden file of its name (files of
commits that never happened, files a kill cut short), so the writer resumes from the committed
state and does again exactly what was not committed.

One journal per lock at a time (`ingest.locking`: a `flock`, released by the kernel when its
holder dies, so a crash leaves no stale lock). On a local store the lock file is
`_state/<lock>.lock`; elsewhere it is in this machine's temporary folder, which keeps apart the
writers on one machine only: run one writer of a name at a time there.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa

from ingest.errors import StoreError
from ingest.locking import exclusive_lock
from ingest.store import (
    COMMIT_KEY,
    Store,
    conform,
    guarded,
    remove_quietly,
    split_by_day,
    temporary_prefix,
)

PENDING = ".pending."
INFLIGHT = ".inflight"
"""The suffix of a writer's marker in `_state/`: its last commit may be unfinished."""
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
READER_GRACE_S = 15 * 60.0
"""The `linger_s` of writers that replace files readers may be reading (compaction, a features
rebuild): a read that listed the old files within this long of the commit can still open them."""


@dataclass(frozen=True)
class Staging:
    """Writes the files of one commit under their hidden names (step 1 of the module notes).
    It can be pickled, so that Dask workers write their partitions' files and the process
    holding the journal commits them (`Journal.commit(staged=...)`)."""

    store: Store
    prefix: str
    datasets: tuple[str, ...]
    durable: bool

    def write_owned(self, dataset: str, day: date, table: pa.Table | list[pa.Table], **parquet_options: Any) -> str:
        """One file of `date=day` (`Store.write_owned`, hidden until committed)."""
        self._check(dataset)
        return self.store.write_part(
            dataset, day.isoformat(), table, hidden_prefix=self.prefix, durable=self.durable, **parquet_options
        )

    def write(self, dataset: str, table: pa.Table) -> list[str]:
        """Rows of a dataset with a store schema, one file per UTC date (`Store.write`, hidden
        until committed)."""
        self._check(dataset)
        return [
            self.store.write_part(dataset, day, rows, hidden_prefix=self.prefix, durable=self.durable)
            for day, rows in split_by_day(conform(table, dataset))
        ]

    def write_part_of_day(self, dataset: str, day: date, table: pa.Table) -> str:
        """One file of `date=day` of a dataset with a store schema (`Store.write_partition`,
        hidden until committed)."""
        self._check(dataset)
        return self.store.write_part(
            dataset, day.isoformat(), conform(table, dataset), hidden_prefix=self.prefix, durable=self.durable
        )

    def visible(self, path: str) -> str:
        """The path a file written here has once committed."""
        return _visible(path, self.prefix)

    def _check(self, dataset: str) -> None:
        if dataset not in self.datasets:
            name = self.prefix.removeprefix(PENDING).split(".", 1)[0]
            raise ValueError(f"journal {name}: {dataset!r} is not one of its datasets {self.datasets}")


class Journal:
    """Commits of files (to `datasets`) together with the state `name`; a context manager.

    On entry: take the lock, finish the last commit, delete what no commit named (module
    notes), and load `state`, the last committed state (None when there is none).
    - lock: the lock's name (default `name`): writers that must not overlap share one.
    - wait_s: how long to wait for the lock before refusing; holder: who is refused, in words.
    - durable: each file, then the state, is on disk before the next step (a power cut keeps
      the commit or nothing); off for data that can be rebuilt, where syncing costs time.
    - linger_s: how long the files a commit removes stay on disk for readers that listed them
      before it (module notes); 0 deletes them at once.
    """

    def __init__(
        self,
        store: Store,
        name: str,
        datasets: Iterable[str],
        *,
        lock: str | None = None,
        wait_s: float = 0.0,
        holder: str | None = None,
        durable: bool = True,
        linger_s: float = 0.0,
    ) -> None:
        for what, value in (("journal name", name), ("lock name", lock or name)):
            if not _NAME.match(value):
                raise ValueError(f"{what} {value!r}: expected letters, digits, '_' or '-'")
        self.store = store
        self.name = name
        self.datasets = tuple(datasets)
        self.durable = durable
        self.linger_s = linger_s
        self.state: dict[str, Any] | None = None
        self._lock = lock or name
        self._wait_s = wait_s
        self._holder = holder or f"gpufail writer of {name}"
        self._held: ExitStack | None = None
        self._id = ""
        self._lingering: list[str] = []
        """Files the last commit removed that are still on disk (`linger_s`)."""

    def __enter__(self) -> Journal:
        held = ExitStack()
        path = lock_path(self.store, self._lock)
        try:
            with guarded("create the lock file", str(path)):
                held.enter_context(exclusive_lock(path, self._holder, wait_s=self._wait_s, error=StoreError))
            raw = self._recover()
        except BaseException:
            held.close()
            raise
        self._held = held
        self.state = state_without_commit(raw)
        self._id = uuid.uuid4().hex
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._held is None:
            return
        try:
            if exc is not None:
                # What the failed work left: finished or removed now, while the lock is held,
                # rather than at the next entry.
                with contextlib.suppress(StoreError):
                    self._recover()
        finally:
            self._held.close()
            self._held = None

    def staging(self) -> Staging:
        """Where the files of the next commit are written; valid until that commit."""
        if self._held is None:
            raise RuntimeError(f"journal {self.name}: use it as a context manager (it holds a lock)")
        return Staging(self.store, pending_prefix(self.name, self._id), self.datasets, self.durable)

    def commit(
        self,
        state: dict[str, Any] | None = None,
        tables: Mapping[str, pa.Table] | None = None,
        *,
        staged: Iterable[str] = (),
        replaces: Iterable[str] = (),
    ) -> list[str]:
        """Commit, as one step: `state` (None: the committed one, unchanged), the files `staged`
        (written by `staging()` since the last commit), `tables` (dataset -> rows, written here
        one file per UTC date) and the removal of the files `replaces` (paths in the store or
        relative to its root). Returns the visible paths of the new files."""
        staging = self.staging()
        hidden = list(staged)
        foreign = [p for p in hidden if not p.rsplit("/", 1)[-1].startswith(staging.prefix)]
        if foreign:
            raise ValueError(f"journal {self.name}: {foreign[0]} was not staged for this commit")
        removed = sorted({self._relative(p) for p in replaces} | set(self._lingering))
        outside = [p for p in removed if p.split("/", 1)[0] not in self.datasets]
        if outside:
            raise ValueError(f"journal {self.name}: cannot remove {outside[0]}, not in its datasets {self.datasets}")
        kept = self.state if state is None else state
        try:
            for dataset, table in (tables or {}).items():
                hidden += staging.write(dataset, table)
            if self.durable:
                for folder in sorted({path.rsplit("/", 1)[0] for path in hidden}):
                    self.store.sync_folder(folder)
            record: dict[str, Any] = {
                "id": self._id,
                "files": [self._relative(staging.visible(p)) for p in hidden],
                "replaces": removed,
                "at": time.time(),
            }
            with guarded("write", self._marker()):
                self.store.fs.pipe_file(self._marker(), self._id.encode())
            self.store.write_state(self.name, {**(kept or {}), COMMIT_KEY: record}, durable=self.durable)
        except BaseException:
            # Not committed (checked, not assumed: an interruption may land just after the
            # rename): its files must go. Should that fail, the next journal deletes them.
            if not self._committed(self._id):
                for path in hidden:
                    remove_quietly(self.store.fs, path)
            raise
        self.state = kept
        self._id = uuid.uuid4().hex
        self._finish(record)
        return [self.store.path(f) for f in record["files"]]

    # -- finishing and sweeping ------------------------------------------------------------

    def _recover(self) -> dict[str, Any] | None:
        """Finish the last commit, delete every other hidden file of this writer; returns the
        state file as committed."""
        raw = self.store.read_state_raw(self.name)
        self._finish(commit_record(raw))
        self._sweep()
        return raw

    def _finish(self, record: dict[str, Any]) -> None:
        """Step 4 of the module notes for `record`; what is done already is skipped, so this
        can be repeated after a kill at any point of it. Within `linger_s` of the commit, the
        removed files, and so the marker, stay."""
        fs = self.store.fs
        at = record.get("at")
        linger = isinstance(at, (int, float)) and time.time() < at + self.linger_s
        self._lingering = []
        for relative in record.get("replaces", []):
            path = self.store.path(relative)
            with guarded("remove a replaced file (the next run finishes it)", path):
                if fs.exists(path):
                    if linger:
                        self._lingering.append(relative)
                    else:
                        fs.rm(path)
        prefix = pending_prefix(self.name, str(record.get("id")))
        for relative in record.get("files", []):
            final = self.store.path(relative)
            folder, name = final.rsplit("/", 1)
            pending = f"{folder}/{prefix}{name}"
            with guarded("rename a committed file (the next run finishes it)", pending):
                if fs.exists(pending):
                    if linger:
                        # The hidden name stays too, for readers that listed it during the commit.
                        if not fs.exists(final):
                            self._link(pending, final)
                        self._lingering.append(self._relative(pending))
                    elif fs.exists(final):  # a rename that copies (object stores) was cut before its delete
                        fs.rm(pending)
                    else:
                        fs.mv(pending, final)
        if self._lingering:
            return  # the marker keeps readers skipping the lingering files
        marker = self._marker()
        with guarded("remove", marker):
            if fs.exists(marker):
                fs.rm(marker)

    def _link(self, pending: str, final: str) -> None:
        """`final` as a second name of `pending` (a copy on an object store): it appears whole."""
        if self.store.is_local:
            os.link(pending, final)
        else:
            self.store.fs.copy(pending, final)

    def _sweep(self) -> None:
        """Delete this writer's hidden files that no commit names: run after `_finish`, every
        one left (but the hidden names of lingering files) is of a commit that never happened,
        or a file a kill cut short."""
        prefix = f"{PENDING}{self.name}."
        kept = set(self._lingering)
        for dataset in self.datasets:
            for folder, names in self.store.partitions(dataset):
                for name in names:
                    path = f"{folder}/{name}"
                    if name.startswith(prefix) and self._relative(path) not in kept:
                        _delete(self.store, path)
        state_folder = self.store.path("_state")
        with guarded("list", state_folder):
            names = self.store.names_in(state_folder) if self.store.exists_at(state_folder) else []
        half_written = temporary_prefix(f"{self.name}.json")
        for name in names:
            if name.startswith(half_written):
                _delete(self.store, f"{state_folder}/{name}")

    def _committed(self, commit_id: str) -> bool:
        try:
            return commit_record(self.store.read_state_raw(self.name)).get("id") == commit_id
        except StoreError:
            return True  # unknown: keep the files; the next journal decides from the state

    def _marker(self) -> str:
        return self.store.path("_state", f"{self.name}{INFLIGHT}")

    def _relative(self, path: str) -> str:
        return path.removeprefix(self.store.path() + "/")


@dataclass(frozen=True)
class CommitView:
    """What readers apply to a partition folder's listing: the records of the writers whose
    marker exists (module notes)."""

    markers: dict[str, bytes]
    added: dict[str, dict[str, str]]
    """folder (relative to the root) -> {visible name: hidden name} of committed new files."""
    removed: frozenset[str]
    """Paths (relative to the root) of files committed as removed."""

    def visible(self, folder: str, names: list[str]) -> list[str]:
        """The names of a partition folder's files that readers count."""
        shown = [n for n in names if n.endswith(".parquet") and not n.startswith((".", "_"))]
        if not self.markers:
            return shown
        present = set(names)
        shown = [n for n in shown if f"{folder}/{n}" not in self.removed]
        for final, hidden in self.added.get(folder, {}).items():
            if final not in present and hidden in present:
                shown.append(hidden)
        return shown


def commit_view(store: Store) -> CommitView:
    """The `CommitView` of the store now (reads the records of the markers there only)."""
    markers = _markers(store)
    added: dict[str, dict[str, str]] = {}
    removed: set[str] = set()
    for name, marker in markers.items():
        commit_id, files, replaces = _record_of(store, name, marker)
        prefix = pending_prefix(name, commit_id)
        for relative in files:
            folder, final = relative.rsplit("/", 1)
            added.setdefault(folder, {})[final] = f"{prefix}{final}"
        removed.update(replaces)
    for key in [k for k in _RECORDS if k[0] == store.root and markers.get(k[1]) != k[2]]:
        del _RECORDS[key]  # of finished commits
    return CommitView(markers, added, frozenset(removed))


_Record = tuple[str, tuple[str, ...], tuple[str, ...]]
_RECORDS: dict[tuple[str, str, bytes], _Record] = {}
"""(root, writer, marker) -> (id, files, removed files) of that commit's record, for records
whose id is the marker's: a commit's record never changes, and a compaction's (applied while
its replaced files linger) names a day's files, hundreds of thousands on a large fleet, which
every listing would otherwise read again."""


def _record_of(store: Store, name: str, marker: bytes) -> _Record:
    """(id, files, removed files) of the record a writer's marker applies: the record of the
    marker's commit, or while that one is not written yet (or never was), the last one."""
    key = (store.root, name, marker)
    if key in _RECORDS:
        return _RECORDS[key]
    record = commit_record(store.read_state_raw(name))
    found = (
        str(record.get("id")),
        tuple(str(f) for f in record.get("files", [])),
        tuple(str(r) for r in record.get("replaces", [])),
    )
    if found[0] == marker.decode(errors="replace"):
        _RECORDS[key] = found
    return found


def markers_unchanged(store: Store, view: CommitView) -> bool:
    """Whether no writer started or finished a commit since `view` was taken (a reader that
    listed folders meanwhile lists them again)."""
    return _markers(store) == view.markers


def _markers(store: Store) -> dict[str, bytes]:
    folder = store.path("_state")
    with guarded("list", folder):
        if not store.exists_at(folder):
            return {}
        found = {}
        for name in store.names_in(folder):
            writer = name.removesuffix(INFLIGHT)
            if name.endswith(INFLIGHT) and _NAME.match(writer):
                try:
                    found[writer] = store.read_bytes(f"{folder}/{name}")
                except FileNotFoundError:  # finished while we looked
                    continue
        return found


def lock_path(store: Store, name: str) -> Path:
    """The lock file `name` of a data root: in its `_state/` when the root is a local folder;
    else in this machine's temporary folder, named after the root."""
    if store.is_local:
        return Path(store.path("_state", f"{name}.lock"))
    digest = hashlib.sha256(store.root.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"gpufail-{name}-{digest}.lock"


def commit_record(state: dict[str, Any] | None) -> dict[str, Any]:
    record = (state or {}).get(COMMIT_KEY)
    return record if isinstance(record, dict) else {}


def state_without_commit(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """A state file's state: None when it holds only a commit record (a writer without state)."""
    if state is None:
        return None
    rest = {k: v for k, v in state.items() if k != COMMIT_KEY}
    return None if not rest and COMMIT_KEY in state else rest


def pending_prefix(writer: str, commit_id: str) -> str:
    """The name prefix of a commit's new files until they are renamed to their visible names."""
    return f"{PENDING}{writer}.{commit_id}."


def _visible(path: str, prefix: str) -> str:
    folder, name = path.rsplit("/", 1)
    return f"{folder}/{name.removeprefix(prefix)}"


def _delete(store: Store, path: str) -> None:
    with guarded("remove an uncommitted file", path):
        store.fs.rm(path)
