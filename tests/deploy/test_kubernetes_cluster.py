"""What a real cluster does to the rendered manifests (deploy/kubernetes): the kubelet's
service-link variables, taints from other health checkers, node memory pressure, a read-only
root file system for numba's cache, who may connect to the pods, and the monitoring objects
kube-prometheus-stack picks up (the alert rules and the dashboard made from deploy/'s files)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.kubectl import one, pod_spec, pod_template, workloads
from tests.deploy.test_dockerfile import instruction, stages

DEPLOY = Path(__file__).parents[2] / "deploy"


def test_no_pod_gets_service_link_variables(rendered):
    _, objects = rendered
    for workload in workloads(objects):
        assert pod_spec(workload)["enableServiceLinks"] is False, workload["metadata"]["name"]


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, str]) -> bool:
    """Kubernetes' matching of a taint by a pod's tolerations (an empty key with Exists matches
    every key; an empty effect every effect)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t["key"] == taint["key"]:
                return True
        elif t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


TAINTS = [
    {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
    {"key": "gpufail.io/risk", "value": "drain_now", "effect": "NoExecute"},
    {"key": "gpufail.io/risk", "value": "avoid", "effect": "PreferNoSchedule"},
    # another health checker's verdict on the same sick GPU (e.g. the GPU operator's, a
    # vendor's node problem detector): NoExecute would evict a collector without a toleration
    {"key": "nvidia.com/gpu.health", "value": "unhealthy", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/memory-pressure", "effect": "NoSchedule"},
]


def test_the_collector_stays_on_tainted_gpu_nodes_and_is_evicted_last(rendered):
    _, objects = rendered
    spec = pod_spec(one(objects, "DaemonSet", "gpufail-collect"))
    for taint in TAINTS:
        assert tolerates(spec["tolerations"], taint), taint
    assert spec["priorityClassName"] == "system-node-critical"
    # The matching itself tells a missing toleration apart.
    assert not tolerates([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}], TAINTS[3])


def test_every_image_with_numba_gets_a_writable_cache_seeded_from_the_image(rendered):
    """numba caches only in a folder it can write; the pods' root is read-only. Each pod of the
    full image points NUMBA_CACHE_DIR at an emptyDir that an init container fills with the
    kernels the image compiled at build (the Dockerfile's NUMBA_CACHE_DIR)."""
    _, objects = rendered
    [built_into] = [
        e.split("=", 1)[1] for e in instruction(stages()["build-full"], "ENV") if e.startswith("NUMBA_CACHE_DIR=")
    ]
    seeded = []
    for workload in workloads(objects):
        spec = pod_spec(workload)
        [container] = spec["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if container["args"][0] not in ("serve", "nightly"):
            continue
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        cache = env["NUMBA_CACHE_DIR"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == cache]
        assert "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly")
        [init] = [c for c in spec["initContainers"] if any(m["name"] == mount["name"] for m in c["volumeMounts"])]
        assert init["image"] == container["image"]
        assert init["command"] == ["cp", "-a", f"{built_into}/.", f"{cache}/"]
        seeded.append(workload["metadata"]["name"])
    assert sorted(seeded) == ["gpufail-nightly", "gpufail-serve"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items() and not selector.get("matchExpressions")


def test_network_policies_admit_only_prometheus_and_clients_to_the_pods_ports(rendered):
    _, objects = rendered
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    deny = one(objects, "NetworkPolicy", "gpufail-deny-ingress")
    assert deny["spec"]["policyTypes"] == ["Ingress"] and not deny["spec"].get("ingress")
    for workload in workloads(objects):
        labels = pod_template(workload)["metadata"]["labels"]
        assert selects(deny["spec"]["podSelector"], labels), workload["metadata"]["name"]
        [container] = pod_spec(workload)["containers"]
        ports = {p["name"] for p in container.get("ports", [])}
        opened = [
            port["port"]
            for p in policies
            if selects(p["spec"]["podSelector"], labels)
            for rule in p["spec"].get("ingress", [])
            for port in rule["ports"]
        ]
        # Only the container's own named ports, and each of them to Prometheus.
        assert sorted(opened) == sorted(ports), workload["metadata"]["name"]
        for p in policies:
            if selects(p["spec"]["podSelector"], labels) and p["spec"].get("ingress"):
                sources = [peer for rule in p["spec"]["ingress"] for peer in rule["from"]]
                assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}} in sources
                assert all(peer.get("namespaceSelector") is not None for peer in sources)
                assert all(peer != {"namespaceSelector": {}} for peer in sources), "not every pod of the cluster"


def test_the_alert_rules_manifest_is_made_from_the_rules_file(rendered):
    _, objects = rendered
    rule = one(objects, "PrometheusRule", "gpufail")
    rules = yaml.safe_load((DEPLOY / "prometheus" / "gpufail-alerts.yaml").read_text())
    assert rule["spec"]["groups"] == rules["groups"]


def test_the_generator_says_when_the_manifest_is_out_of_date(tmp_path):
    script = DEPLOY / "prometheus" / "prometheusrule.py"
    checked = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr
    # A copy of deploy/ whose rules changed after the manifest was written.
    copy = tmp_path / "deploy"
    for part in ("prometheus", "kubernetes/base"):
        (copy / part).mkdir(parents=True)
    for name in ("gpufail-alerts.yaml", "prometheusrule.py"):
        (copy / "prometheus" / name).write_text((DEPLOY / "prometheus" / name).read_text())
    base = DEPLOY / "kubernetes" / "base" / "prometheusrule.yaml"
    (copy / "kubernetes" / "base" / base.name).write_text(base.read_text())
    rules = copy / "prometheus" / "gpufail-alerts.yaml"
    rules.write_text(rules.read_text().replace("for: 10m", "for: 11m", 1))
    stale = subprocess.run(
        [sys.executable, str(copy / "prometheus" / script.name), "--check"], capture_output=True, text=True, timeout=60
    )
    assert stale.returncode == 1 and "is not" in stale.stderr
    subprocess.run([sys.executable, str(copy / "prometheus" / script.name)], check=True, timeout=60)
    assert "for: 11m" in (copy / "kubernetes" / "base" / base.name).read_text()


def test_the_dashboard_configmap_is_the_dashboard_file(rendered):
    _, objects = rendered
    board = one(objects, "ConfigMap", "gpufail-dashboard")
    assert board["metadata"]["name"] == "gpufail-dashboard", "one name, not a new ConfigMap per change"
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    text = (DEPLOY / "grafana" / "gpufail-dashboard.json").read_text()
    assert board["data"] == {"gpufail-dashboard.json": text}
    assert json.loads(board["data"]["gpufail-dashboard.json"])["uid"]


def test_the_overlays_label_monitoring_objects_for_kube_prometheus_stack(rendered):
    folder, objects = rendered
    monitoring = [o for o in objects if o["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {o["kind"] for o in monitoring} == {"ServiceMonitor", "PrometheusRule"}
    if folder == "base":
        return  # the release name is the cluster's: the overlay sets it
    overlay = yaml.safe_load((DEPLOY / "kubernetes" / "overlays" / "example" / "kustomization.yaml").read_text())
    [patch] = [p for p in overlay["patches"] if p["target"].get("group") == "monitoring.coreos.com"]
    [op] = yaml.safe_load(patch["patch"])
    assert op["path"] == "/metadata/labels/release"
    for obj in monitoring:
        assert obj["metadata"]["labels"]["release"] == op["value"], obj["metadata"]["name"]
