"""`train_model` over a store's `features` dataset, reading the wide columns of the sampled rows only.

`train_model` takes a frame of every row in its window and keeps every positive and a share of
the negatives. At the reference paper's scale (~31k GPUs) a three-week window is ~17M rows x
~420 columns, ~28 GB as float32, of which the fit keeps ~10%. The negatives are drawn by a
hash of each row's (gpu_uuid, ts) (`features.sample_key`), which the feature build stores and
uses to write the rows drawn at up to 10% in a row group of their own: a retrain reads the
window filtered on that key, and the other row groups are skipped unread. Files written
before the key existed are read one day at a time: the draw is made on three narrow columns
first (`models.train.training_sample`), then each date file is cut to those rows. Either way
the rows are the ones `train_model` picks, in the same order.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime, time, timedelta

import pandas as pd
import polars as pl

from features.dataset import (
    drawn_rows,
    feature_days,
    has_sample_keys,
    keep_labels,
    label_counts,
    read_features,
    rows_at,
)
from features.manifest import recorded_spec
from features.spec import require_spec
from ingest.errors import InputError
from ingest.store import Store
from models.calibration import check_method
from models.kinds import TREE_KINDS, kind_params
from models.split import DurationLike, TimeLike, as_timedelta, as_utc
from models.train import (
    TrainedModel,
    TrainOptions,
    attach_calibration,
    calibrate_model,
    calibration_bounds,
    calibration_fit_options,
    check_model_kind,
    check_negative_fraction,
    served_fit_options,
    short_history_note,
    train_model_on_sample,
    training_bounds,
    training_sample,
)

_KEYS = ["ts", "gpu_uuid"]

SKEWED_DAYS = 2
"""Newest features days without rows (dated by clocks ahead of the fleet) passed over before
`store_settled_until` refuses."""


def sampled_training_rows(store: Store, options: TrainOptions) -> pl.DataFrame:
    """The rows `train_model(read_features(store), options)` fits on (all feature columns),
    sorted by (ts, gpu_uuid), drawn at `options.negative_fraction` (`max_negatives_per_positive`
    is applied by `train_model_from_store`, which draws at the capped share). Files written with
    the draw's key (`features.sample_key`) are filtered on it as they are read; older ones are
    read one date file at a time."""
    bounds = store_training_bounds(
        store, train_window=options.train_window, horizon=options.horizon, as_of=options.as_of
    )
    return sampled_rows_between(store, bounds, options)


def sampled_rows_between(
    store: Store, bounds: tuple[pd.Timestamp, pd.Timestamp], options: TrainOptions
) -> pl.DataFrame:
    """`sampled_training_rows` for the window [start, end) = `bounds` already found (the
    bounds `options` give: `train_window` ending `horizon` before `as_of`, read when the
    files lack the stored draw key)."""
    check_negative_fraction(options.negative_fraction)
    start, end = bounds
    if options.seed == 0 and has_sample_keys(store, start.to_pydatetime(), end.to_pydatetime()):
        rows = drawn_rows(store, start.to_pydatetime(), end.to_pydatetime(), options.negative_fraction)
    else:
        rows = _read_sampled_days(store, options)
    if rows.height == 0:
        raise InputError(
            f"{store.root}: the training window of {options.train_window} has no labelled rows in the features "
            "dataset; widen train_window or check the labels"
        )
    return rows


def store_settled_until(store: Store, horizon: DurationLike) -> pd.Timestamp:
    """`models.train.settled_until` of the store's features, found from the last date
    partition alone (the data's last grid time), without reading the rest."""
    days = feature_days(store)
    if not days:
        raise InputError(f"{store.root}: the features dataset is empty; run `gpufail features` first")
    # The newest day can hold no grid time of the fleet: samples of a few GPUs whose clocks run
    # ahead of the bulk's (`features.labels.fleet_data_end`) date it without making it the
    # fleet's. The fleet's last grid time is then in the day before.
    considered = days[-SKEWED_DAYS - 1 :]
    for day in reversed(considered):
        last_ts = read_features(store, start=datetime.combine(day, time.min, tzinfo=UTC), columns=[])["ts"].max()
        if isinstance(last_ts, datetime):
            return as_utc(last_ts) - as_timedelta(horizon, "horizon")
    raise InputError(f"{store.root}: the newest features days ({considered[0]} .. {considered[-1]}) have no rows")


def store_training_bounds(
    store: Store, *, train_window: DurationLike, horizon: DurationLike, as_of: TimeLike | None = None
) -> tuple[pd.Timestamp, pd.Timestamp]:
    """[start, end) of the grid times `models.train.training_rows` keeps, found from the last
    date partition alone (the data's last grid time), without reading the window."""
    settled = store_settled_until(store, horizon)
    return training_bounds(settled, train_window=train_window, horizon=horizon, as_of=as_of)


def window_label_counts(store: Store, start: pd.Timestamp, end: pd.Timestamp) -> tuple[int, int]:
    """(negatives, positives) with start <= ts < end (`store_training_bounds`), from the
    `label` and `ts` columns alone, counted as they are decoded: no gpu_uuid, no sort (12 s ->
    ~1 s for the paper fleet's 15.5M-row window)."""
    return label_counts(store, start.to_pydatetime(), end.to_pydatetime())


def _read_sampled_days(store: Store, options: TrainOptions) -> pl.DataFrame:
    """The drawn rows, for files without the stored key (or another seed): the draw is made on
    three narrow columns of the window first, then each date file is read and cut to those rows."""
    days = feature_days(store)
    # The window ends at the last settled label (or before as_of - horizon when that is earlier),
    # which is within a horizon of the newest day: that day and horizon + train_window before
    # it hold every row the window can contain (and the rows that say where labels settle).
    newest = datetime.combine(days[-1], time.min, tzinfo=UTC)
    span = as_timedelta(options.horizon, "horizon") + as_timedelta(options.train_window, "train_window")
    first = newest - span
    if options.as_of is not None:
        first = min(first, as_utc(options.as_of).to_pydatetime() - span)
    kept = training_sample(read_features(store, start=first, columns=["label"]), options)
    parts = []
    for day in kept["ts"].dt.date().unique().sort().to_list():
        day_start = datetime.combine(day, time.min, tzinfo=UTC)
        wanted = kept.filter(pl.col("ts").dt.date() == day)
        parts.append(rows_at(store, day_start, wanted))
    if not parts:
        return pl.DataFrame()
    return pl.concat(parts, how="vertical").sort(_KEYS)


FitOnWindow = Callable[[TrainOptions, tuple[pd.Timestamp, pd.Timestamp]], TrainedModel]
"""A fit with these options on the training window [start, end) already found."""

_READS = threading.Lock()
"""One read of drawn rows at a time: two fits side by side (`calibrated_from_store`) whose
windows share days compute each day once (the second reads the first's kept files), and hold
one read's blocks at a time."""


def calibrated_from_store(
    store: Store, options: TrainOptions, fit: FitOnWindow, *, side_by_side: bool = False
) -> TrainedModel:
    """`fit(options, window)`, or, with `options.calibration`, that fit carrying a map fitted
    on the calibration slice (`models.train.calibration_bounds`, its rows drawn from the store as
    the training rows are) as scored by the fit `fit` makes as of the slice's start
    (`train_model` on a frame does the same). The windows are found from one read of where the
    labels settle, and every label of the windows and the slice is computed once
    (`features.dataset.keep_labels`). `side_by_side`: the served fit runs on a thread beside
    the fit that scores the slice and the calibration (each is a one-thread fit: on two cores,
    the two take about the time of the longer)."""
    settled = store_settled_until(store, options.horizon)

    def window(as_of: TimeLike | None) -> tuple[pd.Timestamp, pd.Timestamp]:
        return training_bounds(settled, train_window=options.train_window, horizon=options.horizon, as_of=as_of)

    if options.calibration is None:
        return fit(options, window(options.as_of))
    check_method(options.calibration)
    bounds = calibration_bounds(settled, options)
    scorer_options, served_options = calibration_fit_options(options, bounds[0]), served_fit_options(options)
    scorer_window, served_window = window(scorer_options.as_of), window(served_options.as_of)
    # Before the labels are kept: its read of the first day would let them go.
    note = short_history_note(store_first_ts(store), settled, options, bounds)
    spans = (scorer_window, served_window, bounds)
    keep_labels(store, min(s[0] for s in spans).to_pydatetime(), max(s[1] for s in spans).to_pydatetime())
    # The slice first: its days are drawn at a larger share than the window's (more negatives
    # per positive are left in a week than in three) and kept, and the served window, which
    # ends with them, reads them from those files (`features.drawn_cache`).
    rows, slice_fraction = _slice_rows(store, options, bounds)

    def calibrated(scorer: TrainedModel) -> TrainedModel:
        assert options.calibration is not None
        return calibrate_model(
            scorer, rows, method=options.calibration, bounds=bounds, negative_fraction=slice_fraction
        )

    if not side_by_side:
        scorer = calibrated(fit(scorer_options, scorer_window))
        return attach_calibration(fit(served_options, served_window), scorer, note)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="served-fit") as pool:
        served = pool.submit(fit, served_options, served_window)
        scorer = calibrated(fit(scorer_options, scorer_window))
        return attach_calibration(served.result(), scorer, note)


