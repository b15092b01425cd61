"""A Kubernetes API emulator for Node objects: kmock's emulator (an in-memory HTTP server on
127.0.0.1 that speaks the API's JSON) with the parts of a real API server's write semantics that
decide whether a node publisher is correct. It is still not Kubernetes: no admission, no
validation beyond what is below, no kubelet; tests that use it say so.

What it adds to kmock, which merges every patch as plain nested dicts and replaces lists whole:
- patches by content type, as the API documents them
  (https://kubernetes.io/docs/tasks/manage-kubernetes-objects/update-api-object-kubectl-patch/):
  `application/strategic-merge-patch+json` merges maps (null deletes a key), merges the lists a
  Node declares with a merge key (`status.conditions` and `status.addresses`, key `type`),
  honours the `$patch: delete` directive in those lists, and replaces every other list (such as
  `spec.taints`) whole; `application/merge-patch+json` (RFC 7386) replaces every list; JSON
  patches are refused with 415 since nothing here sends them;
- `metadata.resourceVersion`: every write of a node gives it a new one; a patch that names a
  resourceVersion other than the node's current one is refused with 409 Conflict, as the API
  server's optimistic concurrency does;
- the `status` subresource: a patch of the node changes everything but its status, a patch of
  `/status` changes only its status;
- `interleave`: a write to apply right after a read of a node has been answered, to
  stand for another controller writing between a client's read and its patch;
- `writes`: every accepted or refused patch, with its content type and body, for assertions on
  the exact requests a client sends; `calls`: the RBAC verb and resource of every node request
  (what a ClusterRole must allow).
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kmock._internal import apps, enums, k8s, rendering
from kubernetes import client

MERGE_KEYS = {("status", "conditions"): "type", ("status", "addresses"): "type"}
"""Node's list fields with `patchStrategy: merge` and their `patchMergeKey` (core/v1 types)."""
RBAC_VERBS = {
    enums.action.FETCH: "get",
    enums.action.LIST: "list",
    enums.action.WATCH: "watch",
    enums.action.CREATE: "create",
    enums.action.UPDATE: "patch",
    enums.action.DELETE: "delete",
}
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


class PatchError(ValueError):
    """A patch the API server would refuse as invalid (422)."""


