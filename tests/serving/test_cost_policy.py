"""The cost-aware policy (serving/cost_policy.py): prices, choices, and the tiered policy's
safety rules (breaker, cooldown, recovery, unavailable nodes) kept."""

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from ingest.errors import InputError
from serving.cost_policy import (
    CostConfig,
    cheapest,
    decide,
    hinted_from_json,
    hinted_to_json,
    offered_options,
    option_costs,
)
from serving.jobs import IDLE, Job, JobMap, NodeLoad, node_loads
from serving.policy import NodeRisk, NodeState, PolicyConfig, PolicyState, Tier
from tests.tiers import FOUR_TIERS

NOW = datetime(2026, 11, 26, 12, tzinfo=UTC)
H = timedelta(hours=1)
M = timedelta(minutes=1)
TIERS = PolicyConfig(
    tiers=FOUR_TIERS,
    recovery_period=6 * H,
    cooldown=6 * H,
    breaker_max_nodes=3,
    breaker_max_fraction=0.0,
)
COST = CostConfig(
    horizon=24 * H,
    checkpoint_interval=H,
    checkpoint_time=5 * M,
    restart_time=10 * M,
    hang_time=15 * M,
    new_job_gpus=64,
    avoid_share=0.25,
    avoid_cost=0.5,
    false_drain=6 * H,
)
ALL = offered_options(TIERS)


def node(name, risk, **kw):
    return NodeRisk(key=f"c/{name}", cluster="c", node=name, risk=risk, gpus=(f"{name}-g0",), **kw)


def big_job(nodes, *, hours_since_checkpoint=9.5, end_in=None, job_id="train"):
    start = NOW - 10 * H
    return Job(
        job_id,
        dict.fromkeys(nodes, 8),
        start=start,
        checkpoint_at=NOW - timedelta(hours=hours_since_checkpoint),
        end_by=None if end_in is None else NOW + end_in,
    )


def run(nodes, jobs, state=None, hinted=None, config=TIERS, cost=COST, now=NOW, job_map=...):
    jm = JobMap(tuple(jobs)) if job_map is ... else job_map
    return decide(nodes, jm, {n.node: 8 for n in nodes}, cost, state or PolicyState(), hinted or {}, config, now)


def load_of(job, cost=COST, node="n1", now=NOW):
    return node_loads(JobMap((job,)), now, cost.checkpoint_interval)[node]


HANG_RESTART = 0.25 + 10 / 60


def test_the_costs_of_each_option_follow_the_documented_formulas():
    # A node running 8 of the 4,096 GPUs of a job that reported its checkpoint 9.5 h ago, no time
    # limit. It is past the 1 h interval: its next checkpoint is taken to come within the hour.
    load = load_of(big_job([f"n{i}" for i in range(1, 513)], hours_since_checkpoint=9.5))
    p = 0.3
    costs = option_costs(p, load, 8, COST, ALL)
    w = 1 / 24  # the share of the horizon before its next checkpoint
    loss = 4096 * (w * (9.5 + 0.5) + (1 - w) * 0.5 + HANG_RESTART)
    saved = 4096 * w * 9.5
    false_drain = 8 * 6  # no new work: no free GPU while the job runs, and it runs all horizon
    assert costs["none"] == pytest.approx(p * loss)
    assert costs["checkpoint"] == pytest.approx(4096 * 5 / 60 + p * (loss - saved))
    assert costs["avoid"] == pytest.approx(p * loss + 0.5 * 8)
    assert costs["drain_after_job"] == pytest.approx(p * loss + (1 - p) * false_drain)
    assert costs["drain_now"] == pytest.approx(4096 * 9.5 + 4096 * 10 / 60 + (1 - p) * false_drain)
    assert cheapest(costs) == "checkpoint"  # saves 486 GPU-h for 341


