"""The walk-forward read from the store (`run_walk_forward_from_store`), a training draw and a
day of rows at a time, gives the figures of the walk-forward over the whole frame in memory:
the same rows scored by the same models to the same risks, the same fits, the same metrics; and
on a Dask LocalCluster the same as in one process."""

from __future__ import annotations

from functools import cache

import numpy as np
import pandas as pd
import pytest

from features.dataset import read_features
from features.schema import ID_COLUMNS, LABEL_COLUMNS
from ingest.errors import GpufailError
from ingest.store import Store
from models.evaluate import compare_scores, expected_failures_per_day
from models.walk_forward import WalkForwardResult, run_walk_forward, run_walk_forward_from_store
from tests.models import demo_features_store
from tests.models.walk_forward_cases import PLAN, STORE_CONTENDERS

CONTENDERS = STORE_CONTENDERS
TREES_ONLY = {"lgb static", "lgb sliding", "lgb auto"}
"""Contenders whose scores do not depend on which other rows are scored with them."""
IDS = ["ts", "gpu_uuid", "label", "time_to_failure_h"]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    return demo_features_store(str(tmp_path_factory.mktemp("walk-forward-store") / "data"))


@cache
def _in_memory(root: str) -> WalkForwardResult:
    return run_walk_forward(read_features(Store.open(root)), CONTENDERS, PLAN)


@cache
def _streamed(root: str) -> WalkForwardResult:
    return run_walk_forward_from_store(Store.open(root), CONTENDERS, PLAN)


def _assert_same(ours: WalkForwardResult, theirs: WalkForwardResult) -> None:
    pd.testing.assert_frame_equal(ours.test[IDS], theirs.test[IDS])
    assert ours.validation is not None and theirs.validation is not None
    pd.testing.assert_frame_equal(ours.validation[IDS], theirs.validation[IDS])
    assert (ours.test_start, ours.test_end, ours.retrain_times) == (
        theirs.test_start,
        theirs.test_end,
        theirs.retrain_times,
    )
    assert (ours.n_fits, ours.n_fits_unshared) == (theirs.n_fits, theirs.n_fits_unshared)
    assert [f.as_dict() for f in ours.fits] == [f.as_dict() for f in theirs.fits]
    for name in ("scores", "calibrated", "model_age_h", "flags", "validation_calibrated", "validation_flags"):
        mine, yours = getattr(ours, name), getattr(theirs, name)
        assert mine.keys() == yours.keys(), name
        for contender in mine:
            if contender in TREES_ONLY or mine[contender].dtype == bool:
                np.testing.assert_array_equal(mine[contender], yours[contender], err_msg=f"{name} of {contender}")
            else:
                # A linear model's matrix product rounds by the batch it is given (a day here, a
                # run of days there): equal to the last bits of float64.
                np.testing.assert_allclose(
                    mine[contender], yours[contender], rtol=1e-12, err_msg=f"{name} of {contender}"
                )


def test_the_store_read_day_by_day_gives_the_figures_of_the_frame_in_memory(store):
    ours, theirs = _streamed(store.root), _in_memory(store.root)
    assert ours.flags.keys() == {"pair"}  # the parallel ensemble's intersection is there too
    assert all(f.status == "trained" for f in ours.fits)
    assert ours.n_fits > 30 and len(ours.test) > 10_000
    _assert_same(ours, theirs)
    # and so every metric of the comparison
    expected = expected_failures_per_day(theirs.test)
    figures = [
        compare_scores(r.test, r.scores, top_k=["10"], expected_per_day=expected, bootstrap_samples=50, flags=r.flags)
        for r in (ours, theirs)
    ]
    assert figures[0] == figures[1]


def test_the_store_walk_forward_keeps_the_identity_and_label_columns_and_the_columns_asked(store):
    ours, theirs = _streamed(store.root), _in_memory(store.root)
    assert len(theirs.test.columns) == 14
    assert list(ours.test.columns) == [*ID_COLUMNS, *LABEL_COLUMNS]
    wanted = "xid_count_24h"
    assert wanted in theirs.test.columns
    few = run_walk_forward_from_store(store, CONTENDERS[1:2], PLAN, columns=[wanted])
    pd.testing.assert_series_equal(few.test[wanted], theirs.test[wanted])


def test_a_dask_local_cluster_gives_the_figures_of_one_process(store):
    from distributed import get_task_stream

    from gpufail.dask_cluster import dask_client

    with dask_client("local", n_workers=2, processes=True) as client, get_task_stream(client) as stream:
        on_dask = run_walk_forward_from_store(store, CONTENDERS, PLAN, client=client)
    # Every fit was a task of the cluster, on both workers.
    fits = [t for t in stream.data if str(t["key"]).startswith("_run_fit")]
    assert len(fits) == on_dask.n_fits
    assert len({t["worker"] for t in fits}) == 2
    _assert_same(on_dask, _streamed(store.root))


def test_a_store_changed_under_the_walk_forward_is_named(store):
    from models.walk_forward_rows import Span, StoreRows

    rows = StoreRows(store.root, 0.3, 0, pd.Timedelta(hours=12))
    ts = read_features(store, columns=[])["ts"]
    first = pd.Timestamp(ts.min())
    n = int((ts == ts.min()).sum())
    span = Span(slice(0, n + 1), first.value, (first + pd.Timedelta(hours=1)).value)
    with pytest.raises(GpufailError, match=rf"hold {n} labelled rows, where the walk-forward planned {n + 1}"):
        list(rows.scored(span))


def test_the_store_walk_forward_reads_every_feature_column_a_day_at_a_time_at_most(store, monkeypatch):
    import models.walk_forward as wf
    import models.walk_forward_rows as rows

    wide: list[tuple] = []
    for module in (wf, rows):
        real = module.read_features

        def recording(store, start=None, end=None, columns=None, real=real):
            if columns is None:
                wide.append((start, end))
            return real(store, start, end, columns)

        monkeypatch.setattr(module, "read_features", recording)
    drawn: list[tuple] = []
    real_draw = rows.sampled_rows_between

    def draw(store, bounds, options):
        drawn.append(bounds)
        return real_draw(store, bounds, options)

    monkeypatch.setattr(rows, "sampled_rows_between", draw)
    result = run_walk_forward_from_store(store, CONTENDERS[:2], PLAN)
    # Every read of the feature columns is a day (the days scored), each day read once; the
    # training draws are the fits' windows, one per fit.
    assert wide and all(end - start <= pd.Timedelta(days=1) for start, end in wide)
    assert len(wide) == len(set(wide)) == len({start.date() for start, _ in wide})
    assert len(drawn) == result.n_fits
    assert all(end - start == pd.Timedelta(PLAN.train_window) for start, end in drawn)
