"""The metric names gpufail exports, as Prometheus sees them (counters with `_total`,
histograms as `_bucket`, `_sum` and `_count`), from the registries the code serves, and the
metric names an alert rule or dashboard expression reads."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# PromQL words that look like metric names but are functions, keywords or aggregations.
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "offset", "rate", "irate", "increase", "delta", "time", "absent", "absent_over_time",
    "last_over_time", "max_over_time",
    "histogram_quantile", "le", "bool", "topk", "bottomk", "humanizeDuration", "changes", "resets",
}  # fmt: skip
COLLECTOR_CONTRACT = {
    "gpufail_collector_collections_total",
    "gpufail_collector_collection_duration_seconds_bucket",
    "gpufail_collector_collection_duration_seconds_sum",
    "gpufail_collector_collection_duration_seconds_count",
    "gpufail_collector_last_success_timestamp_seconds",
    "gpufail_collector_rows_buffered",
    "gpufail_collector_last_flush_timestamp_seconds",
    "gpufail_collector_flush_failures_total",
    "gpufail_collector_log_lines_total",
    "gpufail_collector_nvml_errors_total",
}
"""What the collect daemon's /metrics serves by its contract (branch h-collect), used where its
code (`ingest.collect.observe`) is not in this tree yet."""


def exposed(registry: Any) -> set[str]:
    names = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        elif family.type == "summary":
            names |= {family.name, family.name + "_sum", family.name + "_count"}
        else:
            names.add(family.name)
    return names


def server_metrics(tmp: Path) -> set[str]:
    """Every name `gpufail serve`'s /metrics can carry (with no model nor data, each family is
    still described)."""
    from gpufail.config import load_settings
    from ingest.store import Store
    from serving.api_metrics import ApiMetrics
    from serving.api_state import FeatureStore, ModelFolder, ServeOptions, ServingState

    root = str(tmp / "data")
    Store.create(root)
    options = ServeOptions(data_root=root, tiers=load_settings(environ={}).publish.policy_config())
    metrics = ApiMetrics()
    metrics.watch(ServingState(options, ModelFolder(tmp / "model"), FeatureStore(root)), top=5)
    return exposed(metrics.registry)


def collector_metrics() -> set[str]:
    try:
        from ingest.collect.observe import DaemonMetrics  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return COLLECTOR_CONTRACT
    return exposed(DaemonMetrics([]).registry)


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label names, label values and functions are not)."""
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    without_labels = re.sub(r"\{[^}]*\}", "", without_strings)
    without_groupings = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", without_labels)
    without_ranges = re.sub(r"\[[^\]]*\]", "", without_groupings)
    words = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", without_ranges))
    return {w for w in words - PROMQL_WORDS if not w.startswith("__") and not re.fullmatch(r"\d+[smhdwy]", w)}


def server_app_routes() -> set[str]:
    """The paths `gpufail serve`'s app answers."""
    from gpufail.config import load_settings
    from serving.api import create_app
    from serving.api_state import ModelFolder, ServeOptions

    options = ServeOptions(data_root="unused", tiers=load_settings(environ={}).publish.policy_config())
    app = create_app(options, ModelFolder("unused"))
    return {getattr(route, "path", "") for route in app.routes}
