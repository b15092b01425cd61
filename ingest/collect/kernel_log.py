"""The live kernel-log collector: new XID lines from a `LogSource` -> `xid_events` rows.

Each `collect()` reads the lines written since the last call (at most `max_lines`), parses them
with the batch parser (`ingest.kernel_log`) and folds floods with its `deduplicate`. An
incident stays open in memory until its dedup window has passed on the clock, so a flood that
spans many collection intervals still becomes one row per (GPU, XID) and window, as in
`gpufail ingest kernel-log`; floods therefore cost memory per open incident, not per line.

Never replay, never lose (DOMAIN.md 5). The daemon calls `checkpoint()` after each flush has
reached the store; it writes `_state/collect_kernel_log-<node>.json` with the source's cursor
and the incidents still open. So:
- a restart resumes after the last checkpointed line, with the open incidents restored;
- a kill loses at most the lines read since the last checkpoint, and those are read again
  (the cursor is older than them), so nothing is lost;
- lines read again whose incident already reached the store (a kill between a flush's Parquet
  rename and its checkpoint write) are recognised on restart: a line of the same node, bus id
  and XID whose time lies within a stored incident's [ts, last_ts] is dropped. No XID line is
  counted twice; at worst one incident is split into two rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from ingest.collect.base import Clock, Collected, CollectorError, SystemClock
from ingest.collect.log_sources import Cursor, LogSource
from ingest.kernel_log import ParseStats, XidIncident, XidRecord, deduplicate, parse_lines
from ingest.kernel_log_ingest import events_table
from ingest.store import Store

STATE_PREFIX = "collect_kernel_log"
STATE_VERSION = 1
# Lines read per collect(): bounds the memory of one read when a flood or a first run finds a
# large backlog; the rest is read by the next calls.
DEFAULT_MAX_LINES = 200_000

_Key = tuple[str | None, str, int]


class KernelLogCollector:
    """XID incidents from a live kernel log. See the module docstring for the guarantees."""

    name = "kernel-log"

    def __init__(
        self,
        store: Store,
        source: LogSource,
        *,
        cluster: str,
        node: str,
        dedup_window: timedelta,
        clock: Clock | None = None,
        tz: str | None = None,
        max_lines: int = DEFAULT_MAX_LINES,
    ) -> None:
        if max_lines < 1:
            raise ValueError(f"max_lines={max_lines}: expected at least 1")
        self.store = store
        self.source = source
        self.cluster = cluster
        self.node = node
        self.window = dedup_window
        self.clock = clock or SystemClock()
        self.tz = tz
        self.max_lines = max_lines
        self.source_label = f"collect:{source.name}"
        self.state_name = f"{STATE_PREFIX}-{node}"
        self.lines_read = 0
        self.lost_records = 0
        self.untimed_records = 0
        self._cursor: Cursor | None = None
        self._open: dict[_Key, XidIncident] = {}
        self._restored = False
        # Stored incidents of this node and source that lines read again after a restart may
        # belong to: key -> [(ts, last_ts)]. Emptied once the backlog is read.
        self._stored: dict[_Key, list[tuple[datetime, datetime]]] = {}

    # -- the Collector interface -------------------------------------------------------------

    def collect(self) -> Collected:
        if not self._restored:
            self._restore()
        chunk = self.source.read(self._cursor, self.max_lines)
        self.lines_read += len(chunk.lines)
        self.lost_records += chunk.lost
        now = self.clock.now()
        stats = ParseStats()
        records = parse_lines(chunk.lines, boot_time=chunk.boot_time, reference_time=now, tz=self.tz, stats=stats)
        emitted = list(self._fold(deduplicate(self._not_stored(records), self.window, node=self.node)))
        emitted += self._expire(now)
        self._cursor = chunk.cursor
        if chunk.exhausted:
            self._stored.clear()  # the backlog is read: later lines are new
        return {"xid_events": self._table(emitted)}

    def drain(self) -> Collected:
        """Emit the incidents still open (the daemon calls this when it stops)."""
        emitted = sorted(self._open.values(), key=lambda i: i.ts)  # type: ignore[arg-type, return-value]
        self._open.clear()
        return {"xid_events": self._table(emitted)}

    def checkpoint(self) -> None:
        """Record the cursor and the open incidents; call only once everything `collect` and
        `drain` returned so far is in the store."""
        if not self._restored:
            return
        self.store.write_state(
            self.state_name,
            {
                "version": STATE_VERSION,
                "source": self.source.name,
                "cursor": self._cursor,
                "open": [_incident_json(i) for i in self._open.values()],
            },
        )

    def close(self) -> None:
        self.source.close()

    # -- folding across calls -------------------------------------------------------------

    def _fold(self, incidents: Iterable[XidIncident]) -> Iterator[XidIncident]:
        """Merge this call's incidents into the open ones; yield the ones that closed."""
        for incident in incidents:
            if incident.ts is None:
                # kmsg or [uptime] stamps without a boot time: cannot be placed, not written.
                self.untimed_records += incident.repeat_count
                continue
            key = (incident.node, incident.pci_bus_id, incident.xid)
            current = self._open.get(key)
            if current is not None and _joins(current, incident, self.window):
                current.repeat_count += incident.repeat_count
                current.last_ts = max(current.last_ts, incident.last_ts)  # type: ignore[type-var]
                current.gpu_uuid = current.gpu_uuid or incident.gpu_uuid
                continue
            if current is not None:
                yield current
            self._open[key] = incident

    def _expire(self, now: datetime) -> list[XidIncident]:
        """Open incidents whose window has passed: no later line can join them."""
        closed = [key for key, i in self._open.items() if i.ts + self.window < now]  # type: ignore[operator]
        return sorted((self._open.pop(key) for key in closed), key=lambda i: i.ts)  # type: ignore[arg-type, return-value]

    def _table(self, incidents: list[XidIncident]) -> pa.Table:
        return events_table(incidents, cluster=self.cluster, source=self.source_label)

    # -- restart --------------------------------------------------------------------------

    def _restore(self) -> None:
        state = self.store.read_state(self.state_name)
        self._restored = True
        if not state or state.get("version") != STATE_VERSION or state.get("source") != self.source.name:
            return
        self._cursor = state.get("cursor")
        try:
            restored = [_incident_from_json(item) for item in state.get("open", [])]
        except (KeyError, TypeError, ValueError) as exc:
            raise CollectorError(
                f"kernel-log collector: {self.store.path('_state', self.state_name + '.json')}: "
                f"unreadable open incident ({exc}); expected the collector's own state"
            ) from None
        if not restored:
            self._load_stored(None)
            return
        self._load_stored(min(i.ts for i in restored if i.ts is not None))
        for incident in restored:
            if not self._already_stored(incident):
                self._open[(incident.node, incident.pci_bus_id, incident.xid)] = incident

    def _load_stored(self, since: datetime | None) -> None:
        """Remember the recent incidents this node and source already stored."""
        if not self.store.exists("xid_events"):
            return
        dates = self.store.dates("xid_events")
        # Lines read again come after the cursor: they are at most a flush interval older than
        # the last stored day, or belong to an open incident restored from `since`.
        start_day = dates[-1] - timedelta(days=1) if since is None else min(since.date(), dates[-1]) - timedelta(days=1)
        table = self.store.dataset("xid_events", start_day).to_table(
            columns=["ts", "last_ts", "node", "pci_bus_id", "xid"],
            filter=(ds.field("node") == self.node)
            & (ds.field("source") == self.source_label)
            & (ds.field("cluster") == self.cluster),
        )
        for row in table.to_pylist():
            key = (row["node"], row["pci_bus_id"], row["xid"])
            self._stored.setdefault(key, []).append((row["ts"], row["last_ts"]))

    def _already_stored(self, incident: XidIncident) -> bool:
        spans = self._stored.get((incident.node, incident.pci_bus_id, incident.xid), [])
        return any(first == incident.ts for first, _ in spans)

    def _not_stored(self, records: Iterable[XidRecord]) -> Iterator[XidRecord]:
        for record in records:
            if self._stored and record.ts is not None:
                spans = self._stored.get((record.host or self.node, record.pci_bus_id, record.xid))
                if spans and any(first <= record.ts <= last for first, last in spans):
                    continue
            yield record


