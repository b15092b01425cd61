"""Walk-forward (sliding) training and scoring of several contenders over a test period.

At every retraining time r (test_start, test_start + retrain_every, ...) a contender's model is
made as `gpufail train` makes the served one: trained on the window whose labels end a full
`horizon` before r (a row at ts has its label window (ts, ts + horizon], known only once
ts + horizon < r), and calibrated by the map fitted on the `calibration_window` of labelled
rows at the end of that window as scored, out of time, by the fit made as of the slice's start
(the model of an earlier retrain when there was one then). It then scores the grid times of
[r, r + retrain_every): `scores` holds the uncalibrated risk (the ranking), `calibrated` the
calibrated one. The first retrain's slice, the days just before the test period, is also
where the comparison chooses its operating points (`WalkForwardResult.validation`, scored
out of time by the fit that calibrates the first model). Modes:

- `static`: trained once, at test_start, on `train_window`; scores the whole test period (the
  baseline: what a model trained once and left alone does as the fleet drifts);
- `sliding`: retrained at every r on the most recent `train_window`;
- `auto`: each of `candidate_windows` is run as a sliding track of its own (retrained at every
  r, and on the days before the test period that validation needs); at every r the window
  whose track ranked best on the most recent `validation_window` of settled labels,
  [r - horizon - validation_window, r - horizon), scores the next period. What is compared is
  what each window would have done had it been used: every validation row is scored by that
  window's model of its own day, trained before it. The current window is kept unless another
  beats its validation precision@K by more than `switch_margin` (hysteresis: on a few days of
  validation the order of close candidates is noise). The choice is logged and recorded.

Shared work. A fit is defined by (kind, parameters, window, monotone features, as_of): when
contenders need the same fit, it is made once and scores the rows of all of them. So a static
contender's fit is its sliding twin's first fit, the auto contender's track of window W is the
sliding contender's of the same kind and W, and a `parallel` contender's members are the single
contenders of those kinds: their per-row probabilities are combined by the ensemble's own
combination (`models.ensemble.combine_probabilities`), which gives exactly what fitting the
`ParallelEnsemble` on the same window scores (tested), without fitting its members again.

The figures of the comparison (metrics, baselines, claims) are `models.comparison`'s.

Speed: every fit sees all positive rows of its window but only a `negative_fraction` of the
negative ones (the same rows for every fit: drawn by the hash of each row's (gpu_uuid, ts) under
the seed, `features.sample_key`, as a served model's training rows are); the
factor is recorded in the result. The fits are independent tasks, and so is scoring each UTC
day of the evaluation period by every model that covers it: run in `jobs` processes, or on a
Dask cluster when a client is given. `run_walk_forward_from_store` reads the rows from the store
as each task needs them (`models.walk_forward_rows`) instead of holding the whole frame.
A retrain that cannot be done (a window without any failure) keeps the contender's previous
model, as a production retrainer would, and says so in `fits`.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal

import numpy as np
import pandas as pd
import polars as pl

from features.dataset import feature_days, read_features
from features.sample_key import drawn, sample_keys
from features.schema import ID_COLUMNS, LABEL_COLUMNS
from ingest.errors import GpufailError, InputError
from ingest.store import Store
from models.calibration import (
    DEFAULT_METHOD,
    METHODS,
    Calibration,
    check_method,
    fit_calibration_on_logits,
    logit,
)
from models.ensemble import check_combination, combine_probabilities, intersection_flags
from models.estimators import prior_correction
from models.evaluate import k_per_row, parse_top_k, prepare_scored, ranks, safe_pr_auc, time_key
from models.frame import labels, require_columns, to_pandas
from models.kinds import ENSEMBLE_KINDS, KINDS, MONOTONE_KINDS, THREADED_KINDS, kind_params, member_kinds, member_params
from models.split import DurationLike, as_timedelta, as_utc
from models.train import TrainedModel, TrainOptions, settled_until, train_model
from models.train_store import store_first_ts, store_settled_until
from models.walk_forward_rows import FrameRows, Pool, Rows, Span, StoreRows, predict, spans

log = logging.getLogger(__name__)

Mode = Literal["static", "sliding", "auto"]
MODES: tuple[str, ...] = ("static", "sliding", "auto")
BASELINES: tuple[str, ...] = ("random", "rule", "heuristic", "best_feature", "oracle")
"""The baselines the comparison (`models.comparison`) scores beside the contenders."""
RESERVED_NAMES: tuple[str, ...] = (*BASELINES, "model")
"""Names no contender may take: the baselines', and `model`, the comparison's primary contender."""


@dataclass(frozen=True)
class Contender:
    """One configuration in the comparison: a model `kind` with `params`, trained in `mode`.
    `train_window` (static and sliding) defaults to the plan's."""

    name: str
    kind: str
    mode: str
    params: Mapping[str, Any] = field(default_factory=dict)
    train_window: DurationLike | None = None


@dataclass(frozen=True)
class WalkForwardPlan:
    """When to retrain and on what; every duration in the configuration's grammar ("21d")."""

    horizon: DurationLike
    test_days: float = 14.0
    retrain_every: DurationLike = "1d"
    train_window: DurationLike = "21d"
    candidate_windows: tuple[DurationLike, ...] = ("7d", "14d", "21d")
    validation_window: DurationLike = "3d"
    top_k: str = "10"
    """K for choosing a window on validation (`models.evaluate.parse_top_k`)."""
    switch_margin: float = 0.0
    """auto: switch to another window only when its validation precision@K beats the current
    window's by more than this (0: always take the best)."""
    negative_fraction: float = 0.05
    seed: int = 0
    jobs: int = 1
    monotone_increasing: tuple[str, ...] = ()
    """Features (names or globs) whose rise must never lower the risk, as `train_model` takes
    them; applied to every contender whose kind can be constrained (all but the MLP and
    ensembles with an MLP member), so the comparison scores what `gpufail train` trains."""
    calibration: str = DEFAULT_METHOD
    """How every fit is calibrated (`models.calibration.METHODS`), as `gpufail train` does."""
    calibration_window: DurationLike = "7d"
    """The calibration slice of a model retrained at r: [r - horizon - calibration_window,
    r - horizon), scored by a fit made as of the slice's start; the model itself is trained as
    of r (as `gpufail train` calibrates, `models.train.calibration_bounds`). The first
    retrain's slice, just before the test period, is also where the operating points are
    chosen."""


