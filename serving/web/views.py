"""What each page shows, as plain values for its template: pure functions of the serving
snapshot and of what `serving.web.reads` and `serving.web.history` return. Nothing here
renders HTML except the charts (`serving.web.svg`)."""

from __future__ import annotations

import os
import re
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

import numpy as np
import polars as pl

from ingest.errors import InputError
from ingest.urls import redact_urls
from ingest.xid_catalog import xid_catalogue
from serving.api_state import Fleet, ServedModel
from serving.display import EXPLAINED, fmt_value
from serving.policy import ACTING_TIERS, TIERS, PolicyConfig, tier_rank
from serving.web import svg
from serving.web.history import DailyCounts
from serving.web.reads import PublishState, source_metric

DEFAULT_ROWS = 50
"""GPUs on a page of the at-risk table: the riskiest first, the rest a page at a time."""
MAX_ROWS = 5000
PAGE_SIZES = (50, 100, 500, 2000, 5000)
MAX_PAGE = 1_000_000
SORTS = ("risk", "node_risk", "tier", "node", "gpu_index", "gpu_uuid", "cluster")
"""Columns the at-risk table sorts by (each ties on fleet rank)."""
TIER_COLORS = {
    "none": "#9aa0a6",
    "watch": "#c9a400",
    "avoid": "#e8710a",
    "drain_after_job": "#d93025",
    "drain_now": "#8b0000",
}
DRIVERS = 4
"""Features charted on a node page."""


# -- formatting --------------------------------------------------------------------------------


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""Control characters but tab and newline: a kernel log line can carry NUL runs and terminal
escapes (ESC), which a page must show, not pass to the browser."""


def visible_controls(value: Any) -> Any:
    """A string with its control characters written as `\\xNN`; anything else as it is. The
    pages' templates apply it to every value they print (before HTML escaping)."""
    if isinstance(value, str) and not hasattr(value, "__html__"):
        return _CONTROL.sub(lambda m: f"\\x{ord(m.group(0)):02x}", value)
    return value


def fmt_time(moment: Any) -> str:
    if moment is None:
        return "—"
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    return f"{moment.astimezone(UTC):%Y-%m-%d %H:%M}Z"


def fmt_duration(d: timedelta) -> str:
    hours = d.total_seconds() / 3600
    if hours >= 48 and hours % 24 == 0:
        return f"{hours / 24:.0f} days"
    return f"{hours:g} h"


def fmt_age(seconds: float) -> str:
    if seconds < 0:
        return "in the future"
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 2 * 86_400:
        return f"{seconds / 3600:.1f} h ago"
    return f"{seconds / 86_400:.1f} days ago"


