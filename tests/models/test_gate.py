"""The promotion gate: held-out metrics (scored in whole grid times), the report, the decision
as a pure function, and promotion through a real MLflow tracking server on 127.0.0.1 (session
fixture `mlflow_server` in tests/conftest.py)."""

from __future__ import annotations

import pandas as pd
import pytest

from ingest.errors import InputError
from models.gate import GATE_TAG, gate, holdout_metrics, holdout_metrics_of, promote_if_better, write_holdout_report
from models.registry import CHALLENGER, CHAMPION, RegistryError, load_champion
from models.train import TrainedModel, TrainOptions, train_model
from tests.models import ONE_THREAD, demo_frame
from tests.models.mlflow_runs import fresh_registry, logged_version, model_and_holdout


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


def _a_champion(mlflow_server, tmp_path):
    """A fresh registry whose first version is the champion: (registry, held-out window, the
    champion's version, its metrics on the window)."""
    url, _ = mlflow_server
    registry = fresh_registry(url)
    model, holdout = model_and_holdout()
    first, _ = logged_version(registry, tmp_path / "1")
    promote_if_better(registry, first, holdout, top_k=5, margin=0.0, recall_tolerance=0.0, floor=0.0)
    return registry, holdout, first, holdout_metrics(model, holdout, top_k=5)["model"]


def test_metrics_the_caller_already_has_judge_the_challenger_without_scoring_it_again(mlflow_server, tmp_path):
    registry, holdout, first, mine = _a_champion(mlflow_server, tmp_path)
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


class _RanksWithinGridTime:
    """A model whose scores depend on every GPU of a grid time, as the ensembles' do: the rank
    of the logistic model's risk among its grid time's rows. Records each frame it scores."""

    scores_each_row_alone = False

    def __init__(self, base: TrainedModel):
        self.base, self.frames = base, []

    def predict_risk(self, frame: pd.DataFrame, *, threads: int | None = None):
        from models.ensemble import group_ranks

        self.frames.append(frame[["ts"]].copy())
        return 1.0 / group_ranks(self.base.predict_risk(frame, threads=threads), frame["ts"].to_numpy())


def test_a_polars_holdout_is_scored_in_whole_grid_times_and_gives_the_metrics_of_scoring_it_whole(monkeypatch):
    import polars as pl

    import models.gate

    base, holdout = model_and_holdout()
    holdout = holdout.sample(frac=1.0, random_state=3).reset_index(drop=True)  # not in time order
    whole = holdout_metrics(_RanksWithinGridTime(base), holdout, top_k=5)  # pandas: scored at once
    chunk = len(holdout) // 7
    monkeypatch.setattr(models.gate, "HOLDOUT_ROWS_PER_CHUNK", chunk)
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

    import models.gate

    base, holdout = model_and_holdout()
    in_time_order = holdout.sort_values(["ts", "gpu_uuid"], kind="stable").reset_index(drop=True)
    whole = holdout_metrics(_RanksWithinGridTime(base), in_time_order, top_k=5)
    shuffled = pl.from_pandas(holdout.sample(frac=1.0, random_state=5).reset_index(drop=True))
    monkeypatch.setattr(models.gate, "HOLDOUT_ROWS_PER_CHUNK", len(holdout) // 5)
    model = _RanksWithinGridTime(base)

    lazy = holdout_metrics(model, shuffled.lazy(), top_k=5)

    assert len(model.frames) >= 5
    rows_per_time = holdout.loc[holdout["label"].notna(), "ts"].value_counts()
    for frame in model.frames:
        seen = frame["ts"].value_counts()
        assert seen.equals(rows_per_time.loc[seen.index])  # every row of each grid time it holds
    assert lazy == whole


def test_a_window_in_parts_of_whole_gpus_scores_several_models_as_the_whole_frame_in_time_order(monkeypatch):
    import polars as pl

    import models.gate

    base, holdout = model_and_holdout()
    other = train_model(
        demo_frame(),
        TrainOptions(kind="lightgbm", train_window="5d", horizon="12h", as_of=holdout["ts"].min(), params=ONE_THREAD),
    )
    in_time_order = holdout.sort_values(["ts", "gpu_uuid"], kind="stable").reset_index(drop=True)
    whole = holdout_metrics(base, in_time_order, top_k=5)
    whole_other = holdout_metrics(other, in_time_order, top_k=5)["model"]
    # Parts of whole GPUs, in no particular order, each larger than a scoring chunk.
    shuffled = pl.from_pandas(holdout.sample(frac=1.0, random_state=7))
    gpus = shuffled["gpu_uuid"].unique().shuffle(seed=2).to_list()
    parts = [shuffled.filter(pl.col("gpu_uuid").is_in(gpus[i::3])) for i in range(3)]
    monkeypatch.setattr(models.gate, "HOLDOUT_ROWS_PER_CHUNK", min(p.height for p in parts) // 2)

    both = holdout_metrics_of({"model": base, "other": other}, iter(parts), top_k=5, in_gpu_parts=True)

    assert set(both) == {"model", "other", "random", "heuristic"}
    assert {name: both[name] for name in ("model", "random", "heuristic")} == whole
    assert both["other"] == whole_other
    assert both["other"] != both["model"]


def test_a_model_that_ranks_a_grid_time_together_is_not_scored_in_parts_of_gpus():
    import polars as pl

    base, holdout = model_and_holdout()
    with pytest.raises(ValueError, match="rank the GPUs of a grid time together"):
        holdout_metrics_of({"model": _RanksWithinGridTime(base)}, [pl.from_pandas(holdout)], top_k=5, in_gpu_parts=True)
    with pytest.raises(InputError, match="held-out window: no rows to score"):
        holdout_metrics_of({"model": base}, iter([]), top_k=5, in_gpu_parts=True)


def test_the_champions_metrics_from_the_caller_are_used_only_while_it_is_the_champion(mlflow_server, tmp_path):
    registry, holdout, first, mine = _a_champion(mlflow_server, tmp_path)
    reads: list[int] = []

    def window():
        reads.append(1)
        return holdout

    # The champion's metrics as the caller scored them: far worse than the challenger's (the
    # same model), so only they can promote it; the window is never read.
    worse = {**mine, "precision_at_k_mean": mine["precision_at_k_mean"] - 0.5}
    second, _ = logged_version(registry, tmp_path / "2")
    decision = promote_if_better(
        registry, second, window, top_k=5, margin=0.1, recall_tolerance=1.0, floor=0.0,
        challenger_metrics=mine, champion_metrics=(first, worse),
    )  # fmt: skip
    assert decision.promote and decision.champion_version == first and not reads
    assert decision.champion["precision_at_k_mean"] == pytest.approx(worse["precision_at_k_mean"])

    # Metrics of a version that is no longer the champion are not used: it is scored, and the
    # same model does not beat itself by the margin.
    third, _ = logged_version(registry, tmp_path / "3")
    decision = promote_if_better(
        registry, third, window, top_k=5, margin=0.1, recall_tolerance=1.0, floor=0.0,
        challenger_metrics=mine, champion_metrics=(first, worse),
    )  # fmt: skip
    assert not decision.promote and decision.champion_version == second and reads == [1]
