"""The collector daemon's write buffer: rows held in memory between flushes to the store.

Rows are appended per dataset and committed by the daemon (`Daemon.flush`) when the buffer
holds `flush_rows` rows or `flush_interval` has passed (and when the daemon stops). The buffer
never drops a row: while the store cannot be written the rows stay, and the daemon
stops reading its sources once it holds too many, so memory stays bounded however long the
store is down.
"""

from __future__ import annotations

from collections import deque

import pyarrow as pa

# Datasets are flushed in this order: telemetry first, so that XID events flushed at the same
# time can be mapped to GPUs from it; collector_runs last, as the record of the rest.
FLUSH_ORDER = ("telemetry", "xid_events", "collector_runs")


class WriteBuffer:
    """Per-dataset batches of rows waiting to be written."""

    def __init__(self) -> None:
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

    def datasets(self) -> list[str]:
        """The datasets with rows, in `FLUSH_ORDER`."""
        return sorted(self._batches, key=_flush_rank)

    def table(self, dataset: str) -> pa.Table:
        batches = self._batches[dataset]
        if len(batches) > 1:  # concatenated once, not again at every retry
            combined = pa.concat_tables(batches)
            batches.clear()
            batches.append(combined)
        return batches[0]

    def remove(self, dataset: str) -> None:
        self._rows -= sum(t.num_rows for t in self._batches.pop(dataset))

    def describe(self) -> str:
        """`telemetry 1,200, xid_events 3`: what is held, for the daemon's reports."""
        return ", ".join(f"{d} {sum(t.num_rows for t in self._batches[d]):,}" for d in self.datasets()) or "nothing"


def _flush_rank(dataset: str) -> tuple[int, str]:
    return (FLUSH_ORDER.index(dataset) if dataset in FLUSH_ORDER else len(FLUSH_ORDER), dataset)
