"""What the REST endpoint serves, and how it changes without dropping a request.

A `Snapshot` is immutable: the served model, the latest feature rows, and the fleet scored with
that model once (risk, ranks, node risks, tiers and each GPU's top contributing features). A
request reads `ServingState.snapshot` once and uses only that object, so swapping in a new
snapshot (one attribute assignment) never changes an answer half-way.

`ServingState.refresh` (the polling thread, or the admin reload call) looks at the model source
(a model folder, or the registry's `champion` alias) and the features dataset; when either
changed it loads the new one *beside* the old, scores the fleet with it (which checks that the
model accepts the features and returns finite probabilities), and only then swaps. A model that
does not load or does not pass is reported (`last_reload_error`, the reload counter) and the old
one keeps serving; the same broken version is not retried until it changes again or an admin
forces a reload.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from features.spec import FeatureSpec
from ingest.errors import GpufailError, InputError
from ingest.urls import redact_urls
from models.train import TrainedModel, load_model
from serving.policy import PolicyConfig
from serving.score import latest_rows, score_latest
from serving.score_store import check_model_spec

log = logging.getLogger("gpufail.serve")


@dataclass(frozen=True)
class ServeOptions:
    """Plain values `create_app` needs (the CLI maps the [serve] settings to these)."""

    data_root: str
    tiers: PolicyConfig
    model_name: str = "gpufail"
    admin_token: str | None = field(default=None, repr=False)
    read_token: str | None = field(default=None, repr=False)
    read_requires_token: bool = False
    admin_token_env: str = "GPUFAIL_SERVE_ADMIN_TOKEN"
    max_body_bytes: int = 2_000_000
    max_gpus_per_request: int = 2000
    max_top_features: int = 10
    reload_poll_s: float = 30.0
    features_max_age_s: float = 30 * 3600.0
    """0: the age of the features is not checked."""
    metrics_top: int = 20


# -- where models and features come from -------------------------------------------------------


@dataclass(frozen=True)
class ServedModel:
    model: TrainedModel
    fingerprint: str
    """What identifies this model at its source (file stamps, or the registry version)."""
    info: dict[str, Any]
    """source, path, registry_version, alias, run_id, metrics."""
    loaded_at: datetime
    version: str = field(init=False)
    """`model.version`, computed once: it hashes the parameters and every feature name (~1 ms)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "version", self.model.version)


class ModelSource(Protocol):
    def fingerprint(self) -> str | None:
        """A cheap look at the source: a value that changes when a new model is there (None: none yet)."""

    def load(self) -> ServedModel: ...


class ModelFolder:
    """A model folder written by `gpufail train` / `models.train.save_model`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def fingerprint(self) -> str | None:
        stamps = []
        for name in ("model.joblib", "metadata.json"):
            try:
                st = (self.path / name).stat()
            except OSError:
                return None
            stamps.append(f"{st.st_mtime_ns}:{st.st_size}")
        return "/".join(stamps)

    def load(self) -> ServedModel:
        before = self.fingerprint()
        model = load_model(self.path)
        info = {"source": "path", "path": str(self.path), "registry_version": None, "alias": None, "metrics": None}
        return ServedModel(model, before or "", info, datetime.now(UTC))


class RegistryChampion:
    """The model the registry's `champion` alias points at (`models.registry.load_champion`)."""

    def __init__(
        self, tracking_uri: str, name: str, *, cache_dir: Path | None, retries: int = 3, backoff_s: float = 2.0
    ) -> None:
        self.tracking_uri, self.name, self.cache_dir = tracking_uri, name, cache_dir
        self.retries, self.backoff_s = retries, backoff_s
        self._registry: Any = None

    def _client(self) -> Any:
        if self._registry is None:
            from models.registry import Registry

            self._registry = Registry(self.tracking_uri, self.name, retries=self.retries, backoff_s=self.backoff_s)
        return self._registry

    def fingerprint(self) -> str | None:
        from models.registry import CHAMPION

        found = self._client().alias_version(CHAMPION)
        return None if found is None else str(found.version)

    def load(self) -> ServedModel:
        from models.registry import CHAMPION, load_champion

        loaded = load_champion(
            self.tracking_uri, self.name, cache_dir=self.cache_dir, retries=self.retries, backoff_s=self.backoff_s
        )
        metrics = None
        try:
            run = self._client().call("read the run's metrics", self._client().client.get_run, loaded.run_id)
            metrics = {k: float(v) for k, v in run.data.metrics.items()}
        except Exception as exc:  # the metrics are informative; the model serves without them
            log.warning("model %s: run metrics unavailable (%s)", loaded.version, type(exc).__name__)
        info = {
            "source": f"registry:{loaded.source}",
            "path": None,
            "registry_version": loaded.version,
            "alias": CHAMPION,
            "run_id": loaded.run_id,
            "metrics": metrics,
        }
        fingerprint = loaded.version.removeprefix("cache")
        return ServedModel(loaded.model, fingerprint, info, datetime.now(UTC))


