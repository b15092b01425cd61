"""The live kernel-log collector: new XID lines from a `LogSource` -> `xid_events` rows.

Each `collect()` reads one piece of the lines written since the last call (at most
`read_lines`), parses it with the batch parser (`ingest.kernel_log_parser`) and folds floods with its
`deduplicate`. While the source holds more, `backlog` is true and the daemon flushes what came
back and calls again, up to `max_lines` lines per interval; so a large backlog never sits in
memory whole. An incident stays open in memory until no later line can join it: until its
dedup window has passed on the clock, or, while a backlog is being read, until the log itself
has moved past its window. A flood that spans many intervals or pieces is therefore about one
row per (GPU, XID) and window, as in `gpufail ingest kernel-log` (an incident cut by a piece
or interval boundary may take in lines up to two windows after its first, where the batch
ingest would start a second row; every line is counted once either way), and floods cost
memory per open incident, not per line.

Never replay, never lose: the collector stores nothing itself. Its `state()`
(the source's cursor and the incidents still open) is committed by the daemon together with
the rows it covers (the store's journal, `ingest.journal`), and handed back through
`restore()` at the next start. Lines after the committed cursor are read again after a kill and give the same rows,
since they are read in the same pieces from the same open incidents.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa

from ingest.collect.base import Clock, Collected, CollectorError, SystemClock
from ingest.collect.log_sources import Cursor, LogSource
from ingest.kernel_log_import import events_table
from ingest.kernel_log_parser import ParseStats, XidIncident, deduplicate, parse_lines
from ingest.store import Store
from ingest.time_bounds import plausible

# Where gpufail before the daemon's commit record kept this collector's state; read once when
# the daemon has committed none, so an upgrade resumes where the previous version stopped.
LEGACY_STATE_PREFIX = "collect_kernel_log"
STATE_VERSION = 1
# Lines read per interval: bounds the work of one interval when a flood or a first run finds a
# large backlog; the rest is read in the next intervals.
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
        read_lines: int | None = None,
    ) -> None:
        if max_lines < 1:
            raise ValueError(f"max_lines={max_lines}: expected at least 1")
        if read_lines is not None and read_lines < 1:
            raise ValueError(f"read_lines={read_lines}: expected at least 1")
        self.store = store
        self.source = source
        self.cluster = cluster
        self.node = node
        self.window = dedup_window
        self.clock = clock or SystemClock()
        self.tz = tz
        self.max_lines = max_lines
        # Every read asks for the same number of lines, whatever is left of an interval's
        # `max_lines`: a restart then reads a backlog in the same pieces as an uninterrupted run.
        self.read_lines = min(read_lines or max_lines, max_lines)
        self.source_label = f"collect:{source.name}"
        self.lines_read = 0
        self.lines_rejected = 0
        self.lines_cut = 0
        self.lost_records = 0
        self.untimed_records = 0
        self.implausible_records = 0
        self._cursor: Cursor | None = None
        self._open: dict[_Key, XidIncident] = {}
        self._restored = False
        self._committed: dict[str, Any] | None = None
        self._more = False
        self._run_lines = 0

    # -- the Collector interface -------------------------------------------------------------

    def collect(self) -> Collected:
        if not self._restored:
            self._resume()
        if not self.backlog:
            self._run_lines = 0  # a new interval's share of `max_lines`
        chunk = self.source.read(self._cursor, self.read_lines)
        self.lines_read += len(chunk.lines)
        self._run_lines += len(chunk.lines)
        self.lost_records += chunk.lost
        self.lines_cut += chunk.cut
        now = self.clock.now()
        stats = ParseStats()
        records = parse_lines(chunk.lines, boot_time=chunk.boot_time, reference_time=now, tz=self.tz, stats=stats)
        incidents = list(deduplicate(records, self.window, node=self.node))
        self.lines_rejected += stats.rejected
        incidents = self._plausible(incidents, now)
        emitted = list(self._fold(incidents))
        # With more lines waiting, an incident may still grow from them: close only what the
        # log has moved past (lines come in time order), not what the clock has.
        newest = max((i.last_ts for i in incidents if i.last_ts is not None), default=None)
        if chunk.exhausted:
            emitted += self._expire(now)
        elif newest is not None:
            emitted += self._expire(min(now, newest))
        self._cursor = chunk.cursor
        self._more = not chunk.exhausted
        return {"xid_events": self._table(emitted)}

    @property
    def backlog(self) -> bool:
        return self._more and self._run_lines < self.max_lines

    def drain(self) -> Collected:
        """Emit the incidents still open (the daemon calls this when it stops)."""
        emitted = sorted(self._open.values(), key=lambda i: i.ts)  # type: ignore[arg-type, return-value]
        self._open.clear()
        return {"xid_events": self._table(emitted)}

    def state(self) -> dict[str, Any]:
        """The cursor and the open incidents; valid once everything `collect` and `drain`
        returned so far is in the store (the daemon commits the two together)."""
        if not self._restored:
            # Nothing read yet: what was committed before stays as it was.
            return self._committed if self._committed is not None else self._legacy_state() or {}
        return {
            "version": STATE_VERSION,
            "source": self.source.name,
            "cursor": self._cursor,
            "open": [_incident_json(i) for i in self._open.values()],
        }

    def restore(self, state: dict[str, Any] | None) -> None:
        """Resume from a committed `state()` at the first `collect()`; None: from the state an
        earlier gpufail kept in `_state/collect_kernel_log-<node>.json`, if any."""
        self._committed = state
        self._restored = False

    def counts(self) -> dict[str, dict[str, int]]:
        return {
            "log_lines": {"parsed": self.lines_read - self.lines_rejected, "rejected": self.lines_rejected},
            # Also among the lines above (their kept part was parsed): counted apart.
            "long_lines": {self.source.name: self.lines_cut},
            "left_out": {"implausible_time": self.implausible_records},
        }

    def close(self) -> None:
        self.source.close()

    def _plausible(self, incidents: list[XidIncident], now: datetime) -> list[XidIncident]:
        """`incidents` less those dated before 2010 or far ahead of this node's clock (a garbled
        or unset stamp: 1970, 2099), which are counted (`ingest.time_bounds`)."""
        kept = [i for i in incidents if i.ts is None or plausible(i.ts, now)]
        self.implausible_records += sum(i.repeat_count for i in incidents) - sum(i.repeat_count for i in kept)
        return kept

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

    def _expire(self, horizon: datetime) -> list[XidIncident]:
        """Open incidents whose window ends before `horizon`: no later line can join them."""
        closed = [key for key, i in self._open.items() if i.ts + self.window < horizon]  # type: ignore[operator]
        return sorted((self._open.pop(key) for key in closed), key=lambda i: i.ts)  # type: ignore[arg-type, return-value]

    def _table(self, incidents: list[XidIncident]) -> pa.Table:
        return events_table(incidents, cluster=self.cluster, source=self.source_label)

    # -- restart --------------------------------------------------------------------------

    def _legacy_state(self) -> dict[str, Any] | None:
        return self.store.read_state(f"{LEGACY_STATE_PREFIX}-{self.node}")

    def _resume(self) -> None:
        state = self._committed if self._committed is not None else self._legacy_state()
        self._restored = True
        if not state or state.get("version") != STATE_VERSION or state.get("source") != self.source.name:
            return
        self._cursor = state.get("cursor")
        try:
            restored = [_incident_from_json(item) for item in state.get("open", [])]
        except (KeyError, TypeError, ValueError) as exc:
            raise CollectorError(
                f"kernel-log collector: the committed state of {self.node} has an unreadable open incident "
                f"({exc}); expected the collector's own state"
            ) from None
        for incident in restored:
            self._open[(incident.node, incident.pci_bus_id, incident.xid)] = incident


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
