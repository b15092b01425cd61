"""The Kubernetes publisher, with the official `kubernetes` client.

Marks, all namespaced under `gpufail.io` so that only ours are ever removed:
- label `gpufail.io/risk-tier=<tier>` on every node with a tier (watch and above), and
  `gpufail.io/alarm=failure|fail-slow`: its risk or a straggler GPU (the fail_slow alarm class);
- taint `gpufail.io/risk=<tier>`: `PreferNoSchedule` for avoid, `NoSchedule` for
  drain-after-job and drain-now (running pods stay; new ones go elsewhere);
- node condition `GpufailRisk` (status True, reason the tier, message ours) while the node has
  a tier above watch;
- cordon (`spec.unschedulable`) only for drain-now, with annotation `gpufail.io/cordoned` so
  that uncordoning undoes only our cordon. Evicting running pods is left to people;
- job-aware (docs/actions.md): label `gpufail.io/placement-score` (0-100, placement hints),
  label `gpufail.io/standby=true` (warm standbys), and on the pods of a job told to
  checkpoint the annotation `gpufail.io/checkpoint-requested`. The job map is the Running pods
  with GPU requests.

A node that is not Ready, or that someone else cordoned, is reported unavailable and left alone.

How the requests are shaped for a real API server (strategic merge patches, as `kubectl` sends):
- labels and annotations are maps: the patch names only our keys (null removes one);
- `spec.taints` has no merge key, so a patch replaces the whole list: it is sent only when our
  taint or the cordon changes, with the node's `metadata.resourceVersion` as read, so a taint
  another controller wrote in between makes the API server refuse it (409 Conflict); the node
  is then read again and the change recomputed, up to `conflict_attempts` times;
- `status.conditions` merges by `type`: the status patch carries only our condition (with
  `lastTransitionTime`, kept while its status stays True), and removes it with the
  `$patch: delete` directive, so kubelet's conditions and heartbeats are never sent back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from serving.cost_policy import Hint
from serving.jobs import JobMap, JobMapUnreadable, kubernetes_job_map
from serving.policy import tier_rank
from serving.publishers import REASON_PREFIX, Applied, Change, NodeView, SchedulerUnavailable, tier_phrase, with_retries

DOMAIN = "gpufail.io"
TIER_LABEL = f"{DOMAIN}/risk-tier"
TAINT_KEY = f"{DOMAIN}/risk"
CORDON_ANNOTATION = f"{DOMAIN}/cordoned"
CONDITION_TYPE = "GpufailRisk"
CHECKPOINT_REQUEST_ANNOTATION = f"{DOMAIN}/checkpoint-requested"
"""Pod annotation of a checkpoint hint: the time it was asked (docs/actions.md)."""
PLACEMENT_LABEL = f"{DOMAIN}/placement-score"
"""Node label: 0 (riskiest) to 100 (healthiest), for preferred node affinity or a scheduler plugin."""
STANDBY_LABEL = f"{DOMAIN}/standby"
ALARM_LABEL = f"{DOMAIN}/alarm"
"""Node label beside the tier's: why the node has it, `failure` (its risk) or `fail-slow` (a
straggler GPU, docs/actions.md)."""
ALARM_VALUES = {"failure": "failure", "fail_slow": "fail-slow"}
TAINT_EFFECTS = {"avoid": "PreferNoSchedule", "drain_after_job": "NoSchedule", "drain_now": "NoSchedule"}
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class _Conflict(Exception):
    """HTTP 409: the node changed since it was read (its resourceVersion moved on)."""


def _camel(tier: str) -> str:
    return "".join(part.capitalize() for part in tier.split("_"))


@dataclass
class KubernetesPublisher:
    api: Any
    """A `kubernetes.client.CoreV1Api`."""
    attempts: int = 3
    backoff: float = 2.0
    conflict_attempts: int = 5
    """Read-modify-write rounds of one node's patch when the node keeps changing under us."""
    now: Callable[[], datetime] = field(default=lambda: datetime.now(UTC), repr=False)
    cluster: str = ""
    """The cluster of the predictions this API server runs ('' when they hold one):
    `serving.publish` gives the publisher that cluster's nodes alone."""
    name = "kubernetes"

    def _call(self, what: str, call: Any) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        def attempt() -> Any:
            try:
                return call()
            except ApiException as exc:
                if exc.status == 409:
                    raise _Conflict(f"kubernetes {what}: HTTP 409 {exc.reason}") from None
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
        known = self._list_nodes()
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
        for _ in range(max(self.conflict_attempts, 1)):
            node = self._call(f"read node {change.node}", lambda: self.api.read_node(change.node))
            view = _view(node)
            if view.unavailable:
                return Applied(False, f"skipped: {view.unavailable}")
            body, done = node_patch(node, change.new, change.alarm)
            try:
                self._call(
                    f"patch node {change.node}",
                    lambda body=body: self.api.patch_node(change.node, body, _content_type=STRATEGIC_MERGE_PATCH),
                )
                break
            except _Conflict:
                continue
        else:
            return Applied(
                False,
                f"failed: kubernetes patch node {change.node}: the node changed between read and write "
                f"{max(self.conflict_attempts, 1)} times in a row (HTTP 409 Conflict)",
            )
        status = condition_patch(node, change, self.now())
        if status is not None:
            self._call(
                f"patch node {change.node} status",
                lambda: self.api.patch_node_status(change.node, status, _content_type=STRATEGIC_MERGE_PATCH),
            )
            done.append(
                f"condition {CONDITION_TYPE}" if tier_rank(change.new) > tier_rank("watch") else "condition removed"
            )
        return Applied(True, ", ".join(done))

    def _list_nodes(self) -> dict[str, Any]:
        listed = self._call("list nodes", self.api.list_node)
        self._known = {item.metadata.name: item for item in listed.items}
        return self._known

    # --- job-aware actions (docs/actions.md) ----------------------------------------------

    def read_jobs(self) -> JobMap:
        """The running pods that request GPUs, grouped into jobs (`serving.jobs.kubernetes_job_map`)."""
        import json

        pods: list[Any] = []
        token = None
        while True:
            # The raw JSON, not the client's models: building 20,000 V1Pods costs seconds.
            raw = self._call(
                "list pods",
                lambda token=token: self.api.list_pod_for_all_namespaces(
                    field_selector="status.phase=Running", limit=500, _continue=token, _preload_content=False
                ),
            )
            try:
                page = json.loads(raw.data)
                pods.extend(page["items"])
            except (ValueError, KeyError, TypeError) as exc:
                raise JobMapUnreadable(f"kubernetes list pods: not a pod list ({type(exc).__name__}: {exc})") from None
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return kubernetes_job_map(pods)

    def checkpoint(self, hints: Sequence[Hint]) -> list[Applied]:
        """Annotate every pod of each job with `gpufail.io/checkpoint-requested=<now>` (a
        training process sees it through a downward-API volume file)."""
        out = []
        stamp = _rfc3339(self.now())
        for hint in hints:
            done = 0
            try:
                for pod in hint.job.pods:
                    namespace, name = pod.split("/", 1)
                    body = {"metadata": {"annotations": {CHECKPOINT_REQUEST_ANNOTATION: stamp}}}
                    self._call(
                        f"patch pod {pod}",
                        lambda namespace=namespace, name=name, body=body: self.api.patch_namespaced_pod(
                            name, namespace, body, _content_type=STRATEGIC_MERGE_PATCH
                        ),
                    )
                    done += 1
            except SchedulerUnavailable as exc:
                out.append(Applied(False, f"failed: {exc} (after {done} of {len(hint.job.pods)} pods)"))
                continue
            out.append(Applied(True, f"annotated {done} pod(s) {CHECKPOINT_REQUEST_ANNOTATION}={stamp}"))
        return out

    def place(self, levels: Mapping[str, int], count: int, apply: bool) -> list[tuple[str, Applied]]:
        """Label each node of `levels` `gpufail.io/placement-score` (100 for the healthiest level,
        0 for the riskiest); remove our label from available nodes not in `levels`."""
        wanted = {node: str(placement_score(level, count)) for node, level in levels.items()}
        return self._label(PLACEMENT_LABEL, wanted, apply, "placement score")

    def standby(self, nodes: Sequence[str], apply: bool) -> list[tuple[str, Applied]]:
        """Label exactly `nodes` `gpufail.io/standby=true` (our label removed from the others)."""
        return self._label(STANDBY_LABEL, dict.fromkeys(nodes, "true"), apply, "standby")

    def _label(self, key: str, wanted: Mapping[str, str], apply: bool, what: str) -> list[tuple[str, Applied]]:
        # The nodes as `observe` listed them: `apply` changes only our tier marks, not these labels.
        known = getattr(self, "_known", None)
        if known is None:
            try:
                known = self._list_nodes()
            except SchedulerUnavailable as exc:
                return [(node, Applied(False, f"failed: {exc}")) for node in sorted(wanted)]
        out = []
        for name in sorted(set(wanted) | {n for n, item in known.items() if key in (item.metadata.labels or {})}):
            item = known.get(name)
            if item is None or _view(item).unavailable:
                continue
            current = (item.metadata.labels or {}).get(key)
            target = wanted.get(name)
            if current == target:
                continue
            detail = f"{what} {current or '(none)'} -> {target or '(removed)'}"
            if not apply:
                out.append((name, Applied(True, f"would set {detail}")))
                continue
            body = {"metadata": {"labels": {key: target}}}
            try:
                self._call(
                    f"patch node {name}",
                    lambda name=name, body=body: self.api.patch_node(name, body, _content_type=STRATEGIC_MERGE_PATCH),
                )
            except SchedulerUnavailable as exc:
                out.append((name, Applied(False, f"failed: {exc}")))
                continue
            out.append((name, Applied(True, detail)))
        return out


