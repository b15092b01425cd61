"""The operator's pages of `gpufail serve`: routes, access and rendering.

Access follows the read API's rule ([serve] read_requires_token): open, or the read or admin
token, which a browser shows with a cookie set by the sign-in form (`POST /login`) or, like a
script, sends as `Authorization: Bearer`. The cookie holds a session value derived from the
token, not the token (`serving.web.session`); it is HttpOnly and SameSite=Strict, and it opens
these pages only: the JSON API still wants the header, and the admin endpoints the admin
token in the header.

Pages render on the server from the serving snapshot (the fleet as scored once per model and
features version) and bounded reads of the store; each part that reads the store shows why
it could not instead of failing the page.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from functools import cache
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from features.spec import FeatureSpec
from ingest.errors import InputError
from serving import display
from serving.api_state import ServingState, Snapshot
from serving.policy import TIERS
from serving.web import history, html, reads, views
from serving.web.session import COOKIE, LIFETIME_S, session_ok, session_value

log = logging.getLogger("gpufail.serve")

LEGACY_COOKIE = "gpufail_token"
"""The cookie that held the raw token: removed at every sign-in and sign-out, never read."""
TEMPLATES = ("fleet.html", "node.html", "actions.html", "login.html", "error.html")
STATIC = {"web.css": "text/css; charset=utf-8", "web.js": "text/javascript; charset=utf-8"}
HISTORY_DAYS = 28
"""Days of alarms and failures on the fleet page."""
RISK_DAYS = 14
FEATURE_DAYS = 7
TELEMETRY_HOURS = 24
XID_DAYS = 30
XID_ROWS = 200
NODE_AUDIT_DAYS = 30
AUDIT_DAYS = 7
AUDIT_ROWS = 1000
DRY_RUN_DAYS = 30
"""How far back the actions page looks for the newest dry run of a target only dry runs published to."""
HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self' data:; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@cache
def _static(name: str) -> bytes:
    return resources.files("serving.web").joinpath("static", name).read_bytes()


@cache
def _templates() -> Any:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("serving.web", "templates"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
        finalize=views.visible_controls,
    )
    env.filters.update(
        risk=display.fmt_risk,
        value=display.fmt_value,
        time=views.fmt_time,
        path=lambda s: quote(str(s), safe=""),
        query=lambda d: urlencode(d),
        thousands=lambda n: f"{n:,}",
    )
    env.globals.update(
        tier_badge=html.tier_badge,
        risk_bar=html.risk_bar,
        feature_chips=html.feature_chips,
        node_link=html.node_link,
        tiers=TIERS,
        tier_colors=views.TIER_COLORS,
        page_sizes=views.PAGE_SIZES,
        static_version={n: hashlib.sha256(_static(n)).hexdigest()[:10] for n in STATIC},
    )
    return env


def _safe_next(target: str) -> str:
    """A local path to return to after signing in; anything else (another site) is `/`."""
    if target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/"


@dataclass(frozen=True)
class OperatorPages:
    router: APIRouter
    """The pages' routes, for `create_app` to include."""
    warm_up: Callable[[], None]
    """Start computing, in the background, what the fleet page's first view would wait for
    (the alarm history, the first rows of the table); `create_app` calls it once the first
    snapshot is loaded."""


