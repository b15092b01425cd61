"""Walk-forward (sliding) training and scoring of several contenders over a test period.

At every retraining time r (test_start, test_start + retrain_every, ...) a contender is trained
on labelled rows that end a full `horizon` before r (`models.split.time_split`: a row at ts has
its label window (ts, ts + horizon], known only once ts + horizon < r), then scores the grid
times of [r, r + retrain_every). Modes:

- `static`: trained once, at test_start, on `train_window`; scores the whole test period (the
  baseline: what a model trained once and left alone does as the fleet drifts);
- `sliding`: retrained at every r on the most recent `train_window`;
- `auto`: at every r, each of `candidate_windows` is trained on data before the most recent
  `validation_window` of settled labels, [r - horizon - validation_window, r - horizon), and
  scored on it; the window with the best precision@K there (PR-AUC breaks ties) is retrained
  at r. The choice is logged and recorded.

Speed: every fit sees all positive rows of its window but only a `negative_fraction` of the
negative ones (the same rows for every fit: one uniform draw per row under the seed); the
factor is recorded in the result. The fits are independent tasks, run in `jobs` processes.
A retrain that cannot be done (a window without any failure) keeps the contender's previous
model, as a production retrainer would, and says so in `fits`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from ingest.errors import GpufailError, InputError
from models.evaluate import k_per_row, parse_top_k, prepare_scored, ranks, safe_pr_auc
from models.frame import labels, require_columns, to_pandas
from models.split import DurationLike, as_timedelta, as_utc
from models.train import TrainedModel, settled_until, train_model

log = logging.getLogger(__name__)

Mode = Literal["static", "sliding", "auto"]
MODES: tuple[str, ...] = ("static", "sliding", "auto")
THREADED_KINDS = ("lightgbm", "xgboost", "random_forest")
"""Kinds whose estimator takes `n_jobs`: one thread per fit, the processes give parallelism."""


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
    negative_fraction: float = 0.05
    seed: int = 0
    jobs: int = 1
    monotone_increasing: tuple[str, ...] = ()
    """Features (names or globs) whose rise must never lower the risk, as `train_model` takes
    them; applied to every contender whose kind can be constrained (all but the MLP and
    ensembles with an MLP member), so the comparison scores what `gpufail train` trains."""


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
    """auto mode: precision@K on the validation window per candidate (None: could not train)."""

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


def available_kinds() -> tuple[str, ...]:
    """Model kinds `models.train.train_model` accepts in this installation."""
    from models import estimators

    return tuple(estimators.KINDS)


def check_contenders(contenders: Sequence[Contender], kinds: Sequence[str] | None = None) -> None:
    """Refuse, before any training, an empty list, a repeated name, an unknown mode, or a kind
    this installation cannot train (never drop a contender silently)."""
    known = tuple(available_kinds() if kinds is None else kinds)
    if not contenders:
        raise InputError("evaluate contenders: expected at least one contender, got none")
    seen: set[str] = set()
    for i, c in enumerate(contenders):
        where = f"evaluate contender {i} ({c.name!r})"
        if not c.name or c.name in seen or c.name in BASELINE_NAMES:
            raise InputError(f"{where}: expected a unique name, not empty and not one of {list(BASELINE_NAMES)}")
        seen.add(c.name)
        if c.mode not in MODES:
            raise InputError(f"{where}: mode expected one of {list(MODES)}, got {c.mode!r}")
        if c.kind not in known:
            raise InputError(
                f"{where}: model kind {c.kind!r} is not available in this installation; expected one of {list(known)}"
            )


BASELINE_NAMES = ("random", "rule", "heuristic", "oracle", "model")


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
        order = np.argsort(ts.to_numpy(dtype="datetime64[ns]").astype(np.int64), kind="stable")
        self.frame = frame.iloc[order].reset_index(drop=True)
        self.ns = ts.to_numpy(dtype="datetime64[ns]").astype(np.int64)[order]
        label = labels(self.frame).to_numpy()
        draw = np.random.default_rng(seed).random(len(self.frame))
        self.trainable = (label == 1) | ((label == 0) & (draw < negative_fraction))
        self.labelled = ~np.isnan(label)
        times = np.unique(self.ns)
        self.step = pd.Timedelta(int(np.diff(times).min()) if len(times) > 1 else pd.Timedelta(hours=1).value)

    def span(self, start: pd.Timestamp | None, end: pd.Timestamp) -> slice:
        lo = 0 if start is None else int(np.searchsorted(self.ns, start.value, side="left"))
        return slice(lo, int(np.searchsorted(self.ns, end.value, side="left")))

    def training_pool(
        self, start: pd.Timestamp | None, settled_end: pd.Timestamp, anchor: pd.Timestamp
    ) -> pd.DataFrame:
        """Subsampled labelled rows with start <= ts < settled_end, plus every row of the last
        grid time before `anchor`. Those last rows are never trained on (they fall in the
        horizon gap); they make `settled_until` of the pool anchor - step - horizon, as it is
        for the full frame at that time."""
        part = self.span(start, settled_end)
        keep = np.flatnonzero(self.trainable[part]) + part.start
        last = self.span(anchor - self.step, anchor)
        rows = np.concatenate([keep, np.arange(last.start, last.stop)])
        return self.frame.iloc[rows]

    def labelled_rows(self, start: pd.Timestamp, end: pd.Timestamp) -> pd.DataFrame:
        part = self.span(start, end)
        return self.frame.iloc[np.flatnonzero(self.labelled[part]) + part.start]


# -- tasks: one (contender, retraining time) each --------------------------------------------------


@dataclass
class _Task:
    contender: Contender
    retrain_at: pd.Timestamp
    pool: pd.DataFrame
    validation: pd.DataFrame | None
    test_rows: np.ndarray
    """Positions in the result's test frame that this model scores."""
    test: pd.DataFrame
    windows: tuple[str, ...]
    horizon: pd.Timedelta
    validation_start: pd.Timestamp | None
    top_k: str
    seed: int
    monotone_increasing: tuple[str, ...] = ()


