"""overlays/spool: the collector writes to its node's spool only, and a `ship` container beside
it moves the spool to the shared data root (docs/fleet-scale.md)."""

from __future__ import annotations

from pathlib import Path

from gpufail.cli import storage
from tests.deploy.kubectl import render

OVERLAY = Path(__file__).parents[2] / "deploy" / "kubernetes" / "overlays" / "spool"
SPOOL = "/var/lib/gpufail/spool"


def test_the_collector_writes_to_the_spool_and_a_shipper_moves_it_to_the_data_root() -> None:
    (daemonset,) = [d for d in render(OVERLAY) if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    collect, ship = containers["collect"], containers["ship"]
    mounts = {name: {m["name"]: m["mountPath"] for m in c["volumeMounts"]} for name, c in containers.items()}
    # The collector never touches the shared volume; the shipper reads the spool, writes the root.
    assert collect["args"] == ["collect", "--data", SPOOL] and "data" not in mounts["collect"]
    assert mounts["collect"]["spool"] == SPOOL == mounts["ship"]["spool"]
    assert mounts["ship"]["data"] == "/var/lib/gpufail/data"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["spool"]["hostPath"] == {"path": SPOOL, "type": "Directory"}  # survives the pod
    assert ship["image"] == collect["image"]
    assert ship["securityContext"]["readOnlyRootFilesystem"] and ship["securityContext"]["capabilities"] == {
        "drop": ["ALL"]
    }
    assert {"name": "GPUFAIL_COLLECT__NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in ship["env"]
    # Its arguments are the command's.
    context = storage.ship.make_context("ship", list(ship["args"][1:]))
    assert context.params["spool"] == SPOOL and context.params["every"] == "5m"
