"""The MLflow model registry: the only link between training and serving (CONVENTIONS.md 10).

A training run logs its parameters, data window, a fingerprint of the input datasets, the code
version, the model libraries' versions, the metrics of the held-out window, the evaluation
report and plot, and the model itself as an MLflow pyfunc (signature and input example
included) whose artifact is the folder `models.train.save_model` writes. Models are registered
under one name; the alias `champion` is what serving loads, `challenger` the newest candidate.

Serving loads the champion by alias and unpickles it with `models.train.load_model`, which warns
when the recorded library versions differ from the installed ones, so a model never predicts
silently with other libraries than it was trained with. The last champion loaded is kept in a
local cache so scoring goes on while the tracking server is down.

The promotion gate (`gate`) is a pure function of two models' metrics on the same, most recent
held-out window: the challenger replaces the champion only if its precision@K beats the
champion's by a margin and its episode recall is not lower by more than a tolerance; a registry
with no champion takes the first model that reaches an absolute precision floor.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from ingest.errors import GpufailError
from ingest.store import Store
from models.evaluate import heuristic_scores, random_scores, score_metrics
from models.frame import labels, to_pandas
from models.train import TrainedModel, load_model, save_model, write_file_atomic

CHAMPION = "champion"
CHALLENGER = "challenger"
MODEL_ARTIFACT = "model"
MODEL_FOLDER = "gpufail_model"
"""Name of the `save_model` folder inside the pyfunc's artifacts."""
DAY_TAG = "gpufail.day"
GATE_TAG = "gpufail.gate"
REASON_TAG = "gpufail.gate_reason"
_T = TypeVar("_T")


class RegistryError(GpufailError):
    """The registry cannot be reached, or holds something gpufail cannot use."""


# -- connecting --------------------------------------------------------------------------------


def quiet_mlflow() -> None:
    """Telemetry, run links and progress bars off, and MLflow's own HTTP retries off (gpufail retries with its own back-off,
    so that a server that is down fails in seconds, not after MLflow's ~2 minutes of retries).
    Values the user set are kept."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "true")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    # gpufail reports its own one-line summaries; MLflow's run links and download bars are noise
    # in a cron log.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def _unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the server could not be reached (worth retrying), rather than that it
    refused the request."""
    import requests

    if isinstance(exc, requests.exceptions.ConnectionError | requests.exceptions.Timeout | ConnectionError):
        return True
    text = str(exc)
    return any(
        marker in text
        for marker in ("Connection refused", "Max retries exceeded", "failed with exception", "Read timed out")
    )