@dataclass
class _Outcome:
    contender: str
    retrain_at: pd.Timestamp
    test_rows: np.ndarray
    scores: np.ndarray | None
    model: TrainedModel | None
    fit: Fit


def _params(contender: Contender) -> dict[str, Any]:
    params = dict(contender.params)
    if contender.kind in THREADED_KINDS:
        params.setdefault("n_jobs", 1)
    return params


def _constraints_for(contender: Contender, monotone_increasing: tuple[str, ...]) -> tuple[str, ...]:
    """The plan's monotone features for a contender whose model kinds can all be constrained;
    none for one with an MLP in it (it has no such constraint)."""
    from models.estimators import ENSEMBLE_DEFAULTS, MONOTONE_KINDS

    kinds = {contender.kind}
    if contender.kind in ENSEMBLE_DEFAULTS:
        params = {**ENSEMBLE_DEFAULTS[contender.kind], **contender.params}
        kinds = set(params["members"]) if contender.kind == "parallel" else {params["first"], params["second"]}
    return monotone_increasing if kinds <= set(MONOTONE_KINDS) else ()


def _fit(task: _Task, window: str, as_of: pd.Timestamp) -> TrainedModel:
    # The pool is already subsampled (the same rows for every fit); train_model must not
    # subsample it again.
    return train_model(
        task.pool,
        kind=task.contender.kind,
        train_window=window,
        horizon=task.horizon,
        as_of=as_of,
        params=_params(task.contender),
        monotone_increasing=task.monotone_increasing,
        negative_fraction=1.0,
    )


def _validation_score(model: TrainedModel, validation: pd.DataFrame, top_k: str, seed: int) -> tuple[float, float]:
    """(precision@K mean over grid times, PR-AUC) of `model` on the validation rows."""
    prepared = prepare_scored(validation, model.predict_risk(validation))
    kind, _ = parse_top_k(top_k)
    # "expected" has no history of its own here: the validation window's failures per day stand in.
    days = max(prepared["ts"].nunique() / 24.0, 1.0)
    expected = prepared["failure_ts"].dropna().nunique() / days if kind == "expected" else None
    picked = ranks(prepared, seed) <= k_per_row(prepared, top_k, expected)
    hits = pd.Series(picked & (prepared["label"] == 1).to_numpy()).groupby(prepared["ts"].to_numpy()).sum()
    picks = pd.Series(picked).groupby(prepared["ts"].to_numpy()).sum()
    precision = float((hits / picks).mean())
    pr_auc = safe_pr_auc(prepared["label"].to_numpy(dtype=int), prepared["score"].to_numpy())
    return precision, -1.0 if pr_auc is None else pr_auc


