"""The MLflow registry against a real tracking server on 127.0.0.1 (session fixture
`mlflow_server` in tests/conftest.py): what a run records, loading, the champion cache."""

from __future__ import annotations

import pytest

from gpufail.mlflow_server import free_port
from models.gate import promote_if_better
from models.provenance import code_version
from models.registry import (
    CHALLENGER,
    CHAMPION,
    Registry,
    RegistryError,
    load_champion,
    load_version,
    log_training_run,
    register,
)
from models.train import ModelVersionWarning, TrainedModel
from tests.models.mlflow_runs import fresh_registry, logged_version, model_and_holdout


def test_a_run_records_what_reproduces_the_model_and_registers_a_challenger(mlflow_server, tmp_path):
    url, _ = mlflow_server
    registry = fresh_registry(url)
    version, run_id = logged_version(registry, tmp_path)

    run = registry.client.get_run(run_id)
    model, _ = model_and_holdout()
    assert run.data.params["kind"] == "logistic"
    assert run.data.params["train_start"] == model.train_start.isoformat()
    assert "data_window_start" in run.data.params and "data_window_end" in run.data.params
    assert run.data.tags["gpufail.data_fingerprint"] == '{"features": "abc"}'
    assert run.data.tags["gpufail.code_version"] == code_version()
    assert run.data.tags["gpufail.lib.scikit-learn"] == model.versions["scikit-learn"]
    assert 0.0 <= run.data.metrics["model.precision_at_k_mean"] <= 1.0
    artifacts = {a.path for a in registry.client.list_artifacts(run_id, "report")}
    assert artifacts == {"report/metrics.json", "report/report.md", "report/precision.png"}
    mv = registry.client.get_model_version(registry.name, version)
    assert CHALLENGER in mv.aliases
    # The pyfunc carries a signature over the feature columns and predicts risks.
    import mlflow.pyfunc

    mlflow.set_tracking_uri(url)
    pyfunc = mlflow.pyfunc.load_model(f"models:/{registry.name}@{CHALLENGER}")
    inputs = [c["name"] for c in pyfunc.metadata.get_input_schema().to_dict()]
    assert inputs == model.feature_columns
    _, holdout = model_and_holdout()
    risks = pyfunc.predict(holdout[model.feature_columns].head(4))
    assert list(risks) == pytest.approx(list(model.predict_risk(holdout.head(4))))
    # Registering the same run again makes no new version.
    assert register(registry, type("R", (), {"run_id": run_id, "model_uri": "unused"})()) == version


def test_scoring_falls_back_to_the_cached_champion_when_the_server_is_down(mlflow_server, tmp_path):
    url, _ = mlflow_server
    registry = fresh_registry(url)
    version, _ = logged_version(registry, tmp_path)
    _, holdout = model_and_holdout()
    promote_if_better(registry, version, holdout, top_k=5, margin=0.0, recall_tolerance=0.0, floor=0.0)
    cache_dir = tmp_path / "cache"
    assert load_champion(url, registry.name, cache_dir=cache_dir).source == "registry"

    down = f"http://127.0.0.1:{free_port()}"
    waits: list[float] = []
    with pytest.warns(RuntimeWarning, match="scoring with the last champion loaded"):
        cached = load_champion(down, registry.name, cache_dir=cache_dir, retries=2, backoff_s=0.5, sleep=waits.append)
    assert cached.source == "cache" and cached.version == version
    assert waits == [0.5, 1.0]  # back-off doubles
    with pytest.raises(RegistryError, match="unreachable.*and no cached champion"):
        load_champion(down, registry.name, cache_dir=tmp_path / "empty", retries=0, sleep=waits.append)


def test_an_unreachable_server_fails_clearly_after_retries(tmp_path):
    waits: list[float] = []
    registry = Registry(f"http://127.0.0.1:{free_port()}", "m", retries=3, backoff_s=1.0, sleep=waits.append)
    with pytest.raises(RegistryError, match=r"unreachable while trying to read alias 'champion' \(4 attempts"):
        registry.alias_version(CHAMPION)
    assert waits == [1.0, 2.0, 4.0]


def test_a_corrupt_artifact_is_reported_with_the_version(mlflow_server, tmp_path):
    url, home = mlflow_server
    registry = fresh_registry(url)
    version, _ = logged_version(registry, tmp_path)
    pickles = list((home / "artifacts").rglob("model.joblib"))
    mv = registry.client.get_model_version(registry.name, version)
    mine = [p for p in pickles if mv.source.removeprefix("models:/") in str(p)]
    assert mine, "the model's pickle is stored under the server's artifacts folder"
    mine[0].write_bytes(b"not a pickle")
    with pytest.raises(RegistryError, match=rf"models:/{registry.name}/{version}: the model artifact is unusable"):
        load_version(registry, version)


def test_a_model_trained_with_other_library_versions_warns_when_loaded(mlflow_server, tmp_path):
    url, _ = mlflow_server
    registry = fresh_registry(url)
    base, holdout = model_and_holdout()
    old = TrainedModel(**{**base.__dict__, "versions": {**base.versions, "scikit-learn": "0.0.1"}})
    version, _ = logged_version(registry, tmp_path, old)
    promote_if_better(registry, version, holdout, top_k=5, margin=0.0, recall_tolerance=0.0, floor=0.0)
    with pytest.warns(ModelVersionWarning, match=r"scikit-learn 0.0.1 \(installed"):
        load_champion(url, registry.name)


def test_logging_the_same_day_and_data_again_returns_the_first_run(mlflow_server, tmp_path):
    url, _ = mlflow_server
    registry = fresh_registry(url, retries=0)
    registry.experiment = f"test-registry-{registry.name}"
    model, holdout = model_and_holdout()
    kwargs = dict(
        example=holdout,
        metrics={"model": {"precision_at_k_mean": 0.5}},
        report_dir=None,
        fingerprint={"features": "f00d"},
        data_window=("a", "b"),
        tags={"gpufail.day": "2026-02-01"},
    )
    first = log_training_run(registry, model, **kwargs)
    assert log_training_run(registry, model, **kwargs) == first
    other = log_training_run(registry, model, **{**kwargs, "fingerprint": {"features": "beef"}})
    assert other.run_id != first.run_id