_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])/[^\s'\"`:,;()\[\]<>]+")


def without_paths(text: str, data_root: str) -> str:
    """`text` as a page shows it: paths within the data root relative to it, and any other
    absolute path by its last part only (a page tells the folder layout of no machine)."""
    for root in dict.fromkeys([data_root.rstrip("/"), os.path.realpath(data_root)]):
        if root.startswith("/") and len(root) > 1:
            text = text.replace(root + "/", "").replace(root, "the data root")
    return _ABSOLUTE_PATH.sub(lambda m: "…/" + m.group(0).rstrip("/").rsplit("/", 1)[-1], text)


def reference_time(fleet_ts: Any, now: datetime) -> datetime:
    """Where the pages' time windows end: now, unless the served features are more than two
    days old (replayed or simulated data), then just after their grid time."""
    if fleet_ts is None:
        return now
    ts = fleet_ts.to_pydatetime() if hasattr(fleet_ts, "to_pydatetime") else fleet_ts
    return now if now - ts < timedelta(days=2) else ts + timedelta(hours=1)


@cache
def feature_meaning(name: str) -> str:
    """What a feature column means, with its unit and window (`features.dictionary`); '' for a
    name the dictionary does not know (a model trained with other windows)."""
    from features.dictionary import describe

    try:
        doc = describe(name)
    except ValueError:
        return ""
    return f"{doc.meaning} ({doc.unit}; window {doc.window})"


# -- the at-risk table -------------------------------------------------------------------------


@dataclass(frozen=True)
class AtRiskQuery:
    q: str = ""
    """Case-insensitive substring of the node, the GPU uuid or a top feature's name."""
    tier: str = ""
    """The weakest tier shown ('' = every GPU)."""
    cluster: str = ""
    sort: str = "risk"
    order: str = "desc"
    limit: int = DEFAULT_ROWS
    """GPUs per page."""
    page: int = 1
    """Which page of `limit` GPUs, from 1."""

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> AtRiskQuery:
        """From the page's query parameters; `InputError` naming the parameter otherwise."""
        q = params.get("q", "").strip()[:200]
        tier = params.get("tier", "")
        if tier and tier not in TIERS:
            raise InputError(f"query parameter tier: expected one of {', '.join(TIERS)}, got {tier[:50]!r}")
        sort = params.get("sort", "risk")
        if sort not in SORTS:
            raise InputError(f"query parameter sort: expected one of {', '.join(SORTS)}, got {sort[:50]!r}")
        order = params.get("order", "desc" if sort in ("risk", "node_risk", "tier") else "asc")
        if order not in ("asc", "desc"):
            raise InputError(f"query parameter order: expected asc or desc, got {order[:50]!r}")
        raw = params.get("limit", str(DEFAULT_ROWS))
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_ROWS:
            raise InputError(f"query parameter limit: expected a whole number from 1 to {MAX_ROWS}, got {raw[:50]!r}")
        page = params.get("page", "1")
        if not page.isdigit() or not 1 <= int(page) <= MAX_PAGE:
            raise InputError(f"query parameter page: expected a whole number from 1 to {MAX_PAGE:,}, got {page[:50]!r}")
        return cls(q, tier, params.get("cluster", "")[:200], sort, order, int(raw), int(page))

    def params(self, **changes: Any) -> dict[str, str]:
        """The query parameters of this view with `changes`, defaults left out."""
        values = {**self.__dict__, **changes}
        default = AtRiskQuery()
        out = {}
        for key in ("q", "tier", "cluster", "sort", "order", "limit", "page"):
            if values[key] != getattr(default, key) or (key == "order" and values["sort"] != default.sort):
                out[key] = str(values[key])
        return out


def _sort_key(sort: str) -> Any:
    if sort == "tier":
        return lambda r: tier_rank(r["tier"])
    if sort == "node":
        return lambda r: (r["cluster"], r["node"], r["gpu_index"])
    return lambda r: r[sort]


def at_risk(fleet: Fleet, query: AtRiskQuery) -> tuple[list[int], int]:
    """The fleet positions of the at-risk table's rows on the query's page, in order, and how
    many GPUs matched in all. Sorting by risk descending is the fleet's own order."""
    needle = query.q.lower()
    floor = tier_rank(query.tier) if query.tier else 0
    positions: list[int] = []
    for i, rec in enumerate(fleet.records):
        if floor and tier_rank(rec["tier"]) < floor:
            continue
        if query.cluster and rec["cluster"] != query.cluster:
            continue
        if needle and not (
            needle in rec["node"].lower()
            or needle in rec["gpu_uuid"].lower()
            or any(needle in e["feature"].lower() for e in fleet.explanations[i][:EXPLAINED])
        ):
            continue
        positions.append(i)
    if not (query.sort == "risk" and query.order == "desc"):
        key = _sort_key(query.sort)
        # Python's sort is stable in both directions: ties stay in fleet rank order.
        positions.sort(key=lambda i: key(fleet.records[i]), reverse=query.order == "desc")
    start = (query.page - 1) * query.limit
    return positions[start : start + query.limit], len(positions)


@dataclass(frozen=True)
class Pager:
    """Where a page of the at-risk table sits among the matching GPUs."""

    first: int
    """The position of its first row among them, from 1 (0: the page is empty)."""
    last: int
    matched: int
    previous: dict[str, str] | None
    """The query parameters of the page before (None on the first)."""
    next: dict[str, str] | None
    pages: int


def pager(query: AtRiskQuery, shown: int, matched: int) -> Pager:
    start = (query.page - 1) * query.limit
    pages = max(1, -(-matched // query.limit))
    return Pager(
        first=start + 1 if shown else 0,
        last=start + shown,
        matched=matched,
        previous=query.params(page=min(query.page - 1, pages)) if query.page > 1 else None,
        next=query.params(page=query.page + 1) if start + shown < matched else None,
        pages=pages,
    )


# -- the fleet overview ------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetSummary:
    gpus_by_tier: dict[str, int]
    nodes_by_tier: dict[str, int]
    clusters: list[str]
    n_gpus: int
    n_nodes: int


_last_summary: list[tuple[weakref.ref[Fleet], FleetSummary]] = []


def summary(fleet: Fleet) -> FleetSummary:
    """Counts by tier, computed once per scored fleet (the last one is remembered; a Fleet is
    replaced, never changed)."""
    if _last_summary and _last_summary[0][0]() is fleet:
        return _last_summary[0][1]
    gpus = Counter(r["tier"] for r in fleet.records)
    nodes = Counter(n["node_tier"] for n in fleet.nodes.values())
    found = FleetSummary(
        gpus_by_tier={t: gpus.get(t, 0) for t in TIERS},
        nodes_by_tier={t: nodes.get(t, 0) for t in TIERS},
        clusters=sorted({c for c, _ in fleet.nodes}),
        n_gpus=len(fleet.records),
        n_nodes=len(fleet.nodes),
    )
    _last_summary[:] = [(weakref.ref(fleet), found)]
    return found


def model_card(served: ServedModel, model_name: str) -> dict[str, Any]:
    """The served model: identity, training window and data, and its evaluation metrics
    (registry runs carry them; a model folder does not), the held-out model's first."""
    m = served.model
    metrics = served.info.get("metrics") or {}
    ordered = sorted(metrics.items(), key=lambda kv: (not kv[0].startswith("model."), kv[0]))
    return {
        "name": model_name,
        "version": served.version,
        "registry_version": served.info.get("registry_version"),
        "alias": served.info.get("alias"),
        "source": served.info.get("source"),
        "path": served.info.get("path"),
        "kind": m.kind,
        "train_start": fmt_time(m.train_start),
        "train_end": fmt_time(m.train_end),
        "train_days": (m.train_end - m.train_start).total_seconds() / 86_400,
        "horizon_h": m.horizon.total_seconds() / 3600,
        "n_rows": m.n_rows,
        "n_positives": m.n_positives,
        "n_features": len(m.feature_columns),
        "trained_at": fmt_time(m.trained_at),
        "loaded_at": fmt_time(served.loaded_at),
        "metrics": [(k.removeprefix("model."), fmt_value(v)) for k, v in ordered],
    }


def alarms_chart(counts: DailyCounts) -> dict[str, Any]:
    groups = [
        ("GPU alarms", counts.gpu_alarms, TIER_COLORS["avoid"]),
        ("node alarms", counts.node_alarms, "#7b3f00"),
        ("failed GPUs", counts.failed_gpus, "#5f6368"),
    ]
    return {
        "svg": svg.bar_chart(counts.days, groups, title="alarms and failures per day"),
        "legend": [(label, sum(values), color) for label, values, color in groups],
        "days": len(counts.days),
        "first": counts.days[0] if counts.days else None,
        "last": counts.days[-1] if counts.days else None,
        "alarm_tier": counts.alarm_tier,
        "alarm_threshold": counts.alarm_threshold,
        "snapshots": counts.snapshots,
    }


# -- the node page -----------------------------------------------------------------------------


def node_gpus(fleet: Fleet, node: dict[str, Any]) -> list[dict[str, Any]]:
    """The node's GPUs by slot, each with its full record and explanation."""
    out = []
    for g in node["gpus"]:
        i = fleet.index[g["gpu_uuid"]]
        out.append({**fleet.records[i], "top_features": fleet.explanations[i]})
    return sorted(out, key=lambda r: r["gpu_index"])


def driving_features(gpus: Sequence[dict[str, Any]], limit: int = DRIVERS) -> list[str]:
    """The features that push the node's GPUs' risk up most: each GPU's top features, summed by
    positive contribution, largest first."""
    weight: Counter[str] = Counter()
    for g in gpus:
        for e in g["top_features"][: EXPLAINED + 2]:
            if e["contribution"] > 0:
                weight[e["feature"]] += e["contribution"]
    return [f for f, _ in weight.most_common(limit)]


def data_window(series: Sequence[svg.Series], window: tuple[float, float]) -> tuple[float, float]:
    """The window's end, and its start or the first sample if later (a GPU with a short
    history is drawn across the chart, not squeezed into its right edge)."""
    firsts = [float(s.t[0]) for s in series if len(s.t)]
    return (max(window[0], min(firsts)) if firsts else window[0], window[1])


def _gpu_series(frame: pl.DataFrame, column: str, gpus: Sequence[dict[str, Any]]) -> list[svg.Series]:
    out = []
    for g in gpus:
        part = frame.filter(pl.col("gpu_uuid") == g["gpu_uuid"])
        if part.height == 0 or column not in part.columns:
            continue
        t = part["ts"].dt.epoch("us").to_numpy() / 1e6
        y = part[column].cast(pl.Float64).fill_null(float("nan")).to_numpy()
        out.append(svg.Series(f"GPU {g['gpu_index']} ({g['gpu_uuid']})", t, y, svg.color_for(g["gpu_index"])))
    return out


def risk_chart(history: pl.DataFrame, gpus: Sequence[dict[str, Any]], tiers: PolicyConfig, window: tuple) -> str:
    series = _gpu_series(history, "risk", gpus)
    top = max([0.0, *(float(np.nanmax(s.y)) for s in series if len(s.y))])
    first = tiers.tiers[0].enter
    y1 = min(1.0, max(top * 1.15, first * 1.1, 0.01))
    lines = [svg.HLine(t.enter, f"{t.name} {t.enter:g}", TIER_COLORS[t.name]) for t in tiers.tiers]
    return svg.line_chart(
        series,
        width=560,
        height=190,
        t_range=data_window(series, window),
        y_range=(0.0, y1),
        hlines=lines,
        value_format=lambda v: f"{v:.2g}",
        title="risk of each GPU over time",
    )


def feature_charts(
    frame: pl.DataFrame, columns: Sequence[str], gpus: Sequence[dict[str, Any]], window: tuple
) -> dict[str, str]:
    """Column -> a chart of its values, one line per GPU."""
    out = {}
    for c in columns:
        series = _gpu_series(frame, c, gpus)
        out[c] = svg.line_chart(series, width=360, height=120, t_range=data_window(series, window), title=c)
    return out


def telemetry_metrics(features: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(m for m in (source_metric(f) for f in features) if m is not None))


def drivers_view(
    drivers: Sequence[str], feature_charts: Mapping[str, str] | None, telemetry_charts: Mapping[str, str] | None
) -> list[dict[str, Any]]:
    """Per driving feature: its chart and, when it summarises one metric, that metric's raw chart."""
    out = []
    for f in drivers:
        metric = source_metric(f)
        out.append(
            {
                "feature": f,
                "meaning": feature_meaning(f),
                "chart": (feature_charts or {}).get(f),
                "metric": metric,
                "raw": (telemetry_charts or {}).get(metric) if metric else None,
            }
        )
    return out


def xid_rows(events: pl.DataFrame, failure_xids: Sequence[int]) -> list[dict[str, Any]]:
    catalogue, failing = xid_catalogue(), set(failure_xids)
    rows = []
    for e in events.iter_rows(named=True):
        info = catalogue.get(int(e["xid"]))
        rows.append(
            {
                **e,
                "time": fmt_time(e["ts"]),
                "mnemonic": info.mnemonic if info else "unknown code",
                "xid_class": info.xid_class if info else "other",
                "action": info.immediate_action if info else "",
                "failure": int(e["xid"]) in failing,
            }
        )
    return rows


def audit_rows(frame: pl.DataFrame) -> list[dict[str, Any]]:
    # Rows written before results masked their URLs may still quote a webhook's key.
    masked = [name for name in ("result", "reason") if name in frame.columns]
    return [
        {**r, "when": fmt_time(r["time"]), **{name: redact_urls(r[name] or "") for name in masked}}
        for r in frame.iter_rows(named=True)
    ]


# -- publish state -----------------------------------------------------------------------------


@dataclass(frozen=True)
class BreakerView:
    name: str
    target: str
    mode: str
    error: str = ""
    tripped: bool = False
    tripped_at: str = ""
    reason: str = ""
    raised: int = 0
    limit: int | None = None
    applied: dict[str, int] = field(default_factory=dict)
    acting_nodes: list[tuple[str, str, str, str]] = field(default_factory=list)
    """(cluster, node, applied tier, since) of nodes the scheduler was told to act on."""
    dry_run: DryRunView | None = None
    """Where only dry runs have published: what the newest would have done."""


@dataclass(frozen=True)
class DryRunView:
    at: str
    """When it ran ('' when no dry run is in the window read)."""
    tiers: dict[str, int] = field(default_factory=dict)
    """Nodes per tier it decided (`none` left out)."""
    actions: dict[str, int] = field(default_factory=dict)
    acting_nodes: list[tuple[str, str, str]] = field(default_factory=list)
    """(cluster, node, tier) of the nodes it would have had the scheduler act on."""


def dry_run_view(rows: pl.DataFrame | None) -> DryRunView:
    """A dry run's decisions (`reads.last_dry_runs`) as the state it would have published."""
    if rows is None or rows.height == 0:
        return DryRunView(at="")
    tiers = Counter(t for t in rows["tier"].to_list() if t != "none")
    acting = sorted(
        ((c, n, t) for c, n, t in rows.select("cluster", "node", "tier").iter_rows() if t in ACTING_TIERS),
        key=lambda r: (-tier_rank(r[2]), r[0], r[1]),
    )
    return DryRunView(
        at=fmt_time(rows["time"].max()),
        tiers={t: tiers[t] for t in TIERS if tiers.get(t)},
        actions=dict(sorted(Counter(rows["action"].to_list()).items())),
        acting_nodes=acting,
    )


def breaker_views(
    states: Sequence[PublishState],
    tiers: PolicyConfig,
    fleet_nodes: int | None,
    now: datetime,
    dry_runs: Mapping[str, pl.DataFrame] | None = None,
) -> list[BreakerView]:
    """One view per publish state; `dry_runs` (target -> its newest dry run's audit rows) shows
    what a target published only in dry runs would have done."""
    out = []
    for s in states:
        target = s.name.removeprefix("publish-")
        mode = "shadow" if target.endswith("-shadow") else "live"
        target = target.removesuffix("-shadow")
        if s.dry_run_only:
            out.append(BreakerView(s.name, target, "dry-run", dry_run=dry_run_view((dry_runs or {}).get(target))))
            continue
        if s.policy is None:
            out.append(BreakerView(s.name, target, mode, error=s.error))
            continue
        p = s.policy
        window_start = now - tiers.breaker_window
        applied = Counter(n.applied for n in p.nodes.values() if n.applied != "none")
        acting = sorted(
            (
                (*key.split("/", 1), n.applied, fmt_time(n.changed_at or n.since))
                for key, n in p.nodes.items()
                if n.applied in ACTING_TIERS
            ),
            key=lambda r: (-tier_rank(r[2]), r[0], r[1]),
        )
        out.append(
            BreakerView(
                s.name,
                target,
                mode,
                tripped=p.breaker.tripped,
                tripped_at=fmt_time(p.breaker.tripped_at),
                reason=p.breaker.reason,
                raised=len({key for at, key in p.breaker.raised if at > window_start}),
                limit=None if fleet_nodes is None else tiers.breaker_limit(fleet_nodes),
                applied={t: applied[t] for t in TIERS if applied.get(t)},
                acting_nodes=[(c, n, t, since) for c, n, t, since in acting],  # type: ignore[misc]
            )
        )
    return out


def published_tiers(states: Sequence[PublishState], cluster: str, node: str) -> list[dict[str, Any]]:
    """The node's tier in each publish state (policy tier and what the scheduler was told)."""
    key, out = f"{cluster}/{node}", []
    for s in states:
        if s.policy is None:
            continue
        n = s.policy.nodes.get(key)
        if n is not None:
            out.append({"state": s.name, "tier": n.tier, "applied": n.applied, "since": fmt_time(n.since)})
    return out


# -- the publish audit -------------------------------------------------------------------------

AUDIT_ACTIONS = ("raise", "lower", "breaker_held", "cooldown_held", "skip", "keep")


def notable(audit: pl.DataFrame) -> pl.DataFrame:
    """Audit rows of decisions that change or hold something: all but `keep` (every publish
    run records one for each node whose tier stays)."""
    return audit.filter(pl.col("action") != "keep")


def action_counts(audit: pl.DataFrame) -> dict[str, int]:
    found = dict(audit.group_by("action").len().iter_rows()) if audit.height else {}
    return {a: int(found.get(a, 0)) for a in AUDIT_ACTIONS}


@dataclass(frozen=True)
class AuditQuery:
    days: int = 7
    action: str = ""
    """'' = every decision but keep (`notable`), 'all', or one action."""
    mode: str = ""
    target: str = ""
    q: str = ""
    """Case-insensitive substring of the node."""

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> AuditQuery:
        raw = params.get("days", "7")
        if not raw.isdigit() or not 1 <= int(raw) <= 90:
            raise InputError(f"query parameter days: expected a whole number from 1 to 90, got {raw[:50]!r}")
        action = params.get("action", "")
        if action not in ("", "all", *AUDIT_ACTIONS):
            raise InputError(
                f"query parameter action: expected all or one of {', '.join(AUDIT_ACTIONS)}, got {action[:50]!r}"
            )
        mode = params.get("mode", "")
        if mode not in ("", "live", "shadow", "dry-run"):
            raise InputError(f"query parameter mode: expected live, shadow or dry-run, got {mode[:50]!r}")
        return cls(int(raw), action, mode, params.get("target", "")[:100], params.get("q", "").strip()[:200])

    def actions(self) -> list[str] | None:
        """The actions to read (None: all)."""
        if self.action == "all":
            return None
        return [self.action] if self.action else [a for a in AUDIT_ACTIONS if a != "keep"]

    def select(self, audit: pl.DataFrame) -> pl.DataFrame:
        """The rows of `audit` this query shows (its action filter may already be applied)."""
        wanted = self.actions()
        rows = audit if wanted is None else audit.filter(pl.col("action").is_in(wanted))
        if self.mode:
            rows = rows.filter(pl.col("mode") == self.mode)
        if self.target:
            rows = rows.filter(pl.col("target") == self.target)
        if self.q:
            rows = rows.filter(pl.col("node").str.to_lowercase().str.contains(self.q.lower(), literal=True))
        return rows