def _run_task(task: _Task) -> _Outcome:
    contender = task.contender
    validation: dict[str, float | None] | None = None
    window = task.windows[0]
    if contender.mode == "auto":
        assert task.validation is not None and task.validation_start is not None
        validation, best = {}, (-math.inf, -math.inf)
        for candidate in task.windows:
            try:
                model = _fit(task, candidate, task.validation_start)
            except InputError:
                validation[candidate] = None  # no failure in this window: not a candidate today
                continue
            score = _validation_score(model, task.validation, task.top_k, task.seed)
            validation[candidate] = score[0]
            if score > best:  # the first (shortest) window wins exact ties
                best, window = score, candidate
        if best[0] == -math.inf:
            fit = Fit(contender.name, task.retrain_at, "-", "kept previous model: no candidate window could be trained")
            fit.validation = validation
            return _Outcome(contender.name, task.retrain_at, task.test_rows, None, None, fit)
    try:
        model = _fit(task, window, task.retrain_at)
    except InputError as exc:
        fit = Fit(contender.name, task.retrain_at, window, f"kept previous model: {exc}", validation=validation)
        return _Outcome(contender.name, task.retrain_at, task.test_rows, None, None, fit)
    fit = Fit(
        contender.name,
        task.retrain_at,
        window,
        "trained",
        model.train_start,
        model.train_end,
        model.n_rows,
        model.n_positives,
        validation,
    )
    return _Outcome(contender.name, task.retrain_at, task.test_rows, model.predict_risk(task.test), model, fit)


def _tasks(
    timeline: _Timeline,
    test: pd.DataFrame,
    test_ns: np.ndarray,
    contenders: Sequence[Contender],
    plan: WalkForwardPlan,
    retrain_times: list[pd.Timestamp],
    test_end_excl: pd.Timestamp,
) -> Iterator[_Task]:
    """The tasks in a fixed order, each carrying only the rows it needs (cheap to send to a
    worker process)."""
    horizon = as_timedelta(plan.horizon, "horizon")
    validation_window = as_timedelta(plan.validation_window, "validation_window")
    every = as_timedelta(plan.retrain_every, "retrain_every")
    candidates = tuple(duration_label(w, "candidate_windows") for w in plan.candidate_windows)
    for contender in contenders:
        window = duration_label(contender.train_window or plan.train_window, f"train_window of {contender.name}")
        times = retrain_times[:1] if contender.mode == "static" else retrain_times
        for r in times:
            end = test_end_excl if contender.mode == "static" else min(r + every, test_end_excl)
            rows = np.flatnonzero((test_ns >= r.value) & (test_ns < end.value))
            if contender.mode == "auto":
                longest = max(as_timedelta(w, "candidate_windows") for w in candidates)
                validation_start = r - horizon - validation_window
                pool_start = validation_start - horizon - longest
                validation = timeline.labelled_rows(validation_start, r - horizon)
                windows = candidates
            else:
                pool_start = r - horizon - as_timedelta(window, f"train_window of {contender.name}")
                validation_start, validation, windows = None, None, (window,)
            yield _Task(
                contender=contender,
                retrain_at=r,
                pool=timeline.training_pool(pool_start, r - horizon, r),
                validation=validation,
                test_rows=rows,
                test=test.iloc[rows],
                windows=windows,
                horizon=horizon,
                validation_start=validation_start,
                top_k=plan.top_k,
                seed=plan.seed,
                monotone_increasing=_constraints_for(contender, plan.monotone_increasing),
            )


def _execute(tasks: Iterator[_Task], n_tasks: int, jobs: int, progress: bool) -> list[_Outcome]:
    from tqdm.auto import tqdm

    bar = tqdm(total=n_tasks, desc="walk-forward fits", unit="fit", disable=not progress)
    outcomes: list[_Outcome] = []
    try:
        if jobs <= 1:
            for task in tasks:
                outcomes.append(_run_task(task))
                bar.update()
        else:
            from joblib import Parallel, delayed

            # Fresh worker processes (loky), not fork: a forked child of a process that has
            # already run OpenMP (LightGBM, XGBoost) can hang.
            parallel = Parallel(n_jobs=jobs, backend="loky", return_as="generator", pre_dispatch="2*n_jobs")
            for outcome in parallel(delayed(_run_task)(task) for task in tasks):
                outcomes.append(outcome)
                bar.update()
    finally:
        bar.close()
    return outcomes