class Registry:
    """One registered model name on one tracking server, with retries and back-off.

    `sleep` is a keyword default so tests never wait."""

    def __init__(
        self,
        tracking_uri: str,
        name: str,
        *,
        experiment: str = "gpufail",
        retries: int = 3,
        backoff_s: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        quiet_mlflow()
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        self.name = name
        self.experiment = experiment
        self.retries = retries
        self.backoff_s = backoff_s
        self.sleep = sleep
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    def call(self, what: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """`fn(*args, **kwargs)`, retried `retries` times with doubling waits while the server is
        unreachable; then a `RegistryError` naming the server and what was being done."""
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                if not _unreachable(exc):
                    raise
                if attempt == self.retries:
                    raise RegistryError(
                        f"MLflow tracking server {self.tracking_uri}: unreachable while trying to {what} "
                        f"({self.retries + 1} attempts over ~{self.backoff_s * (2**self.retries - 1):.0f}s; "
                        f"last error {type(exc).__name__}); start it with `gpufail mlflow` or fix [mlflow] tracking_uri"
                    ) from exc
                self.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def _experiment_id(self) -> str:
        found = self.call("look up the experiment", self.client.get_experiment_by_name, self.experiment)
        if found is not None:
            return str(found.experiment_id)
        return str(self.call("create the experiment", self.client.create_experiment, self.experiment))

    def alias_version(self, alias: str) -> Any | None:
        """The model version an alias points at, or None when the model or alias does not exist."""
        from mlflow.exceptions import MlflowException

        try:
            return self.call(f"read alias {alias!r}", self.client.get_model_version_by_alias, self.name, alias)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
                return None
            raise


# -- what a run records ------------------------------------------------------------------------


def dataset_fingerprint(store: Store, datasets: Iterable[str]) -> dict[str, str]:
    """A digest per dataset of its visible part files (path relative to the root and size).
    Files are written once under unique names, so equal digests mean equal data."""
    out = {}
    base = store.path()
    for dataset in datasets:
        digest = hashlib.sha256()
        for path in store.files(dataset):
            size = store.fs.size(path)
            digest.update(f"{path.removeprefix(base)}\t{size}\n".encode())
        out[dataset] = digest.hexdigest()[:16]
    return out


def code_version() -> str:
    """The git commit of this checkout (with `-dirty` when it has uncommitted changes), else the
    installed gpufail package's version."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"gpufail {version('gpufail')}"
        except PackageNotFoundError:
            return "unknown"


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text[:6000]  # MLflow's limit on a parameter value


def _flat_metrics(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat_metrics(value, f"{name}."))
        elif isinstance(value, int | float | np.number) and not isinstance(value, bool) and np.isfinite(float(value)):
            out[name] = float(value)
    return out


# -- evaluation on the held-out window ---------------------------------------------------------


# Rows of a held-out window converted to pandas and scored at once. The paper fleet's 3-day
# window is 2.3M rows x 420 feature columns (4 GB in polars, and as much again in pandas); a
# chunk of this size is ~0.5 GB.
HOLDOUT_ROWS_PER_CHUNK = 300_000
_ROW = "_holdout_row"


def holdout_metrics(model: TrainedModel, holdout: Any, top_k: int) -> dict[str, Any]:
    """`model`'s precision@K, episode recall and row metrics on the labelled rows of `holdout`,
    with the random and heuristic baselines on the same rows.

    A polars `holdout` (a DataFrame, or a LazyFrame read a piece at a time) is scored a few grid
    times at a time (`_grid_time_chunks`), keeping only the keys and scores of each chunk; the
    metrics see the rows in `holdout`'s order, so they equal scoring the whole frame at once."""
    keys: list[pd.DataFrame] = []
    model_scores: list[np.ndarray] = []
    heuristic: list[np.ndarray] = []
    order: list[np.ndarray] = []
    placed = 0
    for chunk in _grid_time_chunks(holdout, HOLDOUT_ROWS_PER_CHUNK):
        df = to_pandas(chunk)
        df = df.loc[labels(df).notna().to_numpy()]
        # Where each row goes: its place in a DataFrame, else the order the pieces come in.
        order.append(df.pop(_ROW).to_numpy() if _ROW in df.columns else np.arange(placed, placed + len(df)))
        placed += len(df)
        model_scores.append(np.asarray(model.predict_risk(df), dtype=np.float64))
        heuristic.append(heuristic_scores(df))
        keys.append(df[[c for c in _METRIC_KEYS if c in df.columns]].reset_index(drop=True))
    rows = np.argsort(np.concatenate(order), kind="stable")
    df = pd.concat(keys, ignore_index=True).iloc[rows].reset_index(drop=True)
    scores = {
        "model": np.concatenate(model_scores)[rows],
        "random": random_scores(len(df)),
        "heuristic": np.concatenate(heuristic)[rows],
    }
    return {name: score_metrics(df, s, k=top_k) for name, s in scores.items()}


# What the metrics read of a scored frame (models.evaluate._prepared).
_METRIC_KEYS = ("ts", "gpu_uuid", "label", "time_to_failure_h")


def _grid_time_chunks(frame: Any, rows: int) -> Iterable[Any]:
    """`frame` in pieces of about `rows` rows, each holding whole grid times (the ensembles rank
    the GPUs of a grid time against each other).

    A DataFrame's rows are numbered by their place in it (column `_ROW`). A LazyFrame
    (`features.build.scan_features`) is read a piece at a time, each piece in (ts, gpu_uuid)
    order: the order `read_features` gives the same rows. A pandas frame is already in memory
    and comes whole."""
    import polars as pl

    lazy = isinstance(frame, pl.LazyFrame)
    if not (lazy or isinstance(frame, pl.DataFrame)) or "ts" not in frame.collect_schema().names():
        yield frame
        return
    if not lazy and frame.height <= rows:
        yield frame
        return
    if not lazy:
        frame = frame.with_row_index(_ROW)
    per_time = frame.group_by("ts").len().sort("ts")
    per_time = per_time.collect() if isinstance(per_time, pl.LazyFrame) else per_time
    if per_time.height == 0:
        yield frame.collect() if lazy else frame
        return
    piece = (per_time["len"].cum_sum() - per_time["len"]) // rows
    for times in per_time.with_columns(piece=piece).partition_by("piece", maintain_order=True):
        chunk = frame.filter(pl.col("ts").is_between(times["ts"][0], times["ts"][-1]))
        yield chunk.sort("ts", "gpu_uuid").collect() if lazy else chunk


def write_holdout_report(metrics: dict[str, Any], out_dir: Path, *, title: str) -> list[Path]:
    """`metrics.json`, `report.md` and `precision.png` (precision@K of each ranking) into
    `out_dir`, each written to a temporary name and renamed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = ["| ranking | precision@K | episodes caught | recall | PR-AUC |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, m in metrics.items():
        if not isinstance(m, dict) or "precision_at_k_mean" not in m:
            continue
        rows.append(
            f"| {name} | {m['precision_at_k_mean']:.3f} | {m.get('n_caught_at_k', 0)} of {m.get('n_episodes', 0)} "
            f"| {_fmt(m.get('recall_at_k'))} | {_fmt(m.get('pr_auc'))} |"
        )
    text = f"# {title}\n\n" + "\n".join(rows) + "\n"
    written = []
    for name, data in [
        ("metrics.json", json.dumps(metrics, indent=2, default=str).encode()),
        ("report.md", text.encode()),
    ]:
        written.append(write_file_atomic(out_dir / name, data))
    names = [n for n, m in metrics.items() if isinstance(m, dict) and "precision_at_k_mean" in m]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(names, [metrics[n]["precision_at_k_mean"] for n in names], color="#4878a8")
    ax.set_ylabel("precision@K (mean over grid times)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=80)
    plt.close(fig)
    written.append(write_file_atomic(out_dir / "precision.png", png.getvalue()))
    return written


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{float(value):.3f}"


# -- logging and registering -------------------------------------------------------------------


def _pyfunc_class() -> type:
    import mlflow.pyfunc

    class GpufailModel(mlflow.pyfunc.PythonModel):  # type: ignore[misc,name-defined]
        """A `TrainedModel` as an MLflow pyfunc: `predict` returns each row's risk."""

        def load_context(self, context: Any) -> None:
            self.model = load_model(context.artifacts[MODEL_FOLDER])

        def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> Any:
            return self.model.predict_risk(model_input)

    return GpufailModel


@dataclass(frozen=True)
class LoggedRun:
    run_id: str
    model_uri: str
    resumed: str | None = None
    """The status (RUNNING, FAILED, ...) of an unfinished run of the same job that this one
    finished, instead of logging a second run; None for a new or already finished run."""


def log_training_run(
    registry: Registry,
    model: TrainedModel,
    *,
    example: Any,
    metrics: dict[str, Any],
    report_dir: Path | None,
    fingerprint: dict[str, str],
    data_window: tuple[Any, Any],
    params: dict[str, Any] | None = None,
    tags: dict[str, str] | None = None,
    run_id: str | None = None,
    on_start: Callable[[str], None] | None = None,
) -> LoggedRun:
    """Log one training run: parameters (the model's and `params`), the data window, the
    dataset fingerprint, code and library versions, `metrics` (flattened), the files of
    `report_dir`, and the model as a pyfunc with a signature inferred from `example` (feature
    rows). A run already logged with the same `tags[DAY_TAG]` and fingerprint is returned as
    is, so a resumed job never logs twice.

    The run is created first, with its tags, and its id handed to `on_start` before anything
    else is logged (the nightly job records it). A process killed while logging leaves the run
    RUNNING: the next call with that `run_id` (or, with none, the unfinished run of the same day
    and fingerprint) logs into that run and finishes it, so the job still has one run. Models
    the interrupted run had begun to log are marked FAILED."""
    import mlflow
    from mlflow.models import infer_signature

    all_tags = {
        "gpufail.code_version": code_version(),
        "gpufail.model_version": model.version,
        "gpufail.kind": model.kind,
        "gpufail.data_fingerprint": json.dumps(fingerprint, sort_keys=True),
        **{f"gpufail.lib.{lib}": v for lib, v in model.versions.items()},
        **(tags or {}),
    }
    experiment_id = registry._experiment_id()
    existing = _finished_run(registry, experiment_id, all_tags)
    if existing is not None:
        return existing
    resumed = _unfinished_run(registry, experiment_id, all_tags, run_id)
    if resumed is not None:
        run_id, status = resumed.info.run_id, resumed.info.status
        _fail_unfinished_models(registry, experiment_id, run_id)
    else:
        created = registry.call("create the training run", registry.client.create_run, experiment_id, tags=all_tags)
        run_id, status = created.info.run_id, None
    if on_start is not None:
        on_start(run_id)
    design = model.design_matrix(to_pandas(example).head(5))
    signature = infer_signature(design, model.predict_risk(design))
    run_params = {
        "kind": model.kind,
        "train_start": model.train_start.isoformat(),
        "train_end": model.train_end.isoformat(),
        "horizon_h": model.horizon / pd.Timedelta(hours=1),
        "n_rows": model.n_rows,
        "n_positives": model.n_positives,
        "n_features": len(model.feature_columns),
        "negative_fraction": model.negative_fraction,
        "data_window_start": str(data_window[0]),
        "data_window_end": str(data_window[1]),
        **{f"model.{k}": v for k, v in model.params.items()},
        **(params or {}),
    }
    with tempfile.TemporaryDirectory(prefix="gpufail-log-") as tmp:
        folder = save_model(model, Path(tmp) / MODEL_FOLDER)

        def log() -> LoggedRun:
            mlflow.set_tracking_uri(registry.tracking_uri)
            with mlflow.start_run(run_id=run_id) as run:
                mlflow.set_tags(all_tags)
                mlflow.log_params({k: _param_value(v) for k, v in run_params.items()})
                mlflow.log_metrics(_flat_metrics(metrics))
                if report_dir is not None and report_dir.is_dir():
                    mlflow.log_artifacts(str(report_dir), artifact_path="report")
                info = mlflow.pyfunc.log_model(
                    name=MODEL_ARTIFACT,
                    python_model=_pyfunc_class()(),
                    artifacts={MODEL_FOLDER: str(folder)},
                    signature=signature,
                    input_example=design.head(2),
                    # Stated, not inferred: inference imports the model in a subprocess.
                    pip_requirements=[f"{lib}=={v}" for lib, v in model.versions.items() if lib != "python"],
                )
                # Found again by `_finished_run` when a resumed job logs the same day twice.
                mlflow.set_tag("gpufail.model_uri", info.model_uri)
                return LoggedRun(run.info.run_id, info.model_uri, status)

        return registry.call("log the training run", log)


def _finished_run(registry: Registry, experiment_id: str, tags: dict[str, str]) -> LoggedRun | None:
    if DAY_TAG not in tags:
        return None
    query = (
        f"tags.`{DAY_TAG}` = '{tags[DAY_TAG]}' and "
        f"tags.`gpufail.data_fingerprint` = '{tags['gpufail.data_fingerprint']}' and attributes.status = 'FINISHED'"
    )
    runs = registry.call("search earlier runs", registry.client.search_runs, [experiment_id], query, max_results=1)
    if not runs:
        return None
    run_id = runs[0].info.run_id
    uri = runs[0].data.tags.get("gpufail.model_uri") or f"runs:/{run_id}/{MODEL_ARTIFACT}"
    return LoggedRun(run_id, uri)


def _unfinished_run(registry: Registry, experiment_id: str, tags: dict[str, str], run_id: str | None) -> Any | None:
    """The run `run_id` if it is not finished, else an unfinished run of the same day and data
    fingerprint (a process killed between creating the run and recording its id); None when
    there is none to resume. Other unfinished runs of the same job are marked FAILED."""
    from mlflow.exceptions import MlflowException

    candidates = []
    if run_id is not None:
        try:
            candidates.append(registry.call("read the interrupted run", registry.client.get_run, run_id))
        except MlflowException as exc:
            if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND"):
                raise
    if DAY_TAG in tags:
        query = (
            f"tags.`{DAY_TAG}` = '{tags[DAY_TAG]}' and "
            f"tags.`gpufail.data_fingerprint` = '{tags['gpufail.data_fingerprint']}' and attributes.status != 'FINISHED'"
        )
        candidates += registry.call(
            "search interrupted runs",
            registry.client.search_runs,
            [experiment_id],
            query,
            order_by=["attributes.start_time DESC"],
        )
    unfinished = [r for r in candidates if r.info.status != "FINISHED" and r.info.lifecycle_stage == "active"]
    if not unfinished:
        return None
    chosen = unfinished[0]
    for other in {r.info.run_id for r in unfinished} - {chosen.info.run_id}:
        registry.call("close an interrupted run", registry.client.set_terminated, other, "FAILED")
    return chosen


def _fail_unfinished_models(registry: Registry, experiment_id: str, run_id: str) -> None:
    """Mark FAILED the models an interrupted run began to log and never finished."""
    from mlflow.entities import LoggedModelStatus

    models = registry.call(
        "search the run's models",
        registry.client.search_logged_models,
        [experiment_id],
        filter_string=f"source_run_id = '{run_id}'",
    )
    for model in models:
        if model.status != LoggedModelStatus.READY:
            registry.call("close an interrupted model", registry.client.finalize_logged_model, model.model_id, "FAILED")


def register(registry: Registry, run: LoggedRun) -> str:
    """Register the run's model under the registry's name (once: a version already made from
    this run is returned) and point the `challenger` alias at it. Returns the version."""
    import mlflow

    versions = registry.call("search model versions", registry.client.search_model_versions, f"run_id = '{run.run_id}'")
    mine = [v for v in versions if v.name == registry.name]
    if mine:
        version = str(max(int(v.version) for v in mine))
    else:
        mlflow.set_registry_uri(registry.tracking_uri)
        mlflow.set_tracking_uri(registry.tracking_uri)
        created = registry.call("register the model", mlflow.register_model, run.model_uri, registry.name)
        version = str(created.version)
    champion = registry.alias_version(CHAMPION)
    if champion is None or str(champion.version) != version:
        registry.call(
            "set the challenger alias", registry.client.set_registered_model_alias, registry.name, CHALLENGER, version
        )
    return version


# -- loading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedModel:
    model: TrainedModel
    version: str
    """The registry version, or `cache` plus the version when loaded from the local cache."""
    run_id: str
    source: str
    """`registry` or `cache`."""


def _load_version(registry: Registry, version: str, dest: Path) -> TrainedModel:
    """Download one version's artifacts into `dest` and unpickle its model."""
    import mlflow

    uri = f"models:/{registry.name}/{version}"

    def download() -> str:
        mlflow.set_registry_uri(registry.tracking_uri)
        mlflow.set_tracking_uri(registry.tracking_uri)
        return str(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dest)))

    local = Path(registry.call(f"download {uri}", download))
    folder = local / "artifacts" / MODEL_FOLDER
    try:
        return load_model(folder)
    except GpufailError as exc:
        raise RegistryError(
            f"{uri}: the model artifact is unusable ({exc}); retrain or promote another version"
        ) from exc


