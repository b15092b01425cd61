"""`serving.publish.publish` with the job-aware actions (docs/actions.md): the cost policy's
decisions and expected costs in the audit, checkpoint hints, placement levels and standbys, by
mode, and what happens when the job map cannot be read."""

from datetime import UTC, datetime, timedelta

import pandas as pd
import pytest

from ingest.errors import InputError
from serving.cost_policy import CostConfig
from serving.jobs import Job, JobMap, JobMapUnreadable
from serving.policy import PolicyConfig, PolicyState
from serving.publish import JobActions, append_audit, publish, read_audit
from serving.publishers import Applied, NodeView, SchedulerUnavailable
from serving.publishers.log import LogPublisher
from tests.tiers import FOUR_TIERS

NOW = datetime(2026, 11, 26, 12, tzinfo=UTC)
H = timedelta(hours=1)
CONFIG = PolicyConfig(
    tiers=FOUR_TIERS,
    breaker_max_nodes=10,
)
COST = CostConfig(false_drain=6 * H)
COSTLY = JobActions(policy="cost", cost=COST)


def fleet(node_risks):
    rows = [("c1", n, i, f"{n}-gpu{i}", r if i == 0 else 0.001) for n, r in node_risks.items() for i in range(8)]
    frame = pd.DataFrame(rows, columns=["cluster", "node", "gpu_index", "gpu_uuid", "risk"])
    frame["model_version"] = "lgbm-7"
    return frame


# Its last checkpoint at its start, 10 h ago (it checkpoints far less often than the assumed hour):
# at risk 0.3 a hint saves 16 x 10 h x 0.3 / 24 = 2 GPU-h for 16 x 5 min = 1.3.
TRAIN = Job("4242", {"busy1": 8, "busy2": 8}, start=NOW - 10 * H, checkpoint_at=NOW - 10 * H)


class JobScheduler:
    """A scheduler stand-in with a job map; records every call. `jobs=None`: unreadable."""

    name = "fake"

    def __init__(self, jobs=(TRAIN,), hint_ok=True):
        self.jobs, self.hint_ok = jobs, hint_ok
        self.changes, self.hinted, self.placed, self.standbys = [], [], [], []

    def observe(self, nodes):
        return {n: NodeView() for n in nodes}

    def apply(self, changes):
        self.changes.extend(changes)
        return [Applied(True, f"set {c.new}") for c in changes]

    def read_jobs(self):
        if self.jobs is None:
            raise SchedulerUnavailable("fake (squeue): no answer after 3 tries (connection refused)")
        return JobMap(tuple(self.jobs), "fake")

    def checkpoint(self, hints):
        self.hinted.extend(h.job.id for h in hints)
        return [Applied(self.hint_ok, "signalled" if self.hint_ok else "failed: gone") for _ in hints]

    def place(self, levels, count, apply):
        self.placed.append((dict(levels), count, apply))
        return [
            (n, Applied(True, f"{'set' if apply else 'would set'} level {lvl}")) for n, lvl in sorted(levels.items())
        ]

    def standby(self, nodes, apply):
        self.standbys.append((list(nodes), apply))
        return [(n, Applied(True, "added" if apply else "would add")) for n in nodes]


JOB_ACTIONS = ("checkpoint", "checkpoint_held", "placement", "standby")


def rows_by(out, action=None):
    """Node -> its row: its decision's, or (`action`) its row of that job-aware action."""
    return {r.node: r for r in out.rows if r.action == action or (action is None and r.action not in JOB_ACTIONS)}


def test_the_cost_policy_records_every_options_cost_and_the_jobs_in_the_audit(tmp_path):
    scheduler = JobScheduler()
    predictions = fleet({"busy1": 0.3, "busy2": 0.01, "idle": 0.95, "calm": 0.01})
    out = publish(predictions, scheduler, CONFIG, PolicyState(), mode="live", now=NOW, actions=COSTLY)
    rows = rows_by(out)
    assert rows["busy1"].policy == "cost" and rows["busy1"].option == "checkpoint" and rows["busy1"].tier == "watch"
    assert rows["busy1"].jobs == ("4242",) and rows["busy1"].blast_radius == 16
    assert rows["busy1"].work_at_risk == pytest.approx(16 * 10)
    assert set(rows["busy1"].costs) == {"none", "checkpoint", "avoid", "drain_after_job", "drain_now"}
    assert rows["idle"].option == "drain_now" and rows["idle"].costs["checkpoint"] is None  # not offered: no job
    assert {(c.node, c.new) for c in scheduler.changes} == {("busy1", "watch"), ("idle", "drain_now")}
    # One hint for the job, as its own audit row, and the time kept as the policy's state.
    assert scheduler.hinted == ["4242"]
    hint = rows_by(out, "checkpoint")["busy1"]
    assert hint.result == "signalled" and hint.jobs == ("4242",) and "16 GPUs, 10.00 h" in hint.reason
    assert out.hinted == {"4242": NOW}
    # The audit file keeps the costs (a struct column) and the jobs.
    append_audit(out.rows, str(tmp_path / "actions"))
    audit = read_audit(str(tmp_path / "actions"))
    busy = audit[(audit["node"] == "busy1") & (audit["action"] == "raise")].iloc[0]
    assert busy["costs"]["checkpoint"] == pytest.approx(rows["busy1"].costs["checkpoint"])
    assert list(busy["jobs"]) == ["4242"] and busy["policy"] == "cost"


