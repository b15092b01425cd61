"""The Kubernetes publisher's job-aware actions with the official client against `NodeEmulator`
(kube_emulator.py, kmock's in-memory API on 127.0.0.1): the job map from the pod list,
checkpoint hints as pod annotations, the placement score label and the standby label. An
emulator, not Kubernetes: a contract test of the requests sent and the objects they make."""

import json
from datetime import UTC, datetime

import pandas as pd
import pytest

from serving.cost_policy import CostConfig, Hint
from serving.jobs import JobMapUnreadable
from serving.policy import PolicyConfig, PolicyState
from serving.publish import JobActions, publish
from serving.publishers.kubernetes import (
    CHECKPOINT_REQUEST_ANNOTATION,
    PLACEMENT_LABEL,
    STANDBY_LABEL,
    KubernetesPublisher,
    placement_score,
)
from tests.serving.kube_emulator import node_api
from tests.tiers import FOUR_TIERS

NOW = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
READY = {"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}
NODES = {f"gpu00{i}": READY for i in range(1, 6)}
NODES["gpu005"] = {**READY, "spec": {"unschedulable": True}}  # cordoned by an operator
CONFIG = PolicyConfig(
    tiers=FOUR_TIERS,
    breaker_max_nodes=10,
)


def worker(name, node, gpus, owner="llm", annotations=None):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ml",
            "annotations": annotations or {},
            "ownerReferences": [
                {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": owner, "uid": "u", "controller": True}
            ],
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "t", "image": "trainer", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
        },
        "status": {"phase": "Running", "startTime": "2026-11-26T08:00:00Z"},
    }


@pytest.fixture
def cluster():
    with node_api(NODES) as (core, emulator):
        core.create_namespaced_pod(
            "ml", worker("llm-0", "gpu001", 8, annotations={"gpufail.io/checkpoint-at": "2026-11-26T08:30:00Z"})
        )
        core.create_namespaced_pod("ml", worker("llm-1", "gpu002", 8))
        yield core, emulator


def labels(api, node):
    return api.read_node(node).metadata.labels or {}


def test_the_job_map_is_read_from_the_running_pods(cluster):
    api, emulator = cluster
    job_map = KubernetesPublisher(api, attempts=1).read_jobs()
    job = job_map.by_id()["ml/PyTorchJob/llm"]
    assert job.gpus_on == {"gpu001": 8, "gpu002": 8} and job.pods == ("ml/llm-0", "ml/llm-1")
    assert job.checkpoint_at == datetime(2026, 11, 26, 8, 30, tzinfo=UTC)
    assert ("list", "nodes") not in emulator.calls  # pods only


def test_a_checkpoint_hint_annotates_every_pod_of_the_job(cluster):
    api, _ = cluster
    pub = KubernetesPublisher(api, attempts=1, now=lambda: NOW)
    job = pub.read_jobs().by_id()["ml/PyTorchJob/llm"]
    result = pub.checkpoint([Hint(job, ("gpu001",), "test")])
    assert (
        result[0].ok and result[0].detail == f"annotated 2 pod(s) {CHECKPOINT_REQUEST_ANNOTATION}=2026-11-26T12:00:00Z"
    )
    for name in ("llm-0", "llm-1"):
        annotations = api.read_namespaced_pod(name, "ml").metadata.annotations
        assert annotations[CHECKPOINT_REQUEST_ANNOTATION] == "2026-11-26T12:00:00Z"
    # The job's own annotation is left as it was.
    assert (
        api.read_namespaced_pod("llm-0", "ml").metadata.annotations["gpufail.io/checkpoint-at"]
        == "2026-11-26T08:30:00Z"
    )


def test_a_pod_that_is_gone_fails_its_hint_with_the_reason(cluster):
    api, _ = cluster
    pub = KubernetesPublisher(api, attempts=1)
    job = pub.read_jobs().by_id()["ml/PyTorchJob/llm"]
    api.delete_namespaced_pod("llm-1", "ml")
    result = pub.checkpoint([Hint(job, ("gpu001",), "test")])
    assert (
        not result[0].ok
        and "patch pod ml/llm-1: HTTP 404" in result[0].detail
        and "after 1 of 2 pods" in result[0].detail
    )


