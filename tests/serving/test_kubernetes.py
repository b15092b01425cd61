"""The Kubernetes publisher with the official client against `NodeEmulator` (kube_emulator.py):
kmock's in-memory Kubernetes API on 127.0.0.1, extended with a real API server's strategic merge
patch semantics for Node, the status subresource and resourceVersion conflicts. An emulator, not
Kubernetes: a contract test of the requests we send and of the objects the API's documented
semantics make of them, not of real scheduling."""

import threading
from datetime import UTC, datetime, timedelta

import pytest
from kubernetes import client

from serving.publishers import Change
from serving.publishers.kubernetes import (
    ALARM_LABEL,
    CONDITION_TYPE,
    CORDON_ANNOTATION,
    TAINT_KEY,
    TIER_LABEL,
    KubernetesPublisher,
)
from tests.serving.kube_emulator import STRATEGIC, node_api

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
NODES = {
    name: {
        "metadata": {"labels": {"team": "llm"}},
        "spec": {"taints": [{"key": "dedicated", "value": "llm", "effect": "NoSchedule"}]},
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "lastHeartbeatTime": "2026-11-20T11:59:50Z",
                }
            ]
        },
    }
    for name in ("gpu001", "gpu002", "gpu003")
}


@pytest.fixture
def cluster():
    with node_api(NODES) as (core, emulator):
        yield core, emulator


@pytest.fixture
def api(cluster):
    return cluster[0]


class Clock:
    def __init__(self):
        self.t = NOW

    def __call__(self):
        return self.t


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
    assert node.metadata.labels == {"team": "llm", TIER_LABEL: "avoid", ALARM_LABEL: "failure"}
    assert not node.spec.unschedulable
    condition = next(c for c in node.status.conditions if c.type == CONDITION_TYPE)
    assert (condition.status, condition.reason) == ("True", "Avoid") and condition.message.startswith("gpufail: avoid")
    drained = api.read_node("gpu002")
    assert drained.spec.unschedulable and drained.metadata.annotations[CORDON_ANNOTATION] == "true"
    assert (TAINT_KEY, "drain_now", "NoSchedule") in taints(api, "gpu002")
    assert "cordoned" in results[1].detail


def test_a_straggler_is_marked_with_its_alarm_class_and_the_avoid_tiers_taint(api):
    reason = "fail-slow: GPU g-7 runs 12.0% slower than its peers (fail-slow score 0.120 >= 0.05); node risk 0.010"
    pub = KubernetesPublisher(api, attempts=1)
    assert pub.apply([Change("gpu003", "none", "avoid", 0.01, reason, ("g-7",))])[0].ok
    node = api.read_node("gpu003")
    assert node.metadata.labels == {"team": "llm", TIER_LABEL: "avoid", ALARM_LABEL: "fail-slow"}
    assert (TAINT_KEY, "avoid", "PreferNoSchedule") in taints(api, "gpu003")
    condition = next(c for c in node.status.conditions if c.type == CONDITION_TYPE)
    assert condition.message.startswith("gpufail: avoid alarm=fail-slow")
    assert pub.apply([Change("gpu003", "avoid", "none", 0.01, "recovered")])[0].ok
    assert api.read_node("gpu003").metadata.labels == {"team": "llm"}


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


# -- the exact requests, against the API's documented patch semantics ------------------------


def status_writes(emulator, node):
    return [w for w in emulator.writes if w.node == node and w.subresource == "status" and w.status == 200]


def kubelet_heartbeat(api, node, at):
    """What kubelet does every few seconds: its own conditions, merged by type."""
    api.patch_node_status(
        node,
        {
            "status": {
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": at}]
            }
        },
        _content_type=STRATEGIC,
    )


def test_the_status_patch_carries_only_our_condition_and_removes_it_with_a_delete_directive(cluster):
    api, emulator = cluster
    clock = Clock()
    pub = KubernetesPublisher(api, attempts=1, now=clock)
    assert pub.apply([change("gpu001", "none", "avoid")])[0].ok
    [first] = status_writes(emulator, "gpu001")
    assert first.content_type == STRATEGIC
    set_at = "2026-11-20T12:00:00Z"
    assert first.body == {
        "status": {
            "conditions": [
                {
                    "type": CONDITION_TYPE,
                    "status": "True",
                    "reason": "Avoid",
                    "message": "gpufail: avoid alarm=failure risk=0.90 model=lgbm-1",
                    "lastHeartbeatTime": set_at,
                    "lastTransitionTime": set_at,
                }
            ]
        }
    }
    # kubelet keeps reporting; a later tier change must neither resend nor roll back Ready.
    kubelet_heartbeat(api, "gpu001", "2026-11-20T12:30:00Z")
    clock.t = NOW + timedelta(hours=1)
    assert pub.apply([change("gpu001", "avoid", "drain_after_job")])[0].ok
    second = status_writes(emulator, "gpu001")[-1]
    [condition] = second.body["status"]["conditions"]
    assert (condition["reason"], condition["lastHeartbeatTime"]) == ("DrainAfterJob", "2026-11-20T13:00:00Z")
    assert condition["lastTransitionTime"] == set_at, "the status stayed True: no transition"

    kubelet_heartbeat(api, "gpu001", "2026-11-20T13:30:00Z")
    assert pub.apply([change("gpu001", "drain_after_job", "none")])[0].ok
    assert status_writes(emulator, "gpu001")[-1].body == {
        "status": {"conditions": [{"type": CONDITION_TYPE, "$patch": "delete"}]}
    }
    conditions = api.read_node("gpu001").status.conditions
    assert [(c.type, c.last_heartbeat_time) for c in conditions] == [
        ("Ready", datetime(2026, 11, 20, 13, 30, tzinfo=UTC))
    ]