def placement_score(level: int, count: int) -> int:
    """The node label's score of a placement level (0 = the healthiest of `count` levels)."""
    return 100 if count <= 1 else round(100 * (count - 1 - level) / (count - 1))


def node_patch(node: Any, new: str, alarm: str = "failure") -> tuple[dict[str, Any], list[str]]:
    """The strategic merge patch that moves `node` (as read) to tier `new`, and what it does.

    Labels and annotations are maps, merged key by key. `spec` is sent only when our taint or
    our cordon changes; it then carries the whole taint list (a list without a merge key is
    replaced) and the resourceVersion that list was read at, so a concurrent change is refused
    rather than overwritten."""
    current = list(node.spec.taints or [])
    others = [_plain(t) for t in current if t.key != TAINT_KEY]
    ours = sorted((t.key, t.value, t.effect) for t in current if t.key == TAINT_KEY)
    wanted = [{"key": TAINT_KEY, "value": new, "effect": TAINT_EFFECTS[new]}] if new in TAINT_EFFECTS else []
    done = [f"taint {TAINT_EFFECTS[new]}"] if new in TAINT_EFFECTS else []
    spec: dict[str, Any] = {}
    if ours != [(t["key"], t["value"], t["effect"]) for t in wanted]:
        spec["taints"] = others + wanted
    marked = new != "none"
    metadata: dict[str, Any] = {
        "labels": {TIER_LABEL: new if marked else None, ALARM_LABEL: ALARM_VALUES[alarm] if marked else None}
    }
    ours_cordoned = (node.metadata.annotations or {}).get(CORDON_ANNOTATION) == "true"
    if new == "drain_now" and not node.spec.unschedulable:
        spec["unschedulable"] = True
        metadata["annotations"] = {CORDON_ANNOTATION: "true"}
        done.append("cordoned")
    elif new != "drain_now" and ours_cordoned:
        spec["unschedulable"] = False
        metadata["annotations"] = {CORDON_ANNOTATION: None}
        done.append("uncordoned")
    if spec:
        metadata["resourceVersion"] = node.metadata.resource_version
    done.append(f"label {new}" if new != "none" else "label removed")
    body: dict[str, Any] = {"metadata": metadata}
    if spec:
        body["spec"] = spec
    return body, done


def condition_patch(node: Any, change: Change, now: datetime) -> dict[str, Any] | None:
    """The status patch for our condition on `node` (as read): set while the tier is above
    watch, deleted when it falls back, None when there is nothing to change."""
    existing = next((c for c in (node.status.conditions or []) if c.type == CONDITION_TYPE), None)
    if tier_rank(change.new) > tier_rank("watch"):
        stamp = _rfc3339(now)
        since = existing.last_transition_time if existing is not None and existing.status == "True" else None
        condition = {
            "type": CONDITION_TYPE,
            "status": "True",
            "reason": _camel(change.new),
            "message": f"{REASON_PREFIX} {tier_phrase(change.new)} alarm={ALARM_VALUES[change.alarm]} risk={change.risk:.2f}"
            + (f" model={change.model_version}" if change.model_version else ""),
            "lastHeartbeatTime": stamp,
            "lastTransitionTime": _rfc3339(since) if since is not None else stamp,
        }
        return {"status": {"conditions": [condition]}}
    if existing is not None:
        return {"status": {"conditions": [{"type": CONDITION_TYPE, "$patch": "delete"}]}}
    return None


def _rfc3339(moment: datetime) -> str:
    """A Kubernetes `Time`: RFC 3339 in UTC, whole seconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
