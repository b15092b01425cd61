from datetime import UTC, datetime, timedelta

import pandas as pd
import pytest

from ingest.errors import InputError
from serving.policy import PolicyConfig, PolicyState
from serving.publish import AUDIT_SCHEMA, append_audit, publish, read_audit, state_name
from serving.publishers import Applied, NodeView, SchedulerUnavailable
from serving.publishers.log import LogPublisher
from tests.tiers import FOUR_TIERS

NOW = datetime(2026, 1, 5, 12, tzinfo=UTC)
CONFIG = PolicyConfig(
    tiers=FOUR_TIERS,
    breaker_max_nodes=10,
)


def fleet(node_gpu_risks):
    rows = [
        ("c1", node, i, f"{node}-gpu{i}", risk)
        for node, risks in node_gpu_risks.items()
        for i, risk in enumerate(risks)
    ]
    frame = pd.DataFrame(rows, columns=["cluster", "node", "gpu_index", "gpu_uuid", "risk"])
    frame["model_version"] = "lightgbm-test"
    return frame


class RecordingPublisher:
    """A scheduler stand-in that records changes; `down` makes every call fail like an unreachable one."""

    name = "fake"

    def __init__(self, views=None, down=False):
        self.views, self.down, self.changes = views or {}, down, []

    def observe(self, nodes):
        if self.down:
            raise SchedulerUnavailable("fake: no answer after 3 tries (connection refused)")
        return {n: self.views.get(n, NodeView()) for n in nodes}

    def apply(self, changes):
        self.changes.extend(changes)
        return [Applied(True, f"set {c.new}", {"mark": c.new}) for c in changes]


def test_live_publish_applies_changes_once_and_a_rerun_is_idempotent():
    predictions = fleet({"a": [0.6, 0.01], "b": [0.3, 0.01], "c": [0.01]})
    publisher = RecordingPublisher()
    out = publish(predictions, publisher, CONFIG, PolicyState(), mode="live", now=NOW)
    assert {(c.node, c.old, c.new) for c in publisher.changes} == {
        ("a", "none", "drain_after_job"),
        ("b", "none", "watch"),
    }
    change_a = next(c for c in publisher.changes if c.node == "a")
    assert change_a.gpus == ("a-gpu0",) and change_a.model_version == "lightgbm-test"
    assert out.state.nodes["c1/a"].applied == "drain_after_job" and out.state.nodes["c1/a"].saved == {
        "mark": "drain_after_job"
    }
    rows = {r.node: r for r in out.rows}
    assert rows["a"].result == "set drain_after_job" and rows["c"].result == "unchanged" and not rows["a"].dry_run
    publisher.changes.clear()
    again = publish(predictions, publisher, CONFIG, out.state, mode="live", now=NOW + timedelta(hours=1))
    assert publisher.changes == [] and {r.result for r in again.rows} == {"unchanged"}


def test_dry_run_changes_nothing_and_keeps_the_state():
    publisher = RecordingPublisher()
    out = publish(fleet({"a": [0.9]}), publisher, CONFIG, PolicyState(), mode="dry-run", now=NOW)
    assert publisher.changes == [] and out.state == PolicyState()
    assert out.rows[0].result == "dry-run: would set none -> drain_now" and out.rows[0].dry_run


def test_shadow_advances_its_own_state_without_touching_the_scheduler():
    publisher = RecordingPublisher()
    out = publish(fleet({"a": [0.9]}), publisher, CONFIG, PolicyState(), mode="shadow", now=NOW)
    assert publisher.changes == [] and out.state.nodes["c1/a"].applied == "drain_now"
    assert out.rows[0].result.startswith("shadow: would set")
    assert state_name("slurm", "shadow") == "publish-slurm-shadow" and state_name("slurm", "dry-run") == "publish-slurm"


