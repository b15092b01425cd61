"""`gpufail nightly`: the retraining job, once a day.

ingest (new kernel-log lines) -> compact (each settled day's small part files into a few) ->
features (new days, and the recent days whose labels the new data settles) -> train (the most
recent window before the held-out window) -> evaluate (on the held-out window) -> register (an
MLflow run and a model version, alias `challenger`) -> gate (`champion` moves only on evidence)
-> score (the fleet, with the champion loaded by alias) ->
publish (the action policy; dry run unless configured otherwise).

The job is keyed by its day, the date of the newest telemetry partition. Each completed step
is recorded in the store's state (`_state/nightly.json`) with what it produced, so:
- a second run for the same day finds every step done and changes nothing;
- a run that crashed resumes at the first step not done (MLflow logging and registration are
  themselves idempotent: a run for this day and data fingerprint, or a version made from that
  run, is reused);
- a new day starts from the first step.
A file lock (`flock`, released by the kernel when the process dies, so a crash leaves no stale
lock) keeps two runs from overlapping. When a step fails, the champion keeps serving: the job
still scores and publishes with it (falling back to the last champion loaded when the registry
is down), without marking those steps done, and then exits non-zero naming the failed step.

The night builds, trains and scores with the champion's feature spec (the settings its
training features were built with): the challenger is judged against the champion on the same
held-out features, and the champion keeps scoring the features the night builds. The spec of
the configuration is used only while there is no champion; a configuration that differs is
reported, and takes effect once a model trained on features rebuilt with it is promoted.
The steps are the functions the commands call (`gpufail.config.Settings.nightly_options`
makes the options from the same settings).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

from features.runner import BuildOptions
from features.spec import FeatureSpec
from ingest.errors import ConfigError, GpufailError
from ingest.locking import exclusive_lock
from ingest.store import Store
from models.train import TrainOptions
from serving.publishing import PublishOptions

STEPS = ("ingest", "compact", "features", "train", "evaluate", "register", "gate", "score", "publish")
SERVING_STEPS = ("score", "publish")
STATE = "nightly"


class NightlyError(GpufailError):
    """A nightly step failed (the champion keeps serving), or another run holds the lock."""


@dataclass(frozen=True, kw_only=True)
class NightlyOptions:
    """Everything the job needs, as plain values (`gpufail.config.Settings.nightly_options`)."""

    work_dir: Path
    tracking_uri: str
    model_name: str
    experiment: str
    train: TrainOptions
    """The fit, as `gpufail train` makes it (with the [nightly] parameters and negative share);
    each night sets its window end, and its horizon and feature spec to the night's spec."""
    top_k: int
    holdout_days: float
    promotion_margin: float
    recall_tolerance: float
    precision_floor: float
    feature_spec: FeatureSpec = field(default_factory=FeatureSpec)
    """The configuration's spec: the night's while there is no champion (see the module notes)."""
    build: BuildOptions = field(default_factory=BuildOptions)
    retries: int = 3
    backoff_s: float = 2.0
    cluster: str = "default"
    dedup_window: timedelta = timedelta(minutes=5)
    ingest_workers: int = 1
    compact_settle: timedelta = timedelta(hours=6)
    """Days that ended less than this long ago are not compacted (`ingest.compact`)."""


@dataclass
class NightlySummary:
    day: str
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    already_done: bool = False
    results: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def unreadable_kernel_logs(self) -> list[str]:
        """The kernel-log files the ingest step could not read (and skipped)."""
        return list(self.results.get("ingest", {}).get("unreadable_files", []))

    def line(self) -> str:
        if self.already_done:
            return f"nightly {self.day}: already complete, nothing to do"
        gate = self.results.get("gate", {})
        score = self.results.get("score", {})
        parts = [f"nightly {self.day}: ran {', '.join(self.done) or 'nothing'}"]
        if self.skipped:
            parts.append(f"skipped {', '.join(self.skipped)}")
        if unreadable := self.unreadable_kernel_logs():
            parts.append(f"{len(unreadable)} unreadable kernel-log files skipped (first: {unreadable[0]})")
        if "reason" in self.results.get("train", {}):
            parts.append(f"no training: {self.results['train']['reason']}")
        if gate:
            verdict = "promoted" if gate.get("promote") else "kept the champion"
            parts.append(f"version {gate.get('version')} {verdict} ({gate.get('reason')})")
        if score:
            parts.append(f"scored {score.get('gpus')} GPUs with champion version {score.get('version')}")
        return "; ".join(parts) + f" in {self.seconds:.1f}s"


