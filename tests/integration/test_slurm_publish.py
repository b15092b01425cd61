"""The Slurm publisher and the action policy against a real slurmctld with 16 virtual GPU
nodes (Debian's Slurm 22.05, started by the `slurm` fixture)."""

from datetime import UTC, datetime, timedelta

import pandas as pd
import pyarrow as pa
from click.testing import CliRunner

from gpufail.cli import cli
from ingest.store import Store
from serving.policy import PolicyConfig, PolicyState
from serving.publish import publish
from serving.publishers.slurm import MemoryLedger, SlurmPublisher
from serving.score import PREDICTION_SCHEMA
from tests.tiers import FOUR_TIERS

T0 = datetime(2026, 1, 5, 12, tzinfo=UTC)
H = timedelta(hours=1)
CONFIG = PolicyConfig(
    tiers=FOUR_TIERS,
    recovery_period=6 * H,
    breaker_max_nodes=2,
    breaker_max_fraction=0.05,
)


def predictions(node_risk: dict[str, float], nodes: list[str]) -> pd.DataFrame:
    """One GPU per node at the given risk (the rest of the 16 at 0.01)."""
    rows = [("slurm", n, 0, f"{n}-gpu0", node_risk.get(n, 0.01)) for n in nodes]
    frame = pd.DataFrame(rows, columns=["cluster", "node", "gpu_index", "gpu_uuid", "risk"])
    frame["ts"] = pd.Timestamp(T0)
    frame["rank"] = frame["risk"].rank(ascending=False, method="first").astype("int64")
    frame["node_risk"] = frame["risk"]
    frame["model_kind"] = "lightgbm"
    frame["model_version"] = "lightgbm-test"
    return frame[list(PREDICTION_SCHEMA.names)]


def publisher(slurm, **overrides) -> SlurmPublisher:
    return SlurmPublisher(**{"slurm_conf": str(slurm.conf), "attempts": 2, "backoff": 0.05, **overrides})


def flags(slurm, node):
    return slurm.node_states()[node]["state_flags"]


def test_a_risky_node_is_drained_with_our_reason_and_a_moderate_one_avoided(slurm):
    out = publish(
        predictions({"gpu003": 0.6, "gpu004": 0.4}, slurm.nodes),
        publisher(slurm),
        CONFIG,
        PolicyState(),
        mode="live",
        now=T0,
    )
    states = slurm.node_states()
    assert states["gpu003"]["state_flags"] == ["DRAIN"]
    assert states["gpu003"]["reason"] == "gpufail: drain-after-job risk=0.60 model=lightgbm-test"
    assert states["gpu004"]["weight"] == 100_000 and not states["gpu004"]["state_flags"]
    assert all(not s["state_flags"] and s["weight"] == 1 for n, s in states.items() if n not in ("gpu003", "gpu004"))
    rows = {r.node: r for r in out.rows}
    assert rows["gpu003"].result == "drained, weight 1 -> 100000" and rows["gpu004"].result == "weight 1 -> 100000"
    assert out.state.nodes["slurm/gpu004"].saved == {"weight": 1}


def test_an_operator_drained_node_is_left_alone(slurm):
    slurm.scontrol("update", "NodeName=gpu005", "State=DRAIN", "Reason=bad fan, ticket 123")
    out = publish(
        predictions({"gpu005": 0.95}, slurm.nodes), publisher(slurm), CONFIG, PolicyState(), mode="live", now=T0
    )
    row = next(r for r in out.rows if r.node == "gpu005")
    assert row.action == "skip" and "bad fan, ticket 123" in row.reason and "not ours" in row.reason
    assert slurm.node_states()["gpu005"]["reason"] == "bad fan, ticket 123"
    # Recovery later must not resume it either.
    later = publish(predictions({}, slurm.nodes), publisher(slurm), CONFIG, out.state, mode="live", now=T0 + 30 * H)
    assert slurm.node_states()["gpu005"]["state_flags"] == ["DRAIN"]
    assert next(r for r in later.rows if r.node == "gpu005").result == "skipped"


def test_a_down_node_is_never_touched(slurm):
    slurm.scontrol("update", "NodeName=gpu006", "State=DOWN", "Reason=cable")
    out = publish(
        predictions({"gpu006": 0.95}, slurm.nodes), publisher(slurm), CONFIG, PolicyState(), mode="live", now=T0
    )
    assert next(r for r in out.rows if r.node == "gpu006").action == "skip"
    assert slurm.node_states()["gpu006"]["reason"] == "cable"


def test_recovery_resumes_only_our_drains_and_restores_the_weight(slurm):
    ledger = MemoryLedger()  # what gpufail set, kept across the runs as the CLI keeps it in the store
    state = publish(
        predictions({"gpu007": 0.6, "gpu008": 0.4}, slurm.nodes),
        publisher(slurm, ledger=ledger),
        CONFIG,
        PolicyState(),
        mode="live",
        now=T0,
    ).state
    # An operator takes gpu008 over after we raised its weight: they set their own weight.
    slurm.scontrol("update", "NodeName=gpu008", "Weight=5")
    calm = predictions({}, slurm.nodes)
    state = publish(calm, publisher(slurm, ledger=ledger), CONFIG, state, mode="live", now=T0 + H).state
    assert flags(slurm, "gpu007") == ["DRAIN"]  # below exit, but not for the recovery period yet
    out = publish(calm, publisher(slurm, ledger=ledger), CONFIG, state, mode="live", now=T0 + 8 * H)
    rows = {r.node: r for r in out.rows}
    assert rows["gpu007"].action == "lower" and rows["gpu007"].result == "resumed, weight restored to 1"
    assert "changed by someone else" in rows["gpu008"].result
    slurm.wait_idle()  # right after a resume a node shows idle* briefly
    states = slurm.node_states()
    assert states["gpu007"]["state_flags"] == [] and states["gpu008"]["weight"] == 5