def _check_gap(fit: Fit, horizon: pd.Timedelta) -> None:
    # The contract of the whole comparison: no training label may look into the period scored.
    if fit.train_end is not None and not fit.train_end + horizon < fit.retrain_at:
        raise GpufailError(
            f"walk-forward: {fit.contender} trained at {fit.retrain_at} on rows up to {fit.train_end}, "
            f"whose labels reach past the retraining time (horizon {horizon}); this is a bug"
        )


def run_walk_forward(
    frame: Any,
    contenders: Sequence[Contender],
    plan: WalkForwardPlan,
    *,
    progress: bool = False,
) -> WalkForwardResult:
    """Train and score every contender over the last `plan.test_days` of settled grid times.

    The test period ends at `models.train.settled_until(frame, horizon)` (later labels are
    known only for GPUs that already failed) and starts `test_days` earlier; it is cut into
    retraining periods of `retrain_every`. Raises InputError for a bad plan or contender, or
    when a contender cannot be trained at its first retraining time."""
    check_contenders(contenders)
    if not plan.test_days > 0:
        raise InputError(f"test_days: expected a positive number of days, got {plan.test_days!r}")
    if not 0.0 < plan.negative_fraction <= 1.0:
        raise InputError(f"negative_fraction: expected a share in (0, 1], got {plan.negative_fraction!r}")
    if plan.jobs < 1:
        raise InputError(f"jobs: expected at least 1 process, got {plan.jobs!r}")
    parse_top_k(plan.top_k)
    if any(c.mode == "auto" for c in contenders) and not plan.candidate_windows:
        raise InputError("candidate_windows: expected at least one window for the auto contenders, got none")
    horizon = as_timedelta(plan.horizon, "horizon")
    every = as_timedelta(plan.retrain_every, "retrain_every")
    df = to_pandas(frame)
    require_columns(df, ["ts", "gpu_uuid", "label"], "walk-forward frame")
    timeline = _Timeline(df, plan.negative_fraction, plan.seed)
    test_end = settled_until(timeline.frame, horizon)
    test_start = test_end - pd.Timedelta(days=plan.test_days) + timeline.step
    test_end_excl = test_end + timeline.step
    if test_start <= as_utc(pd.Timestamp(timeline.ns[0])) + horizon:
        raise InputError(
            f"test_days {plan.test_days}: the test period would start at {test_start}, before any settled "
            f"training label (data from {pd.Timestamp(timeline.ns[0], tz='UTC')}); expected a shorter test period"
        )
    test = timeline.labelled_rows(test_start, test_end_excl).reset_index(drop=True)
    test_ns = timeline.ns[timeline.span(test_start, test_end_excl)][
        timeline.labelled[timeline.span(test_start, test_end_excl)]
    ]
    n_periods = math.ceil((test_end_excl - test_start) / every)
    retrain_times = [test_start + i * every for i in range(n_periods)]
    n_tasks = sum(1 if c.mode == "static" else len(retrain_times) for c in contenders)
    outcomes = _execute(
        _tasks(timeline, test, test_ns, contenders, plan, retrain_times, test_end_excl), n_tasks, plan.jobs, progress
    )
    scores = {c.name: np.full(len(test), np.nan) for c in contenders}
    ages = {c.name: np.full(len(test), np.nan) for c in contenders}
    latest: dict[str, tuple[TrainedModel, pd.Timestamp]] = {}
    fits = []
    for outcome in outcomes:  # in task order: by contender, then by retraining time
        fit = outcome.fit
        _check_gap(fit, horizon)
        fits.append(fit)
        if outcome.model is not None:
            latest[outcome.contender] = (outcome.model, outcome.retrain_at)
            assert outcome.scores is not None
            scores[outcome.contender][outcome.test_rows] = outcome.scores
            trained_at = outcome.retrain_at
        else:
            if outcome.contender not in latest:
                raise InputError(
                    f"walk-forward: {outcome.contender} could not be trained at its first retraining time "
                    f"{outcome.retrain_at} ({fit.status}); expected a training window with failures"
                )
            model, trained_at = latest[outcome.contender]
            scores[outcome.contender][outcome.test_rows] = model.predict_risk(test.iloc[outcome.test_rows])
        hours = (test_ns[outcome.test_rows] - trained_at.value) / pd.Timedelta(hours=1).value
        ages[outcome.contender][outcome.test_rows] = hours
        if fit.validation is not None:
            log.info(
                "%s at %s: train window %s (validation precision@K %s)",
                fit.contender,
                fit.retrain_at,
                fit.train_window,
                fit.validation,
            )
    return WalkForwardResult(
        test=test,
        scores=scores,
        model_age_h=ages,
        fits=fits,
        test_start=test_start,
        test_end=test_end,
        retrain_times=retrain_times,
        horizon=horizon,
        negative_fraction=plan.negative_fraction,
        contenders=list(contenders),
    )


