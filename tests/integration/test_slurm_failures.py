"""Failures the real Slurm controller saw become labels: a job that ends NODE_FAIL on a node set
DOWN, read by `gpufail ingest slurm` from the job-completion record (the test cluster has no
accounting database for sacct) and `sinfo --json`."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa

from ingest.store import Store
from tests.cli import gpufail
from tests.conftest import make_rows
from tests.integration.slurm_cluster import SlurmCluster


def telemetry(nodes: list[str], end: datetime) -> pa.Table:
    """Two GPUs per node, one sample every 10 minutes over the two days before `end`."""
    start = end.replace(minute=0, second=0, microsecond=0) - timedelta(days=2)
    times = [start + timedelta(minutes=10 * i) for i in range(int((end - start) / timedelta(minutes=10)) + 1)]
    tables = []
    for node in nodes:
        for index in range(2):
            tables.append(
                make_rows(
                    "telemetry",
                    times,
                    cluster="default",
                    node=node,
                    gpu_index=index,
                    gpu_uuid=f"GPU-{node}-{index}",
                    temp_gpu_c=50.0,
                )
            )
    return pa.concat_tables(tables)


def wait_for(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_a_node_fail_job_and_a_down_node_label_their_gpus_and_gpufails_own_drain_does_not(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    job = slurm.run(
        "sbatch", "--parsable", "-N1", "-w", "gpu005", "--output", str(tmp_path / "job.out"), "--wrap", "sleep 300"
    ).stdout.strip()
    wait_for(lambda: slurm.jobs().get(job, {}).get("job_state") == "RUNNING")
    # Its job ends NODE_FAIL; the node's slurmd, alive, registers again and the node returns
    # (ReturnToService=2). A node with no job set DOWN stays down with its reason.
    slurm.scontrol("update", "NodeName=gpu005", "State=DOWN", "Reason=Xid 79 on the node")
    wait_for(lambda: f"JobId={job} " in slurm.jobcomp.read_text() if slurm.jobcomp.exists() else False)
    # The return is asynchronous (the next registration of its slurmd): wait for it, or on a
    # loaded machine the import can still see gpu005 down.
    wait_for(lambda: slurm.node_states()["gpu005"]["state"] != "down", timeout=120)
    slurm.scontrol("update", "NodeName=gpu007", "State=DOWN", "Reason=GPU fell off the bus")
    slurm.scontrol("update", "NodeName=gpu006", "State=DRAIN", "Reason=gpufail: drain_now (risk 0.9)")

    root = tmp_path / "data"
    Store.create(str(root)).write("telemetry", telemetry(["gpu005", "gpu006", "gpu007"], datetime.now(UTC)))
    env = {"SLURM_CONF": str(slurm.conf)}
    imported = gpufail("ingest", "slurm", "--data", str(root), "--jobcomp", str(slurm.jobcomp), env=env)
    assert imported.returncode == 0, imported.stderr
    assert "1 NODE_FAIL job-node ends and 1 down nodes; 2 new failure events stored" in imported.stdout
    again = gpufail("ingest", "slurm", "--data", str(root), "--jobcomp", str(slurm.jobcomp), env=env)
    assert "0 new failure events stored, 2 stored already" in again.stdout, again.stdout + again.stderr

    events = Store.open(str(root)).read("failure_events").to_pylist()
    assert {(e["node"], e["source"], e["ref"]) for e in events} == {
        ("gpu005", "slurm", f"job:{job}"),
        ("gpu007", "slurm", "node"),
    }
    assert any("GPU fell off the bus" in (e["reason"] or "") for e in events)

    built = gpufail("features", "--data", str(root), "--quiet")
    assert built.returncode == 0, built.stderr
    assert "positive from the scheduler (Slurm)" in built.stdout
    from features.dataset import read_features

    features = read_features(Store.open(str(root)))
    positive = features.filter(features["label"] == 1)
    assert set(positive["gpu_uuid"]) == {"GPU-gpu005-0", "GPU-gpu005-1", "GPU-gpu007-0", "GPU-gpu007-1"}


def test_without_accounting_sacct_is_refused_with_the_way_out(slurm: SlurmCluster, tmp_path: Path) -> None:
    result = gpufail("ingest", "slurm", "--data", str(tmp_path / "d"), env={"SLURM_CONF": str(slurm.conf)})
    assert result.returncode == 2
    assert "sacct --json" in result.stderr and "--jobcomp FILE" in result.stderr
    assert "Traceback" not in result.stderr
