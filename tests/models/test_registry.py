"""The MLflow registry against a real tracking server on 127.0.0.1 (session fixture
`mlflow_server` in tests/conftest.py), and the promotion gate as a pure function."""

from __future__ import annotations

import itertools
from functools import cache
from pathlib import Path

import pandas as pd
import pytest

from gpufail.mlflow_server import free_port
from models.registry import (
    CHALLENGER,
    CHAMPION,
    GATE_TAG,
    Registry,
    RegistryError,
    code_version,
    gate,
    holdout_metrics,
    load_champion,
    load_version,
    log_training_run,
    promote_if_better,
    register,
    write_holdout_report,
)
from models.train import ModelVersionWarning, TrainedModel, train_model
from tests.models import demo_frame

_names = itertools.count()


@cache
def model_and_holdout() -> tuple[TrainedModel, pd.DataFrame]:
    frame = demo_frame()
    holdout_start = frame["ts"].max() - pd.Timedelta(days=3)
    model = train_model(frame, kind="logistic", train_window="5d", horizon="12h", as_of=holdout_start)
    return model, frame[frame["ts"] >= holdout_start]


def fresh_registry(url: str, **kwargs) -> Registry:
    # One registered name per test: tests share the session's server.
    return Registry(url, f"test-model-{next(_names)}", experiment="test-registry", **kwargs)


def logged_version(registry: Registry, tmp_path: Path, model: TrainedModel | None = None) -> tuple[str, str]:
    base, holdout = model_and_holdout()
    model = model or base
    metrics = holdout_metrics(model, holdout, top_k=5)
    report = tmp_path / "report"
    write_holdout_report(metrics, report, title="test")
    run = log_training_run(
        registry,
        model,
        example=holdout,
        metrics=metrics,
        report_dir=report,
        fingerprint={"features": "abc"},
        data_window=(model.train_start, holdout["ts"].max()),
    )
    return register(registry, run), run.run_id


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


def test_first_model_becomes_champion_only_above_the_floor_and_serving_loads_it(mlflow_server, tmp_path):
    url, _ = mlflow_server
    registry = fresh_registry(url)
    version, run_id = logged_version(registry, tmp_path)
    _, holdout = model_and_holdout()
    with pytest.raises(RegistryError, match="no version has the alias 'champion'"):
        load_champion(url, registry.name)

    refused = promote_if_better(registry, version, holdout, top_k=5, margin=0.0, recall_tolerance=0.0, floor=1.01)
    assert not refused.promote and "below the floor" in refused.reason
    assert registry.alias_version(CHAMPION) is None
    assert registry.client.get_run(run_id).data.tags["gpufail.gate_reason"] == refused.reason

    # A decided version is not judged again (the decision is a tag of the version).
    again = promote_if_better(registry, version, holdout, top_k=5, margin=0.0, recall_tolerance=0.0, floor=0.0)
    assert again.reason == refused.reason

    version2, _ = logged_version(registry, tmp_path / "2")
    promoted = promote_if_better(registry, version2, holdout, top_k=5, margin=0.0, recall_tolerance=0.0, floor=0.0)
    assert promoted.promote and "no champion yet" in promoted.reason
    loaded = load_champion(url, registry.name)
    assert loaded.version == version2 and loaded.source == "registry"
    assert isinstance(loaded.model, TrainedModel)
    assert registry.alias_version(CHALLENGER) is None  # the challenger became the champion
    assert GATE_TAG in registry.client.get_model_version(registry.name, version2).tags


def test_a_challenger_that_does_not_beat_the_champion_by_the_margin_stays_challenger(mlflow_server, tmp_path):
    url, _ = mlflow_server
    registry = fresh_registry(url)
    _, holdout = model_and_holdout()
    first, _ = logged_version(registry, tmp_path / "1")
    promote_if_better(registry, first, holdout, top_k=5, margin=0.0, recall_tolerance=0.0, floor=0.0)
    second, _ = logged_version(registry, tmp_path / "2")  # the same model: it cannot beat itself
    decision = promote_if_better(registry, second, holdout, top_k=5, margin=0.01, recall_tolerance=0.0, floor=0.0)
    assert not decision.promote and "by the margin 0.010" in decision.reason
    assert decision.champion_version == first
    assert str(registry.alias_version(CHAMPION).version) == first
    assert str(registry.alias_version(CHALLENGER).version) == second


def test_metrics_the_caller_already_has_judge_the_challenger_without_scoring_it_again(mlflow_server, tmp_path):
    url, _ = mlflow_server
    registry = fresh_registry(url)
    model, holdout = model_and_holdout()
    first, _ = logged_version(registry, tmp_path / "1")
    promote_if_better(registry, first, holdout, top_k=5, margin=0.0, recall_tolerance=0.0, floor=0.0)
    mine = holdout_metrics(model, holdout, top_k=5)["model"]
    second, _ = logged_version(registry, tmp_path / "2")

    class Unscorable:  # the challenger: scoring it would fail
        version = "unused"

        def predict_proba(self, frame):
            raise AssertionError("the challenger was scored again")

    # The given metrics say the challenger is far better; only they can promote it (the same
    # model as the champion cannot beat it by the margin when scored).
    better = {**mine, "precision_at_k_mean": mine["precision_at_k_mean"] + 0.5}
    decision = promote_if_better(
        registry,
        second,
        holdout,
        top_k=5,
        margin=0.1,
        recall_tolerance=1.0,
        floor=0.0,
        challenger_model=Unscorable(),
        challenger_metrics=better,
    )
    assert decision.promote and decision.champion_version == first
    assert decision.challenger["precision_at_k_mean"] == pytest.approx(better["precision_at_k_mean"])


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


