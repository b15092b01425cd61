"""deploy/kubernetes rendered with `kubectl kustomize`: every object valid against the
Kubernetes schemas (kubernetes-validate, offline, strict: no unknown field), and what the
manifests promise checked against the code: the collector's and the server's probes and ports,
the publisher's exact verbs on nodes, the configuration gpufail loads, the commands and images."""

from __future__ import annotations

import itertools
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest

from gpufail.cli import COMMANDS
from gpufail.config import CollectSettings, load_settings
from serving.publishers import Change
from serving.publishers.kubernetes import KubernetesPublisher
from tests.deploy.kubectl import one, pod_spec, workloads
from tests.serving.kube_emulator import node_api

KUBERNETES_VERSION = "1.30"
PENDING_KEYS = {("collect", "listen")} - {("collect", k) for k in CollectSettings.model_fields}
"""Settings the manifests set that this tree's gpufail does not know yet: `[collect] listen`
comes with the collect daemon's endpoints (branch h-collect); once it is here this is empty
and the key is validated like every other."""


SERVICE_MONITOR_FIELDS = {
    "spec": {"selector", "endpoints", "namespaceSelector", "jobLabel"},
    "endpoint": {"port", "path", "interval", "scheme", "relabelings", "metricRelabelings", "bearerTokenSecret"},
    "relabeling": {"sourceLabels", "targetLabel", "regex", "replacement", "action", "separator"},
}
"""The ServiceMonitor fields (monitoring.coreos.com/v1, prometheus-operator's API reference) the
manifests may use; the Kubernetes schemas do not cover this custom resource."""


def check_service_monitor(obj):
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    spec = obj["spec"]
    assert set(spec) <= SERVICE_MONITOR_FIELDS["spec"] and spec["selector"]["matchLabels"]
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= SERVICE_MONITOR_FIELDS["endpoint"] and isinstance(endpoint["port"], str)
        for relabel in endpoint.get("relabelings", []):
            assert set(relabel) <= SERVICE_MONITOR_FIELDS["relabeling"]