def load_version(registry: Registry, version: str) -> TrainedModel:
    """The `TrainedModel` of one registered version (warns on library-version mismatch)."""
    with tempfile.TemporaryDirectory(prefix="gpufail-model-") as tmp:
        return _load_version(registry, version, Path(tmp))


CACHE_FILE = "champion.json"


def load_champion(
    tracking_uri: str,
    name: str,
    *,
    cache_dir: Path | None = None,
    retries: int = 3,
    backoff_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
) -> LoadedModel:
    """The model the `champion` alias points at, with its version.

    With `cache_dir`, the champion is also copied there, and when the tracking server cannot be
    reached the copy is used instead (with a warning): scoring goes on with the last champion
    loaded. Raises `RegistryError` when there is no champion, or no server and no copy."""
    try:
        registry = Registry(tracking_uri, name, retries=retries, backoff_s=backoff_s, sleep=sleep)
        found = registry.alias_version(CHAMPION)
        if found is None:
            raise RegistryError(
                f"registered model {name!r} on {tracking_uri}: no version has the alias {CHAMPION!r} yet; "
                "run `gpufail nightly` until a model passes the promotion gate"
            )
        version = str(found.version)
        if cache_dir is None:
            return LoadedModel(load_version(registry, version), version, str(found.run_id), "registry")
        return _load_through_cache(registry, version, str(found.run_id), cache_dir)
    except RegistryError as exc:
        if cache_dir is None or not _unreachable(exc.__cause__ or exc):
            raise
        cached = _cached_champion(cache_dir, name)
        if cached is None:
            raise RegistryError(f"{exc}; and no cached champion under {cache_dir} to fall back on") from exc
        warnings.warn(
            f"{exc}; scoring with the last champion loaded (version {cached.version}, cached in {cache_dir})",
            RuntimeWarning,
            stacklevel=2,
        )
        return cached