@dataclass
class Fit:
    """One training of one contender: when, on what, and what came of it."""

    contender: str
    retrain_at: pd.Timestamp
    train_window: str
    status: str
    """"trained", or why the previous model was kept."""
    train_start: pd.Timestamp | None = None
    train_end: pd.Timestamp | None = None
    n_rows: int = 0
    n_positives: int = 0
    validation: dict[str, float | None] | None = None
    """auto mode: precision@K on the validation window per candidate (None: no score)."""
    calibration: dict[str, Any] | None = None
    """The provenance of the calibration in use from this retrain (`Calibration.provenance`)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "contender": self.contender,
            "retrain_at": self.retrain_at.isoformat(),
            "train_window": self.train_window,
            "status": self.status,
            "train_start": None if self.train_start is None else self.train_start.isoformat(),
            "train_end": None if self.train_end is None else self.train_end.isoformat(),
            "n_rows": self.n_rows,
            "n_positives": self.n_positives,
            "validation": self.validation,
            "calibration": self.calibration,
        }


@dataclass
class WalkForwardResult:
    """Scores of every contender on the labelled test rows (`test`, sorted by ts, gpu_uuid)."""

    test: pd.DataFrame
    scores: dict[str, np.ndarray]
    model_age_h: dict[str, np.ndarray]
    """Hours between each test row and the retraining time of the model that scored it."""
    fits: list[Fit]
    test_start: pd.Timestamp
    test_end: pd.Timestamp
    retrain_times: list[pd.Timestamp]
    horizon: pd.Timedelta
    negative_fraction: float
    contenders: list[Contender]
    n_fits: int = 0
    """Models actually trained (each distinct fit once)."""
    n_fits_unshared: int = 0
    """Models the contenders' retrains (members and auto candidates included) name: what the
    comparison would train without sharing."""
    calibrated: dict[str, np.ndarray] = field(default_factory=dict)
    """Per contender, the calibrated risk of each test row (`scores` is the uncalibrated risk,
    in the same order within every grid time)."""
    flags: dict[str, np.ndarray] = field(default_factory=dict)
    """Per parallel contender, the paper's intersection flags of each test row."""
    validation: pd.DataFrame | None = None
    """The operating points' validation slice: the labelled rows of the first retrain's
    calibration slice, before the test period (sorted by ts, gpu_uuid)."""
    validation_calibrated: dict[str, np.ndarray] = field(default_factory=dict)
    """Per contender, the calibrated risk of the validation rows by its first model."""
    validation_flags: dict[str, np.ndarray] = field(default_factory=dict)
    """Per parallel contender, its intersection flags on the validation rows."""
    calibration_window: pd.Timedelta | None = None
    calibrated_by_method: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    """Per contender, per calibration method other than the plan's, the calibrated risk of each
    test row by that method's maps, fitted on the same slices (`models.calibration.METHODS`)."""


def available_kinds() -> tuple[str, ...]:
    """Model kinds `models.train.train_model` accepts in this installation."""
    return KINDS


def check_contenders(contenders: Sequence[Contender], kinds: Sequence[str] | None = None) -> None:
    """Refuse, before any training, an empty list, a repeated name, an unknown mode, a kind
    this installation cannot train (never drop a contender silently), or an ensemble whose
    settings cannot be built (members that are not single kinds, an unknown combination)."""
    known = tuple(available_kinds() if kinds is None else kinds)
    if not contenders:
        raise InputError("evaluate contenders: expected at least one contender, got none")
    seen: set[str] = set()
    for i, c in enumerate(contenders):
        where = f"evaluate contender {i} ({c.name!r})"
        if not c.name or c.name in seen or c.name in RESERVED_NAMES:
            raise InputError(f"{where}: expected a unique name, not empty and not one of {list(RESERVED_NAMES)}")
        seen.add(c.name)
        if c.mode not in MODES:
            raise InputError(f"{where}: mode expected one of {list(MODES)}, got {c.mode!r}")
        if c.kind not in known:
            raise InputError(
                f"{where}: model kind {c.kind!r} is not available in this installation; expected one of {list(known)}"
            )
        if c.kind in ENSEMBLE_KINDS:
            settings = kind_params(c.kind, c.params)
            try:
                member_kinds(c.kind, settings)
                if c.kind == "parallel":
                    check_combination(settings["combine"], settings["top_k"])
            except ValueError as exc:
                raise InputError(f"{where}: params.{exc}") from None


