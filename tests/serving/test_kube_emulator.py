"""The node emulator's write semantics against what the Kubernetes documentation says a real API
server does (update-api-object-kubectl-patch, api-concepts "resource versions"), so that the
publisher's tests rest on those semantics and not on the emulator's convenience."""

import pytest
from kubernetes import client

from tests.serving.kube_emulator import MERGE, STRATEGIC, PatchError, json_merge, node_api, strategic_merge

NODE = {
    "metadata": {"name": "n1", "labels": {"a": "1", "b": "2"}},
    "spec": {"taints": [{"key": "k1", "effect": "NoSchedule"}, {"key": "k2", "effect": "NoSchedule"}]},
    "status": {
        "conditions": [
            {"type": "Ready", "status": "True", "lastHeartbeatTime": "2026-01-01T00:00:00Z"},
            {"type": "DiskPressure", "status": "False"},
        ]
    },
}


def test_strategic_merge_merges_conditions_by_type_and_replaces_taints():
    patched = strategic_merge(
        NODE,
        {
            "metadata": {"labels": {"a": None, "c": "3"}},
            "spec": {"taints": [{"key": "k3", "effect": "NoSchedule"}]},
            "status": {
                "conditions": [
                    {"type": "Ready", "lastHeartbeatTime": "2026-01-01T00:00:10Z"},
                    {"type": "Mine", "status": "True"},
                ]
            },
        },
    )
    assert patched["metadata"]["labels"] == {"b": "2", "c": "3"}
    assert patched["spec"]["taints"] == [{"key": "k3", "effect": "NoSchedule"}]
    assert patched["status"]["conditions"] == [
        {"type": "Ready", "status": "True", "lastHeartbeatTime": "2026-01-01T00:00:10Z"},
        {"type": "DiskPressure", "status": "False"},
        {"type": "Mine", "status": "True"},
    ]


def test_strategic_merge_deletes_a_list_element_by_its_merge_key():
    patched = strategic_merge(NODE, {"status": {"conditions": [{"type": "DiskPressure", "$patch": "delete"}]}})
    assert [c["type"] for c in patched["status"]["conditions"]] == ["Ready"]
    # Deleting what is not there is not an error.
    assert strategic_merge(NODE, {"status": {"conditions": [{"type": "Gone", "$patch": "delete"}]}}) == NODE


def test_strategic_merge_refuses_an_element_without_its_merge_key():
    with pytest.raises(PatchError, match="merge key 'type'"):
        strategic_merge(NODE, {"status": {"conditions": [{"status": "True"}]}})


def test_a_json_merge_patch_replaces_lists_whole():
    patched = json_merge(NODE, {"status": {"conditions": [{"type": "Mine"}]}, "metadata": {"labels": {"a": None}}})
    assert patched["status"]["conditions"] == [{"type": "Mine"}]
    assert patched["metadata"]["labels"] == {"b": "2"}


def test_the_emulator_refuses_a_stale_resource_version_and_keeps_status_and_spec_apart():
    body = {k: v for k, v in NODE.items() if k != "metadata"} | {"metadata": {"labels": {"a": "1"}}}
    with node_api({"n1": body}) as (api, emulator):
        first = api.read_node("n1").metadata.resource_version
        api.patch_node("n1", {"metadata": {"labels": {"x": "1"}}}, _content_type=MERGE)
        with pytest.raises(client.ApiException) as refused:
            api.patch_node(
                "n1", {"metadata": {"resourceVersion": first}, "spec": {"taints": []}}, _content_type=STRATEGIC
            )
        assert refused.value.status == 409
        assert len(api.read_node("n1").spec.taints) == 2
        # The node endpoint ignores status; the status endpoint ignores everything else.
        api.patch_node(
            "n1", {"status": {"conditions": [{"type": "Ready", "$patch": "delete"}]}}, _content_type=STRATEGIC
        )
        api.patch_node_status("n1", {"spec": {"unschedulable": True}}, _content_type=STRATEGIC)
        node = api.read_node("n1")
        assert [c.type for c in node.status.conditions] == ["Ready", "DiskPressure"] and not node.spec.unschedulable
        assert [w.status for w in emulator.writes] == [200, 409, 200, 200]
        with pytest.raises(client.ApiException) as invalid:
            api.patch_node_status("n1", {"status": {"conditions": [{"status": "x"}]}}, _content_type=STRATEGIC)
        assert invalid.value.status == 422
