"""Whose drain is it: `gpufail publish --to slurm` against the real slurmctld (the `slurm`
fixture). gpufail records what it set (node, exact reason, time) in the data root and checks it
against the node's current reason; an edited reason is the operator's, a drain of ours that the
state does not record is orphaned and reported until adopted or cleared. Then kill -9 at random
points of a live run, and a rerun: Slurm, the ledger, the state and the audit as after a clean
run."""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from click.testing import CliRunner

from gpufail.cli import cli
from ingest.store import Store
from serving.publish import read_audit
from tests.faults import kill_points
from tests.integration.test_slurm_publish import T0, predictions

SEED = 25
KILLS = 8
ENV = {
    "GPUFAIL_PUBLISH__BACKOFF": "0.05s",
    "GPUFAIL_PUBLISH__RECOVERY_PERIOD": "0s",
    "GPUFAIL_PUBLISH__COOLDOWN": "0s",
    "GPUFAIL_PUBLISH__BREAKER_MAX_NODES": "8",
}


@pytest.fixture
def env(slurm, monkeypatch) -> dict[str, str]:
    values = {**ENV, "GPUFAIL_PUBLISH__SLURM_CONF": str(slurm.conf)}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return values


def score(data: Path, node_risk: dict[str, float], nodes: list[str], hours: int = 0) -> None:
    """Predictions for the grid time T0 + hours, as `gpufail score` would leave them."""
    store = Store.open(str(data)) if (data / "gpufail.json").exists() else Store.create(str(data))
    frame = predictions(node_risk, nodes)
    frame["ts"] = pd.Timestamp(T0 + timedelta(hours=hours))
    store.write_owned(
        "predictions", (T0 + timedelta(hours=hours)).date(), pa.Table.from_pandas(frame, preserve_index=False)
    )


def publish(data: Path, *args: str):
    result = CliRunner().invoke(cli, ["publish", "--data", str(data), "--to", "slurm", "--no-dry-run", *args])
    assert result.exit_code == 0, result.output
    return result


def test_a_drain_whose_reason_an_operator_edited_is_theirs_and_never_resumed(slurm, env, tmp_path):
    data = tmp_path / "data"
    score(data, {"gpu011": 0.9}, slurm.nodes)
    publish(data)
    ours = slurm.node_states()["gpu011"]["reason"]
    assert ours.startswith("gpufail: drain-now")
    # The operator keeps the node out for an RMA and says so, keeping our prefix.
    edited = f"{ours} (kept for RMA ticket 77)"
    slurm.scontrol("update", "NodeName=gpu011", "State=DRAIN", f"Reason={edited}")
    score(data, {}, slurm.nodes, hours=1)  # the risk has fallen: the policy would resume the node
    result = publish(data)
    state = slurm.node_states()["gpu011"]
    assert state["state_flags"] == ["DRAIN"] and state["reason"] == edited
    assert f"gpu011: drain reason is now {edited!r}, not the {ours!r} gpufail set" in result.stderr
    row = read_audit(str(data / "actions")).iloc[-16:].set_index("node").loc["gpu011"]
    assert row["action"] == "skip" and "the operator's, not ours" in row["reason"]


def test_after_state_loss_our_drains_are_reported_orphaned_until_adopted(slurm, env, tmp_path):
    data = tmp_path / "data"
    score(data, {"gpu012": 0.9}, slurm.nodes)
    publish(data)
    reason = slurm.node_states()["gpu012"]["reason"]
    shutil.rmtree(data / "_state")  # the state is lost (a data root restored from an old backup)
    result = publish(data)
    assert f"gpu012: drained with {reason!r}, a gpufail reason that {data}: _state/publish-slurm-ledger.json" in (
        result.stderr
    )
    assert "`gpufail publish --to slurm --adopt gpu012`" in result.stderr
    assert slurm.node_states()["gpu012"]["reason"] == reason  # not touched
    # Nor drained again as if it were new: its one line in the summary is a skip, saying why.
    (line,) = [line for line in result.stdout.splitlines() if line.strip().startswith("gpu012")]
    assert "skip" in line and "(orphaned): not touched" in line, line
    adopted = publish(data, "--adopt", "gpu012")
    assert f"gpu012: adopted the drain {reason!r} as drain_now" in adopted.stdout
    ledger = json.loads((data / "_state" / "publish-slurm-ledger.json").read_text())
    assert ledger["drains"]["gpu012"]["reason"] == reason
    # Adopted, it is ours again: the next calm run resumes it, and nothing is reported.
    score(data, {}, slurm.nodes, hours=1)
    calm = publish(data)
    assert "orphaned" not in calm.stderr and "gpu012" in calm.stdout and "resumed" in calm.stdout
    slurm.wait_idle()


def test_adopting_a_node_that_is_not_drained_by_gpufail_is_refused(slurm, env, tmp_path):
    data = tmp_path / "data"
    score(data, {}, slurm.nodes)
    slurm.scontrol("update", "NodeName=gpu013", "State=DRAIN", "Reason=bad fan")
    result = CliRunner().invoke(cli, ["publish", "--data", str(data), "--to", "slurm", "--adopt", "gpu013"])
    assert result.exit_code != 0 and "expected a node drained with a 'gpufail:' reason" in str(result.exception)


def node_marks(slurm) -> dict[str, tuple]:
    return {n: (tuple(s["state_flags"]), s["reason"], s["weight"]) for n, s in slurm.node_states().items()}


def test_kill_9_of_a_live_slurm_publish_then_a_rerun_leaves_what_a_clean_run_leaves(slurm, env, tmp_path):
    risks = {"gpu014": 0.9, "gpu015": 0.6, "gpu016": 0.4}  # drain now, drain after job, avoid
    base = tmp_path / "base"
    score(base, risks, slurm.nodes)
    args = ["publish", "--data", "DATA", "--to", "slurm", "--no-dry-run", "--quiet"]

    def run(folder: Path, kill: kill_points.Kill | None = None) -> int:
        return kill_points.run([str(folder / "data") if a == "DATA" else a for a in args], kill=kill, env=env)[0]

    clean = shutil.copytree(base, tmp_path / "clean" / "data").parent
    assert run(clean) == 0
    expected_slurm = node_marks(slurm)
    expected_ledger = json.loads((clean / "data" / "_state" / "publish-slurm-ledger.json").read_text())
    expected_audit = read_audit(str(clean / "data" / "actions"))
    acted = sorted(
        expected_audit.loc[expected_audit["action"] != "keep", ["node", "tier", "result"]].itertuples(index=False)
    )
    assert len(acted) == 3
    slurm.reset_nodes()
    planned = shutil.copytree(base, tmp_path / "plan" / "data").parent
    kills = kill_points.plan([str(planned / "data") if a == "DATA" else a for a in args], KILLS, SEED, env=env)
    for i, kill in enumerate(kills):
        slurm.reset_nodes()
        folder = shutil.copytree(base, tmp_path / f"kill-{i}" / "data").parent
        assert run(folder, kill) == -9 or kill.after_s is not None, kill
        assert run(folder) == 0
        assert node_marks(slurm) == expected_slurm, kill
        ledger = json.loads((folder / "data" / "_state" / "publish-slurm-ledger.json").read_text())
        assert {n: d["reason"] for n, d in ledger["drains"].items()} == {
            n: d["reason"] for n, d in expected_ledger["drains"].items()
        } and ledger["weights"] == expected_ledger["weights"], kill
        audit = read_audit(str(folder / "data" / "actions"))
        changed = audit.loc[audit["action"] != "keep", ["node", "tier", "result"]]
        assert sorted(changed.itertuples(index=False)) == acted, kill
