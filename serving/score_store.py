"""Score the fleet of a store with a model: `gpufail score` and the nightly job's score step.

The features must have been built with the model's feature spec (`TrainedModel.feature_spec`):
features built with other settings have other columns, or the same columns with other
meanings (another window, another horizon), and a model scores them without a word of
complaint. So the spec the features dataset records is checked first, and scoring is refused
with a one-line message naming both specs and the settings they differ in.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from features.dataset import read_newest_grid_time
from features.manifest import recorded_spec
from features.spec import FeatureSpec, require_spec
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


def score_store(store: Store, model: TrainedModel, *, top_features: int = TOP_FEATURES) -> ScoredFleet:
    """Score every GPU's latest grid time in the store's features with `model` and write the
    predictions snapshot of that grid time and model version (scoring them again replaces it).

    Only the newest grid time is read: GPUs that failed or left earlier have no row there (the
    feature grid is dense for every GPU still in service)."""
    check_model_spec(model, recorded_spec(store), store.root)
    frame = read_newest_grid_time(store)
    if frame.height == 0:
        raise InputError(
            f"{store.root}: the features dataset is empty; run `gpufail features --data {store.root}` first"
        )
    predictions = score_latest(model, frame, top_features=top_features)
    path, replaced = write_snapshot(store, predictions)
    return ScoredFleet(predictions, path, replaced)