def test_a_dry_run_sends_no_hint_and_keeps_the_hint_state():
    scheduler = JobScheduler()
    earlier = {"old-job": NOW - 5 * H}
    out = publish(
        fleet({"busy1": 0.3, "busy2": 0.01}),
        scheduler,
        CONFIG,
        PolicyState(),
        mode="dry-run",
        now=NOW,
        actions=COSTLY,
        hinted=earlier,
    )
    assert scheduler.hinted == [] and scheduler.changes == []
    assert rows_by(out, "checkpoint")["busy1"].result == "dry-run: would tell job 4242 to checkpoint"
    assert out.hinted == earlier
    assert scheduler.placed == [({}, 0, False)]  # placement off: the publisher only undoes its own


def test_a_hint_that_did_not_go_out_is_tried_again_next_run():
    scheduler = JobScheduler(hint_ok=False)
    out = publish(
        fleet({"busy1": 0.3, "busy2": 0.01}), scheduler, CONFIG, PolicyState(), mode="live", now=NOW, actions=COSTLY
    )
    assert rows_by(out, "checkpoint")["busy1"].result == "failed: gone" and out.hinted == {}


def test_an_unreadable_job_map_keeps_every_tier_and_says_why():
    scheduler = JobScheduler(jobs=None)
    out = publish(
        fleet({"idle": 0.95, "calm": 0.01}), scheduler, CONFIG, PolicyState(), mode="live", now=NOW, actions=COSTLY
    )
    assert all(r.action == "keep" and r.tier == "none" for r in out.rows) and scheduler.changes == []
    assert any("job map: fake (squeue): no answer" in n for n in out.notices)
    assert rows_by(out)["idle"].costs is None  # nothing was priced


def test_a_target_without_a_job_map_keeps_every_tier():
    out = publish(fleet({"idle": 0.95}), LogPublisher(), CONFIG, PolicyState(), mode="live", now=NOW, actions=COSTLY)
    assert out.rows[0].action == "keep"
    assert any("log: no job map; expected [publish] jobs_url" in n for n in out.notices)


def test_a_broken_job_document_for_the_log_target_is_a_notice(tmp_path):
    doc = tmp_path / "jobs.json"
    doc.write_text('{"jobs": [{"id": 1}]}')
    out = publish(
        fleet({"idle": 0.95}),
        LogPublisher(jobs_url=str(doc)),
        CONFIG,
        PolicyState(),
        mode="live",
        now=NOW,
        actions=COSTLY,
    )
    assert out.rows[0].action == "keep" and "jobs[0] is not a job" in " ".join(out.notices)


def test_placement_levels_and_standbys_become_audit_rows():
    scheduler = JobScheduler()
    risks = {"busy1": 0.05, "busy2": 0.01, "a": 0.001, "b": 0.002, "c": 0.3, "d": 0.003}
    actions = JobActions(placement_levels=4, standby_nodes=2)
    out = publish(fleet(risks), scheduler, CONFIG, PolicyState(), mode="live", now=NOW, actions=actions)
    levels, count, apply = scheduler.placed[0]
    # Four equal steps of risk up to the avoid tier's enter threshold (0.35).
    assert count == 4 and apply and levels == {"busy1": 0, "busy2": 0, "a": 0, "b": 0, "c": 3, "d": 0}
    # The tiered policy put c in watch: standbys are the lowest-risk idle nodes without a tier.
    assert scheduler.standbys == [(["a", "b"], True)]
    standby = rows_by(out, "standby")
    assert set(standby) == {"a", "b"} and standby["a"].result == "added" and "lowest-risk idle" in standby["a"].reason
    assert rows_by(out, "placement")["c"].reason == "placement level 3 of 4"


def test_standbys_are_left_alone_when_the_job_map_cannot_be_read():
    scheduler = JobScheduler(jobs=None)
    out = publish(
        fleet({"a": 0.01}), scheduler, CONFIG, PolicyState(), mode="live", now=NOW, actions=JobActions(standby_nodes=1)
    )
    assert scheduler.standbys == [] and "standby: not refreshed" in " ".join(out.notices)


def test_shadow_mode_asks_the_publisher_what_would_change():
    scheduler = JobScheduler()
    out = publish(
        fleet({"a": 0.01, "b": 0.02}),
        scheduler,
        CONFIG,
        PolicyState(),
        mode="shadow",
        now=NOW,
        actions=JobActions(placement_levels=2, standby_nodes=1),
    )
    assert scheduler.placed[0][2] is False and scheduler.standbys == [(["a"], False)]
    assert rows_by(out, "standby")["a"].result == "shadow: would add"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"policy": "cheapest"}, "policy: expected one of tiers, cost"), ({"standby_nodes": -1}, "expected >= 0")],
)
def test_bad_job_actions_are_refused(kwargs, message):
    with pytest.raises(InputError, match=message):
        JobActions(**kwargs)


def test_audit_files_written_before_the_job_fields_still_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from serving.publish import AUDIT_SCHEMA

    old_names = AUDIT_SCHEMA.names[: AUDIT_SCHEMA.get_field_index("result") + 1]
    old = pa.schema([AUDIT_SCHEMA.field(n) for n in old_names])
    folder = tmp_path / "actions" / "date=2026-01-01"
    folder.mkdir(parents=True)
    row = {n: [None] for n in old_names} | {
        "time": [NOW],
        "node": ["n1"],
        "action": ["raise"],
        "gpus": [[]],
        "top_features": [[]],
    }
    pq.write_table(pa.table(row, schema=old), folder / "part-old.parquet")
    audit = read_audit(str(tmp_path / "actions"))
    assert audit.loc[0, "node"] == "n1" and audit.loc[0, "costs"] is None and pd.isna(audit.loc[0, "policy"])


def test_job_map_unreadable_is_a_gpufail_error():
    from ingest.errors import GpufailError

    assert issubclass(JobMapUnreadable, GpufailError)
