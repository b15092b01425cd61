"""Job-aware actions against a real slurmctld with 16 virtual GPU nodes (Debian's Slurm 22.05,
started by the `slurm` fixture), on real `sbatch` jobs: the job map from `squeue --json`, the
checkpoint signal reaching the job, the cost policy draining a busy node after its job and an
idle one at once, placement weights, and the standby reservation created and refreshed."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pandas as pd
import pytest

from serving.cost_policy import CostConfig, Hint
from serving.jobs import expand_hostlist
from serving.policy import PolicyConfig, PolicyState
from serving.publish import JobActions, publish
from serving.publishers.slurm import STANDBY_RESERVATION, MemoryLedger, SlurmPublisher
from serving.score import PREDICTION_SCHEMA
from tests.tiers import FOUR_TIERS

H = timedelta(hours=1)
CONFIG = PolicyConfig(
    tiers=FOUR_TIERS,
    recovery_period=6 * H,
    breaker_max_nodes=4,
    breaker_max_fraction=0.0,
)
COST = CostConfig(false_drain=6 * H)

# A training job stand-in: on the checkpoint signal it writes the time to a file (where a real
# job would save its state); it ends when a stop file appears. It says when its trap is set:
# Slurm shows a job RUNNING a moment before its script runs, and a signal then would end it.
JOB_SCRIPT = """#!/bin/bash
trap 'date -u +%FT%TZ > "$GPUFAIL_TEST_DIR/checkpoint.$SLURM_JOB_ID"' USR1
touch "$GPUFAIL_TEST_DIR/ready.$SLURM_JOB_ID"
while [ ! -e "$GPUFAIL_TEST_DIR/stop.$SLURM_JOB_ID" ]; do sleep 0.2; done
"""


class Jobs:
    """Submits `JOB_SCRIPT` jobs to the test cluster and watches them."""

    def __init__(self, slurm, folder: Path) -> None:
        self.slurm, self.folder = slurm, folder
        self.script = folder / "job.sh"
        self.script.write_text(JOB_SCRIPT)
        self.script.chmod(0o755)

    def submit(self, *options: str) -> str:
        done = self.slurm.run(
            "sbatch",
            "--parsable",
            f"--export=ALL,GPUFAIL_TEST_DIR={self.folder}",
            f"--output={self.folder}/slurm-%j.out",
            *options,
            str(self.script),
        )
        job = done.stdout.strip().split(";")[0]
        self.wait(lambda: (self.folder / f"ready.{job}").exists(), f"job {job} running its script")
        return job

    def stop(self, job: str) -> None:
        (self.folder / f"stop.{job}").touch()
        self.wait(lambda: job not in self.slurm.jobs(), f"job {job} ended")

    def wait(self, condition, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; job output in {self.folder}")


@pytest.fixture
def jobs(slurm, tmp_path):
    return Jobs(slurm, tmp_path)


def publisher(slurm, **overrides) -> SlurmPublisher:
    return SlurmPublisher(**{"slurm_conf": str(slurm.conf), "attempts": 2, "backoff": 0.05, **overrides})


def predictions(node_risk: dict[str, float], nodes: list[str]) -> pd.DataFrame:
    """Eight GPUs per node; the first at the node's risk (0.001 unless given), the rest at 0.0001."""
    rows = [
        ("slurm", n, g, f"{n}-gpu{g}", node_risk.get(n, 0.001) if g == 0 else 0.0001) for n in nodes for g in range(8)
    ]
    frame = pd.DataFrame(rows, columns=["cluster", "node", "gpu_index", "gpu_uuid", "risk"])
    frame["ts"] = pd.Timestamp(datetime.now(UTC))
    frame["rank"] = frame["risk"].rank(ascending=False, method="first").astype("int64")
    frame["node_risk"] = frame.groupby("node")["risk"].transform("max")
    frame["model_kind"] = "lightgbm"
    frame["model_version"] = "lightgbm-test"
    return frame[list(PREDICTION_SCHEMA.names)]


def reservation(slurm) -> str:
    done = slurm.run("scontrol", "show", "reservation", STANDBY_RESERVATION, "--oneliner", check=False)
    if done.returncode != 0:
        return ""
    return next(w.split("=", 1)[1] for w in done.stdout.split() if w.startswith("Nodes="))