def check_prometheus_rule(obj):
    """A PrometheusRule (monitoring.coreos.com/v1): `spec.groups`, a Prometheus rules file's
    groups, and nothing else (promtool checks the rules themselves, test_observability)."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1" and set(obj["spec"]) == {"groups"}
    for group in obj["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["rules"]


def test_every_object_is_valid_for_kubernetes(rendered):
    _, objects = rendered
    assert objects
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            check_service_monitor(obj)
            continue
        if obj["kind"] == "PrometheusRule":
            check_prometheus_rule(obj)
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {exc.message}")


def test_the_validation_refuses_an_unknown_field(rendered):
    _, objects = rendered
    daemonset = one(objects, "DaemonSet")
    broken = {**daemonset, "spec": {**daemonset["spec"], "updateStrategyy": {}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_collector_is_not_privileged_and_probes_its_own_endpoints(rendered):
    folder, objects = rendered
    daemonset = one(objects, "DaemonSet", "gpufail-collect")
    spec = pod_spec(daemonset)
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    [container] = spec["containers"]
    security = container["securityContext"]
    assert security.get("privileged") is False and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert set(security["capabilities"].get("add", [])) <= {"SYSLOG"}
    if folder != "overlays/kmsg":
        assert "add" not in security["capabilities"] and spec["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    host, _, port = env["GPUFAIL_COLLECT__LISTEN"].rpartition(":")
    assert host == "0.0.0.0", "kubelet probes the pod's address, not its loopback"
    [metrics_port] = container["ports"]
    assert metrics_port["containerPort"] == int(port)
    probes = {kind: container[kind]["httpGet"] for kind in ("livenessProbe", "readinessProbe", "startupProbe")}
    assert {p["port"] for p in probes.values()} == {metrics_port["name"]}
    assert (probes["livenessProbe"]["path"], probes["readinessProbe"]["path"]) == ("/healthz", "/readyz")


def test_the_server_is_probed_on_the_apis_health_endpoints(rendered):
    from serving.api import create_app  # noqa: F401  (the routes below are the API's)

    _, objects = rendered
    deployment = one(objects, "Deployment", "gpufail-serve")
    [container] = pod_spec(deployment)["containers"]
    assert container["args"] == ["serve"]
    assert (container["livenessProbe"]["httpGet"]["path"], container["readinessProbe"]["httpGet"]["path"]) == (
        "/healthz",
        "/readyz",
    )
    [port] = container["ports"]
    settings = tomllib.loads(config_text(objects))
    assert port["containerPort"] == settings["serve"]["port"] and settings["serve"]["host"] == "0.0.0.0"
    service = one(objects, "Service", "gpufail-serve")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]


def test_the_apis_health_routes_exist():
    from tests.deploy.exported import server_app_routes

    assert {"/healthz", "/readyz", "/metrics"} <= server_app_routes()


def test_the_nightly_and_publish_jobs_never_overlap_themselves(rendered):
    _, objects = rendered
    for name in ("gpufail-nightly", "gpufail-publish"):
        assert one(objects, "CronJob", name)["spec"]["concurrencyPolicy"] == "Forbid"


def test_only_the_publish_job_can_change_nodes(rendered):
    """The nightly job trains and loads models: it gets no API token, and its publish step is a
    dry run to the audit log; the publish job, which runs no model, has the node permissions."""
    _, objects = rendered
    bound = {s["name"] for b in objects if b["kind"] == "ClusterRoleBinding" for s in b["subjects"]}
    accounts = {a["metadata"]["name"]: a for a in objects if a["kind"] == "ServiceAccount"}
    by_account = {}
    for workload in workloads(objects):
        spec, name = pod_spec(workload), workload["metadata"]["name"]
        account = spec.get("serviceAccountName", "default")
        by_account.setdefault(account, []).append(name)
        has_token = spec.get(
            "automountServiceAccountToken", accounts.get(account, {}).get("automountServiceAccountToken", True)
        )
        assert has_token == (account in bound), f"{name}: an API token only where the account has a role"
    assert bound == {"gpufail-publisher"} and by_account["gpufail-publisher"] == ["gpufail-publish"]
    nightly = pod_spec(one(objects, "CronJob", "gpufail-nightly"))
    assert nightly["serviceAccountName"] == "gpufail-nightly"
    [container] = nightly["containers"]
    settings = load_settings(
        environ={
            e["name"]: e["value"]
            for e in container["env"]
            if e["name"].startswith("GPUFAIL_") and e["name"] != "GPUFAIL_CONFIG"
        },
        cwd=Path("/nonexistent"),
        system=Path("/nonexistent"),
    )
    assert (settings.publish.target, settings.publish.dry_run) == ("log", True)
    publish = pod_spec(one(objects, "CronJob", "gpufail-publish"))
    [container] = publish["containers"]
    assert container["args"][0] == "publish" and not any(
        e["name"].startswith("GPUFAIL_PUBLISH") for e in container["env"]
    )


def test_service_monitors_scrape_named_ports_of_their_services(rendered):
    _, objects = rendered
    services = {s["metadata"]["name"]: s for s in objects if s["kind"] == "Service"}
    for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
        service = services[monitor["metadata"]["name"]]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        names = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= names


def used_node_verbs() -> set[tuple[str, str]]:
    """The (verb, resource) pairs the Kubernetes publisher sends, through every tier change."""
    nodes = {"gpu001": {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}}
    with node_api(nodes) as (api, emulator):
        emulator.calls.clear()
        pub = KubernetesPublisher(api, attempts=1)
        pub.observe(["gpu001"])
        tiers = ["none", "watch", "avoid", "drain_after_job", "drain_now", "avoid", "none"]
        for old, new in itertools.pairwise(tiers):
            [result] = pub.apply([Change("gpu001", old, new, 0.5, "test")])
            assert result.ok, result.detail
        return set(emulator.calls)


def test_the_publisher_role_allows_exactly_the_verbs_it_uses_on_nodes(rendered):
    _, objects = rendered
    role = one(objects, "ClusterRole", "gpufail-publisher")
    allowed = {(verb, resource) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]}
    assert all(rule["apiGroups"] == [""] for rule in role["rules"])
    assert allowed == used_node_verbs()
    binding = one(objects, "ClusterRoleBinding", "gpufail-publisher")
    account = one(objects, "ServiceAccount", "gpufail-publisher")
    [subject] = binding["subjects"]
    assert (subject["name"], subject.get("namespace")) == (
        account["metadata"]["name"],
        account["metadata"].get("namespace", "gpufail"),
    )


def config_text(objects) -> str:
    return one(objects, "ConfigMap", "gpufail-config")["data"]["gpufail.toml"]


def test_gpufail_loads_the_configuration_each_container_gets(rendered, tmp_path):
    _, objects = rendered
    config = tmp_path / "gpufail.toml"
    config.write_text(config_text(objects))
    assert {"gpufail-collect", "gpufail-serve", "gpufail-nightly", "gpufail-publish"} <= {
        w["metadata"]["name"] for w in workloads(objects)
    }
    for workload in workloads(objects):
        for container in pod_spec(workload)["containers"]:
            env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
            assert env.pop("GPUFAIL_CONFIG") == "/etc/gpufail/gpufail.toml"
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts["/etc/gpufail"] == "config"
            overrides = {
                k: v.replace("$(HOST_IP)", "10.0.0.1")
                for k, v in env.items()
                if k.startswith("GPUFAIL_")
                and tuple(k.removeprefix("GPUFAIL_").lower().split("__")) not in PENDING_KEYS
            }
            settings = load_settings(config, environ=overrides)
            assert settings.store.root in mounts, "the data root is a mounted volume"


def test_containers_run_gpufail_commands_from_the_dockerfiles_images(rendered):
    _, objects = rendered
    for workload in workloads(objects):
        [container] = pod_spec(workload)["containers"]
        assert container["args"][0] in COMMANDS
        expected = "gpufail-collector" if workload["kind"] == "DaemonSet" else "gpufail"
        assert container["image"].split("/")[-1].split(":")[0] == expected
