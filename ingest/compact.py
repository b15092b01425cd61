"""`gpufail compact`: a settled day's many small part files rewritten as a few large ones.

Why: every collector commits a part file per dataset at every flush (five minutes), so a fleet
of 1,000 nodes leaves ~288,000 files a day in each of `telemetry`, `xid_events` and
`collector_runs`; every reader lists and opens them all, and the features build sorts a day
whose GPUs are spread over hundreds of files. Compaction rewrites a day into files of whole
nodes, each sorted by (cluster, node, gpu_uuid, ts), the order the features readers check for
before sorting (`features.windows.in_gpu_and_time_order`), in the store's row groups, so that
node statistics let a reader of some nodes skip the rest.

How it stays exactly once: each day is one commit of the journal `compact-<dataset>`
(`ingest.journal`), whose new files replace the files they were read from. Readers see the old
files or the new ones, never both or neither, whatever point compaction is killed at; a rerun
finishes the last commit and compacts what is left; a day of only the files its last compaction
wrote (the journal's state names them) is done. The replaced files linger for
`READER_GRACE` (the journal's `linger_s`), so a reader that listed them just before the commit
still opens them. Only committed files under their visible names are read: a collector's commit
in flight, or a file another commit is removing, waits for the next run. Files written to the
day meanwhile are not touched (the next run takes them in). A day is left alone until `settle`
after its end, while collectors still write to it. Every file's checksum is verified before its
rows are rewritten: a corrupt file stops compaction with the store's message, instead of its
damage being sealed under a new checksum.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING

import pyarrow as pa

from ingest.collect.buffer import FLUSH_ORDER
from ingest.errors import InputError
from ingest.journal import READER_GRACE_S
from ingest.schema import schema_for
from ingest.store import ROW_GROUP_SIZE, Store

if TYPE_CHECKING:
    import polars as pl  # imported where used: a collector may be installed without it

DATASETS = FLUSH_ORDER
"""What collectors write every flush, and so what compaction takes by default."""
DEFAULT_SETTLE = timedelta(hours=6)
FILE_ROWS = 4 * ROW_GROUP_SIZE
"""Rows per compacted file at most (whole nodes; a node with more gets a file of its own): the
rows compaction holds in memory at once, and what a reader decodes for one node at worst."""
READ_FILES = 5000
"""Files compaction reads into one frame at a time (`_read`)."""
READER_GRACE = timedelta(seconds=READER_GRACE_S)
"""How long replaced files stay on disk for readers that listed them before the commit."""
ORDER = ("cluster", "node", "gpu_uuid", "ts")
STATE_VERSION = 1
"""The journal's state: {"version", "compacted": {day: the names of the files it wrote}}."""


@dataclass
class CompactSummary:
    """What a compaction did, per dataset."""

    days: dict[str, int] = field(default_factory=dict)
    files_read: dict[str, int] = field(default_factory=dict)
    files_written: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    unsettled: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        done = [
            f"{d} {self.files_read[d]:,} files -> {self.files_written[d]:,} ({self.rows[d]:,} rows, "
            f"{self.days[d]} day{'s' if self.days[d] != 1 else ''})"
            for d in self.days
        ]
        text = "; ".join(done) if done else "nothing to compact"
        if self.unsettled:
            text += f"; left until settled: {', '.join(self.unsettled)}"
        return f"compact: {text} in {self.seconds:.1f}s"