def live_publish(slurm, risks, actions, *, via=None, state=None, now=None, **kwargs):  # type: ignore[no-untyped-def]
    """One live publish run of `risks` (node -> risk) to `slurm` with `actions` (by default
    through a fresh publisher, from no policy state, now)."""
    return publish(
        predictions(risks, slurm.nodes),
        via or publisher(slurm),
        CONFIG,
        PolicyState() if state is None else state,
        mode="live",
        now=datetime.now(UTC) if now is None else now,
        actions=actions,
        **kwargs,
    )


def test_the_job_map_of_real_jobs(slurm, jobs):
    big = jobs.submit("-N2", "-w", "gpu003,gpu004", "--gres=gpu:8", "--comment=gpufail_checkpoint=2030-01-01T00:00:00Z")
    small = jobs.submit("-N1", "-w", "gpu005", "--gpus=3", "--time=30")
    found = publisher(slurm).read_jobs().by_id()
    assert set(found) == {big, small}
    assert found[big].gpus_on == {"gpu003": 8, "gpu004": 8} and found[big].end_by is None
    assert found[big].checkpoint_at == datetime(2030, 1, 1, tzinfo=UTC)
    assert found[small].gpus_on == {"gpu005": 3}
    assert found[small].end_by == found[small].start + timedelta(minutes=30)
    assert abs((datetime.now(UTC) - found[small].start).total_seconds()) < 120


def test_a_checkpoint_hint_reaches_the_job_as_its_signal(slurm, jobs):
    job = jobs.submit("-N1", "-w", "gpu006", "--gres=gpu:8")
    mapped = publisher(slurm).read_jobs().by_id()[job]
    result = publisher(slurm).checkpoint([Hint(mapped, ("gpu006",), "test")])
    assert result[0].ok and result[0].detail == f"signalled USR1 to job {job} (batch step)"
    jobs.wait(lambda: (jobs.folder / f"checkpoint.{job}").exists(), "the job's checkpoint file")
    assert slurm.jobs()[job]["job_state"] == "RUNNING"  # told, not ended


def test_the_cost_policy_tells_a_long_job_on_a_risky_node_to_checkpoint(slurm, jobs):
    # The job reports one checkpoint, at its start (a report before the start counts from it).
    job = jobs.submit(
        "-N2", "-w", "gpu007,gpu008", "--gres=gpu:8", f"--comment=gpufail_checkpoint={datetime.now(UTC):%FT%TZ}"
    )
    ledger = MemoryLedger()
    # Decided as if 10 h into the job: 16 GPUs x 10 h at risk, and the job is past the assumed
    # hourly interval, so its next checkpoint is taken to come within the hour. A hint then saves
    # 0.3 x 160 x 1 / 24 = 2 GPU-h for 16 x 5 min = 1.3. (A job that checkpoints every hour on its
    # own would get none: the hint saves its work only if the failure comes before its next one.)
    later = datetime.now(UTC) + timedelta(hours=10)
    out = live_publish(
        slurm, {"gpu007": 0.3}, JobActions(policy="cost", cost=COST), via=publisher(slurm, ledger=ledger), now=later
    )
    rows = [r for r in out.rows if r.node == "gpu007"]
    decision = next(r for r in rows if r.action == "raise")
    assert decision.option == "checkpoint" and decision.tier == "watch" and decision.blast_radius == 16
    hint = next(r for r in rows if r.action == "checkpoint")
    assert hint.result == f"signalled USR1 to job {job} (batch step)" and hint.jobs == (job,)
    jobs.wait(lambda: (jobs.folder / f"checkpoint.{job}").exists(), "the job's checkpoint file")
    assert out.hinted == {job: later}
    # The next run (the job reported nothing) does not signal it again within the interval.
    again = live_publish(
        slurm,
        {"gpu007": 0.3},
        JobActions(policy="cost", cost=COST),
        via=publisher(slurm, ledger=ledger),
        state=out.state,
        now=later + timedelta(minutes=5),
        hinted=out.hinted,
    )
    assert [r.action for r in again.rows if r.jobs == (job,) and r.action.startswith("checkpoint")] == [
        "checkpoint_held"
    ]


