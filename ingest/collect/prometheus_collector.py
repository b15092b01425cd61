"""The Prometheus collector: the newest dcgm-exporter samples a Prometheus server holds, every
interval, from one central process (`gpufail collect --source prometheus`): a fleet that
already scrapes dcgm-exporter needs no gpufail agent on its GPU nodes.

Each call reads the samples stamped after the last call's end, up to `LAG` before now (a
scrape's samples are stamped when it starts and stored when it ends), and maps them as `gpufail
ingest prometheus` does (`ingest.prometheus_rows`): at their own timestamps, XID changes as
events. The end reached is the collector's state, committed with the rows (`Resumable`): a
restart reads on from there, neither losing nor repeating a sample; after a long stop it
catches up `MAX_CATCH_UP` at a time (`backlog`). With no state it starts one interval back:
history is the importer's business.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ingest.collect.base import Clock, Collected, CollectorError, SystemClock
from ingest.dcgm_scrape import metric_by_name
from ingest.errors import GpufailError
from ingest.prometheus_api import PrometheusClient
from ingest.prometheus_import import parse_selector
from ingest.prometheus_labels import GpuKey, LabelMap
from ingest.prometheus_rows import XID_METRICS, SeriesCounts, map_series, xid_changes
from ingest.store import Store

LAG = timedelta(seconds=10)
MAX_CATCH_UP = timedelta(hours=1)
"""The longest span one call reads; more waits for the next call of the same tick."""
STATE_VERSION = 1


class PrometheusCollector:
    """Telemetry and XID events of the DCGM series `match` selects on a Prometheus server."""

    name = "prometheus"

    def __init__(
        self,
        client: PrometheusClient,
        *,
        labels: LabelMap,
        interval: timedelta,
        match: str = "",
        clock: Clock | None = None,
        lag: timedelta = LAG,
        store: Store | None = None,
    ) -> None:
        self.client = client
        self.labels = labels
        self.interval = interval
        self.clock = clock or SystemClock()
        self.lag = lag
        name, body = parse_selector(match)
        names = sorted(set(metric_by_name()) | XID_METRICS)
        if name is not None:
            names = [n for n in names if n == name]
        alternatives = "|".join(names)
        self.selector = "{" + ",".join(p for p in (f'__name__=~"{alternatives}"', body) if p) + "}"
        self.series_counts = SeriesCounts()
        """What the mapping read and left out since the collector was made."""
        self._cursor_ms: int | None = None
        self._xid_last: dict[GpuKey, float] = {}
        self._backlog = False
        self._store = store
        self._resumed = False

    def collect(self) -> Collected:
        newest = int((self.clock.now() - self.lag).timestamp() * 1000)
        start = self._cursor_ms if self._cursor_ms is not None else newest - int(self.interval.total_seconds() * 1000)
        end = min(newest, start + int(MAX_CATCH_UP.total_seconds() * 1000))
        self._backlog = end < newest
        if end <= start:
            return {}
        try:
            series = self.client.samples(self.selector, start, end)
        except GpufailError as exc:
            raise CollectorError(f"prometheus collector: {exc}") from None
        mapped = map_series(series, self.labels, self.series_counts)
        if self._resumed:
            mapped.telemetry = self._not_yet_stored(mapped.telemetry, start, end)
            self._resumed = False
        events = xid_changes(mapped.xids, self._xid_last, self.series_counts)
        self._cursor_ms = end
        out: dict[str, pa.Table] = {"telemetry": mapped.telemetry}
        if events.num_rows:
            out["xid_events"] = events
        return out

    @property
    def backlog(self) -> bool:
        return self._backlog

    def state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "cursor_ms": self._cursor_ms,
            "xid_last": [[*key, value] for key, value in self._xid_last.items()],
        }

    def restore(self, state: dict[str, Any] | None) -> None:
        if not state or state.get("version") != STATE_VERSION:
            return
        cursor = state.get("cursor_ms")
        self._cursor_ms = int(cursor) if isinstance(cursor, int) else None
        self._resumed = self._cursor_ms is not None
        self._xid_last = {(str(c), str(n), int(i), str(u)): float(v) for c, n, i, u, v in state.get("xid_last", [])}

    def _not_yet_stored(self, telemetry: pa.Table, start: int, end: int) -> pa.Table:
        """`telemetry` without the rows the store holds already. The daemon commits telemetry
        before the collectors' states (`ingest.collect.daemon`): a kill between the two leaves
        rows past the committed end, which the first read after the restart must not repeat."""
        if self._store is None or telemetry.num_rows == 0 or not self._store.exists("telemetry"):
            return telemetry
        held = self._store.read(
            "telemetry",
            start=datetime.fromtimestamp(start / 1000, UTC),
            end=datetime.fromtimestamp((end + 1) / 1000, UTC),
            columns=["ts", "gpu_uuid"],
        )
        if held.num_rows == 0:
            return telemetry
        stored = _row_keys(held)
        return telemetry.filter(pc.invert(pc.is_in(_row_keys(telemetry), value_set=stored)))

    def close(self) -> None:
        pass


def _row_keys(table: pa.Table) -> pa.Array:
    stamps = pc.cast(pc.cast(table["ts"], pa.int64()), pa.string())
    return pc.binary_join_element_wise(table["gpu_uuid"], stamps, "@")
