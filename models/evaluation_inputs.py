"""What the comparison (`models.comparison`) reads besides the walk-forward's scores, from a
frame in memory or from a store a day at a time.

Beyond the contenders' risks, the figures read: the test and validation rows' columns of the
baselines (the rule's, the heuristic's, the fail-slow score's, the best single feature's), the
failures and grid times of the whole data (`models.history.History`), the drift events' facts
(`models.drift.DriftFacts`) and, to explain the top false alarms, the test period's spread of
every feature and the features of a few test rows (`models.false_alarms.FeatureView`).

From a store, none of these needs every feature of every row in one process:

- one pass over the feature days reads the days before the evaluation period as identity and
  labels only (cheap even where features are computed on demand), and each day of the
  evaluation period with every feature, keeping of it the columns the figures read, its
  history and drift facts, the moments of its test rows' features, and, of its validation
  rows, every positive and a uniform sample of the negatives (`VALIDATION_SAMPLE`);
- the best single feature is chosen on that sample (ROC-AUC, which a uniform sample of the
  negatives leaves unbiased; every row is kept where the slice is smaller than the sample, as
  on the demo) as soon as the pass leaves the validation slice, so the test days keep its
  column; the validation days are read again for that one column;
- the walk-forward then runs from the store (`run_walk_forward_from_store`) over the rows kept;
- the false alarms' features are read back for their rows alone.

A process so holds one day of features, the sample, and the kept columns of the evaluation
period's labelled rows."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import polars as pl

from features.dataset import computed, feature_days, read_features, write_features
from features.fail_slow import fail_slow_columns, needed_columns
from features.schema import ID_COLUMNS, LABEL_COLUMNS
from ingest.errors import GpufailError
from ingest.store import Store
from models.drift import DriftFacts
from models.evaluate import heuristic_columns, rule_columns
from models.false_alarms import FeatureView, Moments
from models.feature_baseline import choose_feature
from models.frame import labels, to_pandas
from models.history import History
from models.walk_forward import (
    Contender,
    Periods,
    WalkForwardPlan,
    WalkForwardResult,
    evaluation_frame,
    run_walk_forward,
    run_walk_forward_from_store,
    store_periods,
    training_span,
)
from models.walk_forward_rows import draw_ahead

VALIDATION_SAMPLE = 200_000
"""The most negative validation rows the best single feature is chosen on (every positive is
kept): 200k rows of ~440 features are ~350 MB; a ROC-AUC on them is within ~0.002 of the whole
slice's."""


@dataclass(frozen=True)
class EvaluationInputs:
    """Use it as a context manager: leaving it removes the evaluation period's copy, if any."""

    result: WalkForwardResult
    history: History
    drift: DriftFacts
    best_feature: dict[str, Any] | None
    """`models.feature_baseline.choose_feature` of the validation slice; its column is in
    `result.test` and `result.validation`."""
    features: FeatureView
    scratch: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> EvaluationInputs:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.scratch is not None:
            self.scratch.cleanup()


def figure_columns(frame: pd.DataFrame, fail_slow_window: str | None) -> list[str]:
    """The columns of `frame` (only its names and types are read) the figures after the
    walk-forward read of the test and validation rows, besides identity and labels: the rule's,
    the heuristic's and the fail-slow score's (or its inputs)."""
    names = [*rule_columns(frame), *heuristic_columns(frame)]
    if fail_slow_window is not None:
        built = fail_slow_columns(fail_slow_window)
        # The score's inputs only where the features do not hold the score itself.
        names += built if built[-1] in frame.columns else [*built, *needed_columns(fail_slow_window)]
    return [c for c in dict.fromkeys(names) if c in frame.columns]


def inputs_in_memory(
    frame: Any, contenders: Sequence[Contender], plan: WalkForwardPlan, *, progress: bool, client: Any
) -> EvaluationInputs:
    """The inputs of a whole features frame held in memory."""
    frame = to_pandas(frame)
    result = run_walk_forward(frame, contenders, plan, progress=progress, client=client)
    assert result.validation is not None
    return EvaluationInputs(
        result,
        History.of(frame),
        DriftFacts.of(frame),
        choose_feature(result.validation),
        FeatureView.of(result.test),
    )


