import hashlib
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from ingest.errors import InputError
from serving.publish import AUDIT_SCHEMA, append_audit, decide_actions, read_audit

NOW = pd.Timestamp("2026-01-05T12:00Z")


def fleet(node_gpu_risks: dict[str, list[float]]) -> pd.DataFrame:
    rows = [
        ("c1", node, i, f"{node}-gpu{i}", risk)
        for node, risks in node_gpu_risks.items()
        for i, risk in enumerate(risks)
    ]
    frame = pd.DataFrame(rows, columns=["cluster", "node", "gpu_index", "gpu_uuid", "risk"])
    frame["model_version"] = "lightgbm-test"
    return frame


def ten_nodes_five_risky() -> pd.DataFrame:
    risky = {f"n{i}": [r, 0.01] for i, r in enumerate([0.9, 0.85, 0.8, 0.75, 0.7])}
    calm = {f"n{i}": [0.01, 0.01] for i in range(5, 10)}
    return fleet({**risky, **calm})


def test_circuit_breaker_drains_only_up_to_the_limit():
    decisions = decide_actions(
        ten_nodes_five_risky(), risk_threshold=0.5, max_nodes_fraction=0.2, total_nodes=10, now=NOW
    )
    actions = Counter(d.action for d in decisions)
    assert actions == {"drain": 2, "breaker_held": 3, "none": 5}
    by_node = {d.node: d for d in decisions}
    assert {n for n, d in by_node.items() if d.action == "drain"} == {"n0", "n1"}  # the riskiest
    assert {n for n, d in by_node.items() if d.action == "breaker_held"} == {"n2", "n3", "n4"}
    held = by_node["n3"]
    assert "circuit breaker" in held.reason and "at most 2" in held.reason and "20% of 10 nodes" in held.reason
    assert held.gpus == ("n3-gpu0",)
    assert all(d.dry_run for d in decisions)
    assert all(d.reason.startswith("dry-run") for d in decisions if d.action != "none")
    assert all(d.time == NOW and d.model_version == "lightgbm-test" for d in decisions)
    assert [d.risk for d in decisions] == sorted((d.risk for d in decisions), reverse=True)


def test_limit_can_be_zero_and_then_every_drain_is_held():
    decisions = decide_actions(ten_nodes_five_risky(), risk_threshold=0.5, max_nodes_fraction=0.05, total_nodes=10)
    assert Counter(d.action for d in decisions)["breaker_held"] == 5


def test_total_nodes_counts_nodes_not_in_the_predictions():
    decisions = decide_actions(ten_nodes_five_risky(), risk_threshold=0.5, max_nodes_fraction=0.2, total_nodes=25)
    assert Counter(d.action for d in decisions)["drain"] == 5  # limit 5 of 25


def test_watch_uses_node_risk_from_several_moderate_gpus():
    # No GPU is over the drain threshold 0.5, but the node is: 1 - 0.7**2 = 0.51.
    decisions = decide_actions(
        fleet({"a": [0.3, 0.3], "b": [0.2, 0.1], "c": [0.01]}),
        risk_threshold=0.5,
        max_nodes_fraction=1.0,
        total_nodes=3,
    )
    assert [(d.node, d.action) for d in decisions] == [("a", "drain"), ("b", "watch"), ("c", "none")]
    assert decisions[0].gpus == ("a-gpu0", "a-gpu1")
    assert decisions[1].gpus == ("b-gpu0",)  # none at the watch threshold: the riskiest
    assert decisions[2].gpus == ()


def test_bad_arguments_are_refused():
    predictions = ten_nodes_five_risky()
    with pytest.raises(InputError, match="total_nodes"):
        decide_actions(predictions, risk_threshold=0.5, max_nodes_fraction=0.2, total_nodes=3)
    with pytest.raises(InputError, match="dry_run"):
        decide_actions(predictions, risk_threshold=0.5, max_nodes_fraction=0.2, total_nodes=10, dry_run=False)
    with pytest.raises(InputError, match="max_nodes_fraction"):
        decide_actions(predictions, risk_threshold=0.5, max_nodes_fraction=0.0, total_nodes=10)


def test_audit_appends_a_new_file_per_call_and_never_touches_old_ones(tmp_path):
    root = tmp_path / "actions"
    first = decide_actions(ten_nodes_five_risky(), risk_threshold=0.5, max_nodes_fraction=0.2, total_nodes=10, now=NOW)
    path1 = append_audit(first, str(root))
    digest = hashlib.sha256(Path(path1).read_bytes()).hexdigest()
    second = decide_actions(
        ten_nodes_five_risky(), risk_threshold=0.5, max_nodes_fraction=0.2, total_nodes=10, now=NOW + pd.Timedelta("1h")
    )
    path2 = append_audit(second, str(root))
    assert path1 != path2
    files = sorted(p for p in root.rglob("*") if p.is_file())
    assert [str(p) for p in files] == sorted([path1, path2])  # no temporary files left behind
    assert hashlib.sha256(Path(path1).read_bytes()).hexdigest() == digest
    log = read_audit(str(root))
    assert list(log.columns) == AUDIT_SCHEMA.names
    assert len(log) == 20 and log["dry_run"].all()
    assert log["time"].tolist() == [NOW] * 10 + [NOW + pd.Timedelta("1h")] * 10
    assert log.loc[0, "gpus"].tolist() == ["n0-gpu0"] and log.loc[0, "action"] == "drain"
    assert append_audit([], str(root)) is None
