"""Score the fleet of a store with a model: `gpufail score` and the nightly job's score step.

The features must have been built with the model's feature spec (`TrainedModel.feature_spec`):
features built with other settings have other columns, or the same columns with other
meanings (another window, another horizon), and a model scores them without a word of
complaint. So the spec the features dataset records is checked first, and scoring is refused
with a one-line message naming both specs and the settings they differ in.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pandas as pd

from features.dataset import feature_days, read_features, read_newest_grid_time
from features.manifest import recorded_spec
from features.spec import FeatureSpec, require_spec
from features.windows import grid_floor
from ingest.errors import InputError
from ingest.store import Store
from models.train import TrainedModel
from serving.predictions import write_snapshot
from serving.score import score_latest

TOP_FEATURES = 5
"""Each GPU's top features kept with its prediction, so that the publish audit log says why."""


def check_model_spec(model: TrainedModel, built: FeatureSpec | None, root: str) -> None:
    """Refuse features of `root` built with `built` when `model` needs another spec (features
    whose spec was not recorded pass: there is nothing to check them against)."""
    require_spec(
        built,
        model.feature_spec,
        features=f"{root}: the features",
        user=f"model {model.version} needs",
        remedy="rebuild the features with the model's settings (the feature_spec of its metadata.json, as "
        "[features] and [labels]; gpufail features --overwrite) or use a model trained on these features",
    )


@dataclass(frozen=True)
class ScoredFleet:
    predictions: pd.DataFrame
    """`serving.score.score_latest`'s frame, with each GPU's top features."""
    path: str
    """The predictions snapshot written."""
    replaced: int
    """How many files of an earlier snapshot of the same grid time and model version it replaced."""


def score_store(
    store: Store, model: TrainedModel, *, top_features: int = TOP_FEATURES, at: datetime | None = None
) -> ScoredFleet:
    """Score every GPU's latest grid time in the store's features with `model` and write the
    predictions snapshot of that grid time and model version (scoring them again replaces it).
    With `at`: the GPUs' rows at the grid time `at` falls in (a backtest), instead.

    Only one grid time is read: GPUs that failed or left earlier have no row there (the
    feature grid is dense for every GPU still in service)."""
    check_model_spec(model, recorded_spec(store), store.root)
    if at is None:
        frame = read_newest_grid_time(store)
    else:
        moment = grid_floor(at, model.feature_spec.grid)
        frame = read_features(store, start=moment, end=moment + timedelta(microseconds=1))
        if frame.height == 0:
            raise InputError(
                f"{store.root}: no features at {moment:%Y-%m-%d %H:%M} UTC (--at {at.isoformat()}); "
                f"{_built_days(store)}"
            )
    if frame.height == 0:
        raise InputError(
            f"{store.root}: the features dataset is empty; run `gpufail features --data {store.root}` first"
        )
    predictions = score_latest(model, frame, top_features=top_features)
    path, replaced = write_snapshot(store, predictions)
    return ScoredFleet(predictions, path, replaced)


@dataclass(frozen=True)
class ScoredRange:
    grid_times: int
    rows: int
    replaced: int
    first: datetime
    last: datetime


def score_range(
    store: Store, model: TrainedModel, start: datetime, end: datetime, *, top_features: int = TOP_FEATURES
) -> ScoredRange:
    """Score every grid time in [start, end) that has features, one predictions snapshot each
    (as `score_store` at that time writes it): a backtest of the days after a training cut-off.
    Read one UTC day at a time."""
    check_model_spec(model, recorded_spec(store), store.root)
    grid_times = rows = replaced = 0
    first = last = None
    for day in feature_days(store, start, end):
        day_start = datetime.combine(day, datetime.min.time(), tzinfo=UTC)
        frame = read_features(store, start=max(start, day_start), end=min(end, day_start + timedelta(days=1)))
        for (ts,), rows_at_ts in frame.group_by("ts", maintain_order=True):
            predictions = score_latest(model, rows_at_ts, top_features=top_features)
            replaced += write_snapshot(store, predictions)[1]
            grid_times, rows = grid_times + 1, rows + len(predictions)
            first = first or ts
            last = ts
    if first is None or last is None:
        raise InputError(
            f"{store.root}: no features in {start:%Y-%m-%d %H:%M}..{end:%Y-%m-%d %H:%M} UTC; {_built_days(store)}"
        )
    return ScoredRange(grid_times, rows, replaced, first, last)


def _built_days(store: Store) -> str:
    days = feature_days(store)
    if not days:
        return f"the features dataset is empty; run `gpufail features --data {store.root}` first"
    return f"features are built for {days[0]}..{days[-1]}"
