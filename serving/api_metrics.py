"""Prometheus metrics of the REST endpoint (`GET /metrics`), in a registry of its own.

Request counts and latencies are labelled by route template (`/v1/nodes/{node}`, not the node),
method and status, so their label sets are bounded by the API. Risk gauges are read from the
current snapshot at scrape time and cover only the [serve] metrics_top riskiest GPUs and nodes
(a fleet of 30,000 GPUs must not become 30,000 series), plus the number of GPUs per tier.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client import Counter as PromCounter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from serving.api_state import ServingState

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class ApiMetrics:
    def __init__(self) -> None:
        # `*_created` timestamps double the series and say nothing a scraper needs.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = PromCounter(
            "gpufail_http_requests", "HTTP requests served", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "gpufail_http_request_duration_seconds",
            "Time to answer an HTTP request (server side)",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.reloads = PromCounter(
            "gpufail_model_reloads", "Model and feature reloads by result", ["result"], registry=self.registry
        )

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)

    def watch(self, state: ServingState, top: int) -> None:
        self.registry.register(_SnapshotCollector(state, top))


class _SnapshotCollector(Collector):
    def __init__(self, state: ServingState, top: int) -> None:
        self.state, self.top = state, top

    def collect(self) -> Iterator[Any]:
        snap = self.state.snapshot
        info = GaugeMetricFamily(
            "gpufail_model_info", "The served model (value 1)", labels=["version", "kind", "source"]
        )
        if snap.served is not None:
            m = snap.served.model
            info.add_metric([snap.served.version, m.kind, str(snap.served.info["source"])], 1.0)
        yield info
        ready, _ = self.state.readiness()
        yield GaugeMetricFamily("gpufail_ready", "1 when /readyz answers ready", value=float(ready))
        age = GaugeMetricFamily("gpufail_features_age_seconds", "Age of the newest features' grid time")
        if snap.features is not None and snap.features.ts is not None:
            age.add_metric([], time.time() - snap.features.ts.timestamp())
        yield age
        gpu = GaugeMetricFamily(
            "gpufail_gpu_risk",
            "Risk of the riskiest GPUs ([serve] metrics_top)",
            labels=["cluster", "node", "gpu_uuid"],
        )
        node = GaugeMetricFamily(
            "gpufail_node_risk", "Risk of the riskiest nodes ([serve] metrics_top)", labels=["cluster", "node"]
        )
        tiers = GaugeMetricFamily("gpufail_gpus_by_tier", "GPUs per risk tier of their own risk", labels=["tier"])
        fleet = snap.fleet
        if fleet is not None:
            for rec in fleet.records[: self.top]:
                gpu.add_metric([rec["cluster"], rec["node"], rec["gpu_uuid"]], rec["risk"])
            for n in sorted(fleet.nodes.values(), key=lambda n: n["node_rank"])[: self.top]:
                node.add_metric([n["cluster"], n["node"]], n["node_risk"])
            for tier, count in sorted(Counter(r["tier"] for r in fleet.records).items()):
                tiers.add_metric([tier], count)
        yield gpu
        yield node
        yield tiers


class MetricsMiddleware:
    """Pure ASGI (no per-request task or body copy): times each HTTP request and counts it by
    route template once the router has matched it."""

    def __init__(self, app: Callable[..., Any], metrics: ApiMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]

        async def send_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.observe(scope["method"], template, status[0], time.perf_counter() - started)
