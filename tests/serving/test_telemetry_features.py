"""`POST /v1/predict` with raw telemetry computes the store's features for the GPUs the store
knows: a node's samples and XID events of the eight days before a grid time, sent as a request,
give every feature of every GPU of the node, and the risk, of the store's row of that GPU-hour
(`features.payload`); a GPU the store does not know is scored from the payload alone, and the
answer names the features that took."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

from features.on_demand import features_on_demand, on_demand_spec
from features.payload import fleet_fact_feature, model_peer_feature
from features.schema import feature_columns
from ingest.store import Store
from serving.api_payloads import telemetry_frame
from serving.api_schemas import PredictRequest
from tests.features.cached_stores import simulated_store

PAYLOAD_DAYS = 8
XID_FIELDS = ("ts", "last_ts", "cluster", "node", "pci_bus_id", "gpu_index", "gpu_uuid", "xid")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("telemetry") / "data"
    return Store.open(simulated_store(root, seed=3, nodes=3, days=10))


@pytest.fixture(scope="module")
def model(store: Store) -> Any:
    from models.train import TrainOptions
    from models.train_store import train_model_from_store

    options = TrainOptions(
        kind="lightgbm",
        train_window="6d",
        horizon=on_demand_spec(store).horizon,
        params={"n_estimators": 20, "n_jobs": 1},
        negative_fraction=1.0,
        calibration="platt",
        calibration_window="2d",
    )
    return train_model_from_store(store, options)


def _value(v: Any) -> Any:
    return v.isoformat() if isinstance(v, datetime) else v


def request_of(store: Store, node: str, t: datetime, *, rename: dict[str, str] | None = None) -> PredictRequest:
    """What a collector of `node` would send at grid time `t`: its samples and XID events of
    the `PAYLOAD_DAYS` days before (`rename`: GPUs sent under another uuid)."""
    tel = pl.from_arrow(store.read("telemetry"))
    assert isinstance(tel, pl.DataFrame)
    part = tel.filter(
        (pl.col("node") == node) & (pl.col("ts") <= t) & (pl.col("ts") > t - timedelta(days=PAYLOAD_DAYS))
    )
    events = pl.from_arrow(store.read("xid_events"))
    assert isinstance(events, pl.DataFrame)
    events = events.filter(
        (pl.col("node") == node) & (pl.col("ts") <= t) & (pl.col("ts") > t - timedelta(days=PAYLOAD_DAYS))
    )
    if rename:
        part = part.with_columns(pl.col("gpu_uuid").replace(rename))
        events = events.with_columns(pl.col("gpu_uuid").replace(rename))
    telemetry = [{k: _value(v) for k, v in row.items()} for row in part.to_dicts()]
    xids = [{k: _value(row[k]) for k in XID_FIELDS} for row in events.to_dicts()]
    return PredictRequest.model_validate({"telemetry": telemetry, "xid_events": xids})


def grid_times(store: Store) -> list[datetime]:
    """Three grid times of the last days, at different hours, each with eight days before it."""
    last: datetime = pl.from_arrow(store.read("telemetry")).select(pl.col("ts").max()).item()  # type: ignore[union-attr]
    top = last.replace(minute=0, second=0, microsecond=0)
    return [top - timedelta(hours=h) for h in (25, 37, 46)]


def test_telemetry_of_a_known_node_gives_the_stores_features_and_risk(store: Store, model: Any) -> None:
    nodes = pl.from_arrow(store.read("telemetry"))["node"].unique().sort().to_list()  # type: ignore[index]
    compared, other_medians = 0, []
    for node, t in zip(nodes, grid_times(store), strict=True):
        request = request_of(store, node, t)
        frame, sent, payload_only = telemetry_frame(
            request.telemetry or [], request.xid_events or [], model.feature_spec, store
        )
        stored = features_on_demand(store, t, t + timedelta(microseconds=1)).to_pandas()
        stored = stored[stored["gpu_uuid"].isin(sent)].sort_values("gpu_uuid").reset_index(drop=True)
        sent_rows = frame[frame["ts"] == t].sort_values("gpu_uuid").reset_index(drop=True)
        assert len(stored) > 0 and list(sent_rows["gpu_uuid"]) == list(stored["gpu_uuid"])
        columns = feature_columns(pl.from_pandas(stored))
        assert set(model.feature_columns) <= {*columns, "gpu_model", "driver"}
        for c in ("gpu_model", "driver"):
            assert list(sent_rows[c].astype(str)) == list(stored[c].astype(str))
        for c in columns:
            # Every feature equal to the store's, within float32 rounding.
            np.testing.assert_allclose(
                sent_rows[c].to_numpy(dtype=np.float64),
                stored[c].to_numpy(dtype=np.float64),
                rtol=1e-6,
                atol=1e-6,
                err_msg=f"{c} of node {node} at {t}",
            )
        assert all(payload_only[u] == [] for u in sent_rows["gpu_uuid"])
        # The payload alone gives GPUs seen before it younger, and other fleet medians.
        alone, _, _ = telemetry_frame(request.telemetry or [], request.xid_events or [], model.feature_spec)
        alone = alone[alone["ts"] == t].sort_values("gpu_uuid").reset_index(drop=True)
        older = (stored["gpu_age_h"] > 24 * PAYLOAD_DAYS).to_numpy()
        assert older.any() and (alone["gpu_age_h"].to_numpy()[older] <= 24 * PAYLOAD_DAYS).all()
        # (A GPU model on this node alone has the same median either way.)
        delta = next(c for c in columns if "_model_delta_" in c)
        other_medians.append(
            not np.allclose(alone[delta].to_numpy(dtype=np.float64), stored[delta].to_numpy(dtype=np.float64))
        )
        np.testing.assert_allclose(model.predict_risk(sent_rows), model.predict_risk(stored), atol=0.005)
        compared += len(stored)
    assert compared >= 3 * 4 and any(other_medians)


def test_telemetry_of_gpus_the_store_does_not_know_names_the_features_from_the_payload_alone(
    store: Store, model: Any
) -> None:
    node = pl.from_arrow(store.read("telemetry"))["node"].unique().sort()[0]  # type: ignore[index]
    t = grid_times(store)[0]
    tel = pl.from_arrow(store.read("telemetry"))
    assert isinstance(tel, pl.DataFrame)
    uuids = tel.filter(pl.col("node") == node)["gpu_uuid"].unique().to_list()
    rename = {u: f"GPU-new-{i}" for i, u in enumerate(uuids)}
    request = request_of(store, node, t, rename=rename)
    frame, _, payload_only = telemetry_frame(
        request.telemetry or [], request.xid_events or [], model.feature_spec, store
    )
    names = [c for c in frame.columns if fleet_fact_feature(c)]
    assert "gpu_age_h" in names and any(c.startswith("xid_") for c in names)
    for uuid in frame["gpu_uuid"]:
        # The fleet medians of the hour are still the store's; the GPU's history is the payload's.
        assert payload_only[uuid] == [c for c in names if not model_peer_feature(c)]
    assert (frame["gpu_age_h"] <= 24 * PAYLOAD_DAYS).all()


def test_without_a_store_every_fleet_fact_feature_is_named(tmp_path: Path, store: Store, model: Any) -> None:
    node = pl.from_arrow(store.read("telemetry"))["node"].unique().sort()[0]  # type: ignore[index]
    request = request_of(store, node, grid_times(store)[0])
    empty = Store.create(str(tmp_path / "empty"))
    frame, _, payload_only = telemetry_frame(
        request.telemetry or [], request.xid_events or [], model.feature_spec, empty
    )
    names = [c for c in frame.columns if fleet_fact_feature(c)]
    assert any("_model_delta_" in c for c in names)
    assert all(payload_only[u] == names for u in frame["gpu_uuid"])