def _load_through_cache(registry: Registry, version: str, run_id: str, cache_dir: Path) -> LoadedModel:
    target = cache_dir / registry.name
    info = _read_cache_info(target)
    if info is not None and info.get("version") == version:
        try:
            return LoadedModel(load_model(target / MODEL_FOLDER), version, run_id, "registry")
        except GpufailError:
            pass  # a damaged copy: download again below
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".tmp-{uuid.uuid4().hex}"
    try:
        model = _load_version(registry, version, staging)
        shutil.rmtree(staging / "artifacts" / MODEL_FOLDER / "__pycache__", ignore_errors=True)
        fresh = target.parent / f".tmp-{uuid.uuid4().hex}"
        fresh.mkdir()
        os.replace(staging / "artifacts" / MODEL_FOLDER, fresh / MODEL_FOLDER)
        (fresh / CACHE_FILE).write_text(json.dumps({"name": registry.name, "version": version, "run_id": run_id}))
        old = target.parent / f".old-{uuid.uuid4().hex}"
        if target.exists():
            os.replace(target, old)
        os.replace(fresh, target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return LoadedModel(model, version, run_id, "registry")


def _read_cache_info(target: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((target / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _cached_champion(cache_dir: Path, name: str) -> LoadedModel | None:
    target = cache_dir / name
    info = _read_cache_info(target)
    if info is None:
        return None
    return LoadedModel(load_model(target / MODEL_FOLDER), str(info["version"]), str(info.get("run_id", "")), "cache")


# -- the promotion gate ------------------------------------------------------------------------


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    reason: str
    challenger: dict[str, Any]
    champion: dict[str, Any] | None
    champion_version: str | None = None


def _headline(metrics: dict[str, Any]) -> tuple[float, float | None]:
    precision = float(metrics.get("precision_at_k_mean") or 0.0)
    recall = metrics.get("recall_at_k")
    return precision, None if recall is None else float(recall)


_SUMMARY_KEYS = ("precision_at_k_mean", "precision_at_k_pooled", "recall_at_k", "n_episodes", "n_caught_at_k", "pr_auc")


def _summary(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics a decision is recorded with (a tag holds at most 5000 characters)."""
    return {key: metrics.get(key) for key in _SUMMARY_KEYS}


def gate(
    challenger: dict[str, Any],
    champion: dict[str, Any] | None,
    *,
    margin: float,
    recall_tolerance: float,
    floor: float,
) -> tuple[bool, str]:
    """Whether the challenger replaces the champion, and why, from their metrics on the same
    held-out window (`score_metrics` dicts).

    Without a champion: promote when precision@K >= `floor`. With one: promote when precision@K
    >= the champion's + `margin` and recall >= the champion's - `recall_tolerance`."""
    p, r = _headline(challenger)
    if champion is None:
        if p + 1e-9 >= floor:
            return True, f"no champion yet; precision@K {p:.3f} reaches the floor {floor:.3f}"
        return False, f"no champion yet, but precision@K {p:.3f} is below the floor {floor:.3f}"
    if int(challenger.get("n_episodes") or 0) == 0:
        return False, "the held-out window has no failure episodes: nothing to compare on, the champion stays"
    cp, cr = _headline(champion)
    # The epsilon keeps 0.28 + 0.02 from exceeding 0.30 in binary floating point.
    if p + 1e-9 < cp + margin:
        return False, f"precision@K {p:.3f} does not beat the champion's {cp:.3f} by the margin {margin:.3f}"
    if r is not None and cr is not None and r + 1e-9 < cr - recall_tolerance:
        return False, (
            f"precision@K {p:.3f} beats the champion's {cp:.3f}, but recall {r:.3f} is below the champion's "
            f"{cr:.3f} by more than the tolerance {recall_tolerance:.3f}"
        )
    return True, f"precision@K {p:.3f} beats the champion's {cp:.3f} by at least {margin:.3f}" + (
        f"; recall {r:.3f} vs {cr:.3f}" if r is not None and cr is not None else ""
    )


def promote_if_better(
    registry: Registry,
    version: str,
    holdout: Any,
    *,
    top_k: int,
    margin: float,
    recall_tolerance: float,
    floor: float,
    challenger_model: TrainedModel | None = None,
    challenger_metrics: dict[str, Any] | None = None,
) -> GateDecision:
    """Compare registered `version` with the champion on `holdout` (the most recent held-out
    window), move the `champion` alias to it if `gate` says so, and record the decision and its
    reason as tags of the version and of its run. A version already decided is not re-judged.

    `challenger_metrics`: the version's `holdout_metrics(...)["model"]` on this same window and
    K when the caller has them (the nightly job's evaluation step): scoring it again cost the
    paper fleet's nightly 38 s."""
    mv = registry.call("read the model version", registry.client.get_model_version, registry.name, version)
    if GATE_TAG in (mv.tags or {}):
        recorded = json.loads(mv.tags[GATE_TAG])
        return GateDecision(**recorded)
    champion_mv = registry.alias_version(CHAMPION)
    if champion_mv is not None and str(champion_mv.version) == version:
        return GateDecision(False, f"version {version} is already the champion", {}, None, version)
    if challenger_metrics is not None:
        mine = challenger_metrics
    else:
        challenger = challenger_model or load_version(registry, version)
        mine = holdout_metrics(challenger, holdout, top_k)["model"]
    theirs = None
    if champion_mv is not None:
        try:
            theirs = holdout_metrics(load_version(registry, str(champion_mv.version)), holdout, top_k)["model"]
        except RegistryError as exc:
            if _unreachable(exc.__cause__ or exc):
                raise
            # A champion that no longer loads (corrupt artifact, incompatible pickle) cannot
            # serve; any challenger that reaches the floor is better than it.
            theirs = None
            warnings.warn(
                f"champion version {champion_mv.version} cannot be loaded ({exc}); judging against the floor",
                RuntimeWarning,
                stacklevel=2,
            )
    promote, reason = gate(mine, theirs, margin=margin, recall_tolerance=recall_tolerance, floor=floor)
    decision = GateDecision(
        promote,
        reason,
        _summary(mine),
        None if theirs is None else _summary(theirs),
        None if champion_mv is None else str(champion_mv.version),
    )
    if promote:
        registry.call(
            "set the champion alias", registry.client.set_registered_model_alias, registry.name, CHAMPION, version
        )
        challenger_alias = registry.alias_version(CHALLENGER)
        if challenger_alias is not None and str(challenger_alias.version) == version:
            registry.call(
                "clear the challenger alias", registry.client.delete_registered_model_alias, registry.name, CHALLENGER
            )
    record = json.dumps(asdict(decision), default=str)
    registry.call(
        "record the decision", registry.client.set_model_version_tag, registry.name, version, GATE_TAG, record
    )
    registry.call("record the reason", registry.client.set_tag, mv.run_id, REASON_TAG, reason)
    return decision