def test_a_risky_nodes_job_is_drained_after_it_ends_and_an_idle_risky_node_at_once(slurm, jobs):
    job = jobs.submit("-N1", "-w", "gpu009", "--gres=gpu:8", "--time=5")
    out = live_publish(slurm, {"gpu009": 0.9, "gpu010": 0.9}, JobActions(policy="cost", cost=COST))
    rows = {r.node: r for r in out.rows if r.action not in ("placement", "standby")}
    assert (rows["gpu009"].option, rows["gpu009"].tier) == ("drain_after_job", "drain_after_job")
    assert (rows["gpu010"].option, rows["gpu010"].tier) == ("drain_now", "drain_now")
    assert rows["gpu009"].costs["drain_after_job"] < rows["gpu009"].costs["drain_now"]
    states = slurm.node_states()
    # The busy node is draining: its job runs on; the idle one is drained already.
    assert states["gpu009"]["state_flags"] == ["DRAIN"] and states["gpu009"]["state"] in ("mixed", "allocated")
    assert states["gpu009"]["reason"].startswith("gpufail: drain-after-job")
    assert slurm.jobs()[job]["job_state"] == "RUNNING"
    assert states["gpu010"]["state_flags"] == ["DRAIN"] and states["gpu010"]["state"] == "idle"
    assert states["gpu010"]["reason"].startswith("gpufail: drain-now")
    jobs.stop(job)
    jobs.wait(lambda: slurm.node_states()["gpu009"]["state"] == "idle", "gpu009 drained")
    assert slurm.node_states()["gpu009"]["state_flags"] == ["DRAIN"]
    # New work goes elsewhere.
    follower = jobs.submit("-N2", "--gres=gpu:8")
    assert not {"gpu009", "gpu010"} & set(publisher(slurm).read_jobs().by_id()[follower].gpus_on)


def test_placement_weights_follow_risk_and_an_operators_weight_is_the_new_base(slurm):
    ledger = MemoryLedger()
    actions = JobActions(placement_levels=4)

    def run(risks):
        return live_publish(slurm, risks, actions, via=publisher(slurm, ledger=ledger))

    out = run({"gpu011": 0.1, "gpu012": 0.3, "gpu013": 0.5})
    weights = {n: s["weight"] for n, s in slurm.node_states().items()}
    # Levels in four steps up to the avoid threshold 0.35; gpu013 is in drain_after_job: its
    # weight is the avoid weight, not a placement level.
    assert (weights["gpu001"], weights["gpu011"], weights["gpu012"], weights["gpu013"]) == (1, 2, 4, 100_000)
    placed = {r.node: r.result for r in out.rows if r.action == "placement"}
    assert placed["gpu012"] == "weight 1 -> 4 (placement level 3)" and "gpu001" not in placed
    slurm.scontrol("update", "NodeName=gpu011", "Weight=50")  # an operator's own weight
    run({"gpu011": 0.1, "gpu012": 0.01})
    weights = {n: s["weight"] for n, s in slurm.node_states().items()}
    assert (weights["gpu011"], weights["gpu012"]) == (51, 1)
    # Placement switched off: every node gets its base weight back.
    actions = JobActions(placement_levels=0)
    run({})
    weights = {n: s["weight"] for n, s in slurm.node_states().items()}
    assert weights["gpu011"] == 50 and all(w in (1, 50, 100_000) for w in weights.values())
    assert ledger.load().placement == {}


def test_the_standby_reservation_is_created_and_refreshed_each_run(slurm, jobs):
    ledger = MemoryLedger()
    busy = jobs.submit("-N1", "-w", "gpu001", "--gres=gpu:8")

    def run(risks, standbys=2):
        return live_publish(slurm, risks, JobActions(standby_nodes=standbys), via=publisher(slurm, ledger=ledger))

    base = {n: 0.01 for n in slurm.nodes}
    # gpu001 is the healthiest but runs a job: not a standby.
    out = run({**base, "gpu001": 0.0001, "gpu014": 0.0002, "gpu015": 0.0003})
    assert reservation(slurm) == "gpu[014-015]"
    assert {r.node: r.result for r in out.rows if r.action == "standby"} == {
        "gpu014": f"added to reservation {STANDBY_RESERVATION}",
        "gpu015": f"added to reservation {STANDBY_RESERVATION}",
    }
    assert ledger.load().standby == ("gpu014", "gpu015")
    # Normal jobs do not land on standbys: one as large as the rest of the cluster takes the rest.
    normal = jobs.submit("-N13", "--gres=gpu:8")
    assert set(expand_hostlist(slurm.jobs()[normal]["nodes"])) == set(slurm.nodes) - {"gpu001", "gpu014", "gpu015"}
    jobs.stop(normal)
    # Risks move: refreshed.
    run({**base, "gpu014": 0.0002, "gpu016": 0.0001})
    assert reservation(slurm) == "gpu[014,016]"
    # A job restarted into a standby makes that node busy: replaced by the next healthiest.
    restarted = jobs.submit("-N1", "-w", "gpu016", "--gres=gpu:8", f"--reservation={STANDBY_RESERVATION}")
    run({**base, "gpu014": 0.0002, "gpu016": 0.0001, "gpu013": 0.0003})
    assert reservation(slurm) == "gpu[013-014]"
    assert slurm.jobs()[restarted]["job_state"] == "RUNNING"  # refreshing did not disturb it
    # Standbys switched off: Slurm keeps a reservation while a job of it runs, so it goes after.
    out = run(base, standbys=0)
    assert {r.result for r in out.rows if r.action == "standby"} == {
        f"kept: reservation {STANDBY_RESERVATION} is in use by a running job; deleted after it ends"
    }
    assert reservation(slurm) == "gpu[013-014]" and ledger.load().standby == ("gpu013", "gpu014")
    jobs.stop(restarted)
    jobs.stop(busy)
    run(base, standbys=0)
    assert reservation(slurm) == "" and ledger.load().standby is None


