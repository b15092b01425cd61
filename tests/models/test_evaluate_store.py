"""`evaluate_walk_forward` on a store (`models.evaluation_inputs.inputs_from_store`: a day of
features at a time) gives every figure the comparison gives on the whole frame in memory; the
best single feature is chosen on every validation positive and a uniform sample of its
negatives; no read holds more than a day of features."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace
from functools import cache
from typing import Any

import numpy as np
import pandas as pd
import pytest

import models.evaluation_inputs as inputs
from features.dataset import read_features
from ingest.errors import GpufailError
from ingest.store import Store
from models.comparison import evaluate_walk_forward
from tests.models import demo_features_store
from tests.models.walk_forward_cases import PLAN, STORE_CONTENDERS

CONTENDERS = [c for c in STORE_CONTENDERS if c.mode != "auto"]
OPTIONS: dict[str, Any] = {"top_k": ["10"], "bootstrap_samples": 50, "budgets": (20.0, 60.0)}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    return demo_features_store(str(tmp_path_factory.mktemp("evaluate-store") / "data"))


@cache
def _from_store(root: str) -> dict[str, Any]:
    return evaluate_walk_forward(Store.open(root), CONTENDERS, PLAN, **OPTIONS)


@cache
def _in_memory(root: str) -> dict[str, Any]:
    return evaluate_walk_forward(read_features(Store.open(root)), CONTENDERS, PLAN, **OPTIONS)


def _assert_close(ours: Any, theirs: Any, where: str = "metrics") -> None:
    """Equal, floats to 1e-9 relative: a linear model's matrix product rounds by the batch it is
    given (a day from the store, the whole frame in memory), and the features' spread is summed
    a day at a time."""
    if isinstance(ours, dict):
        assert isinstance(theirs, dict) and ours.keys() == theirs.keys(), where
        for key in ours:
            _assert_close(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(ours, list | tuple):
        assert isinstance(theirs, list | tuple) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _assert_close(a, b, f"{where}[{i}]")
    elif isinstance(ours, float) and not isinstance(theirs, bool):
        assert isinstance(theirs, float | int), where
        assert (math.isnan(ours) and math.isnan(theirs)) or ours == pytest.approx(theirs, rel=1e-9, abs=1e-12), where
    else:
        assert ours == theirs, where


def test_evaluate_on_the_store_gives_every_figure_of_the_frame_in_memory(store):
    ours, theirs = _from_store(store.root), _in_memory(store.root)
    _assert_close(ours, theirs)
    # The figures are not empty shells: a feature was chosen, alarms were raised, the
    # history's failures were counted.
    assert ours["baselines"]["best_feature"].startswith("the single feature with the best ROC-AUC")
    assert ours["alarms"]["quota"]["20"]["points"]["lgb sliding"]["n_alarms"] > 0
    assert ours["expected_failures_per_day"] > 0
    assert ours["test"]["n_positives"] > 0


def test_the_false_alarms_are_explained_by_the_features_the_frame_in_memory_holds(store):
    # (The small fleet's false alarms are not known in the long window, so the figures above
    # list none: the view they are explained by is compared here.)
    streamed = inputs.inputs_from_store(
        Store.open(store.root), CONTENDERS[:1], PLAN, fail_slow_window=None, progress=False, client=None
    )
    held = inputs.inputs_in_memory(read_features(store), CONTENDERS[:1], PLAN, progress=False, client=None)
    ours, theirs = streamed.features, held.features
    assert len(ours.spread) >= 5 and ours.spread.keys() == theirs.spread.keys()
    for column, (mean, std) in theirs.spread.items():
        assert ours.spread[column] == pytest.approx((mean, std), rel=1e-9, abs=1e-12), column
    positions = np.array([len(held.result.test) - 1, 0, 17])
    mine, yours = ours.rows(positions), theirs.rows(positions).reset_index(drop=True)
    assert list(mine["gpu_uuid"]) == list(yours["gpu_uuid"])
    numeric = [c for c in theirs.spread if c in mine.columns]
    assert len(numeric) == len(theirs.spread)
    np.testing.assert_allclose(
        mine[numeric].to_numpy(dtype=float, na_value=np.nan), yours[numeric].to_numpy(dtype=float, na_value=np.nan)
    )


def test_the_best_feature_is_chosen_on_every_positive_and_a_uniform_sample_of_the_negatives(store, monkeypatch):
    seen: list[pd.DataFrame] = []
    real = inputs.choose_feature

    def recording(frame):
        seen.append(frame)
        return real(frame)

    monkeypatch.setattr(inputs, "choose_feature", recording)
    monkeypatch.setattr(inputs, "VALIDATION_SAMPLE", 300)
    result = inputs.inputs_from_store(
        Store.open(store.root), CONTENDERS[:1], PLAN, fail_slow_window=None, progress=False, client=None, sample=300
    ).result
    (sample,) = seen
    assert result.validation is not None
    validation = result.validation
    y = validation["label"].to_numpy()
    assert (y == 0).sum() > 1_000  # the slice has far more negatives than the sample holds
    assert (sample["label"] == 1).sum() == (y == 1).sum()
    assert (sample["label"] == 0).sum() == 300
    key = ["ts", "gpu_uuid"]
    inside = sample[key].merge(validation[key].drop_duplicates(), on=key, how="inner")
    assert len(inside) == len(sample) and not sample.duplicated(key).any()
    # spread over the slice's days, not its first ones
    days = pd.to_datetime(sample["ts"], utc=True).dt.floor("D").nunique()
    assert days == pd.to_datetime(validation["ts"], utc=True).dt.floor("D").nunique()


def test_no_read_of_evaluate_on_the_store_holds_more_than_a_day_of_features(store, monkeypatch):
    import models.walk_forward as wf
    import models.walk_forward_rows as rows

    wide: list[tuple] = []
    for module in (inputs, wf, rows):
        real = module.read_features

        def recording(store, start=None, end=None, columns=None, real=real):
            if columns is None or len(columns) > 20:
                wide.append((start, end))
            return real(store, start, end, columns)

        monkeypatch.setattr(module, "read_features", recording)
    evaluate_walk_forward(Store.open(store.root), CONTENDERS[:2], PLAN, **OPTIONS)
    assert wide
    assert all(start is not None and end - start <= pd.Timedelta(days=1) for start, end in wide)


def test_a_test_row_gone_from_the_store_is_named(store):
    test = read_features(store, columns=["label"]).to_pandas().tail(3).reset_index(drop=True)
    test.loc[2, "gpu_uuid"] = "GPU-not-there"
    with pytest.raises(GpufailError, match=r"1 test rows not found again; expected the features unchanged"):
        inputs.rows_at(store, test, np.array([0, 2]))
    # in the order asked, each with its features
    back = inputs.rows_at(store, test, np.array([1, 0]))
    assert len(back) == 2
    assert list(back["gpu_uuid"]) == [test.loc[1, "gpu_uuid"], test.loc[0, "gpu_uuid"]]
    assert list(pd.to_datetime(back["ts"], utc=True)) == list(pd.to_datetime(test.loc[[1, 0], "ts"], utc=True))
    assert len(back.columns) > len(test.columns)


@pytest.fixture(scope="module")
def computed_store(tmp_path_factory) -> Store:
    from tests.features.cached_stores import simulated_store

    return Store.open(simulated_store(tmp_path_factory.mktemp("computed") / "data", seed=5, nodes=6, days=12))


def test_a_store_computing_its_features_is_scored_from_a_copy_of_the_period_removed_after(
    computed_store, tmp_path, monkeypatch
):
    import tempfile

    import models.walk_forward_rows as rows

    scored_from: list[str] = []
    real = rows.read_features

    def recording(store, start=None, end=None, columns=None):
        if columns is None:
            scored_from.append(store.root)
        return real(store, start, end, columns)

    monkeypatch.setattr(rows, "read_features", recording)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # the copy of a run killed before it removed it (its process is gone) goes; a live one stays
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"gpufail-evaluate-{gone.stdout.strip()}-abc"
    (orphan / "data").mkdir(parents=True)
    live = tmp_path / f"gpufail-evaluate-{os.getppid()}-def"
    live.mkdir()
    contenders = CONTENDERS[:2]
    ours = evaluate_walk_forward(computed_store, contenders, PLAN, **OPTIONS)
    theirs = evaluate_walk_forward(read_features(computed_store), contenders, PLAN, **OPTIONS)
    _assert_close(ours, theirs)
    assert ours["test"]["n_positives"] > 0
    # every scored day came from the copy, which is gone once the figures are made
    assert scored_from and all(root.startswith(str(tmp_path)) for root in scored_from)
    assert list(tmp_path.iterdir()) == [live]


def test_evaluate_on_the_store_finds_its_periods_once(store, monkeypatch):
    import models.walk_forward as wf

    calls: list[str] = []
    real = wf._store_step

    def counting(store):
        calls.append(store.root)
        return real(store)

    monkeypatch.setattr(wf, "_store_step", counting)
    inputs.inputs_from_store(
        Store.open(store.root), CONTENDERS[:1], PLAN, fail_slow_window=None, progress=False, client=None
    )
    assert calls == [store.root]  # the newest days read once for the grid step, not again by the walk-forward


def test_the_fits_read_the_draws_computed_before_the_pass(computed_store, tmp_path, monkeypatch):
    """Where the store computes its features on demand, every training draw of the walk-forward
    is computed into the day cache before the pass, so no fit computes one (a fit that did held
    the evaluation's inputs meanwhile; Dask workers computed the same days side by side)."""
    import features.drawn_cache as drawn_cache
    import models.walk_forward as wf
    from tests.features.cached_stores import uncached_copy

    store = uncached_copy(computed_store.root, tmp_path)
    phase = ["before the fits"]
    computed_during: list[str] = []
    compute, fit = drawn_cache.features_on_demand, wf._run_fit

    def computing(*args, **kwargs):
        computed_during.append(phase[0])
        return compute(*args, **kwargs)

    def fitting(task, source):
        phase[0] = "a fit"
        return fit(task, source)

    monkeypatch.setattr(drawn_cache, "features_on_demand", computing)
    monkeypatch.setattr(wf, "_run_fit", fitting)
    plan = replace(PLAN, negative_fraction=0.1)  # a share the day cache keeps
    ours = evaluate_walk_forward(store, CONTENDERS[:2], plan, **OPTIONS)
    assert phase == ["a fit"] and computed_during
    assert set(computed_during) == {"before the fits"}
    _assert_close(ours, evaluate_walk_forward(read_features(computed_store), CONTENDERS[:2], plan, **OPTIONS))