def _slice_rows(
    store: Store, options: TrainOptions, bounds: tuple[pd.Timestamp, pd.Timestamp]
) -> tuple[pl.DataFrame, float]:
    """The drawn rows of the calibration slice `bounds` and the share of its negatives drawn."""
    counts = window_label_counts(store, *bounds)
    # The slice read as a training window of its own (files without the stored draw key are
    # drawn from the window that `train_window` and `as_of` name).
    drawn = replace(
        options.drawn_from(*counts),
        train_window=options.calibration_window,
        as_of=bounds[1] + as_timedelta(options.horizon, "horizon"),
    )
    with _READS:
        rows = sampled_rows_between(store, bounds, drawn) if sum(counts) else pl.DataFrame()
    return rows, drawn.negative_fraction


def store_first_ts(store: Store) -> pd.Timestamp:
    """The first grid time of the store's features, from the first date partition alone."""
    days = feature_days(store)
    if not days:
        raise InputError(f"{store.root}: the features dataset is empty; run `gpufail features` first")
    first = datetime.combine(days[0], time.min, tzinfo=UTC)
    frame = read_features(store, start=first, end=first + timedelta(days=1), columns=[])
    first_ts = frame["ts"].min()
    if not isinstance(first_ts, datetime):
        raise InputError(f"{store.root}: the first features day ({days[0]}) has no rows")
    return as_utc(first_ts)


