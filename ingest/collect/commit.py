"""Exactly-once flushes: a flush's rows and the cursors that cover them commit together.

A flush of the daemon's buffer, for node N:
1. telemetry goes straight into the store (part files, temporary name then rename). No source
   is read twice for telemetry (NVML and dcgm-exporter are sampled, not replayed), so a kill
   after this step repeats nothing; and it is there when the same flush's XID events are
   mapped to GPUs;
2. every other dataset's rows are written under `_staging/collect-N/` with the store's layout
   (`xid_events/date=D/part-X.parquet`), where no reader looks;
3. the commit: `_state/collect-N.json` is replaced in one rename by the collectors' states
   (the kernel-log cursor and open incidents) and the list of staged files;
4. each staged file is renamed to the same path under the data root.

A kill before 3 leaves staged files that no commit lists; `recover()` removes them at the next
start and hands back the previous commit's states, so the lines behind them are read again and
give the same rows. A kill after 3 leaves renames undone; `recover()` finishes them. Either
way the store ends with exactly the rows of an uninterrupted run. Paths in the record are
relative to the data root, so a copied or moved store resumes where it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from ingest.collect.buffer import WriteBuffer
from ingest.errors import StoreError
from ingest.store import Store

RECORD_VERSION = 1
# Written before the commit because XID events are mapped to GPUs from them (see above).
DIRECT_DATASETS = ("telemetry",)


@dataclass
class FlushResult:
    rows: dict[str, int] = field(default_factory=dict)
    files: int = 0


class CommitLog:
    """The commit record of one node's daemon and its staging folder; see the module docstring."""

    def __init__(self, store: Store, node: str) -> None:
        self.store = store
        self.record_name = f"collect-{node}"
        self.staging_dir = f"_staging/collect-{node}"
        self._staging = Store(f"{store.root.rstrip('/')}/{self.staging_dir}", store.fs, store.path(self.staging_dir))
        self._states: dict[str, dict[str, Any]] = {}
        self._unmoved: list[str] = []

    @property
    def record_path(self) -> str:
        return self.store.path("_state", f"{self.record_name}.json")

    def recover(self) -> dict[str, dict[str, Any]]:
        """Finish the renames of the last commit, remove staged files no commit lists, and
        return the collectors' committed states by collector name."""
        record = self.store.read_state(self.record_name)
        if record is not None:
            if record.get("version") != RECORD_VERSION or not isinstance(record.get("collectors"), dict):
                raise StoreError(
                    f"{self.record_path}: not a commit record of this gpufail (version {record.get('version')!r}); "
                    f"expected version {RECORD_VERSION} with 'collectors' and 'staged'"
                )
            self._states = dict(record["collectors"])
            self._unmoved = [str(p) for p in record.get("staged", [])]
        self._move_staged()
        staging = self.store.path(self.staging_dir)
        try:
            if self.store.fs.exists(staging):
                self.store.fs.rm(staging, recursive=True)
        except OSError as exc:
            raise StoreError(f"{staging}: cannot remove uncommitted files ({exc.strerror or exc})") from None
        return dict(self._states)

    def flush(
        self,
        buffer: WriteBuffer,
        states: dict[str, dict[str, Any]],
        prepare: Callable[[str, pa.Table], pa.Table] = lambda dataset, table: table,
    ) -> FlushResult:
        """Write everything `buffer` holds and commit `states` with it (which must cover exactly
        those rows). A dataset leaves the buffer only once it is written and committed, so an
        error keeps the rest for the next flush; the states commit only with all of it."""
        try:
            return self._flush(buffer, states, prepare)
        except OSError as exc:  # a folder the store could not create, a state it could not write
            raise StoreError(f"{exc.filename or self.store.root}: cannot write ({exc.strerror or exc})") from None

    def _flush(
        self,
        buffer: WriteBuffer,
        states: dict[str, dict[str, Any]],
        prepare: Callable[[str, pa.Table], pa.Table],
    ) -> FlushResult:
        self._move_staged()
        result = FlushResult()
        for dataset in buffer.datasets():
            if dataset in DIRECT_DATASETS:
                table = buffer.table(dataset)
                result.files += len(self.store.write(dataset, table))
                result.rows[dataset] = table.num_rows
                buffer.remove(dataset)
        staged: list[str] = []
        committed = {**self._states, **states}  # a source not run this time keeps its position
        try:
            for dataset in buffer.datasets():
                table = prepare(dataset, buffer.table(dataset))
                staged += [self._relative(p) for p in self._staging.write(dataset, table)]
                result.rows[dataset] = table.num_rows
            self.store.write_state(
                self.record_name, {"version": RECORD_VERSION, "collectors": committed, "staged": staged}
            )
        except BaseException:
            self._remove_quietly(staged)
            raise
        for dataset in buffer.datasets():
            buffer.remove(dataset)
        self._states = committed
        self._unmoved = staged
        result.files += len(staged)
        self._move_staged()
        return result

    def _relative(self, staged_path: str) -> str:
        prefix = self.store.path(self.staging_dir) + "/"
        if not staged_path.startswith(prefix):
            raise AssertionError(f"{staged_path}: written outside {prefix}")
        return staged_path[len(prefix) :]

    def _move_staged(self) -> None:
        """Rename committed staged files into place; a file already moved is skipped, so this
        can be repeated after a kill at any point of it."""
        fs = self.store.fs
        while self._unmoved:
            relative = self._unmoved[0]
            staged, final = self.store.path(self.staging_dir, relative), self.store.path(relative)
            try:
                if fs.exists(staged):
                    fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
                    fs.mv(staged, final)
            except OSError as exc:
                raise StoreError(
                    f"{final}: cannot move the committed file into place ({exc.strerror or exc}); "
                    "it stays staged and the move is retried"
                ) from None
            self._unmoved.pop(0)

    def _remove_quietly(self, relatives: Iterable[str]) -> None:
        for relative in relatives:
            # Uncommitted: if this fails, the next start removes the whole staging folder.
            with contextlib.suppress(OSError):
                self.store.fs.rm(self.store.path(self.staging_dir, relative))