def inputs_from_store(
    store: Store,
    contenders: Sequence[Contender],
    plan: WalkForwardPlan,
    *,
    fail_slow_window: str | None,
    progress: bool,
    client: Any,
    sample: int = VALIDATION_SAMPLE,
    scratch_dir: str | None = None,
) -> EvaluationInputs:
    """The inputs read from the store's features a day at a time (see the module notes). In
    one process (no `client`), where the store computes its features on demand, the pass keeps
    the evaluation period's labelled rows in a temporary store of its own (`scratch_dir`: the
    system's temporary folder by default), which the walk-forward's scoring and the reads after
    it read instead of computing each day again."""
    periods = store_periods(store, contenders, plan)
    # Before anything else is held: the fits then read their draws instead of computing them.
    draw_ahead(store, training_span(periods, contenders, plan), plan.negative_fraction, plan.seed, progress)
    scratch = None
    if client is None and computed(store):
        _remove_orphans(scratch_dir)
        scratch = tempfile.TemporaryDirectory(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-", dir=scratch_dir)
    try:
        copy = None if scratch is None else Store.create(str(Path(scratch.name) / "data"))
        read = _Pass(store, periods, fail_slow_window, sample, plan.seed, copy)
        from tqdm.auto import tqdm

        for day in tqdm(feature_days(store), desc="evaluate reading", unit="day", disable=not progress):
            read.day(day)
        evaluation = read.evaluation()
        result = run_walk_forward_from_store(
            store,
            contenders,
            plan,
            evaluation=(periods, evaluation),
            scored_from=copy,
            progress=progress,
            client=client,
        )
    except BaseException:
        if scratch is not None:
            scratch.cleanup()
        raise
    rows_from = copy or store
    return EvaluationInputs(
        result,
        History.merged(read.history),
        DriftFacts.merged(read.drift),
        read.choice,
        FeatureView(
            Moments.merged(read.moments).spread(), lambda positions: rows_at(rows_from, result.test, positions)
        ),
        scratch,
    )


_SCRATCH_PREFIX = "gpufail-evaluate-"


def _remove_orphans(scratch_dir: str | None) -> None:
    """Remove the copies of evaluate runs whose process is gone (killed before it could remove
    its own): each copy's name holds its process id."""
    for path in Path(scratch_dir or tempfile.gettempdir()).glob(f"{_SCRATCH_PREFIX}*-*"):
        pid = path.name[len(_SCRATCH_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _day_bounds(day: date) -> tuple[datetime, datetime]:
    midnight = datetime.combine(day, time.min, tzinfo=UTC)
    return midnight, midnight + timedelta(days=1)


class _Pass:
    """The one pass over the feature days (`inputs_from_store`)."""

    def __init__(
        self, store: Store, periods: Periods, fail_slow_window: str | None, sample: int, seed: int, copy: Store | None
    ) -> None:
        self.store, self.periods, self.window, self.sample, self.copy = store, periods, fail_slow_window, sample, copy
        self.rng = np.random.default_rng(seed)
        self.history: list[History] = []
        self.drift: list[DriftFacts] = []
        self.moments: list[Moments] = []
        self.parts: list[pl.DataFrame] = []
        self.keep: list[str] | None = None
        self.positives: list[pd.DataFrame] = []
        self.negatives: pd.DataFrame | None = None
        self.negative_keys = np.zeros(0)
        self.choice: dict[str, Any] | None = None
        self.chosen = False
        self.missing_feature: list[date] = []
        """Days whose validation or test rows were kept before the feature was chosen."""

    def day(self, day: date) -> None:
        start, end = _day_bounds(day)
        p = self.periods
        lo, hi = max(pd.Timestamp(start), p.eval_start), min(pd.Timestamp(end), p.test_end_excl)
        if lo >= hi:
            self._facts(read_features(self.store, start, end, columns=[*ID_COLUMNS, *LABEL_COLUMNS]))
            return
        if not self.chosen and pd.Timestamp(start) >= p.validation[1]:
            self._choose()
        whole = read_features(self.store, start, end)
        self._facts(whole)
        in_period = (pl.col("ts") >= lo.to_pydatetime()) & (pl.col("ts") < hi.to_pydatetime())
        labelled = whole.filter(in_period & pl.col("label").is_not_null())
        del whole
        if self.copy is not None:
            write_features(self.copy, labelled)
        if self.keep is None:
            self.keep = list(
                dict.fromkeys([*ID_COLUMNS, *LABEL_COLUMNS, *figure_columns(labelled.head(0).to_pandas(), self.window)])
            )
        kept = [*self.keep, *([self.choice["feature"]] if self.choice else [])]
        self.parts.append(labelled.select([c for c in dict.fromkeys(kept) if c in labelled.columns]))
        ts = pd.to_datetime(labelled["ts"].to_pandas(), utc=True)
        validation = ((ts >= p.validation[0]) & (ts < p.validation[1])).to_numpy()
        test = (ts >= p.test_start).to_numpy()
        if validation.any():
            self._sample(to_pandas(labelled.filter(pl.Series(validation))))
            self.missing_feature.append(day)
        if test.any():
            self.moments.append(Moments.of(to_pandas(labelled.filter(pl.Series(test)))))
            if not self.chosen:
                self.missing_feature.append(day)

    def _facts(self, frame: pl.DataFrame) -> None:
        narrow = to_pandas(frame.select([c for c in (*ID_COLUMNS, *LABEL_COLUMNS) if c in frame.columns]))
        self.history.append(History.of(narrow))
        self.drift.append(DriftFacts.of(narrow))

    def _sample(self, rows: pd.DataFrame) -> None:
        """Every positive, and the `sample` negatives of the smallest random keys so far: a
        uniform sample of all the slice's negatives, whatever the order of the days."""
        positive = (labels(rows) == 1).to_numpy()
        self.positives.append(rows.loc[positive])
        negatives = rows.loc[~positive]
        keys = self.rng.random(len(negatives))
        if self.negatives is not None:
            negatives = pd.concat([self.negatives, negatives], ignore_index=True)
            keys = np.concatenate([self.negative_keys, keys])
        if len(negatives) > self.sample:
            kept = np.sort(np.argpartition(keys, self.sample)[: self.sample])
            negatives, keys = negatives.iloc[kept].reset_index(drop=True), keys[kept]
        self.negatives, self.negative_keys = negatives, keys

    def _choose(self) -> None:
        self.chosen = True
        parts = [*self.positives, *([] if self.negatives is None else [self.negatives])]
        if parts:
            self.choice = choose_feature(pd.concat(parts, ignore_index=True))
        self.positives, self.negatives = [], None

    def evaluation(self) -> pd.DataFrame:
        """The kept columns of the evaluation period's labelled rows, sorted by (ts, gpu_uuid),
        with the chosen feature's column on the validation and test rows."""
        if not self.chosen:
            self._choose()
        parts, self.parts = self.parts, []
        out = evaluation_frame(parts, self.store.root, self.periods.eval_start, self.periods.test_end_excl)
        del parts
        if self.choice is not None and self.choice["feature"] not in (self.keep or []):
            self._fill(out, self.choice["feature"])
        return out

    def _fill(self, out: pd.DataFrame, feature: str) -> None:
        """Read `feature` again for the days kept before it was chosen."""
        values = (
            out[feature].to_numpy(dtype=np.float64, na_value=np.nan) if feature in out else np.full(len(out), np.nan)
        )
        ns = pd.DatetimeIndex(pd.to_datetime(out["ts"], utc=True)).as_unit("ns").asi8
        for day in dict.fromkeys(self.missing_feature):
            start, end = _day_bounds(day)
            lo, hi = np.searchsorted(ns, [pd.Timestamp(start).value, pd.Timestamp(end).value])
            part = read_features(self.copy or self.store, start, end, columns=["label", feature])
            part = part.filter(pl.col("label").is_not_null())
            part = part.filter(pl.col("ts") >= self.periods.eval_start.to_pydatetime()).filter(
                pl.col("ts") < self.periods.test_end_excl.to_pydatetime()
            )
            if part.height != hi - lo:
                raise GpufailError(
                    f"{self.store.root}: the features of {day} changed while evaluate read them "
                    f"({part.height:,} labelled rows, {hi - lo:,} before); expected them unchanged during the run"
                )
            values[lo:hi] = part[feature].cast(pl.Float64).fill_nan(None).to_numpy()
        out[feature] = values


def rows_at(store: Store, test: pd.DataFrame, positions: np.ndarray) -> pd.DataFrame:
    """The rows of `test` (the walk-forward's test rows from the store) at `positions`, with
    every feature, read back from the store a day at a time, in the order of `positions`."""
    keys = test.iloc[positions][["ts", "gpu_uuid"]].reset_index(drop=True)
    keys = keys.assign(ts=pd.to_datetime(keys["ts"], utc=True).dt.as_unit("ns"), _order=np.arange(len(keys)))
    found = []
    for day, wanted in keys.groupby(keys["ts"].dt.floor("D")):
        start, end = _day_bounds(day.date())
        rows = to_pandas(read_features(store, start, end))
        rows = rows.assign(ts=pd.to_datetime(rows["ts"], utc=True).dt.as_unit("ns"))
        found.append(wanted.merge(rows, on=["ts", "gpu_uuid"], how="inner"))
    out = pd.concat(found, ignore_index=True).sort_values("_order") if found else keys.iloc[:0]
    if len(out) != len(keys):
        raise GpufailError(
            f"{store.root}: {len(keys) - len(out)} test rows not found again; expected the features unchanged"
        )
    return out.drop(columns="_order").reset_index(drop=True)