def operator_pages(state: ServingState, read_token_ok: Callable[[str], bool]) -> OperatorPages:
    """The pages over `state`. `read_token_ok` is the read API's own token check."""
    options = state.options
    router = APIRouter(include_in_schema=False)
    counts_cache = history.DailyCountsCache()
    row_cache = html.RowCache()

    def authorized(request: Request) -> bool:
        if not options.read_requires_token:
            return True
        header = request.headers.get("authorization", "")
        scheme, _, credentials = header.partition(" ")
        if scheme.lower() == "bearer":
            token = credentials.strip()
            return bool(token) and read_token_ok(token)
        session = request.cookies.get(COOKIE, "")
        return bool(session) and session_ok(session, (options.read_token, options.admin_token), time.time())

    def shown(text: str) -> str:
        return views.without_paths(text, options.data_root)

    def page(template: str, status: int = 200, **context: Any) -> HTMLResponse:
        snap: Snapshot = context.pop("snap", None) or state.snapshot
        ready, reasons = state.readiness()
        # What went wrong is said without the server's paths (`views.without_paths`).
        reasons = [shown(r) for r in reasons]
        for key, value in context.items():
            if isinstance(value, str) and (key.endswith("_error") or key == "message"):
                context[key] = shown(value)
        now = datetime.now(UTC)
        features_ts = None if snap.features is None else snap.features.ts
        body = (
            _templates()
            .get_template(template)
            .render(
                ready=ready,
                reasons=reasons,
                model_version=None if snap.served is None else snap.served.version,
                features_ts=views.fmt_time(features_ts) if features_ts is not None else None,
                features_age=views.fmt_age((now - features_ts).total_seconds()) if features_ts is not None else None,
                model_error=shown(state.model_error) if state.model_error else state.model_error,
                signed_in=options.read_requires_token,
                **context,
            )
        )
        return HTMLResponse(body, status_code=status, headers=HEADERS)

    def sign_in(request: Request, status: int = 401, message: str = "") -> HTMLResponse:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return page("login.html", status, next=_safe_next(target), message=message, title="Sign in")

    def refused(message: str, status: int = 400) -> HTMLResponse:
        return page("error.html", status, message=message, title="Not found" if status == 404 else "Bad request")

    def store() -> Any:
        from ingest.store import Store

        return Store.open(options.data_root)

    def guarded(what: str, compute: Callable[[], Any]) -> tuple[Any, str]:
        """(value, '') or (None, why `what` could not be shown)."""
        try:
            return compute(), ""
        except Exception as exc:
            log.warning("web: %s not shown: %s", what, exc)
            return None, f"{what} could not be read: {exc}"

    def served_time(snap: Snapshot) -> datetime:
        return views.reference_time(None if snap.fleet is None else snap.fleet.ts, datetime.now(UTC))

    def data_end(s: Any, dataset: str, end: datetime) -> datetime:
        """`end`, or the end of `dataset`'s newest day if later: the audit is written at the
        time of publishing, which for replayed features is later than their grid time."""
        days = s.dates(dataset)
        if not days:
            return end
        return max(end, datetime.combine(days[-1] + timedelta(days=1), datetime.min.time(), tzinfo=UTC))

    def alarm_counts(snap: Snapshot) -> tuple[history.DailyCounts, bool]:
        s = store()
        last = history.last_data_day(s, served_time(snap).date())
        return counts_cache.get(s, options.tiers, _failure_xids(snap), last, HISTORY_DAYS)

    def warm_up() -> None:
        snap = state.snapshot
        if snap.fleet is None:
            return
        fleet = snap.fleet

        def work() -> None:
            def pages() -> None:
                for template in TEMPLATES:  # compiled here rather than at the first view
                    _templates().get_template(template)
                positions, _ = views.at_risk(fleet, views.AtRiskQuery())
                row_cache.rows(fleet, positions, len(views.summary(fleet).clusters) > 1)

            guarded("the pages' templates and first rows", pages)
            guarded("alarms and failures", lambda: alarm_counts(snap))

        threading.Thread(target=work, name="gpufail-web-warm-up", daemon=True).start()

    # -- pages

    @router.get("/", response_class=HTMLResponse)
    def fleet_page(request: Request) -> Response:
        if not authorized(request):
            return sign_in(request)
        try:
            query = views.AtRiskQuery.parse(request.query_params)
        except InputError as exc:
            return refused(str(exc))
        snap = state.snapshot
        context: dict[str, Any] = {"title": "Fleet", "query": query, "snap": snap, "fleet": None, "model": None}
        if snap.served is not None:
            context["model"] = views.model_card(snap.served, options.model_name)
        if snap.fleet is not None:
            fleet = snap.fleet
            positions, matched = views.at_risk(fleet, query)
            summary = views.summary(fleet)
            context.update(
                fleet=summary,
                rows=row_cache.rows(fleet, positions, len(summary.clusters) > 1),
                n_rows=len(positions),
                matched=matched,
                complete=matched == len(positions),
                pager=views.pager(query, len(positions), matched),
                risk_legend=html.risk_legend(options.tiers),
            )

            found, context["history_error"] = guarded("alarms and failures", lambda: alarm_counts(snap))
            context["alarms"] = None if found is None else views.alarms_chart(found[0])
            context["history_stale"] = found is not None and found[1]
            context["history_refresh_error"] = counts_cache.error
        return page("fleet.html", 200 if snap.fleet is not None else 503, **context)

    @router.get("/nodes/{node}", response_class=HTMLResponse)
    def node_page(request: Request, node: str) -> Response:
        if not authorized(request):
            return sign_in(request)
        snap = state.snapshot
        fleet = snap.fleet
        if fleet is None:
            return page("fleet.html", 503, title="Fleet", snap=snap, fleet=None, model=None, query=views.AtRiskQuery())
        cluster = request.query_params.get("cluster")
        clusters = fleet.clusters_of_node.get(node, [])
        if cluster is None and len(clusters) > 1:
            links = ", ".join(sorted(clusters))
            return refused(f"query parameter cluster: node {node!r} exists in clusters {links}; expected one of them")
        chosen = cluster if cluster is not None else (clusters[0] if clusters else None)
        found = fleet.nodes.get((chosen, node)) if chosen is not None else None
        if found is None:
            return refused(
                f"node {node[:100]!r}{f' in cluster {cluster[:100]!r}' if cluster else ''}: not in the latest "
                f"features ({len(fleet.nodes):,} nodes); expected a node name from the fleet page",
                404,
            )
        gpus = views.node_gpus(fleet, found)
        drivers = views.driving_features(gpus)
        end = served_time(snap)
        c = found["cluster"]
        try:
            s = store()
        except Exception as exc:
            s, store_error = None, f"the store could not be opened: {exc}"
        else:
            store_error = ""

        def part(what: str, compute: Callable[[Any], Any]) -> tuple[Any, str]:
            if s is None:
                return None, store_error
            return guarded(what, lambda: compute(s))

        risk_window = ((end - timedelta(days=RISK_DAYS)).timestamp(), end.timestamp())
        risk, risk_error = part(
            "risk history",
            lambda s: views.risk_chart(
                history.risk_history(s, end - timedelta(days=RISK_DAYS), end, cluster=c, node=node),
                gpus,
                options.tiers,
                risk_window,
            ),
        )
        feature_window = ((end - timedelta(days=FEATURE_DAYS)).timestamp(), end.timestamp())
        feature_charts, features_error = part(
            "feature history",
            lambda s: views.feature_charts(
                reads.node_features(s, c, node, drivers, end - timedelta(days=FEATURE_DAYS), end),
                drivers,
                gpus,
                feature_window,
            ),
        )
        metrics = views.telemetry_metrics(drivers)
        telemetry_window = ((end - timedelta(hours=TELEMETRY_HOURS)).timestamp(), end.timestamp())
        telemetry_charts, telemetry_error = part(
            "telemetry",
            lambda s: views.feature_charts(
                reads.node_telemetry(s, c, node, metrics, end - timedelta(hours=TELEMETRY_HOURS), end),
                metrics,
                gpus,
                telemetry_window,
            ),
        )
        xids, xids_error = part(
            "XID events",
            lambda s: views.xid_rows(
                reads.node_xids(s, c, node, end - timedelta(days=XID_DAYS), data_end(s, "xid_events", end), XID_ROWS),
                _failure_xids(snap),
            ),
        )
        decisions, actions_error = part(
            "publish audit",
            lambda s: reads.audit(
                s, end - timedelta(days=NODE_AUDIT_DAYS), data_end(s, reads.AUDIT_DATASET, end), cluster=c, node=node
            ),
        )
        actions = None if decisions is None else views.audit_rows(views.notable(decisions))
        latest = None if decisions is None or decisions.height == 0 else views.audit_rows(decisions.head(1))[0]
        published, published_error = part(
            "publish state", lambda s: views.published_tiers(reads.publish_states(s), c, node)
        )
        return page(
            "node.html",
            title=f"Node {node}",
            snap=snap,
            node=found,
            n_nodes=len(fleet.nodes),
            gpus=gpus,
            drivers=drivers,
            risk=risk,
            risk_error=risk_error,
            drivers_charts=views.drivers_view(drivers, feature_charts, telemetry_charts),
            features_error=features_error,
            telemetry_error=telemetry_error,
            xids=xids,
            xids_error=xids_error,
            actions=actions,
            actions_error=actions_error,
            latest=latest,
            published=published,
            published_error=published_error,
            windows={
                "risk": RISK_DAYS,
                "features": FEATURE_DAYS,
                "telemetry": TELEMETRY_HOURS,
                "xids": XID_DAYS,
                "actions": NODE_AUDIT_DAYS,
            },
            xid_rows_cap=XID_ROWS,
            end=views.fmt_time(end),
            gpu_colors={g["gpu_index"]: views.svg.color_for(g["gpu_index"]) for g in gpus},
        )

    @router.get("/actions", response_class=HTMLResponse)
    def actions_page(request: Request) -> Response:
        if not authorized(request):
            return sign_in(request)
        try:
            query = views.AuditQuery.parse(request.query_params)
        except InputError as exc:
            return refused(str(exc))
        snap = state.snapshot
        end = served_time(snap)
        fleet_nodes = None if snap.fleet is None else len(snap.fleet.nodes)
        try:
            s = store()
        except Exception as exc:
            return page("actions.html", title="Actions", snap=snap, query=query, store_error=str(exc))
        end = data_end(s, reads.AUDIT_DATASET, end)

        def breakers() -> list[views.BreakerView]:
            found = reads.publish_states(s)
            dry_runs = (
                reads.last_dry_runs(s, end - timedelta(days=DRY_RUN_DAYS), end)
                if any(p.dry_run_only for p in found)
                else {}
            )
            listed = views.breaker_views(found, options.tiers, fleet_nodes, end, dry_runs)
            return [replace(b, error=shown(b.error)) if b.error else b for b in listed]

        states, states_error = guarded("publish state", breakers)
        start = end - timedelta(days=query.days)
        counted, audit_error = guarded(
            "publish audit", lambda: views.action_counts(reads.audit(s, start, end, columns=["action"]))
        )
        rows, matched = [], 0
        if counted is not None:
            found, audit_error = guarded("publish audit", lambda: reads.audit(s, start, end, actions=query.actions()))
            if found is not None:
                selected = query.select(found)
                matched = selected.height
                rows = views.audit_rows(selected.head(AUDIT_ROWS))
        return page(
            "actions.html",
            title="Actions",
            snap=snap,
            query=query,
            store_error="",
            states=states,
            states_error=states_error,
            audit_error=audit_error,
            rows=rows,
            counts=counted or {},
            matched=matched,
            cap=AUDIT_ROWS,
            end=views.fmt_time(end),
            breaker_window=views.fmt_duration(options.tiers.breaker_window),
            dry_run_days=DRY_RUN_DAYS,
        )

    # -- signing in, assets

    @router.get("/login", response_class=HTMLResponse)
    def login_form(request: Request) -> Response:
        target = _safe_next(request.query_params.get("next", "/"))
        return page("login.html", next=target, message="", title="Sign in")

    @router.post("/login", response_class=HTMLResponse)
    async def login(request: Request) -> Response:
        form = parse_qs((await request.body()).decode("utf-8", "replace"), max_num_fields=4)
        token = (form.get("token") or [""])[0].strip()
        target = _safe_next((form.get("next") or ["/"])[0])
        accepted = await run_in_threadpool(read_token_ok, token) if token else False
        if not accepted:
            message = "token: missing" if not token else "token: not a read or admin token of this server"
            return page("login.html", 401, next=target, message=message, title="Sign in")
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            COOKIE,
            session_value(token, time.time()),
            max_age=LIFETIME_S,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path="/",
        )
        response.delete_cookie(LEGACY_COOKIE, path="/")
        return response

    @router.post("/logout")
    async def logout() -> Response:
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        response.delete_cookie(LEGACY_COOKIE, path="/")
        return response

    @router.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in STATIC:
            return Response("not found", status_code=404, media_type="text/plain")
        return Response(_static(name), media_type=STATIC[name], headers={"Cache-Control": "public, max-age=86400"})

    return OperatorPages(router, warm_up)


def _failure_xids(snap: Snapshot) -> tuple[int, ...]:
    """The failure XIDs of the served model's feature spec: the failures its alarms are
    compared with are the ones it was trained to predict."""
    if snap.served is not None:
        return tuple(snap.served.model.feature_spec.failure_xids)
    return tuple(FeatureSpec().failure_xids)
