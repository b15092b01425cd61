"""The small pieces of markup the pages repeat (tier badges, risk bars, feature chips, node
links) and the at-risk table's rows, written in Python rather than in the templates: a row
is ~20 escaped values, and rendering 500 of them through template macros took ~0.2 ms each,
most of the fleet page's time. A row depends only on its scored GPU, so rows are also kept
per snapshot (`RowCache`) and a page reuses them until the fleet is scored again. The
templates use the same functions (registered as globals), so each piece has one markup."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence
from functools import cache
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from markupsafe import Markup

from serving.api_state import Fleet
from serving.display import EXPLAINED, fmt_risk, fmt_value
from serving.policy import TIERS, PolicyConfig
from serving.web.views import TIER_COLORS, feature_meaning


@cache
def tier_badge(tier: str) -> Markup:
    return Markup(f'<span class="tier t-{escape(tier)}">{escape(tier.replace("_", " "))}</span>')


RISK_BAR_WIDTH = 48


def risk_bar(risk: float) -> Markup:
    """The risk as a bar, linear from 0 (empty) to 1 (full): its length is the chance of failing,
    so a 0.007 risk is a sliver, never half a bar (`risk_legend` says so above the table)."""
    width = min(max(risk, 0.0), 1.0) * RISK_BAR_WIDTH if math.isfinite(risk) else 0.0
    return Markup(
        f'<svg class="bar" width="{RISK_BAR_WIDTH}" height="8" aria-hidden="true">'
        f'<rect class="track" width="{RISK_BAR_WIDTH}" height="8"/><rect width="{width:.1f}" height="8"/></svg>'
    )


def risk_legend(tiers: PolicyConfig) -> Markup:
    """The risk bar's scale, drawn as the bar is (linear, 0 to 1) at three times its width, with
    each tier's enter threshold marked in its colour."""
    scale = 3 * RISK_BAR_WIDTH
    marks = "".join(
        f'<line x1="{t.enter * scale:.1f}" x2="{t.enter * scale:.1f}" y1="0" y2="12" stroke="{TIER_COLORS[t.name]}" '
        f'stroke-width="2"><title>{escape(t.name.replace("_", " "))} from {t.enter:g}</title></line>'
        for t in tiers.tiers
        if 0.0 <= t.enter <= 1.0
    )
    named = ", ".join(
        f'<span class="tier t-{escape(t.name)}">{escape(t.name.replace("_", " "))}</span> from {t.enter:g}'
        for t in tiers.tiers
    )
    return Markup(
        f'<span class="risk-legend" id="risk-legend">risk bar: 0 <svg class="bar legend-bar" width="{scale}" '
        f'height="12" aria-hidden="true"><rect class="track" y="2" width="{scale}" height="8"/>{marks}</svg> 1, '
        f"linear (its length is the chance of failing within the horizon); tiers: {named}</span>"
    )


def feature_chips(explanation: Sequence[dict[str, Any]]) -> Markup:
    parts = []
    for e in explanation:
        name, value, c = escape(e["feature"]), escape(fmt_value(e["value"])), e["contribution"]
        up = c > 0
        meaning = feature_meaning(e["feature"])
        parts.append(
            f'<span class="feat {"up" if up else "down"}" title="{name} = {value}; contribution {c:+.3g} '
            f'({"raises" if up else "lowers"} the risk){escape(": " + meaning) if meaning else ""}">'
            f"{name} <b>{value}</b></span>"
        )
    return Markup("".join(parts))


def node_href(cluster: str, node: str) -> str:
    return f"/nodes/{quote(node, safe='')}?{urlencode({'cluster': cluster})}"


def node_link(cluster: str, node: str) -> Markup:
    return Markup(f'<a href="{escape(node_href(cluster, node))}">{escape(node)}</a>')


def gpu_row(rec: dict[str, Any], explanation: Sequence[dict[str, Any]], with_cluster: bool) -> str:
    """One `<tr>` of the at-risk table. The `data-s-*` attributes are the values the page's
    script sorts by (the same orders as the server's `?sort=`); `data-search`, what its live
    filter matches."""
    cluster, node, uuid = escape(rec["cluster"]), escape(rec["node"]), escape(rec["gpu_uuid"])
    top = explanation[:EXPLAINED]
    search = escape(" ".join([rec["node"].lower(), rec["gpu_uuid"].lower(), *(e["feature"].lower() for e in top)]))
    risk, node_risk = rec["risk"], rec["node_risk"]
    return (
        f'<tr data-gpu="{uuid}" data-risk="{risk!r}" data-tier="{rec["tier"]}" data-node="{node}" data-cluster="{cluster}" '
        f'data-rank="{rec["fleet_rank"]}" data-s-risk="{risk!r}" data-s-node_risk="{node_risk!r}" '
        f'data-s-tier="{TIERS.index(rec["tier"])}" data-s-gpu_index="{rec["gpu_index"]}" data-s-gpu_uuid="{uuid}" '
        f'data-s-cluster="{cluster}" data-s-node="{cluster}&#9;{node}&#9;{rec["gpu_index"]:06d}" data-search="{search}">'
        + (f"<td>{cluster}</td>" if with_cluster else "")
        + f'<td class="num muted">{rec["fleet_rank"]}</td>'
        f'<td class="node">{node_link(rec["cluster"], rec["node"])}</td>'
        f'<td class="num">{rec["gpu_index"]}</td>'
        f"<td><code>{uuid}</code></td>"
        f'<td class="num risk">{fmt_risk(risk)} {risk_bar(risk)}</td>'
        f"<td>{tier_badge(rec['tier'])}</td>"
        f'<td class="num">{fmt_risk(node_risk)}</td>'
        f"<td>{tier_badge(rec['node_tier'])}</td>"
        f'<td class="why">{feature_chips(top)}</td></tr>\n'
    )


class RowCache:
    """The at-risk rows of the current fleet, rendered on first use. A new fleet (a reload)
    starts an empty cache; the previous one is dropped with its fleet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fleet: weakref.ref[Fleet] | None = None
        self._rows: dict[tuple[int, bool], str] = {}

    def rows(self, fleet: Fleet, positions: Sequence[int], with_cluster: bool) -> Markup:
        with self._lock:
            if self._fleet is None or self._fleet() is not fleet:
                self._fleet, self._rows = weakref.ref(fleet), {}
            rows = self._rows
        out = []
        for i in positions:
            key = (i, with_cluster)
            html = rows.get(key)
            if html is None:
                html = rows[key] = gpu_row(fleet.records[i], fleet.explanations[i], with_cluster)
            out.append(html)
        return Markup("".join(out))