def test_a_standby_reservation_that_is_not_ours_is_left_alone(slurm):
    slurm.scontrol(
        "create",
        "reservation",
        f"ReservationName={STANDBY_RESERVATION}",
        "Nodes=gpu016",
        "StartTime=now",
        "Duration=infinite",
        "Users=root",
    )
    out = live_publish(slurm, {}, JobActions(standby_nodes=1))
    row = next(r for r in out.rows if r.action == "standby")
    assert row.result.startswith(f"skipped: reservation {STANDBY_RESERVATION} (gpu016) is not recorded")
    assert reservation(slurm) == "gpu016"


def tools(folder: Path, refuse: dict[str, str]) -> str:
    """A bin folder of the real Slurm commands, where `refuse[tool]` names the first argument
    with which that tool fails instead (a controller refusing one kind of request)."""
    import shutil

    folder.mkdir()
    for tool in ("sinfo", "squeue", "scontrol", "scancel"):
        real = shutil.which(tool)
        word = refuse.get(tool)
        guard = f'if [ "$1" = "{word}" ]; then echo "{tool}: refused" >&2; exit 1; fi\n' if word else ""
        (folder / tool).write_text(f'#!/bin/sh\n{guard}exec {real} "$@"\n')
        (folder / tool).chmod(0o755)
    return str(folder)


def test_a_signal_to_a_job_that_has_ended_fails_its_hint(slurm, jobs):
    job = jobs.submit("-N1", "-w", "gpu002", "--gres=gpu:1")
    mapped = publisher(slurm).read_jobs().by_id()[job]
    jobs.stop(job)
    result = publisher(slurm).checkpoint([Hint(mapped, ("gpu002",), "test")])
    assert not result[0].ok and result[0].detail.startswith("failed: slurm (scancel)")


def test_an_unreadable_squeue_keeps_every_tier(slurm, tmp_path):
    out = live_publish(
        slurm,
        {"gpu012": 0.99},
        JobActions(policy="cost", cost=COST),
        via=publisher(slurm, bin_dir=tools(tmp_path / "bin", {"squeue": "--json"})),
    )
    assert {r.action for r in out.rows} == {"keep"} and slurm.node_states()["gpu012"]["state_flags"] == []
    assert any("job map: slurm (squeue): no answer after 2 tries" in n and "squeue: refused" in n for n in out.notices)


def test_a_weight_slurm_refuses_is_not_recorded_as_ours(slurm, tmp_path):
    ledger = MemoryLedger()
    pub = publisher(slurm, ledger=ledger, bin_dir=tools(tmp_path / "bin", {"scontrol": "update"}))
    pub.observe(slurm.nodes)
    results = dict(pub.place({"gpu003": 2}, 4, apply=True))
    assert not results["gpu003"].ok and "scontrol: refused" in results["gpu003"].detail
    assert ledger.load().placement == {} and slurm.node_states()["gpu003"]["weight"] == 1


def test_a_standby_node_taken_meanwhile_fails_the_refresh_and_keeps_the_record(slurm, jobs):
    ledger = MemoryLedger()
    pub = publisher(slurm, ledger=ledger)
    pub.standby(["gpu004"], apply=True)
    jobs.submit("-N1", "-w", "gpu005", "--gres=gpu:8")  # gpu005 became busy after the job map was read
    results = dict(pub.standby(["gpu005"], apply=True))
    assert not results["gpu005"].ok and "busy" in results["gpu005"].detail
    assert reservation(slurm) == "gpu004" and ledger.load().standby == ("gpu004",)
