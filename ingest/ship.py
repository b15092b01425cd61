"""`gpufail ship`: a node's spool moved to the fleet's data root, each part file exactly once.

Why: at 1,000+ nodes, collectors that all write to one shared mount put ~300,000 small files a
day per dataset on it, and a hang of that mount stalls every collector. A collector can instead
write to a node-local data root, the spool (`gpufail collect --data /var/lib/gpufail/spool`):
its writes and its cursors stay local and are as kill-safe as ever. `ship` then copies the
spool's committed part files to the data root (a shared folder or an object store URL), where
`gpufail compact` makes each settled day a few files. A slow or absent data root delays
shipping only; the spool keeps the rows until they are shipped.

How it stays exactly once: shipping is a journal of the data root, `ship-<node>`
(`ingest.journal`). Each batch of files is copied under hidden names and committed together
with the state, which names every spool file shipped and still in the spool. A kill before the
commit leaves nothing a reader sees (the next run deletes the hidden copies); a kill after it
leaves the batch whole, and the next run skips what the state names. A file keeps its name,
and so its checksum, on the data root. Only files the spool's collector has finished committing
(visible names) are shipped.

A shipped file stays in the spool while its day is within `keep` of the clock: the collector
maps XID events to GPUs from the spool's telemetry of the day before. Older shipped files are
deleted from the spool, then dropped from the state (a file is dropped from the state only once
it is gone from the spool, so it is never shipped twice).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from ingest.collect.buffer import FLUSH_ORDER
from ingest.errors import InputError
from ingest.store import Store, guarded

BATCH_FILES = 500
"""Files per commit: a kill repeats at most one batch's copies; each commit rewrites the state."""
DEFAULT_KEEP = timedelta(days=1)
STATE_VERSION = 1


@dataclass
class ShipSummary:
    files: int = 0
    bytes: int = 0
    commits: int = 0
    removed_from_spool: int = 0
    waiting: int = 0
    """Files of the spool not shipped yet: a collector's commit still being finished."""
    seconds: float = 0.0

    def line(self, spool: str, root: str) -> str:
        text = (
            f"ship: {self.files:,} files ({self.bytes / 1e6:,.1f} MB) from {spool} to {root} in {self.commits} "
            f"commits; {self.removed_from_spool:,} shipped files older than the spool keeps removed from it"
        )
        if self.waiting:
            text += f"; {self.waiting} still being committed by the collector, shipped next time"
        return f"{text} in {self.seconds:.1f}s"


def ship(
    spool: Store,
    root: Store,
    node: str,
    *,
    datasets: Sequence[str] = FLUSH_ORDER,
    keep: timedelta = DEFAULT_KEEP,
    now: datetime | None = None,
    batch_files: int = BATCH_FILES,
) -> ShipSummary:
    """Copy the committed part files of `datasets` in `spool` that were not shipped yet to
    `root`, then delete from the spool the shipped files of days older than `keep`."""
    from ingest.user_metrics import record_metrics, recorded_metrics

    if spool.fs.protocol == root.fs.protocol and spool.path() == root.path():
        # Shipping a root to itself would delete its files from it as shipped.
        raise InputError(f"ship: the spool {spool.root} is the data root itself; expected the collector's own folder")
    began = time.perf_counter()
    summary = ShipSummary()
    # The files may carry the user's metrics: the data root learns them first.
    record_metrics(root, recorded_metrics(spool))
    with root.journal(f"ship-{node}", datasets, holder=f"`gpufail ship` of node {node}") as journal:
        state = journal.state or {}
        shipped = set(state.get("shipped", []))
        present, waiting = _spool_files(spool, datasets)
        summary.waiting = len(waiting)
        # Gone from the spool: never listed again, so no longer needed to keep it from being shipped twice.
        shipped &= present | waiting
        todo = sorted(present - shipped)
        for i in range(0, len(todo), batch_files):
            batch = todo[i : i + batch_files]
            staging = journal.staging()
            staged = []
            for relative in batch:
                staged.append(_copy(spool, root, relative, staging.prefix))
                summary.bytes += spool.fs.size(spool.path(relative))
            shipped |= set(batch)
            journal.commit({"version": STATE_VERSION, "shipped": sorted(shipped)}, staged=staged)
            summary.files += len(batch)
            summary.commits += 1
        cutoff = ((now or datetime.now(UTC)).astimezone(UTC) - keep).date()
        removed = {relative for relative in shipped if _day_of(relative) < cutoff}
        for relative in sorted(removed):
            path = spool.path(relative)
            with guarded("remove a shipped file from the spool", path):
                if spool.fs.exists(path):
                    spool.fs.rm(path)
        if removed:
            # Only once they are gone (a kill in between: the next run sees them gone).
            journal.commit({"version": STATE_VERSION, "shipped": sorted(shipped - removed)})
            summary.removed_from_spool = len(removed)
    summary.seconds = time.perf_counter() - began
    return summary


def _spool_files(spool: Store, datasets: Sequence[str]) -> tuple[set[str], set[str]]:
    """(committed files under their visible names, committed files still under hidden names) of
    the spool, relative to it."""
    base = spool.path() + "/"
    present: set[str] = set()
    waiting: set[str] = set()
    for dataset in datasets:
        for path in spool.files(dataset):
            relative = path.removeprefix(base)
            (waiting if relative.rsplit("/", 1)[-1].startswith(".") else present).add(relative)
    return present, waiting


def _copy(spool: Store, root: Store, relative: str, prefix: str) -> str:
    """Copy a spool file to its hidden name of this commit in the data root (through a temporary
    name of the same commit, which the journal deletes if a kill cuts the copy short); returns
    that hidden path."""
    folder, name = root.path(relative).rsplit("/", 1)
    hidden = f"{folder}/{prefix}{name}"
    source = spool.path(relative)
    with guarded("read a spool file", source):
        data = spool.fs.cat_file(source)
    tmp = f"{folder}/{prefix}tmp-{uuid.uuid4().hex}"
    with guarded("copy a spool file to", folder):
        root.fs.makedirs(folder, exist_ok=True)
        with root.fs.open(tmp, "wb") as fh:
            fh.write(data)
            if root.is_local:
                fh.flush()
                os.fsync(fh.fileno())
        root.fs.mv(tmp, hidden)
    return hidden


def _day_of(relative: str) -> date:
    return date.fromisoformat(relative.split("/date=", 1)[1].split("/", 1)[0])