def duration_label(duration: DurationLike, what: str = "duration") -> str:
    """A duration in the configuration's grammar, largest whole unit: "21d", "36h", "90m", "45s"."""
    seconds = int(as_timedelta(duration, what).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


# -- the data, indexed by time ------------------------------------------------------------------


class _Timeline:
    """A feature frame sorted by ts, with cheap slicing by time and the negative subsample."""

    def __init__(self, frame: pd.DataFrame, negative_fraction: float, seed: int) -> None:
        ts = pd.to_datetime(frame["ts"])
        ts = ts.dt.tz_localize("UTC") if ts.dt.tz is None else ts.dt.tz_convert("UTC")
        ns = ts.to_numpy(dtype="datetime64[ns]").astype(np.int64)
        if len(ns) > 1 and bool((np.diff(ns) >= 0).all()):
            # The store is written day by day in time order: no copy of the whole frame.
            plain = frame.index.equals(pd.RangeIndex(len(frame)))
            self.frame, self.ns = (frame if plain else frame.reset_index(drop=True)), ns
        else:
            order = np.argsort(ns, kind="stable")
            self.frame, self.ns = frame.iloc[order].reset_index(drop=True), ns[order]
        label = labels(self.frame).to_numpy()
        # The stored (gpu_uuid, ts) hash, as `gpufail train` draws: a row is drawn or not
        # whatever else the frame holds and in whatever order (not its position in a stream).
        keys = sample_keys(self.frame["gpu_uuid"], self.frame["ts"], seed)
        self.trainable = drawn(label, keys, negative_fraction)
        self.labelled = ~np.isnan(label)
        times = np.unique(self.ns)
        self.step = pd.Timedelta(int(np.diff(times).min()) if len(times) > 1 else pd.Timedelta(hours=1).value)

    def span(self, start: pd.Timestamp | None, end: pd.Timestamp) -> slice:
        lo = 0 if start is None else int(np.searchsorted(self.ns, start.value, side="left"))
        return slice(lo, int(np.searchsorted(self.ns, end.value, side="left")))

    def training_rows(self, start: pd.Timestamp | None, settled_end: pd.Timestamp, anchor: pd.Timestamp) -> np.ndarray:
        """Positions of the subsampled labelled rows with start <= ts < settled_end, then of
        every row of the last grid time before `anchor`. Those last rows are never trained on
        (they fall in the horizon gap); they make `settled_until` of the pool anchor - step -
        horizon, as it is for the full frame at that time."""
        part = self.span(start, settled_end)
        keep = np.flatnonzero(self.trainable[part]) + part.start
        last = self.span(anchor - self.step, anchor)
        return np.concatenate([keep, np.arange(last.start, last.stop)])

    def labelled_rows(self, start: pd.Timestamp, end: pd.Timestamp) -> tuple[pd.DataFrame, np.ndarray]:
        """The labelled rows with start <= ts < end (fresh index) and their times (ns)."""
        part = self.span(start, end)
        rows = np.flatnonzero(self.labelled[part]) + part.start
        return self.frame.iloc[rows].reset_index(drop=True), self.ns[rows]


# -- fits: one (model, window, time) each, made once for every contender that needs it ------------


@dataclass(frozen=True)
class _Spec:
    """A fit apart from its time: two contenders asking for equal specs at the same time get
    the same model."""

    kind: str
    key: str
    """The model parameters (defaults filled in) as canonical JSON: equal settings match."""
    window: str
    monotone: tuple[str, ...]
    params: Mapping[str, Any] = field(compare=False, hash=False, default_factory=dict)


def _spec(kind: str, params: Mapping[str, Any], window: str, monotone: tuple[str, ...]) -> _Spec:
    merged = dict(params)
    if kind in THREADED_KINDS or kind in ENSEMBLE_KINDS:
        merged.setdefault("n_jobs", 1)  # one thread per fit: the processes give parallelism
    merged = kind_params(kind, merged)
    return _Spec(kind, json.dumps(merged, sort_keys=True, default=str), window, monotone, merged)


def _member_specs(params: Mapping[str, Any], window: str, monotone: tuple[str, ...]) -> list[_Spec]:
    """The members of a parallel ensemble as the single fits `make_model` would build them
    (`models.kinds.member_params`), one thread each unless the ensemble sets `n_jobs`."""
    return [_spec(kind, extra, window, monotone) for kind, extra in member_params("parallel", {"n_jobs": 1, **params})]


@dataclass
class _FitTask:
    """One fit, by what it reads (`models.walk_forward_rows.Rows`, which every worker holds): a
    task is a few numbers, not the rows themselves."""

    spec: _Spec
    as_of: pd.Timestamp
    """What the model is trained as of (its last training label ends before it): a retraining
    time, whose rows it scores, or the start of a later retrain's calibration slice, which it
    scores out of time (or both)."""
    pool: Pool
    """The rows it trains on."""
    horizon: pd.Timedelta


@dataclass
class _Fitted:
    spec: _Spec
    as_of: pd.Timestamp
    model: TrainedModel | None
    status: str
    """"trained", or why not."""


@dataclass
class _FitOutcome:
    spec: _Spec
    as_of: pd.Timestamp
    rows: np.ndarray
    """Positions in the evaluation frame that the model scored (sorted, unique)."""
    raw: np.ndarray | None
    """The estimator's probabilities on `rows` (`TrainedModel.predict_score`)."""
    model: TrainedModel | None
    status: str
    logit: np.ndarray | None = None
    """The odds-corrected logits on `rows` (`TrainedModel.predict_uncalibrated_logit`)."""
    calibration: Calibration | None = None
    """Fitted on the model's logits on the calibration slice it scores for a later retrain
    (None: none asked, the fit failed, or the slice cannot be calibrated on,
    `calibration_error` says why)."""
    calibration_error: str | None = None
    slice_logit: np.ndarray | None = None
    """The odds-corrected logits on that calibration slice."""
    alternatives: dict[str, Calibration] = field(default_factory=dict)
    """The other methods' maps (`models.calibration.METHODS`) fitted on the same slice, which
    the report compares on the same out-of-time scores (a method that fails there is absent)."""


def _scored_by(calibration: Calibration, scorer: TrainedModel) -> Calibration:
    """`calibration` recording the training window of the fit whose scores it was fitted on."""
    extra = {
        "scored_by_train_start": scorer.train_start.isoformat(),
        "scored_by_train_end": scorer.train_end.isoformat(),
    }
    return replace(calibration, extra={**calibration.extra, **extra})


def _run_fit(task: _FitTask, source: Rows) -> _Fitted:
    spec = task.spec
    try:
        # The pool is already subsampled (the same rows for every fit); train_model must not
        # subsample it again.
        model = train_model(
            source.pool(task.pool),
            TrainOptions(
                kind=spec.kind,
                train_window=spec.window,
                horizon=task.horizon,
                as_of=task.as_of,
                params=dict(spec.params),
                monotone_increasing=spec.monotone,
                negative_fraction=1.0,
            ),
        )
    except InputError as exc:
        return _Fitted(spec, task.as_of, None, f"kept previous model: {exc}")
    return _Fitted(spec, task.as_of, model, "trained")


@dataclass
class _DayTask:
    """The labelled rows of one UTC day (`span`) and the models that score some of them: per
    fit (by number), its model and the positions within the day of the rows it scores."""

    span: Span
    fits: list[tuple[int, TrainedModel, np.ndarray]]


def _score_day(task: _DayTask, source: Rows) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per fit of `task`, `predict_score_and_logit` of its rows of the day, the day read once."""
    pieces = list(source.scored(task.span))
    day = pieces[0] if len(pieces) == 1 else pd.concat(pieces, ignore_index=True)
    return {fit: model.predict_score_and_logit(day.iloc[at]) for fit, model, at in task.fits}


def _day_tasks(
    fitted: list[_Fitted], rows: list[np.ndarray], eval_ns: np.ndarray
) -> Iterator[tuple[_DayTask, list[int]]]:
    """A scoring task per UTC day of the evaluation frame that some model scores, with the fits
    it scores for (in order)."""
    day_ns = pd.Timedelta(days=1).value
    first_day, last_day = (int(eval_ns[0]) // day_ns, int(eval_ns[-1]) // day_ns) if len(eval_ns) else (0, -1)
    for d in range(first_day, last_day + 1):
        lo, hi = (int(i) for i in np.searchsorted(eval_ns, [d * day_ns, (d + 1) * day_ns], side="left"))
        if hi == lo:
            continue
        fits = []
        for i, (fit, positions) in enumerate(zip(fitted, rows, strict=True)):
            a, b = np.searchsorted(positions, [lo, hi], side="left")
            if fit.model is not None and b > a:
                fits.append((i, fit.model, positions[a:b] - lo))
        if fits:
            yield _DayTask(spans(np.arange(lo, hi), eval_ns)[0], fits), [i for i, _, _ in fits]


@dataclass(frozen=True)
class _Calibrates:
    """The calibration slice a fit scores for a later retrain: its positions in the evaluation
    frame and its [start, end)."""

    rows: np.ndarray
    bounds: tuple[pd.Timestamp, pd.Timestamp]


def _outcome(
    fit: _Fitted,
    rows: np.ndarray,
    scored: tuple[np.ndarray, np.ndarray] | None,
    calibrates: _Calibrates | None,
    frame_labels: np.ndarray,
    method: str,
) -> _FitOutcome:
    """A fit with its scores on `rows` and, when it scores a later retrain's calibration slice,
    the map fitted on its logits there."""
    if fit.model is None:
        return _FitOutcome(fit.spec, fit.as_of, rows, None, None, fit.status)
    raw, z = scored if scored is not None else (np.zeros(0), np.zeros(0))  # (no rows to score)
    outcome = _FitOutcome(fit.spec, fit.as_of, rows, raw, fit.model, "trained", logit=z)
    if calibrates is None:
        return outcome
    on_slice = calibrates.rows
    outcome.slice_logit = z[np.searchsorted(rows, on_slice)]
    try:
        outcome.calibration, outcome.alternatives = _fit_maps(
            outcome.slice_logit, frame_labels[on_slice], method, calibrates.bounds, fit.model
        )
    except InputError as exc:
        outcome.calibration_error = str(exc)
    return outcome


def _fit_maps(
    slice_logit: np.ndarray,
    slice_labels: np.ndarray,
    method: str,
    bounds: tuple[pd.Timestamp, pd.Timestamp],
    scorer: TrainedModel,
) -> tuple[Calibration, dict[str, Calibration]]:
    """The map of `method` fitted on a slice's logits and labels as scored by `scorer`, and
    every other method's on the same (those that cannot be fitted there left out). InputError
    when `method`'s cannot."""
    maps = {}
    for each in METHODS:
        try:
            fitted = fit_calibration_on_logits(
                slice_logit, slice_labels, each, slice_start=bounds[0], slice_end=bounds[1]
            )
        except InputError:
            if each == method:
                raise
            continue
        maps[each] = _scored_by(fitted, scorer)
    return maps.pop(method), maps


_WORKER_ROWS: list[Rows] = []
"""A worker process's rows, set once when it starts (`_start_worker`)."""


def _start_worker(source: Rows) -> None:
    _WORKER_ROWS[:] = [source]


def _in_worker(run: Callable[[Any, Rows], Any], task: Any) -> Any:
    return run(task, _WORKER_ROWS[0])


class _Runner:
    """Runs tasks `run(task, rows)` in order: on the Dask cluster of `client` when given (the
    rows sent to every worker once), else in `jobs` processes (this one when 1), each of
    which receives the rows once, when it starts."""

    def __init__(self, source: Rows, jobs: int, client: Any, progress: bool) -> None:
        self.source, self.jobs, self.client, self.progress = source, jobs, client, progress
        self._pool: Any = None
        self._shared: Any = None

    def __enter__(self) -> _Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            # A caller that stops early (an error, Ctrl-C) does not wait for the tasks still queued.
            self._pool.shutdown(wait=True, cancel_futures=True)

    def map(self, run: Callable[[Any, Rows], Any], tasks: Iterator[Any], n: int, what: str) -> Iterator[Any]:
        from tqdm.auto import tqdm

        with tqdm(total=n, desc=f"walk-forward {what}", unit=what.rstrip("s"), disable=not self.progress) as bar:
            for result in self._results(run, tasks):
                yield result
                bar.update()

    def _results(self, run: Callable[[Any, Rows], Any], tasks: Iterator[Any]) -> Iterator[Any]:
        if self.client is not None:
            yield from self._on_dask(run, tasks)
        elif self.jobs <= 1:
            for task in tasks:
                yield run(task, self.source)
        else:
            yield from self._in_processes(run, tasks)

    def _in_processes(self, run: Callable[[Any, Rows], Any], tasks: Iterator[Any]) -> Iterator[Any]:
        from concurrent.futures.process import BrokenProcessPool

        if self._pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # Fresh worker processes (spawn), not fork: a forked child of a process that has
            # already run OpenMP (LightGBM, XGBoost) or started polars' threads can hang. Each
            # task names its rows by position: sending every task its own rows pickled ~20 GB
            # through the pipes for the demo's 108 fits, a quarter of the run's CPU.
            self._pool = ProcessPoolExecutor(
                max_workers=self.jobs,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(self.source,),
            )
        try:
            yield from self._pool.map(partial(_in_worker, run), tasks)
        except BrokenProcessPool as exc:
            raise GpufailError(
                f"walk-forward: a fit process ended abruptly, most likely killed for lack of memory: each of the "
                f"{self.jobs} processes holds {self.source.describe()}; expected room for them, or set "
                f"[evaluate] jobs = 1 ({exc})"
            ) from exc

    def _on_dask(self, run: Callable[[Any, Rows], Any], tasks: Iterator[Any]) -> Iterator[Any]:
        """Each result fetched in the tasks' order, then released from the cluster."""
        if self._shared is None:
            self._shared = self.client.scatter(self.source, broadcast=True)
        futures = [self.client.submit(run, task, self._shared, pure=False) for task in tasks]
        try:
            for future in futures:
                yield future.result()
                future.release()
        finally:
            self.client.cancel(futures)


def _score_by_day(
    runner: _Runner, fitted: list[_Fitted], rows: list[np.ndarray], eval_ns: np.ndarray
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per fit with a model (by number), its (scores, logits) on its `rows`: each day of the
    evaluation frame read once and scored by every model that scores some of its rows."""
    days = list(_day_tasks(fitted, rows, eval_ns))
    parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for result in runner.map(_score_day, (task for task, _ in days), len(days), "days"):
        for i, pair in result.items():
            parts.setdefault(i, []).append(pair)
    return {i: (np.concatenate([r for r, _ in p]), np.concatenate([z for _, z in p])) for i, p in parts.items()}


def _check_gap(model: TrainedModel, as_of: pd.Timestamp, what: str) -> None:
    # The contract of the whole comparison: no training label may look into the period scored.
    if not model.train_end + model.horizon < as_of:
        raise GpufailError(
            f"walk-forward: {what} trained at {as_of} on rows up to {model.train_end}, whose labels reach "
            f"past the retraining time (horizon {model.horizon}); this is a bug"
        )


# -- tracks: what one model configuration scores, retrained at given times -------------------------

Assignments = list[tuple[pd.Timestamp, np.ndarray]]
"""(retraining time, positions in the evaluation frame that time's model scores), in time order."""


@dataclass
class _Track:
    """Per row of the evaluation frame: the probability of the model that scored it (NaN: no
    model), the odds factor of that model, its risk, its calibrated risk, when it was trained
    (ns) and, for a parallel ensemble, the intersection flag; per retraining time, the outcome
    and the model then in use (None: none yet), the calibration then in use, and the
    calibrated risk (and flags) of that time's new model on its calibration slice."""

    raw: np.ndarray
    weight: np.ndarray
    risk: np.ndarray
    trained_ns: np.ndarray
    at: dict[pd.Timestamp, tuple[str, TrainedModel | None]]
    calibrated: np.ndarray
    logit: np.ndarray
    """The odds-corrected logit of each row, which the calibration maps (a linear model's from
    its decision function: never rounded to a probability of 1.0)."""
    flags: np.ndarray | None = None
    calibration: dict[pd.Timestamp, Calibration | None] = field(default_factory=dict)
    alternatives: dict[pd.Timestamp, dict[str, Calibration]] = field(default_factory=dict)
    """Per retraining time, the other calibration methods' maps on the slice of the one in use."""
    on_slice: dict[pd.Timestamp, tuple[np.ndarray, np.ndarray | None]] = field(default_factory=dict)


def _calibrated(
    logit: np.ndarray, assignments: Assignments, maps: Mapping[pd.Timestamp, Calibration | None], first: int = 0
) -> np.ndarray:
    """The calibrated risk of the rows from position `first` on, each by the map `maps` holds
    for the retraining time that scores it (NaN: none)."""
    out = np.full(len(logit) - first, np.nan)
    for t, rows in assignments:
        rows = rows[rows >= first]
        calibration = maps.get(t)
        if calibration is not None and len(rows):
            out[rows - first] = calibration.apply_logit(logit[rows])
    return out


def _by_method(track: _Track, assignments: Assignments, first: int) -> dict[str, np.ndarray]:
    """Per calibration method other than the one in use, the calibrated risk of the rows from
    position `first` on (the test period: at fleet scale each array is tens of MB) by that
    method's maps on the slices of the maps in use (NaN where it could not be fitted)."""
    methods = sorted({method for maps in track.alternatives.values() for method in maps})
    return {
        method: _calibrated(
            track.logit, assignments, {t: maps.get(method) for t, maps in track.alternatives.items()}, first
        )
        for method in methods
    }


def _empty_track(n: int) -> _Track:
    nan = np.full(n, np.nan)
    return _Track(nan.copy(), nan.copy(), nan.copy(), np.zeros(n, dtype=np.int64), {}, nan.copy(), nan.copy())


def _risk(raw: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """`prior_correction` row by row, exactly as each model's `predict_risk` applies it."""
    out = np.full(len(raw), np.nan)
    for w in np.unique(weight[~np.isnan(weight)]):
        rows = weight == w
        out[rows] = prior_correction(raw[rows], float(w))
    return out


class _Tracks:
    """Builds tracks from the fit outcomes, each (spec, assignments) once. The model retrained
    at t (trained as of t) carries the map fitted on its calibration slice
    (`_Layout.calibration_rows`) from the scores there of the fit made as of the slice's start
    (`_Layout.scorer_as_of`), as `gpufail train` calibrates; a retrain whose slice cannot be
    calibrated on (no failure in it) keeps the previous model and calibration, as a failed fit
    does."""

    def __init__(
        self,
        layout: _Layout,
        frame_labels: np.ndarray,
        outcomes: dict[tuple[_Spec, pd.Timestamp], _FitOutcome],
        method: str,
        rescore: Callable[[TrainedModel, np.ndarray], tuple[np.ndarray, np.ndarray]],
    ) -> None:
        """`frame_labels`: those of `layout.frame`, the evaluation frame; `rescore(model, rows)`:
        `predict_score_and_logit` of the rows of the evaluation frame at positions `rows`."""
        self.layout, self.labels, self.outcomes, self.method = layout, frame_labels, outcomes, method
        self.rescore = rescore
        self.frame, self.ns = layout.frame, layout.ns
        self._cache: dict[tuple[Any, ...], _Track] = {}

    def _slice_raw(self, spec: _Spec, t: pd.Timestamp) -> np.ndarray:
        """The probabilities on t's calibration slice of the fit that scores it out of time."""
        out = self.outcomes[(spec, self.layout.scorer_as_of(t))]
        assert out.raw is not None
        return out.raw[np.searchsorted(out.rows, self.layout.calibration_rows(t))]

    def single(self, spec: _Spec, assignments: Assignments) -> _Track:
        key = (spec, tuple(t for t, _ in assignments), tuple(len(r) for _, r in assignments))
        if key in self._cache:
            return self._cache[key]
        track = _empty_track(len(self.frame))
        # (the model in use, its retraining time, its map and the other methods' on its slice)
        latest: tuple[TrainedModel, pd.Timestamp, Calibration, dict[str, Calibration]] | None = None
        for t, rows in assignments:
            out = self.outcomes[(spec, t)]
            scorer = self.outcomes[(spec, self.layout.scorer_as_of(t))]
            status = out.status
            if out.model is not None and out.raw is not None and out.logit is not None:
                slice_logit, calibration = scorer.slice_logit, scorer.calibration
                if calibration is None or slice_logit is None:
                    status = (
                        scorer.status if scorer.model is None else f"kept previous model: {scorer.calibration_error}"
                    )
                else:
                    latest = (out.model, t, calibration, scorer.alternatives)
                    at = np.searchsorted(out.rows, rows)
                    track.raw[rows], track.logit[rows] = out.raw[at], out.logit[at]
                    track.on_slice[t] = (calibration.apply_logit(slice_logit), None)
            if status != "trained" and latest is not None and len(rows):
                # A retrain that could not be done: the previous model goes on scoring.
                track.raw[rows], track.logit[rows] = self.rescore(latest[0], rows)
            track.at[t] = (status, None if latest is None else latest[0])
            track.calibration[t], track.alternatives[t] = (None, {}) if latest is None else latest[2:]
            if latest is not None:
                track.weight[rows] = latest[0].pos_weight
                track.trained_ns[rows] = latest[1].value
        track.risk = _risk(track.raw, track.weight)
        track.calibrated = _calibrated(track.logit, assignments, track.calibration)
        self._cache[key] = track
        return track

    def parallel(self, members: list[_Spec], settings: Mapping[str, Any], assignments: Assignments) -> _Track:
        """The members' tracks combined as `ParallelEnsemble.predict_proba` combines its members
        (`models.ensemble.combine_probabilities`, within each scoring time); then the shared
        odds factor divided out, and the combination calibrated on each retrain's slice. The
        flags are the paper's intersection (`models.ensemble.intersection_flags`)."""
        combine, top_k = settings["combine"], int(settings["top_k"])
        tracks = [self.single(m, assignments) for m in members]
        track = _empty_track(len(self.frame))
        track.flags = np.zeros(len(self.frame), dtype=bool)
        raw = np.vstack([t.raw for t in tracks])
        rows = np.flatnonzero(~np.isnan(raw).any(axis=0))
        track.raw[rows] = combine_probabilities(raw[:, rows], self.ns[rows], combine, top_k)
        track.flags[rows] = intersection_flags(raw[:, rows], self.ns[rows], top_k)
        # Members are fit on the same rows with the same class weight: one odds factor.
        track.weight[rows] = tracks[0].weight[rows]
        track.trained_ns[rows] = np.vstack([t.trained_ns[rows] for t in tracks]).max(axis=0)
        track.risk = _risk(track.raw, track.weight)
        track.logit = logit(track.risk)
        latest: Calibration | None = None
        alternatives: dict[str, Calibration] = {}
        for t, _ in assignments:
            states = [m.at[t] for m in tracks]
            failed = next((s for s, _ in states if s != "trained"), None)
            model = states[0][1] if all(m is not None for _, m in states) else None
            if failed is None and model is not None:
                slice_ns = self.ns[self.layout.calibration_rows(t)]
                member_raw = np.vstack([self._slice_raw(m, t) for m in members])
                scorer = self.outcomes[(members[0], self.layout.scorer_as_of(t))].model
                assert scorer is not None  # (the members' tracks kept their previous model otherwise)
                slice_risk = prior_correction(
                    combine_probabilities(member_raw, slice_ns, combine, top_k), scorer.pos_weight
                )
                try:
                    latest, alternatives = _fit_maps(
                        logit(slice_risk),
                        self.labels[self.layout.calibration_rows(t)],
                        self.method,
                        self.layout.calibration_bounds(t),
                        scorer,
                    )
                except InputError as exc:  # (the members' own slices are the same: they kept theirs)
                    failed = f"kept previous model: {exc}"
                else:
                    track.on_slice[t] = (latest.apply(slice_risk), intersection_flags(member_raw, slice_ns, top_k))
            track.at[t] = (failed or "trained", model)
            track.calibration[t] = latest
            track.alternatives[t] = alternatives
        track.calibrated = _calibrated(track.logit, assignments, track.calibration)
        return track


# -- contenders: which tracks each one needs, and its scores from them -----------------------------


def _constraints_for(contender: Contender, monotone_increasing: tuple[str, ...]) -> tuple[str, ...]:
    """The plan's monotone features for a contender whose model kinds can all be constrained;
    none for one with an MLP in it (it has no such constraint)."""
    kinds = set(member_kinds(contender.kind, contender.params))
    return monotone_increasing if kinds <= set(MONOTONE_KINDS) else ()


@dataclass
class _Need:
    """A contender's model configuration over some retraining times: one spec (single kinds,
    cascade) or the member specs of a parallel ensemble."""

    specs: list[_Spec]
    settings: Mapping[str, Any] | None
    """Parallel ensemble settings (members, combine, top_k); None for one spec."""
    assignments: Assignments
    window: str


def _need(contender: Contender, window: str, monotone: tuple[str, ...], assignments: Assignments) -> _Need:
    if contender.kind == "parallel":
        settings = kind_params("parallel", contender.params)
        return _Need(_member_specs(contender.params, window, monotone), settings, assignments, window)
    return _Need([_spec(contender.kind, contender.params, window, monotone)], None, assignments, window)


def _validation_score(rows: pd.DataFrame, risk: np.ndarray, top_k: str, seed: int) -> tuple[float, float]:
    """(precision@K mean over grid times, PR-AUC) of `risk` on the validation rows."""
    prepared = prepare_scored(rows, risk)
    kind, _ = parse_top_k(top_k)
    # "expected" has no history of its own here: the validation window's failures per day stand in.
    days = max(prepared["ts"].nunique() / 24.0, 1.0)
    expected = prepared["failure_ts"].dropna().nunique() / days if kind == "expected" else None
    picked = ranks(prepared, seed) <= k_per_row(prepared, top_k, expected)
    ts = time_key(prepared)
    hits = pd.Series(picked & (prepared["label"] == 1).to_numpy()).groupby(ts).sum()
    picks = pd.Series(picked).groupby(ts).sum()
    precision = float((hits / picks).mean())
    pr_auc = safe_pr_auc(prepared["label"].to_numpy(dtype=int), prepared["score"].to_numpy())
    return precision, -1.0 if pr_auc is None else pr_auc


@dataclass
class _Layout:
    """The evaluation frame (labelled rows from the first day validation needs to the end of
    the test period; the test rows are its tail from `offset`) and when models are trained."""

    frame: pd.DataFrame
    ns: np.ndarray
    offset: int
    retrain_times: list[pd.Timestamp]
    pre_times: list[pd.Timestamp]
    """Retraining times before the test period whose models score validation rows (auto)."""
    horizon: pd.Timedelta
    every: pd.Timedelta
    test_end_excl: pd.Timestamp
    calibration_window: pd.Timedelta

    def period(self, t: pd.Timestamp, end: pd.Timestamp) -> np.ndarray:
        return np.flatnonzero((self.ns >= t.value) & (self.ns < end.value))

    def calibration_bounds(self, t: pd.Timestamp) -> tuple[pd.Timestamp, pd.Timestamp]:
        """[start, end) of the calibration slice of the model retrained at `t`: settled by `t`."""
        end = t - self.horizon
        return end - self.calibration_window, end

    def calibration_rows(self, t: pd.Timestamp) -> np.ndarray:
        return self.period(*self.calibration_bounds(t))

    def scorer_as_of(self, t: pd.Timestamp) -> pd.Timestamp:
        """What the fit that scores the calibration slice of the model retrained at `t` is
        trained as of: the slice's start (the model itself is trained as of `t`)."""
        return self.calibration_bounds(t)[0]

    def sliding(self, times: list[pd.Timestamp]) -> Assignments:
        return [(t, self.period(t, min(t + self.every, self.test_end_excl))) for t in times]

    def static(self) -> Assignments:
        start = self.retrain_times[0]
        return [(start, self.period(start, self.test_end_excl))]


def _windows(contender: Contender, plan: WalkForwardPlan) -> list[str]:
    """The training windows of a contender's fits: each candidate of an `auto` one, else its own
    or the plan's."""
    if contender.mode == "auto":
        return [duration_label(w, "candidate_windows") for w in plan.candidate_windows]
    return [duration_label(contender.train_window or plan.train_window, f"train_window of {contender.name}")]


def _contender_needs(contender: Contender, plan: WalkForwardPlan, layout: _Layout) -> list[_Need]:
    monotone = _constraints_for(contender, plan.monotone_increasing)
    if contender.mode == "auto":
        times = layout.pre_times + layout.retrain_times
        return [_need(contender, w, monotone, layout.sliding(times)) for w in _windows(contender, plan)]
    (window,) = _windows(contender, plan)
    assignments = layout.static() if contender.mode == "static" else layout.sliding(layout.retrain_times)
    return [_need(contender, window, monotone, assignments)]


def _fit_record(name: str, t: pd.Timestamp, window: str, track: _Track) -> Fit:
    status, model = track.at[t]
    if status != "trained" or model is None:
        return Fit(name, t, window, status)
    calibration = track.calibration.get(t)
    return Fit(
        name,
        t,
        window,
        "trained",
        model.train_start,
        model.train_end,
        model.n_rows,
        model.n_positives,
        calibration=None if calibration is None else calibration.provenance(),
    )


def _first_model_or_error(name: str, t: pd.Timestamp, state: tuple[str, TrainedModel | None]) -> None:
    if state[1] is None:
        raise InputError(
            f"walk-forward: {name} could not be trained at its first retraining time {t} ({state[0]}); "
            "expected a training window with failures"
        )


def _choose(
    current: str | None, usable: list[str], scored: Mapping[str, tuple[float, float] | None], margin: float
) -> str | None:
    """The window to use: the best on validation (precision@K, then PR-AUC; the first listed
    wins exact ties), but the current one stays unless the best beats its precision by more
    than `margin`. Without any validation score, the current window, else the longest usable."""
    ranked = [(score, w) for w in usable if (score := scored[w]) is not None]
    if not ranked:
        return current if current in usable else (usable[-1] if usable else None)
    best_score, best = ranked[0]
    for score, w in ranked[1:]:
        if score > best_score:
            best_score, best = score, w
    held = scored[current] if current is not None and current in usable else None
    if held is None or best_score[0] > held[0] + margin:
        return best
    return current


def _auto_choice(
    name: str,
    candidates: dict[str, _Track],
    layout: _Layout,
    plan: WalkForwardPlan,
) -> tuple[list[tuple[pd.Timestamp, str, dict[str, float | None]]], _Track]:
    """For each retraining time, the window whose track did best on the validation rows (with
    the plan's switching margin), and the contender's track: each period scored by its
    chosen window's model."""
    validation_window = as_timedelta(plan.validation_window, "validation_window")
    track = _empty_track(len(layout.frame))
    choices = []
    current: str | None = None
    for t, rows in layout.sliding(layout.retrain_times):
        end = t - layout.horizon
        vrows = layout.period(end - validation_window, end)
        scored: dict[str, tuple[float, float] | None] = {}
        for window, cand in candidates.items():
            ok = len(vrows) > 0 and not np.isnan(cand.risk[vrows]).any()
            scored[window] = (
                _validation_score(layout.frame.iloc[vrows], cand.risk[vrows], plan.top_k, plan.seed) if ok else None
            )
        usable = [w for w, c in candidates.items() if c.at[t][1] is not None]
        current = _choose(current, usable, scored, plan.switch_margin)
        if current is None:  # no window has a model yet
            status = next(iter(candidates.values())).at[t][0]
            raise InputError(
                f"walk-forward: {name} could not be trained at its first retraining time {t} ({status}); "
                "expected a training window with failures"
            )
        chosen = candidates[current]
        track.raw[rows], track.weight[rows] = chosen.raw[rows], chosen.weight[rows]
        track.risk[rows], track.trained_ns[rows] = chosen.risk[rows], chosen.trained_ns[rows]
        track.calibrated[rows], track.logit[rows] = chosen.calibrated[rows], chosen.logit[rows]
        track.at[t], track.calibration[t] = chosen.at[t], chosen.calibration[t]
        track.alternatives[t] = chosen.alternatives.get(t, {})
        if t in chosen.on_slice:
            track.on_slice[t] = chosen.on_slice[t]
        choices.append((t, current, {w: None if s is None else s[0] for w, s in scored.items()}))
    return choices, track


def _check_plan(contenders: Sequence[Contender], plan: WalkForwardPlan) -> None:
    check_contenders(contenders)
    if not plan.test_days > 0:
        raise InputError(f"test_days: expected a positive number of days, got {plan.test_days!r}")
    if not 0.0 < plan.negative_fraction <= 1.0:
        raise InputError(f"negative_fraction: expected a share in (0, 1], got {plan.negative_fraction!r}")
    if plan.jobs < 1:
        raise InputError(f"jobs: expected at least 1 process, got {plan.jobs!r}")
    if not plan.switch_margin >= 0.0:
        raise InputError(f"switch_margin: expected a precision difference >= 0, got {plan.switch_margin!r}")
    parse_top_k(plan.top_k)
    check_method(plan.calibration)
    if any(c.mode == "auto" for c in contenders) and not plan.candidate_windows:
        raise InputError("candidate_windows: expected at least one window for the auto contenders, got none")


@dataclass(frozen=True)
class Periods:
    """When the test period is, when models are trained, and which rows the evaluation frame
    holds (the labelled rows with eval_start <= ts < test_end_excl)."""

    test_start: pd.Timestamp
    test_end: pd.Timestamp
    test_end_excl: pd.Timestamp
    retrain_times: list[pd.Timestamp]
    pre_times: list[pd.Timestamp]
    eval_start: pd.Timestamp
    step: pd.Timedelta
    validation: tuple[pd.Timestamp, pd.Timestamp]
    """[start, end) of the validation slice: the first retrain's calibration slice."""


def _periods(
    contenders: Sequence[Contender],
    plan: WalkForwardPlan,
    first: pd.Timestamp,
    settled: pd.Timestamp,
    step: pd.Timedelta,
) -> Periods:
    """The periods of data whose first grid time is `first`, whose labels are settled until
    `settled` (the test period's last grid time), on a grid of `step`."""
    horizon = as_timedelta(plan.horizon, "horizon")
    every = as_timedelta(plan.retrain_every, "retrain_every")
    validation_window = as_timedelta(plan.validation_window, "validation_window")
    calibration_window = as_timedelta(plan.calibration_window, "calibration_window")
    test_start = settled - pd.Timedelta(days=plan.test_days) + step
    test_end_excl = settled + step
    # The fit that scores the first model's calibration slice, which ends a horizon before the
    # test, is trained as of the slice's start.
    first_fit = test_start - horizon - calibration_window
    if first_fit <= first + horizon:
        raise InputError(
            f"test_days {plan.test_days}: the first model's calibration would come from a fit as of {first_fit} (the test period "
            f"starts at {test_start}, after a calibration slice of {duration_label(calibration_window)} and the "
            f"horizon), before any settled training label (data from {first}); "
            "expected a shorter test period or calibration_window"
        )
    n_periods = math.ceil((test_end_excl - test_start) / every)
    retrain_times = [test_start + i * every for i in range(n_periods)]
    # auto: the models of the days before the test period score the first validation windows.
    n_pre = math.ceil((horizon + validation_window) / every) if any(c.mode == "auto" for c in contenders) else 0
    pre_times = [test_start - k * every for k in range(n_pre, 0, -1)]
    # From the calibration slice of the first model trained.
    eval_start = (pre_times[0] if pre_times else test_start) - horizon - calibration_window
    validation = (test_start - horizon - calibration_window, test_start - horizon)
    return Periods(test_start, settled, test_end_excl, retrain_times, pre_times, eval_start, step, validation)


RowsFor = Callable[[list[Pool]], Rows]
"""What the fits of the given pools read (`models.walk_forward_rows`)."""


def run_walk_forward(
    frame: Any,
    contenders: Sequence[Contender],
    plan: WalkForwardPlan,
    *,
    progress: bool = False,
    client: Any = None,
) -> WalkForwardResult:
    """Train and score every contender over the last `plan.test_days` of settled grid times.

    The test period ends at `models.train.settled_until(frame, horizon)` (later labels are
    known only for GPUs that already failed) and starts `test_days` earlier; it is cut into
    retraining periods of `retrain_every`. The fits run on the Dask cluster of `client` when
    given (`run_walk_forward_from_store` reads the rows from the store instead of holding
    them). Raises InputError for a bad plan or contender, or when a contender cannot be
    trained at its first retraining time."""
    _check_plan(contenders, plan)
    horizon = as_timedelta(plan.horizon, "horizon")
    df = to_pandas(frame)
    require_columns(df, ["ts", "gpu_uuid", "label"], "walk-forward frame")
    timeline = _Timeline(df, plan.negative_fraction, plan.seed)
    first = as_utc(pd.Timestamp(timeline.ns[0]))
    periods = _periods(contenders, plan, first, settled_until(timeline.frame, horizon), timeline.step)
    evaluation, eval_ns = timeline.labelled_rows(periods.eval_start, periods.test_end_excl)

    def in_memory(pools: list[Pool]) -> Rows:
        positions = [timeline.training_rows(p.start, p.end, p.anchor) for p in pools]
        kept = np.unique(np.concatenate(positions)) if positions else np.zeros(0, dtype=np.int64)
        return FrameRows(evaluation, timeline.frame.iloc[kept], timeline.ns[kept], timeline.trainable[kept])

    return _walk_forward(contenders, plan, periods, evaluation, eval_ns, in_memory, progress, client)


def training_span(
    periods: Periods, contenders: Sequence[Contender], plan: WalkForwardPlan
) -> tuple[pd.Timestamp, pd.Timestamp]:
    """[start, end) of the rows every fit of the walk-forward draws its pool from: the longest
    training window before the earliest fit (the one scoring the first calibration slice,
    trained as of `eval_start`), to a horizon before the last retrain."""
    horizon = as_timedelta(plan.horizon, "horizon")
    longest = max(as_timedelta(w, "train_window") for c in contenders for w in _windows(c, plan))
    return periods.eval_start - horizon - longest, periods.retrain_times[-1] - horizon


def store_periods(store: Store, contenders: Sequence[Contender], plan: WalkForwardPlan) -> Periods:
    """The periods `run_walk_forward_from_store` runs over the store's features (for a reader
    that reads the evaluation rows itself, `models.store_evaluation`)."""
    _check_plan(contenders, plan)
    horizon = as_timedelta(plan.horizon, "horizon")
    return _periods(contenders, plan, store_first_ts(store), store_settled_until(store, horizon), _store_step(store))


def run_walk_forward_from_store(
    store: Store,
    contenders: Sequence[Contender],
    plan: WalkForwardPlan,
    *,
    columns: Sequence[str] = (),
    evaluation: tuple[Periods, pd.DataFrame] | None = None,
    scored_from: Store | None = None,
    progress: bool = False,
    client: Any = None,
) -> WalkForwardResult:
    """`run_walk_forward` on the store's features, read as each fit and each scored day needs
    them (`models.walk_forward_rows.StoreRows`): a process holds one training draw and one
    day of rows. The result is the same as `run_walk_forward(read_features(store), ...)`'s,
    except that `test` and `validation` hold only the identity and label columns and
    `columns` (what the figures after the walk-forward read), not every feature.
    `evaluation`: the store's periods (`store_periods`) and those rows, already read by the
    caller (the labelled rows of eval_start .. test_end_excl, sorted by (ts, gpu_uuid));
    `columns` is then not read. `scored_from`: a
    store holding those rows with every feature, which the scoring reads instead of `store`
    (`models.evaluation_inputs` keeps one where `store` computes its features on demand)."""
    horizon = as_timedelta(plan.horizon, "horizon")
    if evaluation is None:
        periods = store_periods(store, contenders, plan)
        keep = list(dict.fromkeys([*ID_COLUMNS, *LABEL_COLUMNS, *columns]))
        rows = _labelled_from_store(store, periods.eval_start, periods.test_end_excl, keep)
    else:
        periods, rows = evaluation  # (the plan was checked when `store_periods` made them)
    ts = pd.to_datetime(rows["ts"], utc=True)
    eval_ns = ts.to_numpy(dtype="datetime64[ns]").astype(np.int64)
    scored_root = None if scored_from is None else scored_from.root
    source = StoreRows(store.root, plan.negative_fraction, plan.seed, horizon, scored_root)
    return _walk_forward(contenders, plan, periods, rows, eval_ns, lambda _: source, progress, client)


def _store_step(store: Store) -> pd.Timedelta:
    """The grid step: the smallest time between grid times of the newest two feature days."""
    days = feature_days(store)
    if not days:
        raise InputError(f"{store.root}: the features dataset is empty; run `gpufail features` first")
    start = pd.Timestamp(days[-min(2, len(days))], tz="UTC").to_pydatetime()
    times = np.unique(read_features(store, start=start, columns=[])["ts"].to_numpy().astype("datetime64[ns]"))
    return pd.Timedelta(int(np.diff(times).astype(np.int64).min())) if len(times) > 1 else pd.Timedelta(hours=1)


def _labelled_from_store(store: Store, start: pd.Timestamp, end: pd.Timestamp, columns: list[str]) -> pd.DataFrame:
    """The `columns` of the labelled rows with start <= ts < end, sorted by (ts, gpu_uuid),
    read a day at a time (a computed store computes only what a day needs): `evaluation_frame`."""
    parts = []
    for day in feature_days(store, start.to_pydatetime(), end.to_pydatetime()):
        midnight = pd.Timestamp(day, tz="UTC")
        lo, hi = max(start, midnight), min(end, midnight + pd.Timedelta(days=1))
        part = read_features(store, lo.to_pydatetime(), hi.to_pydatetime(), columns=columns)
        parts.append(part.filter(pl.col("label").is_not_null()).select(columns))
    return evaluation_frame(parts, store.root, start, end)


def evaluation_frame(parts: list[pl.DataFrame], root: str, start: pd.Timestamp, end: pd.Timestamp) -> pd.DataFrame:
    """The evaluation frame of the labelled rows of [start, end) of the store at `root`, read a
    day at a time into `parts` (in order; a column some parts lack is null there). The label is
    a float, as a whole frame's (which has censored rows) reads in pandas."""
    if not parts:
        raise InputError(f"{root}: no feature rows in {start} .. {end}; expected the walk-forward's period")
    return to_pandas(pl.concat(parts, how="diagonal_relaxed").with_columns(pl.col("label").cast(pl.Float64)))


def _walk_forward(
    contenders: Sequence[Contender],
    plan: WalkForwardPlan,
    periods: Periods,
    evaluation: pd.DataFrame,
    eval_ns: np.ndarray,
    rows_for: RowsFor,
    progress: bool,
    client: Any,
) -> WalkForwardResult:
    """The walk-forward over `evaluation` (the labelled rows of `periods`, at times `eval_ns`),
    its fits reading the rows `rows_for` gives them."""
    horizon = as_timedelta(plan.horizon, "horizon")
    every = as_timedelta(plan.retrain_every, "retrain_every")
    calibration_window = as_timedelta(plan.calibration_window, "calibration_window")
    test_start, test_end = periods.test_start, periods.test_end
    offset = int(np.searchsorted(eval_ns, test_start.value, side="left"))
    layout = _Layout(
        evaluation,
        eval_ns,
        offset,
        periods.retrain_times,
        periods.pre_times,
        horizon,
        every,
        periods.test_end_excl,
        calibration_window,
    )

    needs = {c.name: _contender_needs(c, plan, layout) for c in contenders}
    # Each retrain at t needs two fits: the model, trained as of t, which scores t's rows, and
    # the fit trained as of the start of t's calibration slice, which scores the slice out of
    # time. The latter is an earlier retrain's model whenever one was made then.
    requests: dict[tuple[_Spec, pd.Timestamp], list[np.ndarray]] = {}
    calibrates: dict[tuple[_Spec, pd.Timestamp], pd.Timestamp] = {}
    n_unshared = 0
    for contender_needs in needs.values():
        for need in contender_needs:
            for spec in need.specs:
                for t, rows in need.assignments:
                    requests.setdefault((spec, t), []).append(rows)
                    scorer = (spec, layout.scorer_as_of(t))
                    requests.setdefault(scorer, []).append(layout.calibration_rows(t))
                    calibrates[scorer] = t
                    n_unshared += 2

    def pool_of(spec: _Spec, as_of: pd.Timestamp) -> Pool:
        end = as_of - horizon
        return Pool(end - as_timedelta(spec.window, "train_window"), end, as_of - periods.step, as_of)

    pools = {key: pool_of(*key) for key in requests}
    source = rows_for(list(pools.values()))

    keys = list(requests)
    # Each fit scores every row of its requests, and of a later retrain's calibration slice.
    fit_rows = [np.unique(np.concatenate(requests[key])) for key in keys]
    frame_labels = labels(evaluation).to_numpy()
    tasks = (_FitTask(spec, as_of, pools[(spec, as_of)], horizon) for spec, as_of in keys)
    with _Runner(source, plan.jobs, client, progress) as runner:
        fitted = list(runner.map(_run_fit, tasks, len(keys), "fits"))
        for fit in fitted:
            if fit.model is not None:
                _check_gap(fit.model, fit.as_of, f"a {fit.spec.kind} fit on {fit.spec.window}")
        scored = _score_by_day(runner, fitted, fit_rows, eval_ns)
    outcomes = {}
    for i, (fit, key) in enumerate(zip(fitted, keys, strict=True)):
        later = calibrates.get(key)
        on_slice = (
            None if later is None else _Calibrates(layout.calibration_rows(later), layout.calibration_bounds(later))
        )
        outcomes[key] = _outcome(fit, fit_rows[i], scored.get(i), on_slice, frame_labels, plan.calibration)

    def rescore(model: TrainedModel, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raw, z, _ = predict(model, source, spans(rows, eval_ns))
        return raw, z

    built = _Tracks(layout, frame_labels, outcomes, plan.calibration, rescore)

    def track_of(need: _Need) -> _Track:
        if need.settings is None:
            return built.single(need.specs[0], need.assignments)
        return built.parallel(need.specs, need.settings, need.assignments)

    scores, ages, fits = {}, {}, []
    calibrated, flags, on_validation, validation_flags, by_method = {}, {}, {}, {}, {}
    hour = pd.Timedelta(hours=1).value
    for c in contenders:
        if c.mode == "auto":
            candidates = {need.window: track_of(need) for need in needs[c.name]}
            choices, track = _auto_choice(c.name, candidates, layout, plan)
            assignments = layout.sliding(layout.retrain_times)
            for t, window, validation in choices:
                fit = _fit_record(c.name, t, window, track)
                fit.validation = validation
                fits.append(fit)
                log.info("%s at %s: train window %s (validation precision@K %s)", c.name, t, window, validation)
        else:
            (need,) = needs[c.name]
            track = track_of(need)
            assignments = need.assignments
            first = need.assignments[0][0]
            _first_model_or_error(c.name, first, track.at[first])
            fits += [_fit_record(c.name, t, need.window, track) for t, _ in need.assignments]
        scores[c.name] = track.risk[offset:]
        calibrated[c.name] = track.calibrated[offset:]
        by_method[c.name] = _by_method(track, assignments, offset)
        ages[c.name] = (eval_ns[offset:] - track.trained_ns[offset:]) / hour
        if test_start not in track.on_slice:
            raise InputError(
                f"walk-forward: {c.name} has no model of its own calibrated at the first retraining time "
                f"{test_start} ({track.at[test_start][0]}); expected a calibration slice with failures"
            )
        on_validation[c.name], first_flags = track.on_slice[test_start]
        if track.flags is not None and first_flags is not None:
            flags[c.name], validation_flags[c.name] = track.flags[offset:], first_flags
    return WalkForwardResult(
        test=evaluation.iloc[offset:].reset_index(drop=True),
        scores=scores,
        model_age_h=ages,
        fits=fits,
        test_start=test_start,
        test_end=test_end,
        retrain_times=periods.retrain_times,
        horizon=horizon,
        negative_fraction=plan.negative_fraction,
        contenders=list(contenders),
        n_fits=len(requests),
        n_fits_unshared=n_unshared,
        calibrated=calibrated,
        flags=flags,
        validation=evaluation.iloc[layout.calibration_rows(test_start)].reset_index(drop=True),
        validation_calibrated=on_validation,
        validation_flags=validation_flags,
        calibration_window=calibration_window,
        calibrated_by_method=by_method,
    )