def test_an_unreachable_scheduler_is_reported_and_retried_next_run():
    predictions = fleet({"a": [0.9]})
    out = publish(predictions, RecordingPublisher(down=True), CONFIG, PolicyState(), mode="live", now=NOW)
    assert "no answer after 3 tries" in out.scheduler_error
    assert out.rows[0].result.startswith("failed: fake: no answer") and out.rows[0].result.endswith("retried next run")
    assert out.state.nodes["c1/a"].tier == "drain_now" and out.state.nodes["c1/a"].applied == "none"
    up = RecordingPublisher()
    later = publish(predictions, up, CONFIG, out.state, mode="live", now=NOW + timedelta(hours=1))
    assert [(c.node, c.old, c.new) for c in up.changes] == [("a", "none", "drain_now")]
    assert later.state.nodes["c1/a"].applied == "drain_now"


def test_a_node_the_scheduler_says_is_not_ours_is_skipped():
    publisher = RecordingPublisher(views={"a": NodeView(unavailable="Slurm state down")})
    out = publish(fleet({"a": [0.9]}), publisher, CONFIG, PolicyState(), mode="live", now=NOW)
    assert publisher.changes == [] and out.rows[0].action == "skip" and out.rows[0].result == "skipped"


def test_log_publisher_records_and_audit_round_trips(tmp_path):
    out = publish(
        fleet({"a": [0.9], "b": [0.01]}),
        LogPublisher(),
        CONFIG,
        PolicyState(),
        mode="live",
        now=NOW,
        top_features={"a-gpu0": ["ecc_sbe_rate_24h", "xid_count_24h"]},
    )
    assert out.rows[0].result == "recorded: none -> drain-now (no scheduler)"
    path = append_audit(out.rows, str(tmp_path / "actions"))
    assert path is not None and "/actions/date=2026-01-05/part-" in path
    audit = read_audit(str(tmp_path / "actions"))
    assert list(audit.columns) == AUDIT_SCHEMA.names and len(audit) == 2
    first = audit.iloc[0]
    assert first["node"] == "a" and list(first["top_features"]) == ["ecc_sbe_rate_24h", "xid_count_24h"]
    assert first["tier"] == "drain_now" and first["target"] == "log" and first["mode"] == "live"
    assert append_audit([], str(tmp_path / "actions")) is None
    assert read_audit(str(tmp_path / "nothing" / "actions")).empty
    assert not list((tmp_path / "actions").rglob(".*"))


def test_unknown_mode_is_refused():
    with pytest.raises(InputError, match="mode: expected one of dry-run, shadow, live"):
        publish(fleet({"a": [0.9]}), LogPublisher(), CONFIG, PolicyState(), mode="yolo", now=NOW)


def test_stragglers_in_the_predictions_are_published_in_avoid_and_audited_as_fail_slow(tmp_path):
    from serving.publishers import alarm_class
    from serving.publishers.log import LogPublisher

    predictions = fleet({"a": [0.01, 0.01], "b": [0.02, 0.01], "c": [0.01]})
    predictions["fail_slow_score"] = [0.15, 0.0, 0.01, None, 0.02]  # a-gpu0 is a straggler
    config = PolicyConfig(tiers=FOUR_TIERS, breaker_max_nodes=10, fail_slow_threshold=0.05)
    publisher = RecordingPublisher()
    out = publish(predictions, publisher, config, PolicyState(), mode="live", now=NOW)
    assert [(c.node, c.old, c.new, c.alarm) for c in publisher.changes] == [("a", "none", "avoid", "fail_slow")]
    row = next(r for r in out.rows if r.node == "a")
    assert row.action == "raise" and row.tier == "avoid" and alarm_class(row.reason) == "fail_slow"
    assert "GPU a-gpu0 runs 15.0% slower" in row.reason
    assert {r.tier for r in out.rows if r.node != "a"} == {"none"}
    # The same rows through the log publisher's audit, as `gpufail publish` records them.
    logged = publish(predictions, LogPublisher(), config, PolicyState(), mode="live", now=NOW)
    append_audit(logged.rows, str(tmp_path / "actions"))
    audit = read_audit(str(tmp_path / "actions"))
    assert audit.loc[audit["node"] == "a", "reason"].str.startswith("fail-slow:").all()
