"""Two clusters with nodes of the same names: a publisher of one scheduler acts on the nodes
of its configured cluster alone. Slurm is a real slurmctld with 16 nodes (the integration
suite's cluster), Kubernetes the API emulator of tests/serving, the webhook a real HTTP
receiver; the predictions hold the clusters `east` (the one the scheduler runs) and `west`."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pandas as pd
import pytest

from ingest.errors import InputError
from ingest.store import Store
from serving.policy import PolicyConfig, PolicyState
from serving.predictions import write_snapshot
from serving.publish import publish
from serving.publishers.kubernetes import TAINT_KEY, KubernetesPublisher
from serving.publishers.slurm import LEDGER, SlurmPublisher, StoreLedger
from serving.publishers.webhook import WebhookPublisher
from serving.score import PREDICTION_SCHEMA
from tests.cli import gpufail
from tests.integration.conftest import slurm, slurm_cluster  # noqa: F401 (fixtures)
from tests.serving.kube_emulator import node_api
from tests.tiers import FOUR_TIERS

T0 = datetime(2026, 1, 5, 12, tzinfo=UTC)
CONFIG = PolicyConfig(tiers=FOUR_TIERS, breaker_max_nodes=10, breaker_max_fraction=1.0)


def predictions(risks: dict[tuple[str, str], float], nodes: list[str]) -> pd.DataFrame:
    """One GPU per node of each cluster, at the given risk (0.01 otherwise)."""
    rows = [(c, n, 0, f"{c}-{n}-gpu0", risks.get((c, n), 0.01)) for c in ("east", "west") for n in nodes]
    frame = pd.DataFrame(rows, columns=["cluster", "node", "gpu_index", "gpu_uuid", "risk"])
    frame["ts"] = pd.Timestamp(T0)
    frame["rank"] = frame["risk"].rank(ascending=False, method="first").astype("int64")
    frame["node_risk"] = frame["risk"]
    frame["model_kind"] = "lightgbm"
    frame["model_version"] = "lightgbm-test"
    return frame[list(PREDICTION_SCHEMA.names)]


RISKS = {
    ("east", "gpu003"): 0.6,  # drain after job, in east
    ("west", "gpu005"): 0.95,  # drain now, but in west: not this Slurm's gpu005
    ("west", "gpu006"): 0.9,  # west's gpu006 is risky, east's is not
    ("east", "gpu007"): 0.4,  # avoid, in east
    ("west", "gpu007"): 0.01,  # ...and calm in west
}


def slurm_publisher(slurm, **kw: Any) -> SlurmPublisher:  # noqa: F811
    return SlurmPublisher(slurm_conf=str(slurm.conf), attempts=2, backoff=0.05, **kw)


def test_slurm_acts_only_on_the_nodes_of_its_cluster(slurm):  # noqa: F811
    out = publish(
        predictions(RISKS, slurm.nodes),
        slurm_publisher(slurm, cluster="east"),
        CONFIG,
        PolicyState(),
        mode="live",
        now=T0,
    )
    states = slurm.node_states()
    assert states["gpu003"]["state_flags"] == ["DRAIN"]
    assert states["gpu007"]["weight"] == 100_000
    for node in ("gpu005", "gpu006"):  # west's risks leave east's nodes of that name alone
        assert not states[node]["state_flags"] and states[node]["weight"] == 1
    assert {r.cluster for r in out.rows} == {"east"}
    assert {key.split("/")[0] for key in out.state.nodes} == {"east"}


def test_slurm_without_a_cluster_refuses_predictions_of_two(slurm):  # noqa: F811
    with pytest.raises(
        InputError, match=r"the predictions hold the clusters east, west .* expected \[publish\] cluster"
    ):
        publish(predictions(RISKS, slurm.nodes), slurm_publisher(slurm), CONFIG, PolicyState(), mode="live", now=T0)
    states = slurm.node_states()
    assert all(not s["state_flags"] and s["weight"] == 1 for s in states.values())


def test_publish_to_slurm_with_a_cluster_keeps_its_own_ledger(slurm, tmp_path):  # noqa: F811
    store = Store.create(str(tmp_path / "data"))
    write_snapshot(store, predictions(RISKS, slurm.nodes), now=T0)
    env = {
        "GPUFAIL_PUBLISH__SLURM_CONF": str(slurm.conf),
        "GPUFAIL_PUBLISH__CLUSTER": "east",
        "GPUFAIL_PUBLISH__BREAKER_MAX_NODES": "10",
    }
    result = gpufail("publish", "--data", str(tmp_path / "data"), "--to", "slurm", "--no-dry-run", env=env)
    assert result.returncode == 0, result.stderr
    states = slurm.node_states()
    assert states["gpu003"]["state_flags"] == ["DRAIN"]
    assert not states["gpu005"]["state_flags"] and not states["gpu006"]["state_flags"]
    east = StoreLedger(store, f"{LEDGER}-east").load()  # the ledger of the Slurm cluster that runs east
    assert set(east.drains) == {"gpu003"} and store.read_state(LEDGER) is None
    # Without the cluster the same command refuses, and changes nothing.
    env.pop("GPUFAIL_PUBLISH__CLUSTER")
    refused = gpufail("publish", "--data", str(tmp_path / "data"), "--to", "slurm", "--no-dry-run", env=env)
    assert refused.returncode == 2 and "expected [publish] cluster" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert slurm.node_states() == states


NODES = {
    name: {"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}
    for name in ("gpu001", "gpu002", "gpu003")
}


@pytest.fixture
def kube() -> Iterator[Any]:
    with node_api(NODES) as (core, _):
        yield core


def our_taints(api: Any, node: str) -> list[str]:
    return [t.value for t in api.read_node(node).spec.taints or [] if t.key == TAINT_KEY]


def test_kubernetes_acts_only_on_the_nodes_of_its_cluster(kube):
    risks = {("east", "gpu001"): 0.9, ("west", "gpu002"): 0.95, ("west", "gpu003"): 0.9, ("east", "gpu003"): 0.4}
    frame = predictions(risks, list(NODES))
    out = publish(
        frame, KubernetesPublisher(kube, attempts=1, cluster="east"), CONFIG, PolicyState(), mode="live", now=T0
    )
    assert our_taints(kube, "gpu001") == ["drain_now"]
    assert our_taints(kube, "gpu002") == []  # west's gpu002
    assert our_taints(kube, "gpu003") == ["avoid"]  # east's risk, not west's
    assert {r.cluster for r in out.rows} == {"east"}
    with pytest.raises(InputError, match="expected the cluster the kubernetes target runs"):
        publish(
            frame, KubernetesPublisher(kube, attempts=1, cluster="north"), CONFIG, PolicyState(), mode="live", now=T0
        )
    with pytest.raises(InputError, match="expected \\[publish\\] cluster"):
        publish(frame, KubernetesPublisher(kube, attempts=1), CONFIG, PolicyState(), mode="live", now=T0)


def test_a_webhook_receiver_of_several_clusters_tells_their_nodes_apart():
    bodies: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        hook = WebhookPublisher(f"http://127.0.0.1:{server.server_port}/hook", b"k", attempts=1)
        frame = predictions({("east", "gpu001"): 0.9, ("west", "gpu001"): 0.9}, ["gpu001"])
        publish(frame, hook, CONFIG, PolicyState(), mode="live", now=T0)
    finally:
        server.shutdown()
        server.server_close()
    changes = json.loads(bodies[0])["changes"]
    assert sorted((c["cluster"], c["node"]) for c in changes) == [("east", "gpu001"), ("west", "gpu001")]
    assert len({c["id"] for c in changes}) == 2  # a receiver deduplicating by id keeps both


def test_adopting_a_drain_names_the_node_of_the_configured_cluster(slurm, tmp_path):  # noqa: F811
    store = Store.create(str(tmp_path / "data"))
    write_snapshot(store, predictions({}, slurm.nodes), now=T0)  # gpu005 in east and in west
    reason = "gpufail: drain-now risk=0.95 model=lightgbm-test"
    slurm.scontrol("update", "NodeName=gpu005", "State=DRAIN", f"Reason={reason}")  # a drain of ours, unrecorded
    env = {"GPUFAIL_PUBLISH__SLURM_CONF": str(slurm.conf)}
    args = ("publish", "--data", str(tmp_path / "data"), "--to", "slurm", "--adopt", "gpu005")
    refused = gpufail(*args, env=env)
    assert refused.returncode == 2 and "in the clusters east, west" in refused.stderr
    assert store.read_state("publish-slurm") is None
    adopted = gpufail(*args, env={**env, "GPUFAIL_PUBLISH__CLUSTER": "west"})
    assert adopted.returncode == 0, adopted.stderr
    state = store.read_state("publish-slurm")
    assert state is not None and state["nodes"]["west/gpu005"]["applied"] == "drain_now"
    assert "east/gpu005" not in state["nodes"]
    assert StoreLedger(store, f"{LEDGER}-west").load().drains["gpu005"].reason == reason