def test_placement_scores_and_standbys_are_labels_of_ours_only(cluster):
    api, _ = cluster
    pub = KubernetesPublisher(api, attempts=1)
    pub.observe(list(NODES))
    done = dict(pub.place({"gpu001": 0, "gpu002": 3, "gpu005": 0}, 4, apply=True))
    assert labels(api, "gpu001")[PLACEMENT_LABEL] == "100" and labels(api, "gpu002")[PLACEMENT_LABEL] == "0"
    assert PLACEMENT_LABEL not in labels(api, "gpu005")  # cordoned by someone else: left alone
    assert done["gpu002"].detail == "placement score (none) -> 0"
    pub.observe(list(NODES))
    assert pub.place({"gpu001": 0, "gpu002": 3}, 4, apply=True) == []  # nothing changed: nothing sent
    pub.standby(["gpu003", "gpu004"], apply=True)
    pub.observe(list(NODES))
    moved = dict(pub.standby(["gpu004"], apply=True))
    assert STANDBY_LABEL not in labels(api, "gpu003") and labels(api, "gpu004")[STANDBY_LABEL] == "true"
    assert moved["gpu003"].detail == "standby true -> (removed)"
    pub.observe(list(NODES))
    preview = dict(pub.place({}, 0, apply=False))
    assert preview["gpu001"].detail == "would set placement score 100 -> (removed)"
    assert labels(api, "gpu001")[PLACEMENT_LABEL] == "100"  # a preview changes nothing


def test_placement_scores_span_0_to_100():
    assert [placement_score(level, 5) for level in range(5)] == [100, 75, 50, 25, 0]
    assert placement_score(0, 1) == 100


def test_the_cost_policy_through_kubernetes(cluster):
    api, _ = cluster
    risks = {"gpu001": 0.75, "gpu002": 0.01, "gpu003": 0.95, "gpu004": 0.001, "gpu005": 0.001}
    rows = [("k", n, g, f"{n}-{g}", r if g == 0 else 0.0) for n, r in risks.items() for g in range(8)]
    frame = pd.DataFrame(rows, columns=["cluster", "node", "gpu_index", "gpu_uuid", "risk"])
    frame["model_version"] = "m"
    out = publish(
        frame,
        KubernetesPublisher(api, attempts=1, now=lambda: NOW),
        CONFIG,
        PolicyState(),
        mode="live",
        now=NOW,
        actions=JobActions(policy="cost", cost=CostConfig(), standby_nodes=1),
    )
    decided = {r.node: r for r in out.rows if r.action in ("raise", "keep", "skip")}
    # llm-0 checkpointed 3.5 h ago, past the assumed hourly interval: its next checkpoint is taken
    # to come within the hour, so a hint saves 0.75 x 16 x 3.5 h / 24 = 1.75 GPU-h for 1.33 on
    # gpu001; gpu003 is idle.
    assert decided["gpu001"].option == "checkpoint" and decided["gpu003"].tier == "drain_now"
    assert api.read_node("gpu003").spec.unschedulable
    assert CHECKPOINT_REQUEST_ANNOTATION in api.read_namespaced_pod("llm-1", "ml").metadata.annotations
    assert labels(api, "gpu004")[STANDBY_LABEL] == "true"  # gpu005 is cordoned: not a standby


class _Raw:
    def __init__(self, data):
        self.data = data


class PagedPods:
    """A CoreV1Api stand-in that answers the pod list in pages, as an API server does for `limit`."""

    def __init__(self, pages):
        self.pages, self.asked = pages, []

    def list_pod_for_all_namespaces(self, **kw):
        self.asked.append(kw.get("_continue"))
        return _Raw(self.pages[len(self.asked) - 1])


def test_the_pod_list_is_read_page_by_page():
    first = {"metadata": {"continue": "tok-1"}, "items": [worker("llm-0", "gpu001", 8)]}
    second = {"metadata": {}, "items": [worker("llm-1", "gpu002", 8)]}
    api = PagedPods([json.dumps(first).encode(), json.dumps(second).encode()])
    job_map = KubernetesPublisher(api, attempts=1).read_jobs()
    assert api.asked == [None, "tok-1"] and job_map.jobs[0].gpus_on == {"gpu001": 8, "gpu002": 8}


def test_an_answer_that_is_not_a_pod_list_is_one_line():
    with pytest.raises(JobMapUnreadable, match="kubernetes list pods: not a pod list"):
        KubernetesPublisher(PagedPods([b"<html>proxy error</html>"]), attempts=1).read_jobs()


def test_a_refused_pod_list_keeps_the_cost_policy_from_acting(cluster):
    api, _ = cluster

    def forbidden(**kw):
        from kubernetes.client.exceptions import ApiException

        raise ApiException(status=403, reason="Forbidden")

    api.list_pod_for_all_namespaces = forbidden
    frame = pd.DataFrame({"cluster": "k", "node": ["gpu003"], "gpu_index": [0], "gpu_uuid": ["g"], "risk": [0.99]})
    frame["model_version"] = "m"
    out = publish(
        frame,
        KubernetesPublisher(api, attempts=1),
        CONFIG,
        PolicyState(),
        mode="live",
        now=NOW,
        actions=JobActions(policy="cost"),
    )
    assert out.rows[0].action == "keep" and not api.read_node("gpu003").spec.unschedulable
    assert any("kubernetes list pods: HTTP 403 Forbidden" in n for n in out.notices)