def test_a_job_fifteen_minutes_before_its_own_checkpoint_gets_no_hint():
    # 64 GPUs, 45 min after its (assumed, hourly) checkpoint: a hint saves its 0.75 h only if the
    # failure comes in the next 15 min, a chance of 0.3 x 0.25 / 24.
    job = Job("j", {f"n{i}": 8 for i in range(1, 9)}, start=NOW - 45 * M)
    costs = option_costs(0.3, load_of(job), 8, COST, ALL)
    w = 0.25 / 24
    loss = 64 * (w * (0.75 + 0.125) + (1 - w) * 0.5 + HANG_RESTART)
    assert costs["none"] == pytest.approx(0.3 * loss)
    assert costs["checkpoint"] - costs["none"] == pytest.approx(64 * 5 / 60 - 0.3 * 64 * 0.75 * w)
    assert cheapest(costs) == "none"


def test_a_hint_saves_the_work_at_risk_only_before_the_jobs_next_checkpoint():
    # A 4,096-GPU job 3 h into its 4 h interval: the hint saves p x 4096 x 3 x min(1, 1/24).
    four_hourly = replace(COST, checkpoint_interval=4 * H)
    load = load_of(big_job([f"n{i}" for i in range(1, 513)], hours_since_checkpoint=3), four_hourly)
    for p, best in ((0.5, "none"), (0.9, "checkpoint")):  # saves 256 or 461 GPU-h, for 341
        costs = option_costs(p, load, 8, four_hourly, ALL)
        assert costs["none"] - costs["checkpoint"] == pytest.approx(p * 4096 * 3 / 24 - 4096 * 5 / 60)
        assert cheapest(costs) == best


def test_a_failure_later_in_the_horizon_loses_about_half_an_interval():
    # Just checkpointed (a = 0): doing nothing still risks, on average, half an interval of work
    # of every GPU after the next checkpoint, not the work at risk now (0).
    job = Job("j", {"n1": 8}, start=NOW - 10 * H, checkpoint_at=NOW)
    costs = option_costs(0.2, load_of(job), 8, COST, ALL)
    assert costs["none"] == pytest.approx(0.2 * 8 * ((1 / 24) * 0.5 + (23 / 24) * 0.5 + HANG_RESTART))
    assert costs["drain_now"] == pytest.approx(8 * 10 / 60 + 0.8 * 8 * 6)  # nothing at risk: only a restart


def test_a_job_ending_before_its_next_checkpoint_is_exposed_only_while_it_runs():
    # 2 h into a 4 h interval, its time limit in 30 min; 4 of the node's 8 GPUs.
    four_hourly = replace(COST, checkpoint_interval=4 * H)
    job = Job("j", {"n1": 4}, start=NOW - 2 * H, end_by=NOW + 30 * M)
    load = load_of(job, four_hourly)
    p, w = 0.4, 0.5 / 24
    costs = option_costs(p, load, 8, four_hourly, ALL)
    loss = 4 * (w * (2 + 0.25) + w * HANG_RESTART)
    new_work = (w * 4 / 8 + (1 - w)) * 64 * (2 + HANG_RESTART)  # new jobs: half of a 4 h interval
    assert costs["none"] == pytest.approx(p * (loss + new_work))
    assert costs["drain_after_job"] == pytest.approx(p * loss + (1 - p) * 8 * 6)


def test_a_busy_load_without_its_jobs_exposures_is_refused():
    # Pricing it would take its jobs' losses for nothing.
    with pytest.raises(ValueError, match="1 job\\(s\\) with 0 exposures"):
        option_costs(0.3, NodeLoad(jobs=("j",), used_gpus=8, blast_radius=8), 8, COST, ALL)


def test_an_idle_node_prices_the_new_work_it_would_take():
    per_new = 64 * (0.5 + 0.25 + 10 / 60)
    costs = option_costs(0.9, IDLE, 8, COST, ALL)
    assert set(costs) == {"none", "avoid", "drain_now"}  # no job: nothing to checkpoint or wait for
    assert costs["none"] == pytest.approx(0.9 * per_new)
    assert costs["avoid"] == pytest.approx(0.9 * 0.25 * per_new + 0.5 * 8)
    assert costs["drain_now"] == pytest.approx(0.1 * 8 * 6)


