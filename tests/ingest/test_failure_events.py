"""Reading scheduler-seen failures (Slurm, Kubernetes) into the failure_events dataset."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from ingest.errors import InputError
from ingest.failure_events import (
    event_frame,
    expand_hostlist,
    jobcomp_node_failures,
    kubernetes_failure_events,
    sacct_node_failures,
    slurm_down_nodes,
    write_failure_events,
)
from ingest.store import Store
from tests.serving.kube_emulator import node_api

T = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)


def test_slurm_host_lists_expand_with_their_zero_padding():
    assert expand_hostlist("gpu[001-003,010],login1") == ["gpu001", "gpu002", "gpu003", "gpu010", "login1"]
    assert expand_hostlist("None assigned") == []


def test_sacct_json_node_fail_jobs_give_one_event_per_node_at_the_job_end():
    # The shape `sacct --json` prints (Slurm 22.05: state.current a string; 23.x: a list, and
    # times as {"set", "number"}); other job states are not failures.
    document = {
        "jobs": [
            {
                "job_id": 7,
                "state": {"current": "NODE_FAIL"},
                "nodes": "gpu[001-002]",
                "time": {"end": int(T.timestamp())},
            },
            {"job_id": 8, "state": {"current": ["COMPLETED"]}, "nodes": "gpu003", "time": {"end": int(T.timestamp())}},
            {
                "job_id": 9,
                "state": {"current": ["NODE_FAIL"]},
                "nodes": "gpu004",
                "time": {"end": {"set": True, "number": int(T.timestamp())}},
            },
        ]
    }
    events = sacct_node_failures(document, cluster="c", where="sacct")
    assert events.select("node", "ref").rows() == [("gpu001", "job:7"), ("gpu002", "job:7"), ("gpu004", "job:9")]
    assert set(events["ts"]) == {T} and set(events["source"]) == {"slurm"}
    with pytest.raises(InputError, match="out.json: no 'jobs' list"):
        sacct_node_failures({"nodes": []}, cluster="c", where="out.json")


def test_jobcomp_lines_of_node_fail_jobs_are_events_and_a_broken_one_is_named():
    text = (
        "JobId=3 UserId=root(0) JobState=COMPLETED EndTime=2026-11-20T11:00:00 NodeList=gpu001\n"
        "JobId=4 UserId=root(0) JobState=NODE_FAIL StartTime=2026-11-20T10:00:00 EndTime=2026-11-20T12:00:00 NodeList=gpu[005-006]\n"
    )
    events = jobcomp_node_failures(text, cluster="c", where="jobcomp.txt")
    assert events.select("ts", "node", "ref").rows() == [(T, "gpu005", "job:4"), (T, "gpu006", "job:4")]
    with pytest.raises(InputError, match="jobcomp.txt line 1: no EndTime"):
        jobcomp_node_failures("JobId=5 JobState=NODE_FAIL NodeList=gpu001\n", cluster="c", where="jobcomp.txt")


def test_down_nodes_are_failures_and_drains_are_not():
    stamp = int(T.timestamp())
    document = {
        "nodes": [
            {"name": "gpu001", "state": "down", "state_flags": [], "reason": "Xid 79", "reason_changed_at": stamp},
            {
                "name": "gpu002",
                "state": "idle",
                "state_flags": ["DRAIN"],
                "reason": "maintenance",
                "reason_changed_at": stamp,
            },
            {
                "name": "gpu003",
                "state": "down",
                "state_flags": ["DRAIN"],
                "reason": "gpufail: drain_now",
                "reason_changed_at": stamp,
            },
            {"name": "gpu004", "state": "idle", "state_flags": [], "reason": "", "reason_changed_at": 0},
        ]
    }
    events = slurm_down_nodes(document, cluster="c", where="sinfo")
    assert events.select("ts", "node", "reason").rows() == [(T, "gpu001", "node DOWN: Xid 79")]


def test_not_ready_kubernetes_nodes_are_read_through_the_api_from_their_transition():
    def node(status: str, since: str) -> dict:
        return {
            "status": {
                "conditions": [
                    {"type": "Ready", "status": status, "reason": "KubeletNotReady", "lastTransitionTime": since}
                ]
            }
        }

    nodes = {
        "gpu001": node("False", "2026-11-20T12:00:00Z"),
        "gpu002": node("True", "2026-11-20T11:00:00Z"),
        "gpu003": node("Unknown", "2026-11-20T12:00:00Z"),
    }
    with node_api(nodes) as (core, _):
        events = kubernetes_failure_events(core, cluster="c")
    assert sorted(events.select("node", "ts", "source").rows()) == [
        ("gpu001", T, "kubernetes"),
        ("gpu003", T, "kubernetes"),
    ]
    assert set(events["reason"]) == {"KubeletNotReady"}


def test_an_event_read_twice_is_stored_once(tmp_path: Path):
    store = Store.create(str(tmp_path / "d"))
    events = event_frame([{"ts": T, "cluster": "c", "node": "gpu001", "source": "kubernetes", "ref": "node"}])
    assert write_failure_events(store, events) == 1
    assert write_failure_events(store, events) == 0
    assert store.read("failure_events").num_rows == 1


def test_gpufail_ingest_kubernetes_reads_the_cluster_of_a_kubeconfig(tmp_path: Path):
    from tests.cli import gpufail

    nodes = {
        "gpu001": {
            "status": {
                "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": "2026-11-20T12:00:00Z"}]
            }
        }
    }
    with node_api(nodes) as (core, _):
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: t\n"
            f"clusters: [{{name: t, cluster: {{server: '{core.api_client.configuration.host}'}}}}]\n"
            "users: [{name: t, user: {}}]\ncontexts: [{name: t, context: {cluster: t, user: t}}]\n"
        )
        root = str(tmp_path / "d")
        first = gpufail("ingest", "kubernetes", "--data", root, "--kubeconfig", str(kubeconfig))
        again = gpufail("ingest", "kubernetes", "--data", root, "--kubeconfig", str(kubeconfig))
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("kubernetes: 1 nodes not Ready; 1 new failure events stored")
    assert "0 new failure events stored, 1 stored already" in again.stdout
    missing = gpufail("ingest", "kubernetes", "--data", root, "--kubeconfig", str(tmp_path / "none"))
    assert missing.returncode == 2 and "kubernetes: no usable configuration" in missing.stderr