@dataclass(frozen=True)
class LatestFeatures:
    frame: pd.DataFrame
    """Each GPU's row at the newest grid time of the features dataset."""
    fingerprint: str
    ts: pd.Timestamp | None
    spec: FeatureSpec | None = None
    """The spec the features were built with (None: not recorded, `features.manifest`)."""


class FeatureStore:
    """The newest grid time of the store's `features` dataset."""

    def __init__(self, root: str) -> None:
        self.root = root

    def _store(self) -> Any:
        from ingest.store import Store

        return Store.open(self.root)

    def fingerprint(self) -> str | None:
        from features.dataset import feature_days, features_dataset

        store = self._store()
        days = feature_days(store)
        if not days:
            return None
        files = store.files(features_dataset(store), days[-1], days[-1])
        return f"{days[-1]}:" + ",".join(sorted(files))

    def load(self) -> LatestFeatures:
        from features.dataset import read_newest_grid_time
        from features.manifest import recorded_spec

        store = self._store()
        fingerprint = self.fingerprint()
        if fingerprint is None:
            raise InputError(f"{self.root}: no features dataset; run `gpufail features --data {self.root}`")
        spec = recorded_spec(store)
        frame = read_newest_grid_time(store)
        latest = latest_rows(frame.to_pandas()).reset_index(drop=True)
        ts = pd.Timestamp(latest["ts"].max()) if len(latest) else None
        return LatestFeatures(latest, fingerprint, ts, spec)


# -- the fleet scored once per (model, features) -----------------------------------------------


@dataclass(frozen=True)
class Fleet:
    """The latest features scored with one model, ordered by rank (position i is rank i + 1)."""

    records: list[dict[str, Any]]
    """Per GPU: the fields of a prediction except top_features."""
    explanations: list[list[dict[str, Any]]]
    """Per GPU: its top [serve] max_top_features contributions, largest first."""
    index: dict[str, int]
    nodes: dict[tuple[str, str], dict[str, Any]]
    clusters_of_node: dict[str, list[str]]
    ts: pd.Timestamp | None


def explanation_lists(model: TrainedModel, frame: pd.DataFrame, top: int) -> list[list[dict[str, Any]]]:
    """`models.explain.explain` for each row of `frame`, as lists of JSON-ready dicts."""
    if top <= 0 or len(frame) == 0:
        return [[] for _ in range(len(frame))]
    from models.explain import explain

    table = explain(model, frame.reset_index(drop=True), top=top)
    width = len(table) // len(frame)
    features = table["feature"].tolist()
    values = [_json_value(v) for v in table["value"].tolist()]
    contributions = table["contribution"].astype(float).tolist()
    return [
        [
            {"feature": features[j], "value": values[j], "contribution": contributions[j]}
            for j in range(i * width, (i + 1) * width)
        ]
        for i in range(len(frame))
    ]


def calibration_payload(model: TrainedModel) -> dict[str, Any]:
    """What `/v1/model` says of the served risk: whether it is calibrated and the calibration's
    provenance (method, slice, rows, failures, its parameters; `models.calibration`)."""
    return {"calibrated": model.calibrated, "calibration": model.calibration_info()}


def _json_value(v: Any) -> float | str | None:
    if v is None or isinstance(v, str):
        return v
    f = float(v)
    return f if np.isfinite(f) else None