def test_an_xid_flood_across_40_percent_of_nodes_trips_the_breaker(slurm):
    flooded = {n: 0.9 for n in slurm.nodes[:7]}  # 7 of 16 nodes
    out = publish(predictions(flooded, slurm.nodes), publisher(slurm), CONFIG, PolicyState(), mode="live", now=T0)
    drained = [n for n, s in slurm.node_states().items() if s["state_flags"]]
    assert len(drained) == 2 and out.state.breaker.tripped
    assert sum(r.action == "breaker_held" for r in out.rows) == 5
    # The next runs, even after the window, drain nothing more until the breaker is reset.
    later = publish(
        predictions(flooded, slurm.nodes), publisher(slurm), CONFIG, out.state, mode="live", now=T0 + 30 * H
    )
    assert [n for n, s in slurm.node_states().items() if s["state_flags"]] == drained
    assert sum(r.action == "breaker_held" for r in later.rows) == 5


def test_a_restarted_publisher_neither_drains_again_nor_forgets(slurm, tmp_path, monkeypatch):
    store = Store.create(str(tmp_path / "data"))
    store.write_owned(
        "predictions", T0.date(), pa.Table.from_pandas(predictions({"gpu009": 0.9}, slurm.nodes), preserve_index=False)
    )
    monkeypatch.setenv("GPUFAIL_PUBLISH__SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv("GPUFAIL_PUBLISH__BACKOFF", "0.05s")
    args = ["publish", "--data", str(tmp_path / "data"), "--to", "slurm", "--no-dry-run"]
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0, first.output
    assert "gpu009" in first.output and "drained" in first.output
    reason = slurm.node_states()["gpu009"]["reason"]
    # An operator edits nothing; the publisher process restarts (a new CLI run, state from the store).
    second = CliRunner().invoke(cli, args)
    assert second.exit_code == 0, second.output
    assert "1 keep" not in second.output and "drained" not in second.output.split("publish (")[0]
    assert slurm.node_states()["gpu009"]["reason"] == reason
    state = PolicyState.from_json(store.read_state("publish-slurm"))
    assert state.nodes["slurm/gpu009"].applied == "drain_now"
    audit = store.read_owned("actions").to_pandas()
    assert sorted(audit.loc[audit["node"] == "gpu009", "result"]) == ["drained, weight 1 -> 100000", "unchanged"]


def test_a_scheduler_that_is_down_is_retried_and_reported(slurm, tmp_path, monkeypatch):
    dead = tmp_path / "slurm.conf"
    text = slurm.conf.read_text()
    port_line = next(line for line in text.splitlines() if line.startswith("SlurmctldPort="))
    dead.write_text(text.replace(port_line, "SlurmctldPort=9"))  # nothing listens on port 9
    attempts = []
    down = publisher(slurm, slurm_conf=str(dead), timeout=20)
    original = down._run
    down._run = lambda *argv: attempts.append(argv) or original(*argv)  # count the tries
    out = publish(predictions({"gpu010": 0.9}, slurm.nodes), down, CONFIG, PolicyState(), mode="live", now=T0)
    assert len(attempts) == 2 and "no answer after 2 tries" in out.scheduler_error
    row = next(r for r in out.rows if r.node == "gpu010")
    assert (
        row.result.startswith("failed: slurm (sinfo): no answer") and out.state.nodes["slurm/gpu010"].applied == "none"
    )
    # The controller is back: the next run applies what was pending.
    out = publish(
        predictions({"gpu010": 0.9}, slurm.nodes), publisher(slurm), CONFIG, out.state, mode="live", now=T0 + H
    )
    assert flags(slurm, "gpu010") == ["DRAIN"]


def test_a_straggler_gets_the_avoid_weight_and_its_weight_back_once_back_to_speed(slurm):
    # The fail_slow alarm class: a node of low risk with a GPU 12% slower than its peers.
    from dataclasses import replace

    config = replace(CONFIG, fail_slow_threshold=0.05)
    slow = predictions({}, slurm.nodes)
    slow["fail_slow_score"] = [0.12 if n == "gpu006" else 0.0 for n in slow["node"]]
    out = publish(slow, publisher(slurm), config, PolicyState(), mode="live", now=T0)
    states = slurm.node_states()
    assert states["gpu006"]["weight"] == 100_000 and not states["gpu006"]["state_flags"]  # avoided, not drained
    assert all(s["weight"] == 1 for n, s in states.items() if n != "gpu006")
    row = next(r for r in out.rows if r.node == "gpu006")
    assert (row.action, row.tier, row.result) == ("raise", "avoid", "weight 1 -> 100000")
    assert row.reason.startswith("fail-slow: GPU gpu006-gpu0 runs 12.0% slower than its peers")
    recovered = slow.assign(fail_slow_score=0.0)
    held = publish(recovered, publisher(slurm), config, out.state, mode="live", now=T0 + H)
    assert next(r for r in held.rows if r.node == "gpu006").action == "keep"  # the recovery period runs
    later = publish(recovered, publisher(slurm), config, held.state, mode="live", now=T0 + 8 * H)
    assert next(r for r in later.rows if r.node == "gpu006").action == "lower"
    assert slurm.node_states()["gpu006"]["weight"] == 1