def with_store_spec(store: Store, options: TrainOptions) -> TrainOptions:
    """`options` with the feature spec the store's features record (the model trained on them
    carries it). A different spec in `options` (the configuration's) is refused: a model would
    carry settings its features were not built with. Unrecorded (features built before specs
    were recorded): the spec of `options`, else the default spec."""
    built = recorded_spec(store)
    if built is None:
        return options
    if options.feature_spec is not None:
        require_spec(
            built,
            options.feature_spec,
            features=f"{store.root}: the features",
            user="the training settings ask for",
            remedy="rebuild the features with these settings (gpufail features --overwrite) or train with the "
            "settings the features were built with",
        )
    return replace(options, feature_spec=built)


def train_model_from_store(store: Store, options: TrainOptions) -> TrainedModel:
    """`models.train.train_model` on the store's features, with the same options and the same
    model (its calibration included), holding the sample in memory instead of the window. The
    model carries the spec the features were built with (`with_store_spec`). The two fits of a
    calibrated model run side by side when each is a one-thread fit of trees
    (`fits_side_by_side`)."""
    check_model_kind(options.kind, options.params)  # before anything is read: a bad setting fails fast
    options = with_store_spec(store, options)
    return calibrated_from_store(
        store,
        options,
        lambda fit_options, window: _train_from_store(store, fit_options, window),
        side_by_side=fits_side_by_side(options),
    )


def fits_side_by_side(options: TrainOptions) -> bool:
    """Whether the two fits of a calibrated model may run at once: trees (no BLAS, whose thread
    limit is process-wide) fitted on one thread each (`[model] threads` = 1), on a machine with
    two cores or more. Each fit is the same as alone: only the wall time changes."""
    if options.kind not in TREE_KINDS or (os.cpu_count() or 1) < 2:
        return False
    return kind_params(options.kind, options.params).get("n_jobs") == 1


def _train_from_store(store: Store, options: TrainOptions, window: tuple[pd.Timestamp, pd.Timestamp]) -> TrainedModel:
    options = options.drawn_from(*window_label_counts(store, *window))
    with _READS:
        rows = sampled_rows_between(store, window, options)
    return train_model_on_sample(rows, options)
