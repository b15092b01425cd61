"""`train_model` over a store's `features` dataset, reading the wide columns of the sampled rows only.

`train_model` takes a frame of every row in its window and keeps every positive and a share of
the negatives. At the reference paper's scale (~31k GPUs) a three-week window is ~17M rows x
~420 columns, ~28 GB as float32, of which the fit keeps ~10%. Here the window and the negative
draw are made on three narrow columns first (`models.train.training_sample`: the same rows, in
the same order, as `train_model` picks), then each date file is read and cut to those rows, so
memory holds one day of the fleet plus the sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, time, timedelta
from typing import Any

import polars as pl

from features.build import FEATURES_DATASET, feature_files, read_features
from ingest.errors import InputError
from ingest.store import Store
from models.estimators import MAX_POS_WEIGHT
from models.split import DurationLike, TimeLike, as_timedelta, as_utc
from models.train import (
    DEFAULT_NEGATIVE_FRACTION,
    TrainedModel,
    check_model_kind,
    train_model_on_sample,
    training_sample,
    window_name,
)

_KEYS = ["ts", "gpu_uuid"]


def sampled_training_rows(
    store: Store,
    *,
    train_window: DurationLike,
    horizon: DurationLike,
    as_of: TimeLike | None = None,
    negative_fraction: float = DEFAULT_NEGATIVE_FRACTION,
    seed: int = 0,
) -> pl.DataFrame:
    """The rows `train_model(read_features(store), ...)` would fit on (all feature columns),
    sorted by (ts, gpu_uuid), read one date file at a time."""
    days = store.dates(FEATURES_DATASET)
    if not days:
        raise InputError(f"{store.root}: the features dataset is empty; run `gpufail features` first")
    # The window ends at the last settled label (or before as_of - horizon when that is earlier),
    # which is within a horizon of the newest day: that day and horizon + train_window before
    # it hold every row the window can contain (and the rows that say where labels settle).
    newest = datetime.combine(days[-1], time.min, tzinfo=UTC)
    first = newest - as_timedelta(horizon, "horizon") - as_timedelta(train_window, "train_window")
    if as_of is not None:
        earliest = (
            as_utc(as_of).to_pydatetime()
            - as_timedelta(horizon, "horizon")
            - as_timedelta(train_window, "train_window")
        )
        first = min(first, earliest)
    keys = read_features(store, start=first, columns=["label"])
    kept = training_sample(
        keys,
        train_window=train_window,
        horizon=horizon,
        as_of=as_of,
        negative_fraction=negative_fraction,
        seed=seed,
    )
    parts = []
    for day in kept["ts"].dt.date().unique().sort().to_list():
        day_start = datetime.combine(day, time.min, tzinfo=UTC)
        wanted = kept.filter(pl.col("ts").dt.date() == day)
        parts.append(_read_rows(store, day_start, wanted))
    if not parts:
        raise InputError(
            f"{store.root}: the training window of {train_window} has no labelled rows in the features dataset; "
            "widen train_window or check the labels"
        )
    return pl.concat(parts, how="vertical").sort(_KEYS)


def _read_rows(store: Store, day_start: datetime, wanted: pl.DataFrame) -> pl.DataFrame:
    """The feature rows of one UTC day whose (ts, gpu_uuid) are in `wanted`. On a local store
    the day's files are scanned with the keys' hash as the filter, so polars drops the other
    rows as it decodes (a hash collision only lets a row through to the exact semi-join):
    ~5x faster than reading the day whole and sorting it, which a retrain did for each of its
    ~22 days (0.6 s against 3.3 s for a day of the paper fleet)."""
    if not store.is_local:
        wide = read_features(store, start=day_start, end=day_start + timedelta(days=1))
        return wide.join(wanted, on=_KEYS, how="semi")
    files = feature_files(store, day_start.date(), day_start.date())
    hashes = wanted.select(pl.struct(_KEYS).hash().alias("_h"))["_h"]
    return (
        pl.scan_parquet(files, hive_partitioning=False)
        .filter(pl.struct(_KEYS).hash().is_in(hashes.implode()))
        .collect()
        .join(wanted, on=_KEYS, how="semi")
    )


def train_model_from_store(
    store: Store,
    *,
    kind: str,
    train_window: DurationLike,
    horizon: DurationLike,
    as_of: TimeLike | None = None,
    params: dict[str, Any] | None = None,
    max_pos_weight: float = MAX_POS_WEIGHT,
    monotone_increasing: Sequence[str] = (),
    negative_fraction: float = DEFAULT_NEGATIVE_FRACTION,
    seed: int = 0,
) -> TrainedModel:
    """`models.train.train_model` on the store's features, with the same arguments and the
    same model, holding one day of features and the sample in memory instead of the window."""
    check_model_kind(kind, params)  # before anything is read: a bad setting fails fast
    rows = sampled_training_rows(
        store,
        train_window=train_window,
        horizon=horizon,
        as_of=as_of,
        negative_fraction=negative_fraction,
        seed=seed,
    )
    where = window_name(train_window, horizon, as_of)
    return train_model_on_sample(
        rows,
        kind=kind,
        horizon=horizon,
        where=where,
        params=params,
        max_pos_weight=max_pos_weight,
        monotone_increasing=monotone_increasing,
        negative_fraction=negative_fraction,
    )
