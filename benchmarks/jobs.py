"""Benchmark of the job map and the cost policy on a large fleet (issue 29's target: reading the
job map of 4,000 nodes and 20,000 jobs and deciding takes under 5 s).

    python -m benchmarks.jobs [--nodes 4000] [--jobs 20000] [--repeat 3] [--json FILE]

Builds `squeue --json` text as Slurm 22.05 prints it (every field of a job record, indented as
squeue indents it; the record is the one of tests/fixtures/slurm/squeue-22.05.json) for a
fleet of `--nodes` nodes of 8 GPUs: large gang jobs over half the nodes (64 to 512 nodes each)
and `--jobs` in all, the rest small (8 one-GPU jobs and 2 without a GPU per node) packed onto
the other half; and predictions for every GPU. Then times, best of `--repeat`:

- `parse`: the text to a `JobMap` (`serving.jobs.slurm_job_map`);
- `loads`: blast radius and work at risk per node (`node_loads`);
- `inputs`: the policy's input per node from the predictions (`serving.publish.node_inputs`);
- `decide`: the cost policy over every node (`serving.cost_policy.decide`), with placement
  levels and the standby choice (`serving.placement`);
- `total`: all of it, as one `gpufail publish` run does between the scheduler's answer and
  the first change it sends; and `kubernetes`: the same jobs as a pod list read into a job map
  (`serving.jobs.kubernetes_job_map`) and decided.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import numpy as np

GPUS_PER_NODE = 8
TARGET_S = 5.0
NOW = datetime(2026, 11, 26, 12, tzinfo=UTC)


def _record(job_id: int, nodes: list[str], gpus: int, start: int, limit: int | None, comment: str) -> dict[str, Any]:
    """A job record with every field 22.05's `squeue --json` prints (values as it prints them)."""
    host = nodes[0]
    hostlist = ",".join(nodes)
    return {
        "account": "",
        "accrue_time": start - 60,
        "admin_comment": "",
        "array_job_id": 0,
        "array_task_id": None,
        "array_max_tasks": 0,
        "array_task_string": "",
        "association_id": 0,
        "batch_features": "",
        "batch_flag": True,
        "batch_host": host,
        "flags": ["JOB_WAS_RUNNING"],
        "burst_buffer": "",
        "burst_buffer_state": "",
        "cluster": "fleet",
        "cluster_features": "",
        "command": "/shared/jobs/train.sh",
        "comment": comment,
        "container": "",
        "contiguous": False,
        "core_spec": None,
        "thread_spec": None,
        "cores_per_socket": None,
        "billable_tres": float(len(nodes)),
        "cpus_per_task": None,
        "cpu_frequency_minimum": None,
        "cpu_frequency_maximum": None,
        "cpu_frequency_governor": None,
        "cpus_per_tres": "",
        "deadline": 0,
        "delay_boot": 0,
        "dependency": "",
        "derived_exit_code": 0,
        "eligible_time": start - 60,
        "end_time": start + (limit or 525600) * 60,
        "excluded_nodes": "",
        "exit_code": 0,
        "features": "",
        "federation_origin": "",
        "federation_siblings_active": "",
        "federation_siblings_viable": "",
        "gres_detail": [f"gpu:h100:{gpus}(IDX:0-{gpus - 1})" if gpus else "gpu:h100:0(IDX:N/A)" for _ in nodes],
        "group_id": 1000,
        "group_name": "ml",
        "job_id": job_id,
        "job_resources": {
            "nodes": hostlist,
            "allocated_hosts": len(nodes),
            "allocated_nodes": [
                {
                    "sockets": {"0": {"cores": {"0": "allocated"}}},
                    "nodename": n,
                    "cpus_used": 0,
                    "memory_used": 0,
                    "memory_allocated": 64000,
                }
                for n in nodes
            ],
        },
        "job_state": "RUNNING",
        "last_sched_evaluation": start,
        "licenses": "",
        "max_cpus": 0,
        "max_nodes": 0,
        "mcs_label": "",
        "memory_per_tres": "",
        "name": f"job-{job_id}",
        "nodes": hostlist,
        "nice": None,
        "tasks_per_core": None,
        "tasks_per_node": 0,
        "tasks_per_socket": None,
        "tasks_per_board": 0,
        "cpus": len(nodes),
        "node_count": len(nodes),
        "tasks": len(nodes),
        "het_job_id": 0,
        "het_job_id_set": "",
        "het_job_offset": 0,
        "partition": "gpu",
        "prefer": "",
        "memory_per_node": None,
        "memory_per_cpu": None,
        "minimum_cpus_per_node": 1,
        "minimum_tmp_disk_per_node": 0,
        "preempt_time": 0,
        "pre_sus_time": 0,
        "priority": 4294901752,
        "profile": None,
        "qos": "",
        "reboot": False,
        "required_nodes": "",
        "requeue": True,
        "resize_time": 0,
        "restart_cnt": 0,
        "resv_name": "",
        "shared": None,
        "show_flags": ["SHOW_ALL", "SHOW_DETAIL", "SHOW_LOCAL"],
        "sockets_per_board": 0,
        "sockets_per_node": None,
        "start_time": start,
        "state_description": "",
        "state_reason": "None",
        "standard_error": "",
        "standard_input": "/dev/null",
        "standard_output": f"/shared/logs/{job_id}.out",
        "submit_time": start - 60,
        "suspend_time": 0,
        "system_comment": "",
        "time_limit": limit,
        "time_minimum": 0,
        "threads_per_core": None,
        "tres_bind": "",
        "tres_freq": "",
        "tres_per_job": "",
        "tres_per_node": f"gres:gpu:h100:{gpus}" if gpus else "",
        "tres_per_socket": "",
        "tres_per_task": "",
        "tres_req_str": f"cpu={len(nodes)},node={len(nodes)},billing={len(nodes)}",
        "tres_alloc_str": f"cpu={len(nodes)},node={len(nodes)},billing={len(nodes)}",
        "user_id": 1000 + job_id % 50,
        "user_name": f"user{job_id % 50}",
        "wckey": "",
        "current_working_directory": "/shared/jobs",
    }