def _joins(current: XidIncident, incident: XidIncident, window: timedelta) -> bool:
    same_gpu = current.gpu_uuid is None or incident.gpu_uuid is None or current.gpu_uuid == incident.gpu_uuid
    return same_gpu and abs(incident.ts - current.ts) <= window  # type: ignore[operator]


def _incident_json(incident: XidIncident) -> dict[str, Any]:
    return {
        "ts": incident.ts.isoformat() if incident.ts else None,
        "last_ts": incident.last_ts.isoformat() if incident.last_ts else None,
        "node": incident.node,
        "pci_bus_id": incident.pci_bus_id,
        "xid": incident.xid,
        "pid": incident.pid,
        "process": incident.process,
        "message": incident.message,
        "gpu_uuid": incident.gpu_uuid,
        "repeat_count": incident.repeat_count,
    }


def _incident_from_json(item: dict[str, Any]) -> XidIncident:
    return XidIncident(
        ts=datetime.fromisoformat(item["ts"]),
        last_ts=datetime.fromisoformat(item["last_ts"]),
        node=item["node"],
        pci_bus_id=str(item["pci_bus_id"]),
        xid=int(item["xid"]),
        pid=item["pid"],
        process=item["process"],
        message=str(item["message"]),
        gpu_uuid=item["gpu_uuid"],
        repeat_count=int(item["repeat_count"]),
        first_line_no=0,
    )
