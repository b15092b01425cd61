"""Scoring a store's fleet (`gpufail score`, the nightly's score step) with the model's feature
spec: features built with another spec are refused in one line naming both specs."""

from __future__ import annotations

import dataclasses
import sys
from datetime import timedelta
from pathlib import Path

import pandas as pd
import pytest

from features.manifest import FeatureManifest, recorded_spec
from features.spec import FeatureSpec, FeatureSpecMismatch
from ingest.errors import InputError
from ingest.store import Store
from models.train import save_model
from serving.predictions import newest_snapshot
from serving.score import score_latest
from serving.score_store import score_store
from tests.serving.api_server import SPEC, fleet, trained_model, write_store

OTHER = dataclasses.replace(SPEC, windows=(timedelta(hours=1), timedelta(hours=6)), horizon=timedelta(hours=12))


def store_built_with(root: Path, spec: FeatureSpec | None) -> Store:
    """The test fleet's features in a store whose manifest records `spec` (None: none, as a
    store built before specs were recorded)."""
    store = Store.open(str(write_store(root)))
    FeatureManifest.load(store)  # takes the written files as complete
    if spec is not None:
        store.write_state("features", {**store.read_state("features"), "spec": spec.to_json()})
    assert recorded_spec(store) == spec
    return store


def test_a_store_of_the_models_spec_is_scored_and_its_snapshot_written(tmp_path):
    store = store_built_with(tmp_path / "data", SPEC)
    model = trained_model()
    scored = score_store(store, model)
    latest = fleet()[2].to_pandas()
    expected = score_latest(model, latest[latest["ts"] == latest["ts"].max()], top_features=5)
    pd.testing.assert_frame_equal(scored.predictions.reset_index(drop=True), expected.reset_index(drop=True))
    assert not scored.replaced and newest_snapshot(store).key.model_version == model.version
    assert score_store(store, model).replaced  # the same grid time and model again


def test_features_of_another_spec_are_refused_naming_both_specs_and_nothing_is_written(tmp_path):
    store = store_built_with(tmp_path / "data", SPEC)
    model = dataclasses.replace(trained_model(), feature_spec=OTHER)
    with pytest.raises(FeatureSpecMismatch) as refused:
        score_store(store, model)
    message = str(refused.value)
    assert message.startswith(
        f"{store.root}: the features were built with feature spec {SPEC.fingerprint}, but model {model.version} "
        f"needs feature spec {OTHER.fingerprint}; they differ in windows ("
    )
    assert 'horizon ("1d" against "12h")' in message and "gpufail features --overwrite" in message
    assert "\n" not in message and newest_snapshot(store) is None


def test_features_that_record_no_spec_are_scored(tmp_path):
    store = store_built_with(tmp_path / "data", None)
    assert len(score_store(store, trained_model()).predictions) == fleet()[0]["gpu_uuid"].n_unique()


def test_an_empty_features_dataset_is_an_input_error(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    with pytest.raises(InputError, match="the features dataset is empty; run `gpufail features"):
        score_store(store, trained_model())


def test_the_score_command_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    from gpufail.cli import main

    store = store_built_with(tmp_path / "data", SPEC)
    model = save_model(dataclasses.replace(trained_model(), feature_spec=OTHER), tmp_path / "model")
    monkeypatch.setattr(sys, "argv", ["gpufail", "score", "--data", store.root, "--model", str(model)])
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"gpufail: error: {store.root}: the features were built with feature spec {SPEC.fingerprint}")