def score_fleet(model: TrainedModel, latest: pd.DataFrame, tiers: PolicyConfig, explain_top: int) -> Fleet:
    """Score the latest rows with `model` (`serving.score.score_latest`, as `gpufail score`),
    then explain each GPU. Raises `InputError` when the model does not accept the features."""
    predictions = score_latest(model, latest)
    risk = predictions["risk"].to_numpy(dtype=np.float64)
    if len(risk) and (risk.min() < 0.0 or risk.max() > 1.0):
        raise InputError(f"model {model.version}: risks outside [0, 1] on the latest features")
    ordered = latest.set_index("gpu_uuid", drop=False).loc[predictions["gpu_uuid"].to_numpy()]
    explanations = explanation_lists(model, ordered, explain_top)
    tier = tiers.entered_tiers(risk)
    node_risk = predictions["node_risk"].to_numpy(dtype=np.float64)
    node_tier = tiers.entered_tiers(node_risk)
    ts_values = [pd.Timestamp(t).isoformat() for t in predictions["ts"]]
    version = model.version
    records = [
        {
            "gpu_uuid": u,
            "cluster": c,
            "node": n,
            "gpu_index": int(i),
            "ts": ts,
            "risk": float(r),
            "fleet_rank": k,
            "tier": t,
            "node_risk": float(nr),
            "node_tier": nt,
            "model_version": version,
        }
        for u, c, n, i, ts, r, k, t, nr, nt in zip(
            predictions["gpu_uuid"],
            predictions["cluster"],
            predictions["node"],
            predictions["gpu_index"],
            ts_values,
            risk,
            range(1, len(risk) + 1),
            tier,
            node_risk,
            node_tier,
            strict=True,
        )
    ]
    nodes: dict[tuple[str, str], dict[str, Any]] = {}
    for rec in records:  # in rank order: each node's GPUs come riskiest first
        key = (rec["cluster"], rec["node"])
        if key not in nodes:
            nodes[key] = {
                "cluster": rec["cluster"],
                "node": rec["node"],
                "ts": rec["ts"],
                "node_risk": rec["node_risk"],
                "node_tier": rec["node_tier"],
                "model_version": version,
                "gpus": [],
            }
        nodes[key]["gpus"].append({k: rec[k] for k in ("gpu_uuid", "gpu_index", "risk", "fleet_rank", "tier")})
    by_risk = sorted(nodes.values(), key=lambda n: (-n["node_risk"], n["cluster"], n["node"]))
    clusters: dict[str, list[str]] = {}
    for rank, node in enumerate(by_risk, start=1):
        node["node_rank"] = rank
        node["n_gpus"] = len(node["gpus"])
        clusters.setdefault(node["node"], []).append(node["cluster"])
    ts = pd.Timestamp(predictions["ts"].max()) if len(predictions) else None
    return Fleet(records, explanations, {r["gpu_uuid"]: i for i, r in enumerate(records)}, nodes, clusters, ts)


# -- the state and its reloads -----------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    served: ServedModel | None = None
    features: LatestFeatures | None = None
    fleet: Fleet | None = None


@dataclass
class ReloadOutcome:
    changed: bool
    previous_version: str | None
    model_version: str | None
    error: str | None = None