def compact(
    store: Store,
    datasets: Sequence[str] = DATASETS,
    *,
    settle: timedelta = DEFAULT_SETTLE,
    now: datetime | None = None,
    first_day: date | None = None,
    last_day: date | None = None,
    file_rows: int = FILE_ROWS,
    linger: timedelta = READER_GRACE,
) -> CompactSummary:
    """Compact every day of `datasets` within [first_day, last_day] (each optional) that ended
    at least `settle` before `now` (default: the clock) and has two or more files."""
    began = time.perf_counter()
    for dataset in datasets:
        try:
            schema_for(dataset)
        except ValueError as exc:
            raise InputError(f"compact: {exc}") from None
    if file_rows < 1:
        raise InputError(f"compact: file_rows = {file_rows}; expected at least 1")
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    summary = CompactSummary()
    for dataset in datasets:
        with store.journal(
            f"compact-{dataset}", [dataset], holder=f"`gpufail compact` of {dataset}", linger_s=linger.total_seconds()
        ) as journal:
            # The files each day's last compaction wrote: a day of only those is done.
            compacted: dict[str, list[str]] = dict((journal.state or {}).get("compacted", {}))
            for day in store.dates(dataset):
                if (first_day and day < first_day) or (last_day and day > last_day):
                    continue
                if _day_end(day) + settle > moment:
                    summary.unsettled.append(f"{dataset} {day}")
                    continue
                files = [f for f in store.files(dataset, day, day) if not _name(f).startswith(".")]
                if len(files) < 2 or {_name(f) for f in files} <= set(compacted.get(str(day), [])):
                    continue
                staging = journal.staging()
                written, rows = [], 0
                for table in _node_groups(store, dataset, files, file_rows):
                    written.append(staging.write_part_of_day(dataset, day, table))
                    rows += table.num_rows
                compacted[str(day)] = sorted(_name(staging.visible(path)) for path in written)
                journal.commit({"version": STATE_VERSION, "compacted": compacted}, staged=written, replaces=files)
                summary.days[dataset] = summary.days.get(dataset, 0) + 1
                summary.files_read[dataset] = summary.files_read.get(dataset, 0) + len(files)
                summary.files_written[dataset] = summary.files_written.get(dataset, 0) + len(written)
                summary.rows[dataset] = summary.rows.get(dataset, 0) + rows
    summary.seconds = time.perf_counter() - began
    return summary


def _node_groups(store: Store, dataset: str, files: list[str], file_rows: int) -> Iterator[pa.Table]:
    """The rows of `files`, in tables of whole nodes of at most `file_rows` rows (one node may
    have more), each sorted by `ORDER` (ties in the order read), through the store's read path
    (each file's checksum and columns checked first: damage is named, never sealed under a new
    checksum). A table's read skips the files of other nodes by their statistics (a collector's
    file holds one node)."""
    import polars as pl

    expected = schema_for(dataset)
    order = [c for c in ORDER if c in expected.names]
    if "node" not in expected.names:
        yield _sorted(_read(store, dataset, files), order)
        return
    counts = store.collect(store.scan(dataset, columns=["node"], files=files).group_by("node").len(), dataset)
    groups: list[list[str]] = []
    held = 0
    for node, n in counts.sort("node").iter_rows():
        if not groups or held + n > file_rows:
            groups.append([])
            held = 0
        groups[-1].append(node)
        held += n
    for nodes in groups:
        yield _sorted(_read(store, dataset, files, pl.col("node").is_in(nodes)), order)


def _read(store: Store, dataset: str, files: list[str], where: pl.Expr | None = None) -> pl.DataFrame:
    """The rows of `files` (and `where`) in the order read, `READ_FILES` files at a time, each
    batch made contiguous before the next is read: a frame read from many files keeps a chunk of
    every column per file, about 40 KB a telemetry file of a few rows, and a day of a 1,000-node
    fleet's collectors is 288,000 files."""
    import polars as pl

    batches = [files[first : first + READ_FILES] for first in range(0, len(files), READ_FILES)] or [[]]
    return pl.concat(
        [store.collect(store.scan(dataset, where=where, files=batch), dataset).rechunk() for batch in batches]
    )


def _sorted(frame: pl.DataFrame, order: list[str]) -> pa.Table:
    import polars as pl

    # A stable sort: rows that tie keep the order they were read in.
    return frame.sort(order, maintain_order=True, nulls_last=True).to_arrow(compat_level=pl.CompatLevel.oldest())


def _name(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _day_end(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC) + timedelta(days=1)