def fleet_jobs(nodes: int, jobs: int, seed: int = 0) -> tuple[list[str], list[dict[str, Any]]]:
    """Node names and job records: gang jobs over the first half of the nodes, small jobs packed
    onto the second half (8 one-GPU jobs and 2 CPU-only ones per node)."""
    rng = np.random.default_rng(seed)
    names = [f"gpu{i:05d}" for i in range(nodes)]
    now = int(NOW.timestamp())
    records: list[dict[str, Any]] = []
    at = 0
    half = nodes // 2
    while at < half:
        size = int(min(rng.choice([64, 128, 256, 512]), half - at))
        start = now - int(rng.integers(600, 3 * 86400))
        checkpoint = datetime.fromtimestamp(now - int(rng.integers(60, 7200)), UTC)
        comment = f"gpufail_checkpoint={checkpoint:%Y-%m-%dT%H:%M:%SZ}" if rng.random() < 0.7 else ""
        records.append(_record(len(records) + 1, names[at : at + size], 8, start, None, comment))
        at += size
    small = max(jobs - len(records), 0)
    rest = names[half:]
    for k in range(small):
        node = rest[(k // 10) % len(rest)]
        gpus = 0 if k % 10 >= 8 else 1
        start = now - int(rng.integers(60, 86400))
        limit = int(rng.choice([60, 240, 1440]))
        records.append(_record(len(records) + 1, [node], gpus, start, limit, ""))
    return names, records


def squeue_text(records: list[dict[str, Any]]) -> str:
    return json.dumps(
        {
            "meta": {"plugin": {"type": "openapi/v0.0.38", "name": "Slurm OpenAPI v0.0.38"}},
            "errors": [],
            "jobs": records,
        },
        indent=2,
    )


def as_pods(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same jobs as the pod list of the Kubernetes API (one pod per node of a job)."""
    pods = []
    for r in records:
        for i, node in enumerate(r["job_resources"]["nodes"].split(",")):
            gpus = int(r["gres_detail"][i].split(":")[2].split("(")[0])
            started = datetime.fromtimestamp(r["start_time"], UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            pods.append(
                {
                    "metadata": {
                        "name": f"job-{r['job_id']}-{i}",
                        "namespace": "ml",
                        "ownerReferences": [{"kind": "PyTorchJob", "name": f"job-{r['job_id']}", "controller": True}],
                        "annotations": {},
                        "labels": {},
                    },
                    "spec": {
                        "nodeName": node,
                        "containers": [{"name": "t", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
                    },
                    "status": {"phase": "Running", "startTime": started},
                }
            )
    return pods


def predictions(names: list[str], seed: int = 0) -> Any:
    import pandas as pd

    rng = np.random.default_rng(seed)
    n = len(names) * GPUS_PER_NODE
    risk = np.minimum(rng.beta(0.3, 30.0, n), 1.0)
    return pd.DataFrame(
        {
            "cluster": "fleet",
            "node": np.repeat(names, GPUS_PER_NODE),
            "gpu_index": np.tile(np.arange(GPUS_PER_NODE), len(names)),
            "gpu_uuid": [f"GPU-{i:08d}" for i in range(n)],
            "risk": risk,
            "model_version": "bench",
        }
    )


def run(nodes: int, jobs: int, repeat: int) -> dict[str, Any]:
    from serving.cost_policy import CostConfig
    from serving.cost_policy import decide as cost_decide
    from serving.jobs import kubernetes_job_map, node_loads, slurm_job_map
    from serving.placement import placement_levels, standby_nodes
    from serving.policy import PolicyConfig, PolicyState, Tier
    from serving.publish import node_inputs

    config = PolicyConfig(
        tiers=(
            Tier("watch", 0.2, 0.1),
            Tier("avoid", 0.35, 0.25),
            Tier("drain_after_job", 0.5, 0.35),
            Tier("drain_now", 0.8, 0.6),
        ),
        breaker_max_fraction=0.05,
    )
    cost = CostConfig(horizon=timedelta(hours=24))
    names, records = fleet_jobs(nodes, jobs)
    text = squeue_text(records)
    pods = as_pods(records)
    frame = predictions(names)
    gpus = dict.fromkeys(names, GPUS_PER_NODE)
    times: dict[str, list[float]] = {}

    def timed(name: str, call: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = call()
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    summary: dict[str, Any] = {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        job_map = timed("parse", lambda: slurm_job_map(text))
        loads = timed("loads", partial(node_loads, job_map, NOW, cost.checkpoint_interval))
        inputs = timed("inputs", lambda: node_inputs(frame, flag_threshold=0.2))

        def decide_all(job_map: Any = job_map, inputs: Any = inputs, loads: Any = loads) -> Any:
            out = cost_decide(inputs, job_map, gpus, cost, PolicyState(), {}, config, NOW)
            tiers = {key: s.tier for key, s in out.state.nodes.items()}
            placement_levels(inputs, 10, config)
            standby_nodes(inputs, loads, tiers, 32)
            return out

        outcome = timed("decide", decide_all)
        times.setdefault("total", []).append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        pod_map = kubernetes_job_map(pods)
        cost_decide(inputs, pod_map, gpus, cost, PolicyState(), {}, config, NOW)
        times.setdefault("kubernetes", []).append(time.perf_counter() - t1)
        summary = {
            "jobs": len(job_map.jobs),
            "busy_nodes": len(loads),
            "options": {
                o: sum(1 for c in outcome.decisions if c.option == o)
                for o in ("none", "checkpoint", "avoid", "drain_after_job", "drain_now")
            },
            "hints": len(outcome.hints),
        }
    return {
        "nodes": nodes,
        "gpus": nodes * GPUS_PER_NODE,
        "squeue_json_mb": round(len(text) / 1e6, 1),
        "pods": len(pods),
        **summary,
        "seconds": {k: round(min(v), 3) for k, v in times.items()},
        "target_s": TARGET_S,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4000)
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", dest="json_path", default="")
    args = parser.parse_args(argv)
    result = run(args.nodes, args.jobs, args.repeat)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_path:
        with open(args.json_path, "w") as fh:
            fh.write(text + "\n")
    return 0 if result["seconds"]["total"] < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
