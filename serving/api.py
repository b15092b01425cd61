"""The prediction REST endpoint: `create_app(options, model_source)` builds the FastAPI app that
`gpufail serve` runs under uvicorn (one worker).

Endpoints (docs/serving.md has examples):

- `GET /healthz` (the process answers), `GET /readyz` (a model is loaded and the features are
  fresh; 503 with the reasons when not);
- `GET /v1/model`: the served model, its training window, metrics and library versions;
- `POST /v1/predict`: GPU ids of the server's latest features (the fast path: the fleet is
  scored and explained once per model and features version), or model inputs, or raw telemetry
  and XID events (scored per request) -> risk, rank, tier, top contributing features;
- `GET /v1/gpus/at-risk?top=K`, `GET /v1/nodes/{node}`: the fleet's latest scores;
- `GET /metrics`: Prometheus exposition;
- `GET /`, `/nodes/{node}`, `/actions`: the operator's pages (`serving.web`);
- `POST /v1/admin/reload`: look for a new model and features now (admin token).

Read endpoints are open unless [serve] read_requires_token; admin endpoints always need the
admin bearer token, and refuse everything when none is configured. Tokens are compared in
constant time and never logged. Every refusal is a 4xx whose `detail` names the field and what
was expected; bodies over [serve] max_body_bytes are refused before they are parsed.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoint annotations at definition
# time, and some of them use this call's options (the query limits).
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

import orjson
from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ingest.errors import InputError
from serving.api_metrics import ApiMetrics, MetricsMiddleware
from serving.api_payloads import feature_frame, score_rows, telemetry_frame
from serving.api_schemas import (
    AtRiskResponse,
    ErrorBody,
    Health,
    ModelResponse,
    NodeResponse,
    PredictRequest,
    PredictResponse,
    Readiness,
    ReloadResponse,
)
from serving.api_state import FeatureStore, ModelSource, ServeOptions, ServingState, Snapshot, calibration_payload
from serving.web import operator_pages

log = logging.getLogger("gpufail.serve")

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409, 413, 422, 503)
}


class JSONBytes(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _json(content: Any, status_code: int = 200) -> Response:
    return JSONBytes(content, status_code=status_code)


# -- request size ------------------------------------------------------------------------------


class BodyLimit:
    """Refuse (413) a request body over `limit` bytes, by its Content-Length or, when it is
    streamed without one, as soon as the bytes read pass the limit; the app then sees the body
    as usual."""

    def __init__(self, app: Callable[..., Any], limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(send, declared.decode("latin-1"))
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away (or was cut off for a slow body): nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(send, f"more than {size}")
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return dict(await receive())

        await self.app(scope, replay, send)

    async def _refuse(self, send: Callable[..., Any], size: str) -> None:
        detail = f"body: {size} bytes; expected at most {self.limit} bytes ([serve] max_body_bytes)"
        payload = orjson.dumps({"detail": detail})
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": [*headers, (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


# -- errors ------------------------------------------------------------------------------------


class UnknownGpus(InputError):
    pass


class NotReady(Exception):
    pass


def _field(loc: tuple[Any, ...]) -> str:
    where, parts = loc[0] if loc else "body", list[str]()
    for part in loc[1:]:
        parts.append(f"[{part}]" if isinstance(part, int) else f".{part}" if parts else str(part))
    name = "".join(parts)
    if where == "body":
        return name or "body"
    return f"{where} parameter {name}" if name else str(where)


def _validation_response(exc: RequestValidationError) -> Response:
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        e = next(e for e in errors if e.get("type") == "json_invalid")
        position = e["loc"][1] if len(e["loc"]) > 1 else "?"
        reason = (e.get("ctx") or {}).get("error", "not JSON")
        return _json(
            {"detail": f"body: malformed JSON at character {position} ({reason}); expected a JSON object"}, 400
        )
    problems, listed = [], []
    for e in errors[:20]:
        field = _field(tuple(e.get("loc", ())))
        message = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        got = e.get("input")
        shown = "" if e.get("type") == "missing" or "got " in message else f", got {_short(got)}"
        problems.append(f"{field}: {message}{shown}")
        listed.append({"field": field, "message": message, "type": e.get("type")})
    more = f" (and {len(errors) - 20} more)" if len(errors) > 20 else ""
    return _json({"detail": "; ".join(problems) + more, "errors": listed}, 422)


def _installed_version(lib: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(lib)
    except PackageNotFoundError:
        return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- the app -----------------------------------------------------------------------------------


def create_app(
    options: ServeOptions,
    model_source: ModelSource,
    *,
    features: FeatureStore | None = None,
    start_polling: bool = True,
) -> FastAPI:
    """The FastAPI application. The first model and features are loaded at startup (the
    server answers /readyz with the reasons if they are not there yet) and then polled every
    [serve] reload_poll."""
    metrics = ApiMetrics()
    state = ServingState(
        options,
        model_source,
        features or FeatureStore(options.data_root),
        on_reload=lambda result: metrics.reloads.labels(result).inc(),
    )
    metrics.watch(state, options.metrics_top)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(state.refresh)
        pages.warm_up()
        if start_polling:
            state.start_polling()
        yield
        state.stop_polling()

    app = FastAPI(
        title="gpufail",
        summary="Which GPUs are at risk of failing, and why.",
        version="1",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.serving = state
    bearer = HTTPBearer(auto_error=False, description="Bearer token ([serve] admin_token_env / read_token_env).")

    def _matches(given: str, expected: str | None) -> bool:
        # compare_digest takes the same time wherever the strings differ.
        return expected is not None and hmac.compare_digest(given.encode(), expected.encode())

    def _token(credentials: HTTPAuthorizationCredentials | None) -> str:
        if credentials is None or not credentials.credentials:
            raise HTTPException(
                401, "Authorization: missing; expected 'Bearer <token>'", {"WWW-Authenticate": "Bearer"}
            )
        return credentials.credentials

    async def require_admin(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        if not options.admin_token:
            raise HTTPException(
                403,
                f"admin endpoints are disabled: no admin token in the environment variable {options.admin_token_env}",
            )
        if not _matches(_token(credentials), options.admin_token):
            raise HTTPException(401, "Authorization: the token is not the admin token", {"WWW-Authenticate": "Bearer"})

    def _read_token_ok(token: str) -> bool:
        # Both compared, so the time taken does not tell which token was close.
        read_ok, admin_ok = _matches(token, options.read_token), _matches(token, options.admin_token)
        return read_ok or admin_ok

    async def require_read(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        if not _read_token_ok(_token(credentials)):
            raise HTTPException(
                401, "Authorization: the token is not a read or admin token", {"WWW-Authenticate": "Bearer"}
            )

    read_deps = [Depends(require_read)] if options.read_requires_token else []
    pages = operator_pages(state, _read_token_ok)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return _validation_response(exc)

    @app.exception_handler(UnknownGpus)
    async def _unknown(request: Request, exc: UnknownGpus) -> Response:
        return _json({"detail": str(exc)}, 404)

    @app.exception_handler(InputError)
    async def _bad_input(request: Request, exc: InputError) -> Response:
        return _json({"detail": str(exc)}, 422)

    @app.exception_handler(NotReady)
    async def _not_ready(request: Request, exc: NotReady) -> Response:
        return _json({"detail": str(exc)}, 503)

    def _served(snap: Snapshot) -> Any:
        if snap.served is None:
            raise NotReady(f"no model loaded: {state.model_error or 'loading'}")
        return snap.served

    def _fleet(snap: Snapshot) -> Any:
        _served(snap)
        if snap.fleet is None:
            raise NotReady(f"no scored features: {state.features_error or 'loading'}")
        return snap.fleet

    def _top_features(requested: int) -> int:
        if requested > options.max_top_features:
            raise InputError(
                f"top_features: expected at most {options.max_top_features} ([serve] max_top_features), got {requested}"
            )
        return requested

    @app.get("/healthz", response_model=Health, tags=["health"])
    async def healthz() -> Response:
        """The process is alive and answering."""
        return _json({"status": "ok"})

    @app.get("/readyz", response_model=Readiness, tags=["health"], responses={503: {"model": Readiness}})
    async def readyz() -> Response:
        """Ready when a model is loaded, the latest features are scored and fresh enough; 503
        with the reasons otherwise."""
        ready, reasons = state.readiness()
        snap = state.snapshot
        body = {
            "ready": ready,
            "reasons": reasons,
            "model_version": None if snap.served is None else snap.served.version,
            "features_ts": None if snap.features is None or snap.features.ts is None else snap.features.ts.isoformat(),
        }
        return _json(body, 200 if ready else 503)

    @app.get("/v1/model", response_model=ModelResponse, dependencies=read_deps, responses=ERRORS, tags=["model"])
    async def model_info() -> Response:
        """The served model: name, version, alias, training window, evaluation metrics and
        library versions (recorded at training and installed here)."""
        snap = state.snapshot
        served = _served(snap)
        m = served.model
        return _json(
            {
                "name": options.model_name,
                "version": served.version,
                "registry_version": served.info.get("registry_version"),
                "alias": served.info.get("alias"),
                "source": served.info["source"],
                "kind": m.kind,
                "train_start": m.train_start.isoformat(),
                "train_end": m.train_end.isoformat(),
                "horizon_h": m.horizon.total_seconds() / 3600,
                "n_rows": m.n_rows,
                "n_positives": m.n_positives,
                "n_features": len(m.feature_columns),
                "feature_columns": m.feature_columns,
                "metrics": served.info.get("metrics"),
                **calibration_payload(m),
                "library_versions": m.versions,
                "installed_versions": {lib: _installed_version(lib) for lib in m.versions if lib != "python"},
                "loaded_at": served.loaded_at.isoformat(),
                "features_ts": None
                if snap.features is None or snap.features.ts is None
                else snap.features.ts.isoformat(),
                "last_reload_error": state.model_error,
            }
        )

    @app.post("/v1/predict", response_model=PredictResponse, dependencies=read_deps, responses=ERRORS, tags=["predict"])
    async def predict(request: PredictRequest) -> Response:
        """Risk per GPU: by id from the server's latest features (fast), or from model inputs
        or raw telemetry in the body (featurised like training; slower)."""
        snap = state.snapshot
        served = _served(snap)
        top = _top_features(request.top_features)
        n = len(request.gpu_uuids or request.features or request.telemetry or [])
        field = (
            "gpu_uuids"
            if request.gpu_uuids is not None
            else "features"
            if request.features is not None
            else "telemetry"
        )
        limit = options.max_gpus_per_request * (1 if field != "telemetry" else 10_000)
        if n == 0 or n > limit:
            what = "GPUs" if field != "telemetry" else "rows"
            raise InputError(f"{field}: expected 1 to {limit} {what} ([serve] max_gpus_per_request), got {n}")
        base = {
            "model_version": served.version,
            "source": "latest_features",
            "horizon_h": served.model.horizon.total_seconds() / 3600,
        }
        if request.gpu_uuids is not None:
            return _json({**base, "gpus": _by_id(_fleet(snap), request.gpu_uuids, top), "not_scored": []})
        if request.features is not None:
            frame = feature_frame(request.features, served.model)
            gpus = await run_in_threadpool(score_rows, served.model, frame, options.tiers, top, served.version)
            return _json({**base, "source": "features", "gpus": gpus, "not_scored": []})
        telemetry: list[Any] = request.telemetry or []
        gpus_sent = {r.gpu_uuid for r in telemetry}
        if len(gpus_sent) > options.max_gpus_per_request:
            raise InputError(
                f"telemetry: expected at most {options.max_gpus_per_request} GPUs ([serve] max_gpus_per_request), "
                f"got {len(gpus_sent)}"
            )

        def featurise_and_score() -> tuple[list[dict[str, Any]], set[str]]:
            frame, sent, payload_only = telemetry_frame(
                telemetry, request.xid_events or [], served.model.feature_spec, _data_store()
            )
            gpus = score_rows(served.model, frame, options.tiers, top, served.version)
            for g in gpus:
                g["payload_only_features"] = payload_only.get(g["gpu_uuid"], [])
            return gpus, sent

        gpus, sent = await run_in_threadpool(featurise_and_score)
        scored = {g["gpu_uuid"] for g in gpus}
        not_scored = [
            {
                "gpu_uuid": u,
                "reason": "no feature row at the newest grid time (out of service after a failure, or silent)",
            }
            for u in sorted(sent - scored)
        ]
        return _json({**base, "source": "telemetry", "gpus": gpus, "not_scored": not_scored})

    def _data_store() -> Any:
        """The store whose fleet facts the telemetry path uses (None: none can be opened; the
        payload's own facts are then used, and named in the answer)."""
        from ingest.errors import StoreError
        from ingest.store import Store

        try:
            return Store.open(state.feature_store.root)
        except (StoreError, OSError):
            return None

    def _by_id(fleet: Any, uuids: list[str], top: int) -> list[dict[str, Any]]:
        positions, unknown, seen = [], [], set()
        for i, u in enumerate(uuids):
            if u in seen:
                raise InputError(f"gpu_uuids[{i}]: {u!r} is listed twice; expected each GPU once")
            seen.add(u)
            pos = fleet.index.get(u)
            if pos is None:
                unknown.append(f"gpu_uuids[{i}] {_short(u)}")
            else:
                positions.append(pos)
        if unknown:
            raise UnknownGpus(
                f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}: unknown GPU(s) ({len(unknown)}); expected "
                f"GPUs of the latest features ({len(fleet.records)} GPUs at {fleet.ts}); send `features` or "
                "`telemetry` for others"
            )
        positions.sort()  # fleet order is rank order
        return [
            {**fleet.records[p], "rank": r, "top_features": fleet.explanations[p][:top]}
            for r, p in enumerate(positions, start=1)
        ]

    @app.get(
        "/v1/gpus/at-risk", response_model=AtRiskResponse, dependencies=read_deps, responses=ERRORS, tags=["fleet"]
    )
    async def at_risk(
        top: Annotated[
            int, Query(ge=1, le=options.max_gpus_per_request, description="How many GPUs, riskiest first.")
        ] = 10,
        top_features: Annotated[int, Query(ge=0, description="Top contributing features per GPU.")] = 3,
    ) -> Response:
        """The `top` riskiest GPUs of the latest features, with their node's risk."""
        snap = state.snapshot
        fleet = _fleet(snap)
        k = _top_features(top_features)
        gpus = [
            {**rec, "rank": i + 1, "top_features": fleet.explanations[i][:k]}
            for i, rec in enumerate(fleet.records[:top])
        ]
        return _json(
            {
                "model_version": snap.served.version if snap.served else "",
                "ts": None if fleet.ts is None else fleet.ts.isoformat(),
                "n_gpus": len(fleet.records),
                "gpus": gpus,
            }
        )

    @app.get("/v1/nodes/{node}", response_model=NodeResponse, dependencies=read_deps, responses=ERRORS, tags=["fleet"])
    async def node_detail(
        node: Annotated[str, Path(min_length=1, max_length=200, description="Node name.")],
        cluster: Annotated[
            str | None, Query(max_length=200, description="Needed when clusters share a node name.")
        ] = None,
    ) -> Response:
        """A node's risk (the chance that any of its GPUs fails) and its GPUs, riskiest first."""
        fleet = _fleet(state.snapshot)
        clusters = fleet.clusters_of_node.get(node, [])
        if cluster is None and len(clusters) > 1:
            raise InputError(
                f"cluster: node {node!r} exists in clusters {sorted(clusters)}; expected ?cluster=<one of them>"
            )
        chosen = cluster if cluster is not None else (clusters[0] if clusters else None)
        found = fleet.nodes.get((chosen, node)) if chosen is not None else None
        if found is None:
            where = f" in cluster {cluster!r}" if cluster is not None else ""
            raise UnknownGpus(
                f"node: unknown node {_short(node)}{where}; expected a node of the latest features ({len(fleet.nodes)} nodes)"
            )
        return _json(found)

    @app.get(
        "/metrics",
        dependencies=read_deps,
        tags=["health"],
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition"}, **ERRORS},
    )
    async def prometheus() -> Response:
        """Request counts and latencies, the model version, reloads, and risk gauges for the
        [serve] metrics_top riskiest GPUs and nodes."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post(
        "/v1/admin/reload",
        response_model=ReloadResponse,
        dependencies=[Depends(require_admin)],
        responses={
            **ERRORS,
            409: {"model": ReloadResponse, "description": "The new model was refused; the old one serves."},
        },
        tags=["admin"],
    )
    async def reload(
        force: Annotated[bool, Query(description="Reload even when nothing seems to have changed.")] = False,
    ) -> Response:
        """Look at the model source and the features now; load what changed (the old model
        serves until the new one is loaded and checked)."""
        outcome = await run_in_threadpool(lambda: state.refresh(force=force))
        snap = state.snapshot
        body = {
            "changed": outcome.changed,
            "model_version": outcome.model_version,
            "previous_version": outcome.previous_version,
            "features_ts": None if snap.features is None or snap.features.ts is None else snap.features.ts.isoformat(),
            "error": outcome.error,
        }
        return _json(body, 409 if outcome.error else 200)

    # The operator's pages (`/`, `/nodes/{node}`, `/actions`): same snapshot, same read rule.
    app.include_router(pages.router)
    app.add_middleware(BodyLimit, limit=options.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
