"""Training on Dask (a LocalCluster of two in-process workers on 127.0.0.1) gives a
`TrainedModel` that scores a hold-out like the single-machine one.

Tolerance: on the synthetic frame's hold-out (6 failures, 55 scoring times) the single-machine
models reach ROC-AUC ~0.92 and PR-AUC ~0.28-0.30. Data-parallel trees bin and split on the
merged histograms of the workers, so the same rows give nearly the same model: ROC-AUC within
0.02 and PR-AUC within 0.05. A 10% negative sample drawn per date file is another draw than the
single-machine one, and which worker holds which file varies from run to run: no worse than
the single-machine model by more than 0.03 and 0.08 (on this hold-out the Dask XGBoost model's
PR-AUC has come out 0.28-0.37 against 0.28; a better draw is not a failure). LightGBM is
checked on the same rows, XGBoost on a sample.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gpufail.dask_cluster import dask_client
from ingest.errors import InputError
from ingest.store import Store
from models.distributed import train_model_distributed
from models.evaluate import score_metrics
from models.train import TrainOptions, load_model, save_model, train_model
from tests.models import ONE_THREAD, demo_features_store, demo_frame

AS_OF = "2026-01-08T12:00Z"
WINDOW = dict(train_window="6d", horizon="12h", as_of=AS_OF, params=ONE_THREAD)


@pytest.fixture(scope="module")
def client():
    with dask_client("local", n_workers=2, processes=False) as c:
        yield c


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    return demo_features_store(str(tmp_path_factory.mktemp("dask-train") / "data"))


def _held_out() -> pd.DataFrame:
    frame = demo_frame()
    return frame[(frame["ts"] >= pd.Timestamp(AS_OF)) & frame["label"].notna()].reset_index(drop=True)


def _metrics(model) -> dict:
    test = _held_out()
    return score_metrics(test, model.predict_risk(test), k=5)


def test_on_the_same_rows_dask_trains_the_single_machine_model(client, store):
    kind = "lightgbm"
    local = train_model(demo_frame(), TrainOptions(kind=kind, negative_fraction=1.0, **WINDOW))
    dist = train_model_distributed(client, store, TrainOptions(kind=kind, negative_fraction=1.0, **WINDOW))
    for name in ("kind", "feature_columns", "n_rows", "n_positives", "train_start", "train_end", "pos_weight"):
        assert getattr(dist, name) == getattr(local, name), name
    assert dist.params == local.params
    ours, theirs = _metrics(dist), _metrics(local)
    assert abs(ours["roc_auc"] - theirs["roc_auc"]) <= 0.02, (ours, theirs)
    assert abs(ours["pr_auc"] - theirs["pr_auc"]) <= 0.05, (ours, theirs)
    assert ours["recall_at_k"] >= 0.9


def test_a_negative_sample_and_monotone_constraints_carry_over(client, store, tmp_path):
    options = dict(WINDOW, kind="xgboost", monotone_increasing=["xid_count_*"])
    local = train_model(demo_frame(), TrainOptions(**options))
    dist = train_model_distributed(client, store, TrainOptions(**options))
    assert dist.n_positives == local.n_positives  # every positive kept
    assert 0.8 < dist.n_rows / local.n_rows < 1.25
    assert dist.pos_weight == local.pos_weight == 10.0 / 0.1  # capped neg/pos weight, then 1 / fraction
    constraints = dist.estimator.named_steps["model"].get_params()["monotone_constraints"]
    assert constraints == "(" + ",".join(str(int(c == "xid_count_24h")) for c in dist.feature_columns) + ")"
    ours, theirs = _metrics(dist), _metrics(local)
    assert ours["roc_auc"] >= theirs["roc_auc"] - 0.03, (ours, theirs)
    assert ours["pr_auc"] >= theirs["pr_auc"] - 0.08, (ours, theirs)
    # The artifact is an ordinary TrainedModel: saved, loaded and scored without a cluster.
    test = _held_out()
    again = load_model(save_model(dist, tmp_path / "model"))
    assert np.array_equal(again.predict_risk(test), dist.predict_risk(test))


def test_kinds_without_a_dask_trainer_are_refused(client, store):
    with pytest.raises(InputError, match=r"'logistic'.*\[dask\] scheduler = ''"):
        train_model_distributed(client, store, TrainOptions(kind="logistic", **WINDOW))


def test_a_window_before_the_data_is_an_error(client, store):
    with pytest.raises(InputError, match="no feature rows"):
        train_model_distributed(
            client, store, TrainOptions(kind="lightgbm", **{**WINDOW, "as_of": "2025-06-01T00:00Z"})
        )