# -- the comparison: contenders and baselines on the same test rows --------------------------------

SINGLE_KINDS = ("lightgbm", "xgboost", "logistic", "random_forest", "mlp")
PAPER_PRECISION = (0.463, 0.840)
"""Liu et al.: precision at the top of the ranking, best single model -> sliding ensembles."""


def evaluate_walk_forward(
    frame: Any,
    contenders: Sequence[Contender],
    plan: WalkForwardPlan,
    *,
    top_k: Sequence[str] = ("10", "expected"),
    failures: Any = None,
    bootstrap_samples: int = 1000,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the walk-forward comparison and return every figure of its report (JSON-ready):
    the contenders, the baselines `random`, `rule` (`models.evaluate.rule_flags`; absent with
    a reason when the frame lacks its columns), `heuristic` and `oracle`, scored on the same
    test rows; `model` repeats the primary contender (the first `auto` one, else the first)."""
    from models.evaluate import baseline_scores, compare_scores, expected_failures_per_day, rule_columns, rule_flags

    specs = [str(s) for s in top_k]
    if not specs:
        raise InputError("top_k: expected at least one K specification, got none")
    plan = WalkForwardPlan(**{**plan.__dict__, "top_k": specs[0]})
    result = run_walk_forward(frame, contenders, plan, progress=progress)
    test = result.test
    history = to_pandas(frame)
    ts = pd.to_datetime(history["ts"], utc=True)
    expected = expected_failures_per_day(history.loc[(ts < result.test_start - result.horizon).to_numpy()])
    baselines = baseline_scores(test, plan.seed)
    scores: dict[str, np.ndarray] = dict(result.scores)
    scores["random"] = baselines["random"]
    rule_note = None
    if rule_columns(test):
        # A rule flags or not; among flagged (and among unflagged) GPUs the order is random.
        scores["rule"] = rule_flags(test).astype(np.float64)
    else:
        rule_note = "the features have no hardware-XID or uncorrectable-ECC columns"
    scores["heuristic"] = baselines["heuristic"]
    scores["oracle"] = labels(test).to_numpy(dtype=np.float64)
    compared = compare_scores(
        test,
        scores,
        top_k=specs,
        expected_per_day=expected,
        model_age_h=result.model_age_h,
        failures=failures,
        bootstrap_samples=bootstrap_samples,
        seed=plan.seed,
    )
    if "rule" in scores:
        compared["rule"]["flagged"] = _flag_metrics(test, scores["rule"])
    primary = next((c.name for c in contenders if c.mode == "auto"), contenders[0].name)
    compared["model"] = {**compared[primary], "name": primary}
    y = labels(test).to_numpy()
    return {
        "kind": "walk-forward",
        "top_k": specs[0],
        "top_k_specs": specs,
        "expected_failures_per_day": expected,
        "horizon_h": result.horizon / pd.Timedelta(hours=1),
        "primary": primary,
        "test": {
            "start": result.test_start.isoformat(),
            "end": result.test_end.isoformat(),
            "n_days": math.ceil((result.test_end - result.test_start) / pd.Timedelta(days=1)),
            "n_rows": len(test),
            "n_positives": int(np.nansum(y)),
            "n_gpus": int(test["gpu_uuid"].nunique()),
            "n_times": int(test["ts"].nunique()),
        },
        "plan": {
            "test_days": plan.test_days,
            "retrain_every": duration_label(plan.retrain_every, "retrain_every"),
            "train_window": duration_label(plan.train_window, "train_window"),
            "candidate_windows": [duration_label(w, "candidate_windows") for w in plan.candidate_windows],
            "validation_window": duration_label(plan.validation_window, "validation_window"),
            "negative_fraction": plan.negative_fraction,
            "bootstrap_samples": bootstrap_samples,
            "seed": plan.seed,
            "jobs": plan.jobs,
        },
        "contenders": [
            {
                "name": c.name,
                "kind": c.kind,
                "mode": c.mode,
                "params": dict(c.params),
                "train_window": None if c.train_window is None else duration_label(c.train_window, "train_window"),
            }
            for c in contenders
        ],
        "baselines": {
            "random": "uniform scores (fixed seed)",
            "rule": rule_note
            or "flag a GPU with any hardware-class XID (memory, NVLink, bus, GSP) or any uncorrectable ECC error in the last 24 h",
            "heuristic": "sum of xid_count* and *ecc*increase* columns",
            "oracle": "ranks by the label itself: the ceiling",
        },
        "retrain_times": [t.isoformat() for t in result.retrain_times],
        "fits": [f.as_dict() for f in result.fits],
        "scores": compared,
        "claims": claims(compared, contenders, specs[0], samples=bootstrap_samples, seed=plan.seed),
    }


def _flag_metrics(test: pd.DataFrame, flags: np.ndarray) -> dict[str, Any]:
    """The rule at its own operating point: every flagged GPU, however many."""
    from models.evaluate import episode_recall

    y = labels(test).to_numpy()
    flagged = flags > 0
    known = ~np.isnan(y)
    n_flags = int((flagged & known).sum())
    per_time = pd.Series(flagged & known).groupby(test["ts"].to_numpy()).sum()
    recall = episode_recall(test.assign(_flag=flags), threshold=0.5, score="_flag")
    return {
        "flags_per_grid_time_mean": float(per_time.mean()),
        "precision": float((y[flagged & known] == 1).mean()) if n_flags else None,
        "recall": recall["recall"],
        "n_caught": recall["n_caught"],
        "lead_time_h_median": recall["lead_time_h_median"],
    }


def claims(
    scores: dict[str, Any], contenders: Sequence[Contender], k: str, *, samples: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """The report's targets checked against the figures: the best contender against the best
    static single model (the paper's step), against the rule, and its day-to-day stability."""

    def daily(name: str) -> dict[str, Any]:
        return dict(scores[name]["by_k"][k])

    def mean(name: str) -> float:
        return daily(name)["precision_daily_mean"] or 0.0

    names = [c.name for c in contenders]
    best = max(names, key=mean)
    statics = [c.name for c in contenders if c.mode == "static" and c.kind in SINGLE_KINDS]
    out: dict[str, Any] = {"best": best, "best_precision": mean(best)}
    oracle = daily("oracle")["precision_daily_mean"]
    out["oracle_precision"] = oracle
    if statics:
        static = max(statics, key=mean)
        out["best_static_single"] = static
        out["best_static_precision"] = mean(static)
        out["gain"] = mean(best) - mean(static)
        out["gain_ratio"] = mean(best) / mean(static) if mean(static) > 0 else None
        out["paper_gain"] = PAPER_PRECISION[1] - PAPER_PRECISION[0]
        out["paper_gain_ratio"] = PAPER_PRECISION[1] / PAPER_PRECISION[0]
        # What the paper's relative step would give here, capped by the ceiling of this data.
        out["paper_step_target"] = min(mean(static) * out["paper_gain_ratio"], oracle or 1.0)
        out["meets_paper_step"] = mean(best) >= out["paper_step_target"]
        s_best, s_static = daily(best)["precision_daily_std"], daily(static)["precision_daily_std"]
        out["std_best"], out["std_static"] = s_best, s_static
        out["std_ratio"] = s_best / s_static if s_best is not None and s_static else None
        out["stability_target_met"] = out["std_ratio"] is not None and out["std_ratio"] <= 0.5
        out["gain_ci"] = _paired_ci(daily(best)["daily"], daily(static)["daily"], samples, seed)
    if "rule" in scores:
        out["rule_precision"] = mean("rule")
        out["beats_rule"] = mean(best) > mean("rule")
        out["gain_over_rule_ci"] = _paired_ci(daily(best)["daily"], daily("rule")["daily"], samples, seed)
    return out


def _paired_ci(a: list[dict[str, Any]], b: list[dict[str, Any]], samples: int, seed: int) -> list[float | None]:
    """Bootstrap CI over days of the mean daily precision difference a - b (same days drawn)."""
    from models.evaluate import bootstrap_ci

    diff = np.array(
        [
            (x["precision"] - y["precision"])
            for x, y in zip(a, b, strict=True)
            if x["precision"] is not None and y["precision"] is not None
        ]
    )
    if len(diff) < 2:
        return [None, None]
    return list(bootstrap_ci(diff, np.mean, samples=samples, seed=seed))
