"""What the collect daemon tells its operators: Prometheus metrics, /healthz and /readyz.

`DaemonMetrics` holds the metrics in a registry of its own; the daemon updates them as it
collects and flushes, and the counts kept by the collectors themselves (kernel-log lines,
NVML call errors; `Counting`) are read when Prometheus scrapes. `Health` is the state the two
probes answer from. `ObservabilityServer` serves all three on `[collect] listen` from a thread
of its own, so a slow scrape never delays a collection. docs/collector.md lists the metrics.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector as PromCollector

from ingest.collect.base import Clock, Collector, Counting
from ingest.errors import InputError

DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# /healthz fails when no source has succeeded within this many intervals.
HEALTHY_INTERVALS = 3
# A scrape or probe that sends nothing for this long is dropped (a stuck client holds a thread).
REQUEST_TIMEOUT_S = 10.0
# `Counting` kinds -> (metric name without _total, help, label name).
COUNTED = {
    "log_lines": ("gpufail_collector_log_lines", "Kernel-log lines read, by parser outcome", "outcome"),
    "nvml_errors": ("gpufail_collector_nvml_errors", "NVML calls that failed, by NVML function", "call"),
    "out_of_range": (
        "gpufail_collector_out_of_range_readings",
        "Readings left missing as not finite or outside their metric's valid range, by telemetry column",
        "metric",
    ),
    "left_out": (
        "gpufail_collector_xid_records_left_out",
        "XID records of the kernel log left out, by reason (implausible_time: dated before 2010 or ahead of the clock)",
        "reason",
    ),
    "long_lines": (
        "gpufail_collector_long_lines",
        "Kernel-log lines longer than ingest.line_stream.MAX_LINE_BYTES, cut to it as they were read, by source",
        "source",
    ),
}


class DaemonMetrics:
    """The daemon's Prometheus metrics; names are what deploy/ alert rules and dashboards use."""

    def __init__(self, collectors: Sequence[Collector]) -> None:
        # `*_created` timestamps double the series and say nothing a scraper needs.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.collections = PromCounter(
            "gpufail_collector_collections",
            "Collections by source and outcome (ok or error)",
            ["source", "outcome"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "gpufail_collector_collection_duration_seconds",
            "Time one collection of a source took",
            ["source"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.last_success = Gauge(
            "gpufail_collector_last_success_timestamp_seconds",
            "Unix time of the source's last successful collection",
            ["source"],
            registry=self.registry,
        )
        self.rows_buffered = Gauge(
            "gpufail_collector_rows_buffered", "Rows read and not yet written to the store", registry=self.registry
        )
        self.last_flush = Gauge(
            "gpufail_collector_last_flush_timestamp_seconds",
            "Unix time of the last flush that reached the store",
            registry=self.registry,
        )
        self.flush_failures = PromCounter(
            "gpufail_collector_flush_failures", "Flushes the store refused", registry=self.registry
        )
        # Every series exists from the start, at 0; children looked up once, not per collection.
        self._children: dict[str, tuple[Any, Any, Any]] = {}
        for collector in collectors:
            self._series(collector.name)
        self.registry.register(_CollectorCounts(collectors))

    def _series(self, source: str) -> tuple[Any, Any, Any]:
        if source not in self._children:
            self._children[source] = (
                self.collections.labels(source, "ok"),
                self.collections.labels(source, "error"),
                self.duration.labels(source),
            )
        return self._children[source]

    def collected(self, source: str, ok: bool, seconds: float, at: datetime) -> None:
        ok_count, error_count, duration = self._series(source)
        (ok_count if ok else error_count).inc()
        duration.observe(seconds)
        if ok:
            # Created at the first success: a source that never succeeded has no timestamp.
            self.last_success.labels(source).set(at.timestamp())

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _CollectorCounts(PromCollector):
    """The collectors' own cumulative counts, read at scrape time (nothing per line or call)."""

    def __init__(self, collectors: Sequence[Collector]) -> None:
        self.counting = [c for c in collectors if isinstance(c, Counting)]

    def collect(self) -> Iterator[CounterMetricFamily]:
        totals: dict[str, dict[str, int]] = {}
        for collector in self.counting:
            for kind, by_label in collector.counts().items():
                into = totals.setdefault(kind, {})
                for label, count in dict(by_label).items():
                    into[label] = into.get(label, 0) + count
        for kind, (name, help_text, label) in COUNTED.items():
            family = CounterMetricFamily(name, help_text, labels=[label])
            for value, count in sorted(totals.get(kind, {}).items()):
                family.add_metric([value], count)
            yield family


class Health:
    """What /healthz and /readyz answer; updated by the daemon's loop, read by the server's
    threads (hence the lock)."""

    def __init__(self, clock: Clock, interval_s: float, sources: Sequence[str]) -> None:
        self.clock = clock
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._sources: dict[str, dict[str, Any]] = {
            s: {"last_success": None, "last_error": None, "_mono": None} for s in sources
        }
        self._ticks = 0
        self._rows_buffered = 0
        self._last_flush: datetime | None = None
        self._flush_error: str | None = None

    def collected(self, source: str, error: str | None) -> None:
        with self._lock:
            entry = self._sources.setdefault(source, {"last_success": None, "last_error": None, "_mono": None})
            if error is None:
                entry["last_success"], entry["_mono"] = self.clock.now(), self.clock.monotonic()
            else:
                entry["last_error"] = error

    def ticked(self, rows_buffered: int) -> None:
        with self._lock:
            self._ticks += 1
            self._rows_buffered = rows_buffered

    def flushed(self, rows_buffered: int, error: str | None) -> None:
        with self._lock:
            self._rows_buffered = rows_buffered
            self._flush_error = error
            if error is None:
                self._last_flush = self.clock.now()

    def healthz(self) -> tuple[int, dict[str, Any]]:
        """200 when a source succeeded within `HEALTHY_INTERVALS` intervals and the last flush
        attempt did not fail; 503 with the reasons otherwise."""
        with self._lock:
            now = self.clock.monotonic()
            recent = [
                name
                for name, s in self._sources.items()
                if s["_mono"] is not None and now - s["_mono"] <= HEALTHY_INTERVALS * self.interval_s
            ]
            reasons = []
            if not recent:
                errors = "; ".join(f"{n}: {s['last_error']}" for n, s in self._sources.items() if s["last_error"])
                reasons.append(
                    f"no source succeeded in the last {HEALTHY_INTERVALS} intervals "
                    f"({HEALTHY_INTERVALS * self.interval_s:g} s)" + (f" ({errors})" if errors else "")
                )
            if self._flush_error is not None:
                reasons.append(f"the last flush failed: {self._flush_error}")
            body: dict[str, Any] = {
                "status": "unhealthy" if reasons else "ok",
                "sources": {
                    name: {
                        "last_success": s["last_success"].isoformat() if s["last_success"] else None,
                        "last_error": s["last_error"],
                    }
                    for name, s in self._sources.items()
                },
                "rows_buffered": self._rows_buffered,
                "last_flush": self._last_flush.isoformat() if self._last_flush else None,
            }
            if reasons:
                body["reasons"] = reasons
            return (503 if reasons else 200), body

    def readyz(self) -> tuple[int, dict[str, Any]]:
        """200 once the first collection round has completed."""
        with self._lock:
            ready = self._ticks > 0
            body = {"status": "ready" if ready else "starting", "ticks": self._ticks}
            return (200 if ready else 503), body


def parse_listen(text: str) -> tuple[str, int] | None:
    """`[collect] listen` -> (host, port); None for "" (serve nothing)."""
    text = text.strip()
    if not text:
        return None
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InputError(
            f"[collect] listen = {text!r}: expected host:port such as 127.0.0.1:9410 (port 0: any free one), "
            'or "" to serve no metrics'
        )
    return host, int(port)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], metrics: DaemonMetrics, health: Health) -> None:
        import socket

        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.metrics = metrics
        self.health = health
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT_S

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, self.server.metrics.exposition(), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/readyz"):
            status, body = self.server.health.healthz() if path == "/healthz" else self.server.health.readyz()
            self._send(status, json.dumps(body).encode(), "application/json")
        else:
            self._send(404, b'{"error": "not found; try /metrics, /healthz or /readyz"}', "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not worth a line


class ObservabilityServer:
    """/metrics, /healthz and /readyz over HTTP, in a background thread."""

    def __init__(self, listen: str, metrics: DaemonMetrics, health: Health) -> None:
        address = parse_listen(listen)
        if address is None:
            raise ValueError("ObservabilityServer needs an address; check parse_listen first")
        try:
            self._server = _Server(address, metrics, health)
        except OSError as exc:
            raise InputError(
                f"[collect] listen = {listen!r}: cannot serve metrics there ({exc.strerror or exc}); "
                'expected a free local address, or "" to serve no metrics'
            ) from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="collect-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = str(self._server.server_address[0]), self._server.server_address[1]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
