"""Prometheus metrics of the REST endpoint (`GET /metrics`), in a registry of its own.

Request counts and latencies are labelled by route template (`/v1/nodes/{node}`, not the node),
method and status, so their label sets are bounded by the API. Risk gauges are read from the
current snapshot at scrape time and cover only the [serve] metrics_top riskiest GPUs and nodes
(a fleet of 30,000 GPUs must not become 30,000 series), plus the number of GPUs per tier.

What the alerting rules (deploy/prometheus/) need from the jobs that share the server's data
root is read from the store at scrape time (`_StoreCollector`): the publish policy's state
(nodes per tier as the scheduler was last told, the circuit breaker and its budget), the nightly
job's state, and how many GPUs reported a failure XID in the last day. A store that cannot be
read leaves those series out (and logs why) rather than failing the scrape.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client import Counter as PromCounter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ingest.journal import state_without_commit
from serving.api_state import ServingState
from serving.policy import PolicyState

log = logging.getLogger(__name__)

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
        self.registry.register(_StoreCollector(state))


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


NIGHTLY_STATE = "nightly"
"""The nightly job's state file (`gpufail.nightly.STATE`, a layer above this one): `started_at`
and `completed_at` (ISO times) of the newest day's run, and `failed.step` while its last
attempt failed."""
PUBLISH_STATE_GLOB = "publish-*.json"
"""The publish policy's state files (`serving.publish.state_name`: one per target and mode)."""
FAILURE_WINDOW = timedelta(hours=24)


class _StoreCollector(Collector):
    def __init__(self, state: ServingState) -> None:
        self.state = state

    def collect(self) -> Iterator[Any]:
        from ingest.store import Store

        options = self.state.options
        try:
            store = Store.open(options.data_root)
        except Exception as exc:
            log.warning("metrics: the store %s cannot be opened: %s", options.data_root, exc)
            return
        yield from self._guarded("publish policy state", lambda: self._policy(store))
        yield from self._guarded("nightly state", lambda: self._nightly(store))
        yield from self._guarded("failure XIDs", lambda: self._failures(store))
        yield from self._guarded("kernel-log ingest state", lambda: self._kernel_logs(store))

    def _guarded(self, what: str, families: Callable[[], list[Any]]) -> list[Any]:
        try:
            return families()
        except Exception as exc:
            log.warning("metrics: %s not exported: %s", what, exc)
            return []

    def _policy(self, store: Any) -> list[Any]:
        published = GaugeMetricFamily(
            "gpufail_published_nodes",
            "Nodes per tier, as the scheduler was last told, by publish state (target and mode)",
            labels=["state", "tier"],
        )
        breaker_open = GaugeMetricFamily(
            "gpufail_breaker_open", "1 while the publish circuit breaker is open", labels=["state"]
        )
        raised = GaugeMetricFamily(
            "gpufail_breaker_raised_nodes",
            "Nodes raised into an acting tier within [publish] breaker_window (the breaker's budget in use)",
            labels=["state"],
        )
        limit = GaugeMetricFamily(
            "gpufail_breaker_limit_nodes",
            "The breaker's budget: nodes that may be raised within the window, for the scored fleet",
            labels=["state"],
        )
        config = self.state.options.tiers
        fleet = self.state.snapshot.fleet
        window_start = datetime.now(UTC) - config.breaker_window
        for path in sorted(store.fs.glob(store.path("_state", PUBLISH_STATE_GLOB))):
            name = path.rsplit("/", 1)[-1].removesuffix(".json")
            # A target only dry runs have published to has a commit record and no state: an
            # empty one (nothing applied, the breaker closed).
            policy = PolicyState.from_json(state_without_commit(json.loads(store.fs.cat_file(path))), path)
            tiers = Counter(node.applied for node in policy.nodes.values() if node.applied != "none")
            for tier, count in sorted(tiers.items()):
                published.add_metric([name, tier], count)
            breaker_open.add_metric([name], float(policy.breaker.tripped))
            raised.add_metric([name], len({key for at, key in policy.breaker.raised if at > window_start}))
            if fleet is not None:
                limit.add_metric([name], config.breaker_limit(len(fleet.nodes)))
        return [published, breaker_open, raised, limit]

    def _nightly(self, store: Any) -> list[Any]:
        started = GaugeMetricFamily(
            "gpufail_nightly_last_started_timestamp_seconds", "When the nightly job's newest day was first started"
        )
        completed = GaugeMetricFamily(
            "gpufail_nightly_last_completed_timestamp_seconds",
            "When the nightly job completed its newest day (absent while that day is not complete)",
        )
        failed = GaugeMetricFamily(
            "gpufail_nightly_failed", "1 while the nightly job's last attempt failed, by step", labels=["step"]
        )
        state = store.read_state(NIGHTLY_STATE)
        if state is not None:
            if state.get("started_at"):
                started.add_metric([], _timestamp(state["started_at"]))
            if state.get("completed_at"):
                completed.add_metric([], _timestamp(state["completed_at"]))
            if state.get("failed"):
                failed.add_metric([str(state["failed"].get("step", "unknown"))], 1.0)
        return [started, completed, failed]

    def _kernel_logs(self, store: Any) -> list[Any]:
        from ingest.kernel_log_import import STATE_NAME

        gauge = GaugeMetricFamily(
            "gpufail_kernel_log_unreadable_files",
            "Kernel-log files the last `ingest kernel-log` (or nightly ingest) could not read and skipped",
        )
        state = store.read_state(STATE_NAME)
        if state is not None:
            gauge.add_metric([], float(state.get("unreadable_count", 0)))
        return [gauge]

    def _failures(self, store: Any) -> list[Any]:
        import pyarrow.compute as pc

        gauge = GaugeMetricFamily(
            "gpufail_failed_gpus_24h",
            "GPUs with a failure XID (the served model's feature spec's failure_xids) in the store's xid_events "
            "within the last 24 h",
        )
        served = self.state.snapshot.served
        if served is None:
            return [gauge]  # no model, no failure XIDs to count by: no sample
        xids = served.model.feature_spec.failure_xids
        if not xids or not store.exists("xid_events"):
            gauge.add_metric([], 0.0)
            return [gauge]
        now = datetime.now(UTC)
        events = store.read(
            "xid_events",
            start=now - FAILURE_WINDOW,
            end=now,
            columns=["node", "pci_bus_id", "gpu_uuid"],
            filter=pc.field("xid").isin(list(xids)),
        )
        gpus = {
            uuid or f"{node}/{bus}"
            for node, bus, uuid in zip(
                events["node"].to_pylist(),
                events["pci_bus_id"].to_pylist(),
                events["gpu_uuid"].to_pylist(),
                strict=True,
            )
        }
        gauge.add_metric([], float(len(gpus)))
        return [gauge]


def _timestamp(iso: str) -> float:
    moment = datetime.fromisoformat(iso)
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


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