class ServingState:
    """The current `Snapshot`, the reload logic and the polling thread."""

    def __init__(
        self,
        options: ServeOptions,
        model_source: ModelSource,
        features: FeatureStore,
        *,
        on_reload: Callable[[str], None] = lambda result: None,
    ) -> None:
        self.options = options
        self.model_source = model_source
        self.feature_store = features
        self.snapshot = Snapshot()
        self.model_error: str | None = None
        self.features_error: str | None = None
        self._rejected: str | None = None  # fingerprint of a model that failed; not retried
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_reload = on_reload

    # Each step builds a complete new snapshot next to the current one, then swaps it in.

    def refresh(self, *, force: bool = False) -> ReloadOutcome:
        """Look at the features and the model source; load what changed; swap when it works."""
        with self._lock:
            before = self.snapshot
            self._refresh_features(force)
            self._refresh_model(force)
            after = self.snapshot
            previous = _version(before)
            error = self.model_error if after.served is before.served and self.model_error else None
            return ReloadOutcome(after is not before, previous, _version(after), error)

    def _refresh_features(self, force: bool) -> None:
        current = self.snapshot
        try:
            fingerprint = self.feature_store.fingerprint()
            if fingerprint is None:
                self.features_error = f"{self.feature_store.root}: no features dataset yet"
                return
            if current.features is not None and fingerprint == current.features.fingerprint and not force:
                return
            latest = self.feature_store.load()
            fleet = self._fleet(current.served, latest)
        except Exception as exc:
            self.features_error = _describe(exc)
            log.warning("features not reloaded: %s", self.features_error)
            self._on_reload("features_failed")
            return
        self.features_error = None
        self.snapshot = replace(current, features=latest, fleet=fleet)
        log.info("features: %d GPUs at %s", len(latest.frame), latest.ts)

    def _refresh_model(self, force: bool) -> None:
        current = self.snapshot
        try:
            fingerprint = self.model_source.fingerprint()
        except Exception as exc:
            self.model_error = _describe(exc)
            log.warning("model source unreadable: %s", self.model_error)
            if current.served is not None:
                return  # keep serving; look again at the next poll
            # Nothing serves yet: loading may still succeed (the registry's local cache).
            fingerprint = "unreachable"
        if fingerprint is None:
            if current.served is None:
                self.model_error = "no model at the source yet"
            return
        if not force and current.served is not None and fingerprint == current.served.fingerprint:
            # The source shows the served model again (after it was unreadable, or pointed at a
            # model that was refused): nothing is wrong any more.
            self._rejected, self.model_error = None, None
            return
        if not force and fingerprint == self._rejected:
            return
        try:
            served = self.model_source.load()
            if current.served is not None and served.version == current.served.version and not force:
                # The same model rewritten (a metadata refresh, or a good copy back over a
                # refused one): keep serving the loaded one, and the error is over.
                self.snapshot = replace(current, served=replace(current.served, fingerprint=fingerprint))
                self._rejected, self.model_error = None, None
                return
            fleet = self._fleet(served, current.features)
        except Exception as exc:
            self._rejected = fingerprint
            self.model_error = f"new model not loaded, the previous one keeps serving: {_describe(exc)}"
            if current.served is None:
                self.model_error = f"model not loaded: {_describe(exc)}"
            log.warning("%s", self.model_error)
            self._on_reload("failed")
            return
        self._rejected, self.model_error = None, None
        self.snapshot = replace(current, served=served, fleet=fleet if fleet is not None else current.fleet)
        log.info("model %s loaded (%s)", served.version, served.info["source"])
        if not served.model.calibrated:
            log.warning(
                "model %s has no calibration (saved before models carried one): its risk is served uncalibrated; "
                "retrain it to calibrate it",
                served.version,
            )
        self._on_reload("loaded")

    def _fleet(self, served: ServedModel | None, features: LatestFeatures | None) -> Fleet | None:
        """The fleet scored with `served`, refused when the features were built with another
        spec than the model's (the model or the features that came last is not taken)."""
        if served is None or features is None:
            return None
        check_model_spec(served.model, features.spec, self.feature_store.root)
        return score_fleet(served.model, features.frame, self.options.tiers, self.options.max_top_features)

    # -- readiness and polling

    def readiness(self, now: float | None = None) -> tuple[bool, list[str]]:
        snap = self.snapshot
        reasons = []
        if snap.served is None:
            reasons.append(self.model_error or "no model loaded yet")
        if snap.features is None:
            reasons.append(self.features_error or "no features loaded yet")
        elif snap.fleet is None and snap.served is not None:
            reasons.append("the latest features are not scored")
        elif snap.features.ts is None:
            reasons.append("the latest features have no GPUs")
        elif self.options.features_max_age_s > 0:
            age = (now if now is not None else time.time()) - snap.features.ts.timestamp()
            if age > self.options.features_max_age_s:
                reasons.append(
                    f"features are stale: newest grid time {snap.features.ts.isoformat()} is {age / 3600:.1f} h old, "
                    f"expected at most {self.options.features_max_age_s / 3600:.1f} h ([serve] features_max_age)"
                )
        return not reasons, reasons

    def start_polling(self) -> None:
        if self.options.reload_poll_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._poll, name="gpufail-reload", daemon=True)
        self._thread.start()

    def stop_polling(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _poll(self) -> None:
        while not self._stop.wait(self.options.reload_poll_s):
            try:
                self.refresh()
            except Exception:  # never let the poller die; each step already records its errors
                log.exception("reload poll failed")


def _version(snapshot: Snapshot) -> str | None:
    return None if snapshot.served is None else snapshot.served.version


def _describe(exc: BaseException) -> str:
    # Shown by /readyz, the pages and the log: a library's message may quote the tracking URI.
    if isinstance(exc, GpufailError):
        return redact_urls(str(exc))
    return redact_urls(f"{type(exc).__name__}: {exc}")
