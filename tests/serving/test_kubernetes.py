"""The Kubernetes publisher with the official client against kmock, a Kubernetes API
*emulator* (an in-memory HTTP server on 127.0.0.1 speaking the API's JSON), not a real API
server: a contract test of the requests we send and the objects they leave, not of real
scheduling. Its patches replace lists (taints, conditions) whole, which is why the publisher
always sends complete lists."""

import asyncio
import threading

import pytest
from kmock._internal import apps, k8s
from kubernetes import client

from serving.publishers import Change
from serving.publishers.kubernetes import CONDITION_TYPE, CORDON_ANNOTATION, TAINT_KEY, TIER_LABEL, KubernetesPublisher


@pytest.fixture
def api():
    ready, box = threading.Event(), {}

    def serve():
        async def main():
            async with k8s.KubernetesEmulator() as emulator, apps.Server(emulator) as server:
                box["url"], box["loop"], box["stop"] = str(server.url), asyncio.get_running_loop(), asyncio.Event()
                ready.set()
                await box["stop"].wait()

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(30), "kmock did not start"
    config = client.Configuration()
    config.host = box["url"].rstrip("/")
    core = client.CoreV1Api(client.ApiClient(config))
    for name in ("gpu001", "gpu002", "gpu003"):
        core.create_node(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {"team": "llm"}},
                "spec": {"taints": [{"key": "dedicated", "value": "llm", "effect": "NoSchedule"}]},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            }
        )
    yield core
    box["loop"].call_soon_threadsafe(box["stop"].set)
    thread.join(10)


def change(node, old, new):
    return Change(node, old, new, 0.9, "test", model_version="lgbm-1")


def taints(api, node):
    return {(t.key, t.value, t.effect) for t in api.read_node(node).spec.taints or []}


def test_tiers_map_to_our_taints_labels_condition_and_cordon(api):
    pub = KubernetesPublisher(api, attempts=1)
    results = pub.apply([change("gpu001", "none", "avoid"), change("gpu002", "none", "drain_now")])
    assert all(r.ok for r in results)
    assert taints(api, "gpu001") == {("dedicated", "llm", "NoSchedule"), (TAINT_KEY, "avoid", "PreferNoSchedule")}
    node = api.read_node("gpu001")
    assert node.metadata.labels == {"team": "llm", TIER_LABEL: "avoid"} and not node.spec.unschedulable
    condition = next(c for c in node.status.conditions if c.type == CONDITION_TYPE)
    assert (condition.status, condition.reason) == ("True", "Avoid") and condition.message.startswith("gpufail: avoid")
    drained = api.read_node("gpu002")
    assert drained.spec.unschedulable and drained.metadata.annotations[CORDON_ANNOTATION] == "true"
    assert (TAINT_KEY, "drain_now", "NoSchedule") in taints(api, "gpu002")
    assert "cordoned" in results[1].detail


def test_clearing_removes_only_our_marks(api):
    pub = KubernetesPublisher(api, attempts=1)
    pub.apply([change("gpu002", "none", "drain_now")])
    [result] = pub.apply([change("gpu002", "drain_now", "none")])
    assert result.ok and "uncordoned" in result.detail
    node = api.read_node("gpu002")
    assert node.metadata.labels == {"team": "llm"} and not node.spec.unschedulable
    assert taints(api, "gpu002") == {("dedicated", "llm", "NoSchedule")}
    assert [c.type for c in node.status.conditions] == ["Ready"]
    assert CORDON_ANNOTATION not in (node.metadata.annotations or {})


def test_nodes_cordoned_by_someone_else_or_not_ready_are_left_alone(api):
    api.patch_node("gpu003", {"spec": {"unschedulable": True}})
    views = KubernetesPublisher(api, attempts=1).observe(["gpu001", "gpu003", "gpu999"])
    assert views["gpu001"].unavailable == ""
    assert views["gpu003"].unavailable == "cordoned by someone else"
    assert not views["gpu999"].exists
    [result] = KubernetesPublisher(api, attempts=1).apply([change("gpu003", "none", "drain_now")])
    assert not result.ok and result.detail == "skipped: cordoned by someone else"
    assert TIER_LABEL not in api.read_node("gpu003").metadata.labels
    api.patch_node_status(
        "gpu001", {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "KubeletDown"}]}}
    )
    assert (
        KubernetesPublisher(api, attempts=1).observe(["gpu001"])["gpu001"].unavailable == "node not Ready (KubeletDown)"
    )


def test_an_unreachable_api_server_is_reported():
    config = client.Configuration()
    config.host = "http://127.0.0.1:9"  # nothing listens on port 9
    api = client.CoreV1Api(client.ApiClient(config))
    pub = KubernetesPublisher(api, attempts=2, backoff=0.01)
    from serving.publishers import SchedulerUnavailable

    with pytest.raises(SchedulerUnavailable, match="kubernetes list nodes: no answer after 2 tries"):
        pub.observe(["gpu001"])
    [result] = pub.apply([change("gpu001", "none", "avoid")])
    assert not result.ok and "no answer after 2 tries" in result.detail