def test_a_tie_goes_to_the_weaker_option():
    assert cheapest({"drain_now": 1.0, "none": 1.0, "avoid": 1.0}) == "none"


def test_a_big_job_far_from_its_checkpoint_is_told_to_checkpoint_once():
    job = big_job(["n1", "n2"])
    out = run([node("n1", 0.3), node("n2", 0.25), node("n3", 0.01)], [job])
    by_node = {c.decision.node: c for c in out.decisions}
    assert by_node["n1"].option == by_node["n2"].option == "checkpoint"
    assert by_node["n1"].decision.tier == "watch"  # told, and watched; the node stays in service
    assert [(h.job.id, h.nodes) for h in out.hints] == [("train", ("n1", "n2"))]
    assert "16 GPUs, 9.50 h since its checkpoint" in out.hints[0].reason
    assert out.hinted == {"train": NOW}
    assert "cheapest checkpoint" in by_node["n1"].decision.reason and "expected GPU-h" in by_node["n1"].decision.reason


def test_a_hint_is_not_repeated_within_the_checkpoint_interval():
    job = big_job(["n1"])
    first = run([node("n1", 0.3)], [job])
    again = run([node("n1", 0.3)], [job], state=first.state, hinted=first.hinted, now=NOW + 30 * M)
    assert again.hints == [] and "within 1:00:00" in again.held[0][1]
    later = run([node("n1", 0.3)], [job], state=first.state, hinted=again.hinted, now=NOW + 61 * M)
    assert [h.job.id for h in later.hints] == ["train"]
    # A job that is gone is forgotten.
    assert run([node("n1", 0.01)], [], state=first.state, hinted=first.hinted).hinted == {}


def test_a_busy_node_whose_job_ends_soon_is_drained_after_it_an_idle_one_at_once():
    ending = big_job(["busy"], hours_since_checkpoint=0.1, end_in=20 * M)
    out = run([node("busy", 0.9), node("idle", 0.9), node("calm", 0.02)], [ending])
    by_node = {c.decision.node: c for c in out.decisions}
    assert by_node["busy"].option == "drain_after_job" and by_node["busy"].decision.tier == "drain_after_job"
    assert by_node["idle"].option == "drain_now" and by_node["idle"].decision.tier == "drain_now"
    assert by_node["calm"].option == "none" and by_node["calm"].decision.action == "keep"


def test_a_huge_job_at_high_risk_is_not_killed_for_a_small_risk_but_is_for_a_large_one():
    fresh = big_job([f"n{i}" for i in range(512)], hours_since_checkpoint=0.05)  # 4,096 GPUs, just checkpointed
    low = run([node("n0", 0.2)], [fresh])
    assert low.decisions[0].option in ("none", "checkpoint")
    high = run([node("n0", 0.97)], [fresh])
    assert high.decisions[0].option == "drain_now"


def test_a_disabled_tier_is_never_chosen():
    config = PolicyConfig(tiers=(Tier("watch", 0.2, 0.1), Tier("avoid", 0.35, 0.25)), breaker_max_nodes=5)
    out = run([node("idle", 0.99)], [], config=config)
    assert set(out.decisions[0].costs) == {"none", "avoid"} and out.decisions[0].decision.tier == "avoid"


def test_without_watch_a_checkpoint_hint_leaves_the_node_without_a_tier():
    config = PolicyConfig(tiers=(Tier("avoid", 0.35, 0.25),), breaker_max_nodes=5)
    out = run([node("n1", 0.3)], [big_job(["n1"])], config=config)
    assert out.decisions[0].option == "checkpoint" and out.decisions[0].decision.tier == "none"
    assert len(out.hints) == 1