def test_a_node_without_our_condition_gets_no_status_patch_below_avoid(cluster):
    api, emulator = cluster
    [result] = KubernetesPublisher(api, attempts=1).apply([change("gpu001", "none", "watch")])
    assert result.ok and result.detail == "label watch"
    assert status_writes(emulator, "gpu001") == []


def node_writes(emulator, node):
    return [w for w in emulator.writes if w.node == node and w.subresource is None]


def test_spec_changes_carry_the_resource_version_they_were_computed_from(cluster):
    api, emulator = cluster
    pub = KubernetesPublisher(api, attempts=1)
    read_at = api.read_node("gpu002").metadata.resource_version
    pub.apply([change("gpu002", "none", "drain_now")])
    [write] = node_writes(emulator, "gpu002")
    assert write.content_type == STRATEGIC
    assert write.body == {
        "metadata": {
            "labels": {TIER_LABEL: "drain_now", ALARM_LABEL: "failure"},
            "annotations": {CORDON_ANNOTATION: "true"},
            "resourceVersion": read_at,
        },
        "spec": {
            "taints": [
                {"key": "dedicated", "value": "llm", "effect": "NoSchedule"},
                {"key": TAINT_KEY, "value": "drain_now", "effect": "NoSchedule"},
            ],
            "unschedulable": True,
        },
    }
    # A label-only change (watch keeps no taint) leaves the spec, and so the version, alone.
    pub.apply([change("gpu003", "none", "watch")])
    assert node_writes(emulator, "gpu003")[0].body == {
        "metadata": {"labels": {TIER_LABEL: "watch", ALARM_LABEL: "failure"}}
    }


def add_taint(key):
    def write(node):
        node["spec"]["taints"] = [*node["spec"].get("taints", []), {"key": key, "value": "x", "effect": "NoSchedule"}]
        return node

    return write


def test_a_taint_another_controller_writes_between_our_read_and_our_patch_is_kept(cluster):
    api, emulator = cluster
    emulator.interleave("gpu001", add_taint("other.io/maintenance"))
    [result] = KubernetesPublisher(api, attempts=1).apply([change("gpu001", "none", "avoid")])
    assert result.ok, result.detail
    assert taints(api, "gpu001") == {
        ("dedicated", "llm", "NoSchedule"),
        ("other.io/maintenance", "x", "NoSchedule"),
        (TAINT_KEY, "avoid", "PreferNoSchedule"),
    }
    assert [w.status for w in node_writes(emulator, "gpu001")] == [409, 200]


def test_a_cordon_by_someone_else_between_read_and_patch_is_not_taken_over(cluster):
    api, emulator = cluster

    def cordon(node):
        node["spec"]["unschedulable"] = True
        return node

    emulator.interleave("gpu001", cordon)
    pub = KubernetesPublisher(api, attempts=1)
    [result] = pub.apply([change("gpu001", "none", "drain_now")])
    assert not result.ok and result.detail == "skipped: cordoned by someone else"
    node = api.read_node("gpu001")
    assert node.spec.unschedulable and CORDON_ANNOTATION not in (node.metadata.annotations or {})
    # ... so a later all-clear does not uncordon the operator's node.
    pub.apply([change("gpu001", "drain_now", "none")])
    assert api.read_node("gpu001").spec.unschedulable


def test_a_node_that_keeps_changing_is_reported_after_the_conflict_attempts(cluster):
    api, emulator = cluster
    for i in range(3):
        emulator.interleave("gpu001", add_taint(f"other.io/t{i}"))
    [result] = KubernetesPublisher(api, attempts=1, conflict_attempts=3).apply([change("gpu001", "none", "avoid")])
    assert not result.ok
    assert result.detail == (
        "failed: kubernetes patch node gpu001: the node changed between read and write 3 times in a row (HTTP 409 Conflict)"
    )
    assert (TAINT_KEY, "avoid", "PreferNoSchedule") not in taints(api, "gpu001")
    assert TIER_LABEL not in api.read_node("gpu001").metadata.labels


def test_concurrent_taint_writers_and_the_publisher_lose_no_taint(cluster):
    """Other controllers that follow the API's rules (a patch with the resourceVersion it read,
    read again on 409) and the publisher, all at once on one node: every taint survives."""
    api, _ = cluster
    writers, per_writer = 3, 8
    tiers = ["avoid", "drain_after_job", "none", "watch", "avoid", "drain_after_job"] * 2
    errors = []

    def controller(w):
        try:
            for i in range(per_writer):
                for _ in range(100):
                    node = api.read_node("gpu001")
                    current = [client.ApiClient().sanitize_for_serialization(t) for t in node.spec.taints or []]
                    body = {
                        "metadata": {"resourceVersion": node.metadata.resource_version},
                        "spec": {"taints": [*current, {"key": f"other.io/w{w}-{i}", "effect": "NoSchedule"}]},
                    }
                    try:
                        api.patch_node("gpu001", body, _content_type=STRATEGIC)
                        break
                    except client.ApiException as exc:
                        assert exc.status == 409
                else:
                    raise AssertionError(f"writer {w} never got its taint {i} in")
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=controller, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    pub = KubernetesPublisher(api, attempts=1, conflict_attempts=50)
    previous = "none"
    for tier in tiers:
        [result] = pub.apply([change("gpu001", previous, tier)])
        assert result.ok, result.detail
        previous = tier
    for t in threads:
        t.join(60)
    assert not errors
    keys = {key for key, _, _ in taints(api, "gpu001")}
    assert {f"other.io/w{w}-{i}" for w in range(writers) for i in range(per_writer)} <= keys
    assert (TAINT_KEY, previous, "NoSchedule") in taints(api, "gpu001")