def default_work_dir(root: str, configured: str) -> Path:
    """`configured`, else DATA/_nightly for a local data root."""
    if configured:
        return Path(configured)
    if "://" in root and not root.startswith("file://"):
        raise ConfigError(
            f"[nightly] work_dir: the data root {root} is not a local folder; set work_dir to a local folder "
            "for the lock, the model being trained and the champion cache"
        )
    return Path(root.removeprefix("file://")) / "_nightly"


@contextmanager
def job_lock(work_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on work_dir/nightly.lock, or fail at once if another run holds it."""
    with exclusive_lock(work_dir / "nightly.lock", "`gpufail nightly`", error=NightlyError):
        yield


def job_day(store: Store) -> str:
    """The day a run is for: the date of the newest telemetry partition."""
    days = store.dates("telemetry")
    if not days:
        raise NightlyError(f"{store.root}: no telemetry; collect or simulate data before running the nightly job")
    return days[-1].isoformat()


def run_nightly(
    root: str,
    options: NightlyOptions,
    *,
    publish: Publish,
    report: Callable[[str], None] = print,
    sleep: Callable[[float], None] = time.sleep,
) -> NightlySummary:
    """Run (or resume, or confirm) the nightly job for the newest day of data under `root`;
    `publish` is the last step (`policy_publisher`)."""
    began = time.perf_counter()
    store = Store.open(root)
    with job_lock(options.work_dir):
        day = job_day(store)
        state = store.read_state(STATE)
        if state is None or state.get("day") != day:
            state = {"day": day, "steps": {}, "started_at": _now()}
        summary = NightlySummary(day=day)
        if all(step in state["steps"] for step in STEPS):
            summary.already_done = True
            summary.results = dict(state["steps"])
            return summary
        job = _Job(store, options, day, state, publish, sleep, report)
        for step in STEPS:
            if step in state["steps"]:
                summary.results[step] = state["steps"][step]
                continue
            report(f"nightly {day}: {step} ...")
            step_began = time.perf_counter()
            try:
                result = job.run(step)
            except Exception as exc:
                summary.seconds = time.perf_counter() - began
                raise job.fail(step, exc, report) from exc
            # Kept in the state file, so an operator sees which step a slow night spent its time in.
            result["seconds"] = round(time.perf_counter() - step_began, 1)
            state["steps"][step] = result
            state.pop("failed", None)
            store.write_state(STATE, state)
            summary.results[step] = result
            (summary.skipped if result.get("skipped") else summary.done).append(step)
        state["completed_at"] = _now()
        store.write_state(STATE, state)
    summary.seconds = time.perf_counter() - began
    return summary


def _now() -> str:
    return datetime.now(UTC).isoformat()


def retrain_reach(newest_day: date, options: NightlyOptions, spec: FeatureSpec) -> datetime:
    """The earliest grid time a retrain with the night's `spec` reads when the newest feature
    day is `newest_day`.

    Its held-out window ends where labels settle, a horizon before the newest row (which is on
    that day), and is `holdout_days` long; the fit's labels end a horizon before that window,
    and its rows go back `train_window` more (with a calibration, the calibration slice and
    another horizon lie in between). A day of margin on top."""
    from models.split import as_timedelta

    newest_start = datetime(newest_day.year, newest_day.month, newest_day.day, tzinfo=UTC)
    train = options.train
    train_window = as_timedelta(train.train_window, "train_window").to_pytimedelta()
    reach = timedelta(days=options.holdout_days) + 2 * spec.horizon + train_window
    if train.calibration is not None:
        reach += as_timedelta(train.calibration_window, "calibration_window").to_pytimedelta() + spec.horizon
    return newest_start - reach - timedelta(days=1)


_HELD_UNTIL = {"_keys": "train", "_holdout": "gate", "_champion": "gate"}
"""What `_Job` keeps between steps, and the last step that reads it."""

_CHAMPION_KEY = "champion"
"""The champion's name among the models the evaluation scores."""
_CHAMPION_METRICS_FILE = "champion-metrics.json"
"""In the day's folder: the version the evaluation judged as the champion, and its metrics."""
_EXAMPLE_FILE = "example.parquet"
_EXAMPLE_ROWS = 5


def _keeping_an_example(parts: Iterator[Any], example: list[Any]) -> Iterator[Any]:
    """`parts` as they come, the first rows of the first one put in `example` on the way."""
    for part in parts:
        if not example:
            example.append(part.head(_EXAMPLE_ROWS))
        yield part


class _Job:
    """The steps of one day's run. Each returns a JSON-ready record of what it did."""

    def __init__(
        self,
        store: Store,
        options: NightlyOptions,
        day: str,
        state: dict[str, Any],
        publish: Publish,
        sleep: Callable[[float], None],
        report: Callable[[str], None] = print,
    ) -> None:
        self.store = store
        self.report = report
        self.publish = publish
        self.o = options
        self.day = day
        self.state = state
        self.sleep = sleep
        self.folder = options.work_dir / day
        self._keys: Any = None
        self._holdout: Any = None
        self._champion: Any = None
        self._registry: Any = None
        self._spec: FeatureSpec | None = None
        self._served: dict[str, Any] = {}

    def run(self, step: str) -> dict[str, Any]:
        if step in ("evaluate", "register", "gate") and self.state["steps"].get("train", {}).get("skipped"):
            return {"skipped": True, "reason": "no model was trained"}
        result: dict[str, Any] = getattr(self, f"_{step}")()
        # Rows read for later steps are let go after their last reader: otherwise the held-out
        # window (4 GB on the paper fleet, computed on demand) is held while scoring computes
        # the newest hour.
        for held, last_reader in _HELD_UNTIL.items():
            if step == last_reader:
                setattr(self, held, None)
        if step == "train":
            # and the labels the retrain's reads shared (`features.label_rows`)
            from features.label_rows import forget

            forget(self.store)
        return result

    # -- failure -------------------------------------------------------------------------------

    def fail(self, step: str, exc: Exception, report: Callable[[str], None]) -> NightlyError:
        """Record the failure, keep the champion serving, and say what happened."""
        message = self._explain(exc)
        self.state["failed"] = {"step": step, "error": message, "at": _now(), "trace": traceback.format_exc()[-4000:]}
        notes = []
        try:
            self.store.write_state(STATE, self.state)
        except Exception as write_exc:  # a full disk: the log below still says what failed
            notes.append(f"the job state could not be saved either ({type(write_exc).__name__})")
        if STEPS.index(step) < STEPS.index("score"):
            try:
                served = self._score()
                self._publish()
                notes.append(
                    f"the champion (version {served['version']}, from the {served['source']}) scored the fleet and "
                    "publishing went on"
                )
            except Exception as serve_exc:
                detail = str(serve_exc) if isinstance(serve_exc, GpufailError) else type(serve_exc).__name__
                notes.append(f"no champion could score the fleet ({detail})")
        else:
            notes.append("the champion keeps serving")
        for note in notes:
            report(f"nightly {self.day}: {note}")
        return NightlyError(
            f"nightly {self.day}: step {step} failed: {message}; " + "; ".join(notes) + "; run `gpufail nightly` "
            "again to resume from this step"
        )

    def _explain(self, exc: Exception) -> str:
        """The failure in words. A reader's error on a damaged feature file does not say which
        file (polars: "parquet: File out of specification"): the files the retrain reaches are
        read one by one to name it."""
        if isinstance(exc, GpufailError):
            return str(exc)
        message = f"{type(exc).__name__}: {exc}"
        import polars as pl
        import pyarrow as pa

        from features.dataset import feature_days, features_dataset

        if isinstance(exc, (pl.exceptions.PolarsError, pa.ArrowException)):
            days = feature_days(self.store)
            # The spec known so far: naming the damaged file must not itself need the registry.
            reach = retrain_reach(days[-1], self.o, self._spec or self.o.feature_spec).date() if days else None
            unreadable = self.store.unreadable(features_dataset(self.store), reach)
            if unreadable is not None:
                return f"{unreadable} ({message})"
        return message

    # -- helpers -------------------------------------------------------------------------------

    def registry(self) -> Any:
        from models.registry import Registry

        if self._registry is None:
            self._registry = Registry(
                self.o.tracking_uri,
                self.o.model_name,
                experiment=self.o.experiment,
                retries=self.o.retries,
                backoff_s=self.o.backoff_s,
                sleep=self.sleep,
            )
        return self._registry

    def spec(self) -> FeatureSpec:
        """The night's feature spec: the champion's; the configuration's while there is none
        (see the module notes). With the registry unreachable and no cached champion, the spec
        the store's features record (the one the champion has been scoring)."""
        from features.manifest import recorded_spec
        from models.registry import CHAMPION, RegistryError

        if self._spec is not None:
            return self._spec
        configured, spec, whose = self.o.feature_spec, None, "the champion's"
        try:
            has_champion = self.registry().alias_version(CHAMPION) is not None
        except RegistryError:
            has_champion = True  # unreachable: the cached champion, if there is one
        if has_champion:
            try:
                spec = self._load_champion().model.feature_spec
            except RegistryError as exc:
                spec, whose = recorded_spec(self.store), "the store's features'"
                self.report(f"nightly {self.day}: the champion's feature spec is unknown ({exc}); using {whose}")
        if spec is None:
            spec, whose = configured, "the configuration's"
        if spec != configured:
            differ = ", ".join(name for name, _, _ in configured.differences(spec))
            self.report(
                f"nightly {self.day}: the configured feature settings ({differ}) differ from {whose} feature spec "
                f"{spec.fingerprint}; the night builds, trains and scores with it (see docs/feature-spec.md)"
            )
        self._spec = spec
        return spec

    def _load_champion(self) -> Any:
        """The champion (`LoadedModel`): the feature spec, the evaluation and scoring read it,
        loaded once until the gate may move it (`_HELD_UNTIL`)."""
        from models.registry import load_champion

        if self._champion is None:
            self._champion = load_champion(
                self.o.tracking_uri,
                self.o.model_name,
                cache_dir=self.o.work_dir / "champion",
                retries=self.o.retries,
                backoff_s=self.o.backoff_s,
                sleep=self.sleep,
            )
        return self._champion

    def keys(self) -> Any:
        """ts, gpu_uuid and label of the feature rows a retrain can reach (`retrain_reach`):
        where labels settle and where failures are, without the hundreds of feature columns.
        Reading every day's keys grew with the history (87M rows for the 120-day paper fleet)."""
        from features.dataset import feature_days, read_features

        if self._keys is None:
            days = feature_days(self.store)
            start = retrain_reach(days[-1], self.o, self.spec()) if days else None
            self._keys = read_features(self.store, start=start, columns=["label"])
            if self._keys.height == 0:
                raise NightlyError(f"{self.store.root}: the features dataset is empty after the features step")
        return self._keys

    def holdout(self) -> Any:
        """The labelled rows of the held-out window as a polars LazyFrame, read a few grid times
        at a time. Computed on demand, it is computed whole first (9.6 GB on the paper fleet):
        the evaluation reads the window in parts of whole GPUs instead (`_holdout_rows`), and
        this is for what must see whole grid times."""
        import polars as pl

        from features.dataset import scan_features

        if self._holdout is None:
            start, end = self._holdout_bounds()
            rows = scan_features(self.store, start=start, end=end)
            self._holdout = rows.filter(pl.col("label").is_not_null())
        return self._holdout

    def _holdout_bounds(self) -> tuple[datetime, datetime]:
        train = self.state["steps"]["train"]
        start, last = datetime.fromisoformat(train["holdout_start"]), datetime.fromisoformat(train["holdout_end"])
        return start, last + timedelta(microseconds=1)

    def _holdout_rows(self, models: Any) -> tuple[Any, bool]:
        """The held-out window for `models.gate.holdout_metrics_of`, and whether it comes in parts
        of whole GPUs: computed on demand part by part when every model scores each row alone
        (nothing holds the whole window), else `holdout`."""
        from features.dataset import computed
        from features.on_demand import iter_features_on_demand

        if computed(self.store) and all(model.scores_each_row_alone for model in models):
            return iter_features_on_demand(self.store, *self._holdout_bounds()), True
        return self.holdout(), False

    def _champion_to_judge(self) -> Any:
        """The champion (`LoadedModel`) that the gate compares the night's model with, scored in
        the evaluation's pass over the held-out window; None when there is none or it does not
        load (the gate then finds the same and says why)."""
        from models.registry import RegistryError

        try:
            return self._load_champion()
        except RegistryError:
            return None

    # -- the steps -----------------------------------------------------------------------------

    def _ingest(self) -> dict[str, Any]:
        from ingest.kernel_log_import import ingest_kernel_logs

        folder = Path(self.store.path("raw", "kernel-log"))
        paths = sorted(p for p in folder.glob("*") if p.is_file()) if self.store.fs.exists(str(folder)) else []
        if not paths:
            return {"kernel_log": "no kernel-log files under raw/kernel-log"}
        summary = ingest_kernel_logs(
            self.store, paths, cluster=self.o.cluster, dedup_window=self.o.dedup_window, workers=self.o.ingest_workers
        )
        # A file that cannot be read is skipped and the night goes on; the job's exit status
        # and the metric `gpufail_kernel_log_unreadable_files` say so.
        return {"kernel_log": str(summary), "unreadable_files": summary.unreadable_files}

    def _compact(self) -> dict[str, Any]:
        from ingest.compact import compact

        return {"compact": compact(self.store, settle=self.o.compact_settle).line()}

    def _features(self) -> dict[str, Any]:
        from features.aggregates import build_aggregates
        from features.plan import FeaturesExistError

        spec = self.spec()
        # The stored aggregates: the new days, and those built before their telemetry ended.
        # Labels are computed when read, so they settle without a rebuild. Aggregates of another
        # grid or silence are refused (`build_aggregates`): someone built them on purpose.
        try:
            summary = str(build_aggregates(self.store, spec))
        except FeaturesExistError as done:
            summary = f"aggregates: up to date: {done.files} files cover {done.start}..{done.last}"
        return {"features": summary, "feature_spec": spec.fingerprint}

    def _train(self) -> dict[str, Any]:
        import polars as pl

        from models.provenance import dataset_fingerprint
        from models.split import as_timedelta
        from models.train import calibration_bounds, save_model, settled_until
        from models.train_store import train_model_from_store

        spec = self.spec()
        options = replace(self.o.train, horizon=spec.horizon, feature_spec=spec)
        frame = self.keys()
        settled = settled_until(frame, spec.horizon)
        holdout_start = settled - timedelta(days=self.o.holdout_days) + spec.grid
        options = replace(options, as_of=holdout_start)
        # The fit's labels end a horizon before the held-out window: it never sees them. Its
        # calibration slice is the end of its window, scored by a fit whose labels end a horizon
        # before the slice (`models.train.calibration_bounds`).
        calibration = None if options.calibration is None else calibration_bounds(settled, options)
        train_window = as_timedelta(options.train_window, "train_window")
        window_end = holdout_start - spec.horizon
        window_start = window_end - train_window
        slices = {"training window": (window_start, window_end)}
        if calibration is not None:
            slices["calibration slice"] = calibration
            scorer_end = calibration[0] - spec.horizon
            slices["window of the fit that scores the calibration slice"] = (scorer_end - train_window, scorer_end)
        base = {
            "holdout_start": holdout_start.isoformat(),
            "holdout_end": settled.isoformat(),
            "window_start": window_start.isoformat(),
            "window_end": window_end.isoformat(),
            "fingerprint": dataset_fingerprint(self.store, ["telemetry", "xid_events", "features"]),
        }
        if calibration is not None:
            base["calibration_start"], base["calibration_end"] = (t.isoformat() for t in calibration)
        for what, (start, end) in slices.items():
            if not frame.filter((pl.col("ts") >= start) & (pl.col("ts") < end))["label"].sum():
                return {
                    **base,
                    "skipped": True,
                    "reason": f"the {what} {start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M} "
                    "has no failures; no model trained, the champion stays",
                }
        model = train_model_from_store(self.store, options)
        path = save_model(model, self.folder / "model")
        return {**base, "model_dir": str(path), "model_version": model.version, "positives": model.n_positives}

    def _evaluate(self) -> dict[str, Any]:
        import io
        import json

        from models.gate import holdout_metrics_of, write_holdout_report
        from models.train import load_model, write_file_atomic

        train = self.state["steps"]["train"]
        models = {"model": load_model(train["model_dir"])}
        champion = self._champion_to_judge()
        if champion is not None:
            models[_CHAMPION_KEY] = champion.model
        rows, in_gpu_parts = self._holdout_rows(models.values())
        example: list[Any] = []
        if in_gpu_parts:
            rows = _keeping_an_example(rows, example)
        else:
            example.append(rows.head(_EXAMPLE_ROWS).collect())
        metrics = holdout_metrics_of(models, rows, self.o.top_k, in_gpu_parts=in_gpu_parts)
        theirs = metrics.pop(_CHAMPION_KEY, None)
        report = self.folder / "report"
        title = f"held-out window {train['holdout_start'][:16]} to {train['holdout_end'][:16]}, K={self.o.top_k}"
        write_holdout_report(metrics, report, title=title)
        # For the register step's model signature, and the gate's comparison: the window is
        # not read again for them.
        buffer = io.BytesIO()
        example[0].write_parquet(buffer)
        write_file_atomic(self.folder / _EXAMPLE_FILE, buffer.getvalue())
        judged = self.folder / _CHAMPION_METRICS_FILE
        if champion is None:
            judged.unlink(missing_ok=True)
        else:
            record = {"version": champion.version, "metrics": theirs}
            write_file_atomic(judged, json.dumps(record, indent=2, default=str).encode())
        m = metrics["model"]
        return {
            "report": str(report),
            "precision_at_k": m["precision_at_k_mean"],
            "recall_at_k": m.get("recall_at_k"),
            "episodes": m.get("n_episodes"),
            "champion_version": None if champion is None else champion.version,
        }

    def _register(self) -> dict[str, Any]:
        import json

        import pandas as pd

        from models.registry import DAY_TAG, log_training_run, register
        from models.split import as_timedelta
        from models.train import load_model

        train, evaluate = self.state["steps"]["train"], self.state["steps"]["evaluate"]
        model = load_model(train["model_dir"])

        def started(run_id: str) -> None:
            # Recorded before anything is logged: a run killed now is finished by the resume,
            # not left RUNNING beside a second run.
            self.state["register_run_id"] = run_id
            self.store.write_state(STATE, self.state)

        metrics = json.loads((Path(evaluate["report"]) / "metrics.json").read_text())
        logged = log_training_run(
            self.registry(),
            model,
            example=self._example(),
            metrics=metrics,
            report_dir=Path(evaluate["report"]),
            fingerprint=train["fingerprint"],
            data_window=(train["window_start"], train["holdout_end"]),
            params={
                "holdout_start": train["holdout_start"],
                "holdout_end": train["holdout_end"],
                "top_k": self.o.top_k,
                "train_window_days": as_timedelta(self.o.train.train_window, "train_window") / pd.Timedelta(days=1),
            },
            tags={DAY_TAG: self.day},
            run_id=self.state.get("register_run_id"),
            on_start=started,
        )
        if logged.resumed:
            self.report(
                f"nightly {self.day}: register: finished MLflow run {logged.run_id}, left {logged.resumed} "
                "by an interrupted run, instead of logging a second one"
            )
        version = register(self.registry(), logged)
        self.state.pop("register_run_id", None)
        return {"run_id": logged.run_id, "version": version, "resumed_run": logged.resumed}

    def _example(self) -> Any:
        """A few held-out rows for the model's signature, kept by the evaluation step (read
        from the window when a run from before it kept them resumes here)."""
        import polars as pl

        kept = self.folder / _EXAMPLE_FILE
        return pl.read_parquet(kept) if kept.exists() else self.holdout().head(_EXAMPLE_ROWS).collect()

    def _gate(self) -> dict[str, Any]:
        import json

        from models.gate import promote_if_better

        version = self.state["steps"]["register"]["version"]
        # The evaluation step scored this model, and the champion of then, on the same held-out
        # window and K; the window is read again only for a champion promoted since.
        evaluated = json.loads((Path(self.state["steps"]["evaluate"]["report"]) / "metrics.json").read_text())
        judged = self.folder / _CHAMPION_METRICS_FILE
        champion = json.loads(judged.read_text()) if judged.exists() else None
        decision = promote_if_better(
            self.registry(),
            version,
            self.holdout,
            top_k=self.o.top_k,
            margin=self.o.promotion_margin,
            recall_tolerance=self.o.recall_tolerance,
            floor=self.o.precision_floor,
            challenger_metrics=evaluated["model"],
            champion_metrics=None if champion is None else (champion["version"], champion["metrics"]),
        )
        return {
            "version": version,
            "promote": decision.promote,
            "reason": decision.reason,
            "champion_before": decision.champion_version,
        }

    def _score(self) -> dict[str, Any]:
        from serving.score_store import score_store

        loaded = self._load_champion()
        # `gpufail score`'s function: refused when the features are not of the champion's spec.
        # A resumed job that scores the same grid time with the same model replaces the snapshot.
        scored = score_store(self.store, loaded.model)
        self._served = {
            "version": loaded.version,
            "source": loaded.source,
            "model_version": loaded.model.version,
            "ts": str(scored.predictions["ts"].max()),
            "gpus": len(scored.predictions),
            "path": scored.path,
        }
        return dict(self._served)

    def _publish(self) -> dict[str, Any]:
        from serving.predictions import newest_snapshot

        # The snapshot the score step just wrote is the newest (the latest grid time, written last).
        latest = newest_snapshot(self.store)
        if latest is None:
            raise NightlyError(f"{self.store.root}: no predictions to publish")
        return self.publish(self.store, latest.frame)


Publish = Callable[[Store, Any], dict[str, Any]]
"""Publishes the latest predictions (a pandas frame) of a store; returns a record of it."""


def policy_publisher(options: PublishOptions) -> Publish:
    """The `gpufail publish` path (action policy, configured target, audit log) as a step, with
    the options the command makes (`gpufail.config.Settings.publish_options`)."""

    def publish(store: Store, latest: Any) -> dict[str, Any]:
        from collections import Counter

        from serving.publishing import publish_latest

        outcome, path = publish_latest(store, latest, options)
        return {
            "mode": options.mode,
            "target": options.target,
            "actions": dict(Counter(r.action for r in outcome.rows)),
            "scheduler_error": outcome.scheduler_error,
            "notices": outcome.notices,
            "path": path,
        }

    return publish
