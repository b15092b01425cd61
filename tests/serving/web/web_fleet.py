"""A store with everything the operator's pages read, built by the code that writes each
dataset in production: the test fleet of `tests.serving.api_server` (features, trained model)
plus its telemetry and XID events (with a few failure XIDs added), a predictions snapshot per
grid time (`serving.score.score_latest`, as `gpufail score` writes them), and a week of live
publishing through the action policy (`serving.publish.publish` with the `log` publisher; a
tight circuit breaker so that it trips, and one node an operator drained, so that it is
skipped), with its state and audit log written as `gpufail publish` writes them."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd
import polars as pl

from tests.serving.api_server import fleet, start_server, trained_model, write_store

DRAINED_NODE = "node00002"
"""The node the scheduler reports as drained by an operator (its decisions are `skip`)."""
FAILED = (
    ("node00001", "GPU-00000009", 79, 30),
    ("node00001", "GPU-00000009", 79, 31),
    ("node00000", "GPU-00000003", 48, 50),
)
"""(node, GPU, failure XID, hour after the start) written into xid_events."""
PUBLISH_EVERY_H = 6
SERVE_CONFIG = "[publish]\nbreaker_max_nodes = 1\nbreaker_max_fraction = 0.0\n"
"""The server's policy settings, the same as the publishing below (the breaker's budget shown)."""


def policy() -> Any:
    from gpufail.config import Settings

    return replace(Settings().publish.policy_config(), breaker_max_nodes=1, breaker_max_fraction=0.0)


class OperatorDrained:
    """The `log` publisher, except that the scheduler says `DRAINED_NODE` was drained by an
    operator (the one place a scheduler's view is faked)."""

    def __init__(self) -> None:
        from serving.publishers.log import LogPublisher

        self.inner = LogPublisher()
        self.name = self.inner.name

    def observe(self, nodes: Any) -> Any:
        from serving.publishers import NodeView

        views = self.inner.observe(nodes)
        if DRAINED_NODE in views:
            views[DRAINED_NODE] = NodeView(unavailable="drained by an operator: 'RMA ticket 4411'")
        return views

    def apply(self, changes: Any) -> Any:
        return self.inner.apply(changes)


def failure_events() -> pl.DataFrame:
    tel = fleet()[0]
    start = tel["ts"].min()
    slots = tel.select("cluster", "node", "gpu_uuid", "gpu_index", "pci_bus_id").unique()
    rows = []
    for node, gpu, xid, hour in FAILED:
        slot = slots.filter(pl.col("gpu_uuid") == gpu).row(0, named=True)
        assert slot["node"] == node
        ts = start + timedelta(hours=hour)
        rows.append(
            {
                **slot,
                "ts": ts,
                "last_ts": ts + timedelta(minutes=2),
                "xid": xid,
                "pid": None,
                "process": None,
                "message": f"Xid (PCI:{slot['pci_bus_id']}): {xid}, pid='<unknown>'",
                "source": "kmsg",
                "repeat_count": 3,
            }
        )
    return pl.DataFrame(rows).cast({"gpu_index": pl.Int16, "xid": pl.Int32, "repeat_count": pl.Int32})


@cache
def predictions() -> pd.DataFrame:
    """`score_latest` at every grid time of the fleet's features (one snapshot each)."""
    from serving.score import score_latest

    features = fleet()[2].to_pandas()
    model = trained_model()
    return pd.concat(
        [score_latest(model, rows, top_features=5) for _, rows in features.groupby("ts", sort=True)],
        ignore_index=True,
    )


def build_store(root: Path) -> Path:
    from ingest.store import Store
    from serving.publish import append_audit, publish, state_name
    from serving.score import prediction_table

    write_store(root)
    store = Store.open(str(root))
    tel, events, _ = fleet()
    store.write("telemetry", tel.to_arrow())
    columns = events.columns
    store.write("xid_events", pl.concat([events, failure_events().select(columns)], how="vertical_relaxed").to_arrow())
    snapshots = predictions()
    for ts, rows in snapshots.groupby("ts", sort=True):
        store.write_owned("predictions", ts.date(), prediction_table(rows))
    config, state, publisher = policy(), None, OperatorDrained()
    from serving.policy import PolicyState

    state = PolicyState()
    times = sorted(snapshots["ts"].unique())
    for ts in times[::PUBLISH_EVERY_H]:
        latest = snapshots[snapshots["ts"] == ts]
        top = {u: list(f) for u, f in zip(latest["gpu_uuid"], latest["top_features"], strict=True)}
        now = pd.Timestamp(ts).to_pydatetime() + timedelta(minutes=20)
        outcome = publish(latest, publisher, config, state, mode="live", now=now, top_features=top)
        state = outcome.state
        append_audit(outcome.rows, store.path("actions"), fs=store.fs)
    store.write_state(state_name(publisher.name, "live"), state.to_json())
    return root


def prepare(tmp: Path) -> tuple[Path, Path]:
    """(data root, model folder) under `tmp`: `build_store` and the trained model."""
    from models.train import save_model

    return build_store(tmp / "data"), save_model(trained_model(), tmp / "model")


def serve(tmp: Path, data: Path, model: Path, **options: Any) -> Any:
    """`gpufail serve` over `data` and `model` with the web fleet's policy settings."""
    extra = SERVE_CONFIG + options.pop("extra_config", "")
    return start_server(tmp, data, model=model, extra_config=extra, **options)
