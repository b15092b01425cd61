"""The collector daemon's write buffer: rows held in memory between flushes to the store.

Rows are appended per dataset and flushed together when the buffer holds `flush_rows` rows or
`flush_interval` has passed (and when the daemon stops). A flush writes new part files through
`Store.write` (temporary name, then rename), one per dataset and UTC day, so it never touches
the files of earlier flushes and a kill leaves no partial file. What a kill loses is the
unflushed buffer: at most `flush_rows` rows, or `flush_interval` of collection.

If the store cannot be written (disk full, bucket unreachable), the rows stay in the buffer and
the next flush retries; beyond `max_rows` the oldest batches are dropped and counted, so memory
stays bounded however long the store is down.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from ingest.store import Store

# Datasets are flushed in this order: telemetry first, so that XID events flushed at the same
# time can be mapped to GPUs from it; collector_runs last, as the record of the rest.
FLUSH_ORDER = ("telemetry", "xid_events", "collector_runs")


@dataclass
class FlushResult:
    rows: dict[str, int]
    files: int


class WriteBuffer:
    """Per-dataset batches of rows waiting to be written."""

    def __init__(self, max_rows: int) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows}: expected at least 1")
        self.max_rows = max_rows
        self.dropped_rows = 0
        self._batches: dict[str, deque[pa.Table]] = {}
        self._rows = 0

    @property
    def rows(self) -> int:
        return self._rows

    def add(self, dataset: str, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        self._batches.setdefault(dataset, deque()).append(table)
        self._rows += table.num_rows
        while self._rows > self.max_rows:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        # The oldest batch of the largest dataset: telemetry is the bulk and the least precious
        # (the next sample replaces it); XID events are kept as long as possible.
        dataset = max(self._batches, key=lambda d: (d != "xid_events", sum(t.num_rows for t in self._batches[d])))
        table = self._batches[dataset].popleft()
        if not self._batches[dataset]:
            del self._batches[dataset]
        self._rows -= table.num_rows
        self.dropped_rows += table.num_rows

    def flush(self, store: Store, prepare: Callable[[str, pa.Table], pa.Table] | None = None) -> FlushResult:
        """Write every dataset's rows as new part files; a dataset leaves the buffer only once
        its files are written, so an error keeps the unwritten datasets for the next flush."""
        written: dict[str, int] = {}
        files = 0
        for dataset in sorted(self._batches, key=_flush_rank):
            batches = self._batches[dataset]
            table = pa.concat_tables(batches)
            if prepare is not None:
                table = prepare(dataset, table)
            files += len(store.write(dataset, table))
            del self._batches[dataset]
            self._rows -= table.num_rows
            written[dataset] = table.num_rows
        return FlushResult(written, files)


def _flush_rank(dataset: str) -> tuple[int, str]:
    return (FLUSH_ORDER.index(dataset) if dataset in FLUSH_ORDER else len(FLUSH_ORDER), dataset)