def strategic_merge(current: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """`current` with a strategic merge `patch` applied (the subset of the semantics Node uses)."""
    if not isinstance(patch, dict) or not isinstance(current, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if "$patch" in patch:
        raise PatchError(f"{'.'.join(path) or 'object'}: unsupported $patch directive {patch['$patch']!r} in a map")
    out = copy.deepcopy(current)
    for key, value in patch.items():
        if key.startswith("$setElementOrder/"):
            continue  # an ordering hint kubectl sends; order does not matter to these tests
        if key.startswith("$"):
            raise PatchError(f"{'.'.join((*path, key))}: unsupported directive")
        where = (*path, key)
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and where in MERGE_KEYS:
            out[key] = _merge_list(out.get(key) or [], value, MERGE_KEYS[where], where)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = strategic_merge(out[key], value, where)
        else:
            out[key] = strategic_merge({}, value, where) if isinstance(value, dict) else copy.deepcopy(value)
    return out


def _merge_list(current: list[Any], patch: list[Any], key: str, path: tuple[str, ...]) -> list[Any]:
    out = [copy.deepcopy(item) for item in current]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(f"{'.'.join(path)}: every element needs the merge key {key!r}, got {item!r}")
        at = next((i for i, old in enumerate(out) if old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del out[at]
        elif "$patch" in item:
            raise PatchError(f"{'.'.join(path)}: unsupported $patch directive {item['$patch']!r} in a list")
        elif at is None:
            out.append(strategic_merge({}, item, path))
        else:
            out[at] = strategic_merge(out[at], item, path)
    return out


def json_merge(current: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(current) if isinstance(current, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = json_merge(out.get(key), value)
    return out


@dataclass(frozen=True)
class Write:
    node: str
    subresource: str | None
    content_type: str
    body: Any
    status: int
    """200, or the HTTP status it was refused with."""


class NodeEmulator(k8s.KubernetesEmulator):  # type: ignore[misc]
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.writes: list[Write] = []
        self.calls: list[tuple[str, str]] = []
        self.versions = 0
        self.pending: dict[str, list[Callable[[dict[str, Any]], dict[str, Any]]]] = {}

    def interleave(self, node: str, write: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """After the next read of `node` is answered, replace the node with `write(node)` (as if
        another controller wrote it), giving it a new resourceVersion. Writes queued for one
        node are applied one per read, in order."""
        self.pending.setdefault(node, []).append(write)

    def _next_version(self) -> str:
        self.versions += 1
        return str(self.versions)

    def _key(self, request: rendering.Request) -> Any:
        return (request.resource, None, request.name)

    async def _handle(self, request: rendering.Request) -> Any:
        if request.resource is None or request.resource.plural != "nodes":
            return await super()._handle(request)
        verb = RBAC_VERBS.get(request.action, str(request.action))
        self.calls.append((verb, "nodes" + (f"/{request.subresource}" if request.subresource else "")))
        if request.action == enums.action.CREATE:
            request.data.setdefault("metadata", {})["resourceVersion"] = self._next_version()
            # Go's JSON encoder never omits a struct: a node always has a spec and a status.
            request.data.setdefault("spec", {})
            request.data.setdefault("status", {})
            return await super()._handle(request)
        if request.action == enums.action.UPDATE and request.name is not None:
            try:
                await self._patch(request)
            except k8s.KubernetesError as exc:
                return await self._render_error(exc)
            # Skip kmock's own dict-merge of the body: the state is already written above.
            return await super(k8s.KubernetesEmulator, self)._handle(request)
        response = await super()._handle(request)
        if request.action == enums.action.FETCH and self.pending.get(request.name or ""):
            async with self._lock:
                obj = self._objects[self._key(request)]
                changed = self.pending[request.name or ""].pop(0)(copy.deepcopy(obj.raw))
                changed["metadata"]["resourceVersion"] = self._next_version()
                obj.create(changed)
        return response

    async def _patch(self, request: rendering.Request) -> None:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        body = request.data
        async with self._lock:
            key = self._key(request)
            if key not in self._objects or self._objects[key].deleted:
                raise k8s.KubernetesObjectNotFoundError()
            current = copy.deepcopy(self._objects[key].raw)
            status = 200
            try:
                if request.subresource not in (None, "status"):
                    raise k8s.KubernetesNotFoundError()
                if content_type == STRATEGIC:
                    patched = strategic_merge(current, body)
                elif content_type == MERGE:
                    patched = json_merge(current, body)
                else:
                    raise k8s.KubernetesError(
                        status=415, reason="UnsupportedMediaType", message=f"the emulator takes no {content_type!r}"
                    )
                wanted = (body.get("metadata") or {}).get("resourceVersion")
                if wanted is not None and wanted != current["metadata"]["resourceVersion"]:
                    raise k8s.KubernetesError(
                        status=409,
                        reason="Conflict",
                        message=f'Operation cannot be fulfilled on nodes "{request.name}": the object has been '
                        "modified; please apply your changes to the latest version and try again",
                    )
            except PatchError as exc:
                status = 422
                raise k8s.KubernetesError(status=422, reason="Invalid", message=str(exc)) from None
            except k8s.KubernetesError as exc:
                status = exc.status
                raise
            finally:
                self.writes.append(Write(request.name, request.subresource, content_type, body, status))
            if request.subresource == "status":
                patched = {**current, "status": patched.get("status", {})}
            else:
                patched["status"] = current.get("status", {})
            patched.setdefault("metadata", {})["resourceVersion"] = self._next_version()
            self._objects[key].create(patched)
            await self._buses[request.resource].put({"type": "MODIFIED", "object": patched})


@contextmanager
def node_api(nodes: Mapping[str, dict[str, Any]]) -> Iterator[tuple[client.CoreV1Api, NodeEmulator]]:
    """A CoreV1Api client talking to a NodeEmulator on 127.0.0.1 that holds `nodes` (name ->
    body without the name), and the emulator itself (its state is read and changed only
    through the API, or with `interleave`)."""
    ready, box = threading.Event(), dict[str, Any]()

    def serve() -> None:
        async def main() -> None:
            async with NodeEmulator() as emulator, apps.Server(emulator) as server:
                box.update(url=str(server.url), loop=asyncio.get_running_loop(), stop=asyncio.Event())
                box["emulator"] = emulator
                ready.set()
                await box["stop"].wait()

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(30), "the node emulator did not start"
    config = client.Configuration()
    config.host = box["url"].rstrip("/")
    core = client.CoreV1Api(client.ApiClient(config))
    try:
        for name, body in nodes.items():
            metadata = {**copy.deepcopy(body.get("metadata", {})), "name": name}
            core.create_node({"apiVersion": "v1", "kind": "Node", **copy.deepcopy(body), "metadata": metadata})
        yield core, box["emulator"]
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10)