def test_the_report_files_are_written(tmp_path):
    model, holdout = model_and_holdout()
    metrics = holdout_metrics(model, holdout, top_k=5)
    assert set(metrics) == {"model", "random", "heuristic"}
    written = write_holdout_report(metrics, tmp_path, title="window")
    assert [p.name for p in written] == ["metrics.json", "report.md", "precision.png"]
    assert "| model |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "precision.png").read_bytes().startswith(b"\x89PNG")
    assert not list(tmp_path.glob(".tmp-*"))


BEST = {"precision_at_k_mean": 0.30, "recall_at_k": 0.50, "n_episodes": 10}


@pytest.mark.parametrize(
    ("challenger", "champion", "promote", "reason"),
    [
        (BEST, None, True, "no champion yet; precision@K 0.300 reaches the floor 0.050"),
        ({**BEST, "precision_at_k_mean": 0.04}, None, False, "below the floor 0.050"),
        (BEST, {**BEST, "precision_at_k_mean": 0.28}, True, "beats the champion's 0.280 by at least 0.020"),
        (BEST, {**BEST, "precision_at_k_mean": 0.29}, False, "does not beat the champion's 0.290 by the margin"),
        (BEST, {**BEST, "precision_at_k_mean": 0.2, "recall_at_k": 0.6}, False, "by more than the tolerance 0.050"),
        ({**BEST, "recall_at_k": 0.46}, {**BEST, "precision_at_k_mean": 0.2}, True, "recall 0.460 vs 0.500"),
        ({**BEST, "n_episodes": 0}, {**BEST, "precision_at_k_mean": 0.0}, False, "no failure episodes"),
    ],
)
def test_the_gate(challenger, champion, promote, reason):
    decided, why = gate(challenger, champion, margin=0.02, recall_tolerance=0.05, floor=0.05)
    assert decided is promote
    assert reason in why


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


class _RanksWithinGridTime:
    """A model whose scores depend on every GPU of a grid time, as the ensembles' do: the rank
    of the logistic model's risk among its grid time's rows. Records each frame it scores."""

    def __init__(self, base: TrainedModel):
        self.base, self.frames = base, []

    def predict_risk(self, frame: pd.DataFrame):
        from models.ensemble import group_ranks

        self.frames.append(frame[["ts"]].copy())
        return 1.0 / group_ranks(self.base.predict_risk(frame), frame["ts"].to_numpy())


def test_a_polars_holdout_is_scored_in_whole_grid_times_and_gives_the_metrics_of_scoring_it_whole(monkeypatch):
    import polars as pl

    import models.registry

    base, holdout = model_and_holdout()
    holdout = holdout.sample(frac=1.0, random_state=3).reset_index(drop=True)  # not in time order
    whole = holdout_metrics(_RanksWithinGridTime(base), holdout, top_k=5)  # pandas: scored at once
    chunk = len(holdout) // 7
    monkeypatch.setattr(models.registry, "HOLDOUT_ROWS_PER_CHUNK", chunk)
    model = _RanksWithinGridTime(base)

    chunked = holdout_metrics(model, pl.from_pandas(holdout), top_k=5)

    scored = holdout.loc[holdout["label"].notna()]  # the censored rows are not scored
    rows_per_time = scored["ts"].value_counts()
    assert len(model.frames) >= 7
    for frame in model.frames:
        assert len(frame) <= chunk + rows_per_time.max()
        seen = frame["ts"].value_counts()
        assert seen.equals(rows_per_time.loc[seen.index])  # every row of each grid time it holds
    assert sum(len(f) for f in model.frames) == len(scored)
    # The same rows in the same order: the same figures, the random baseline's included.
    assert chunked == whole


def test_a_lazy_holdout_is_read_in_pieces_and_scores_as_the_frame_read_whole_in_time_order(monkeypatch):
    import polars as pl

    import models.registry

    base, holdout = model_and_holdout()
    in_time_order = holdout.sort_values(["ts", "gpu_uuid"], kind="stable").reset_index(drop=True)
    whole = holdout_metrics(_RanksWithinGridTime(base), in_time_order, top_k=5)
    shuffled = pl.from_pandas(holdout.sample(frac=1.0, random_state=5).reset_index(drop=True))
    monkeypatch.setattr(models.registry, "HOLDOUT_ROWS_PER_CHUNK", len(holdout) // 5)
    model = _RanksWithinGridTime(base)

    lazy = holdout_metrics(model, shuffled.lazy(), top_k=5)

    assert len(model.frames) >= 5
    rows_per_time = holdout.loc[holdout["label"].notna(), "ts"].value_counts()
    for frame in model.frames:
        seen = frame["ts"].value_counts()
        assert seen.equals(rows_per_time.loc[seen.index])  # every row of each grid time it holds
    assert lazy == whole
