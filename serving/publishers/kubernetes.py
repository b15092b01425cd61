"""The Kubernetes publisher, with the official `kubernetes` client.

Marks, all namespaced under `gpufail.io` so that only ours are ever removed:
- label `gpufail.io/risk-tier=<tier>` on every node with a tier (watch and above);
- taint `gpufail.io/risk=<tier>`: `PreferNoSchedule` for avoid, `NoSchedule` for
  drain-after-job and drain-now (running pods stay; new ones go elsewhere);
- node condition `GpufailRisk` (status True, reason the tier, message ours) while the node has
  a tier above watch;
- cordon (`spec.unschedulable`) only for drain-now, with annotation `gpufail.io/cordoned` so
  that uncordoning undoes only our cordon. Evicting running pods is left to people.

A node that is not Ready, or that someone else cordoned, is reported unavailable and left alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serving.policy import tier_rank
from serving.publishers import REASON_PREFIX, Applied, Change, NodeView, SchedulerUnavailable, tier_phrase, with_retries

DOMAIN = "gpufail.io"
TIER_LABEL = f"{DOMAIN}/risk-tier"
TAINT_KEY = f"{DOMAIN}/risk"
CORDON_ANNOTATION = f"{DOMAIN}/cordoned"
CONDITION_TYPE = "GpufailRisk"
TAINT_EFFECTS = {"avoid": "PreferNoSchedule", "drain_after_job": "NoSchedule", "drain_now": "NoSchedule"}


def _camel(tier: str) -> str:
    return "".join(part.capitalize() for part in tier.split("_"))


@dataclass
class KubernetesPublisher:
    api: Any
    """A `kubernetes.client.CoreV1Api`."""
    attempts: int = 3
    backoff: float = 2.0
    name = "kubernetes"

    def _call(self, what: str, call: Any) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        def attempt() -> Any:
            try:
                return call()
            except ApiException as exc:
                if exc.status is not None and 400 <= exc.status < 500 and exc.status != 429:
                    raise SchedulerUnavailable(f"kubernetes {what}: HTTP {exc.status} {exc.reason}") from None
                raise

        return with_retries(
            attempt,
            what=f"kubernetes {what}",
            attempts=self.attempts,
            backoff=self.backoff,
            retry_on=(ApiException, HTTPError, OSError),
        )

    def observe(self, nodes: Sequence[str]) -> dict[str, NodeView]:
        listed = self._call("list nodes", self.api.list_node)
        known = {item.metadata.name: item for item in listed.items}
        return {
            n: _view(known[n])
            if n in known
            else NodeView(exists=False, unavailable="not a node of this Kubernetes cluster")
            for n in nodes
        }

    def apply(self, changes: Sequence[Change]) -> list[Applied]:
        results = []
        for change in changes:
            try:
                results.append(self._apply_one(change))
            except SchedulerUnavailable as exc:
                results.append(Applied(False, f"failed: {exc}"))
        return results

    def _apply_one(self, change: Change) -> Applied:
        node = self._call(f"read node {change.node}", lambda: self.api.read_node(change.node))
        view = _view(node)
        if view.unavailable:
            return Applied(False, f"skipped: {view.unavailable}")
        new, done = change.new, []
        taints = [t for t in (node.spec.taints or []) if t.key != TAINT_KEY]
        if new in TAINT_EFFECTS:
            taints.append({"key": TAINT_KEY, "value": new, "effect": TAINT_EFFECTS[new]})
            done.append(f"taint {TAINT_EFFECTS[new]}")
        annotations = node.metadata.annotations or {}
        ours_cordoned = annotations.get(CORDON_ANNOTATION) == "true"
        spec: dict[str, Any] = {"taints": [_plain(t) for t in taints]}
        metadata: dict[str, Any] = {"labels": {TIER_LABEL: new if new != "none" else None}}
        if new == "drain_now" and not node.spec.unschedulable:
            spec["unschedulable"] = True
            metadata["annotations"] = {CORDON_ANNOTATION: "true"}
            done.append("cordoned")
        elif new != "drain_now" and ours_cordoned:
            spec["unschedulable"] = False
            metadata["annotations"] = {CORDON_ANNOTATION: None}
            done.append("uncordoned")
        body = {"metadata": metadata, "spec": spec}
        self._call(f"patch node {change.node}", lambda: self.api.patch_node(change.node, body))
        done.append(f"label {new}" if new != "none" else "label removed")

        conditions = [_plain(c) for c in (node.status.conditions or []) if c.type != CONDITION_TYPE]
        if tier_rank(new) > tier_rank("watch"):
            conditions.append(
                {
                    "type": CONDITION_TYPE,
                    "status": "True",
                    "reason": _camel(new),
                    "message": f"{REASON_PREFIX} {tier_phrase(new)} risk={change.risk:.2f}"
                    + (f" model={change.model_version}" if change.model_version else ""),
                }
            )
        had = any(c.type == CONDITION_TYPE for c in (node.status.conditions or []))
        if had or tier_rank(new) > tier_rank("watch"):
            status = {"status": {"conditions": conditions}}
            self._call(f"patch node {change.node} status", lambda: self.api.patch_node_status(change.node, status))
            done.append(f"condition {CONDITION_TYPE}" if tier_rank(new) > tier_rank("watch") else "condition removed")
        return Applied(True, ", ".join(done))


def _plain(obj: Any) -> dict[str, Any]:
    """A client model (or dict) as the JSON the API takes, without unset fields."""
    from kubernetes.client import ApiClient

    data = obj if isinstance(obj, dict) else ApiClient().sanitize_for_serialization(obj)
    return {k: v for k, v in data.items() if v is not None}


def _view(node: Any) -> NodeView:
    annotations = node.metadata.annotations or {}
    if node.spec.unschedulable and annotations.get(CORDON_ANNOTATION) != "true":
        return NodeView(unavailable="cordoned by someone else")
    ready = [c for c in (node.status.conditions or []) if c.type == "Ready"]
    if ready and ready[0].status != "True":
        return NodeView(unavailable=f"node not Ready ({ready[0].reason or ready[0].status})")
    return NodeView()


def kubernetes_api(kubeconfig: str = "") -> Any:
    """A CoreV1Api from `kubeconfig` ('' = the in-cluster service account if present, else
    ~/.kube/config)."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except ConfigException:
                config.load_kube_config()
    except (ConfigException, OSError) as exc:
        raise SchedulerUnavailable(
            f"kubernetes: no usable configuration ({kubeconfig or 'in-cluster or ~/.kube/config'}): {exc}"
        ) from None
    return client.CoreV1Api()