def test_the_breaker_holds_raises_beyond_its_budget_and_then_every_hint():
    idle = [node(f"i{k}", 0.95) for k in range(5)]
    busy = node("b1", 0.3)
    out = run([*idle, busy], [big_job(["b1"])])
    actions = [c.decision.action for c in out.decisions if c.decision.node.startswith("i")]
    assert actions.count("raise") == 3 and actions.count("breaker_held") == 2
    assert out.state.breaker.tripped and out.hints == []
    assert "circuit breaker open" in out.held[0][1]


def test_a_raise_held_by_the_cooldown_falls_back_to_a_checkpoint_hint():
    # n1 was lowered to none an hour ago; now its job's risk calls for a drain after the job.
    state = PolicyState(nodes={"c/n1": NodeState(tier="none", since=NOW - H, changed_at=NOW - H)})
    job = big_job(["n1"], hours_since_checkpoint=5, end_in=H)
    out = run([node("n1", 0.85)], [job], state=state)
    d = out.decisions[0]
    assert d.option == "drain_after_job" and d.decision.action == "cooldown_held"
    assert d.costs["checkpoint"] < d.costs["none"] and [h.job.id for h in out.hints] == ["train"]


def test_an_unavailable_node_is_skipped_and_its_job_not_hinted_for_it():
    out = run([node("n1", 0.3, unavailable="Slurm state down")], [big_job(["n1"])])
    assert out.decisions[0].decision.action == "skip" and out.hints == []


def test_a_node_leaves_its_tier_only_after_a_weaker_option_was_cheapest_for_the_recovery_period():
    first = run([node("idle", 0.95)], [])
    assert first.decisions[0].decision.tier == "drain_now"
    calm = run([node("idle", 0.01)], [], state=first.state, now=NOW + H)
    assert calm.decisions[0].decision.action == "keep" and calm.decisions[0].decision.tier == "drain_now"
    assert "recovery after" in calm.decisions[0].decision.reason
    back = run([node("idle", 0.01)], [], state=calm.state, now=NOW + 8 * H)
    assert back.decisions[0].decision.action == "lower" and back.decisions[0].decision.tier == "none"


def test_without_a_job_map_every_tier_is_kept_and_nothing_is_hinted():
    first = run([node("idle", 0.95)], [])
    low_since = run([node("idle", 0.01)], [], state=first.state, now=NOW + H)
    blind = run([node("idle", 0.01), node("new", 0.99)], [], state=low_since.state, now=NOW + 2 * H, job_map=None)
    by_node = {c.decision.node: c.decision for c in blind.decisions}
    assert by_node["idle"].tier == "drain_now" and by_node["new"].tier == "none"
    assert all(d.action == "keep" for d in by_node.values()) and "job map unavailable" in by_node["new"].reason
    # The recovery clock that started before the blind run is neither reset nor started by it.
    assert blind.state.nodes["c/idle"].below_since == NOW + H
    assert blind.hints == [] and blind.decisions[0].costs == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"horizon": timedelta(0)}, "horizon and checkpoint_interval above zero"),
        ({"restart_time": -M}, r"cost.restart_time: expected a duration >= 0"),
        ({"new_job_gpus": float("nan")}, "cost.new_job_gpus: expected a finite number"),
        ({"avoid_share": 1.5}, r"cost.avoid_share: expected a share in \[0, 1\]"),
    ],
)
def test_bad_prices_are_refused_with_the_name(kwargs, message):
    with pytest.raises(InputError, match=message):
        CostConfig(**kwargs)


def test_hint_times_round_trip_and_bad_ones_name_the_state_file():
    hinted = {"train": NOW, "7": NOW - H}
    assert hinted_from_json(hinted_to_json(hinted), "s") == hinted
    assert hinted_from_json(None, "s") == {}
    with pytest.raises(InputError, match=r"state.json: checkpoint_hints is not"):
        hinted_from_json({"a": "yesterday"}, "state.json")
    with pytest.raises(InputError, match="job a has no time zone"):
        hinted_from_json({"a": "2026-01-01T00:00:00"}, "state.json")
