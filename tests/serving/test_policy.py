from datetime import UTC, datetime, timedelta

import pytest

from ingest.errors import InputError
from serving.policy import NodeRisk, NodeState, PolicyConfig, PolicyState, Tier, decide, reset_breaker

T0 = datetime(2026, 1, 5, 12, tzinfo=UTC)
H = timedelta(hours=1)
TIERS = (
    Tier("watch", 0.2, 0.1),
    Tier("avoid", 0.35, 0.25),
    Tier("drain_after_job", 0.5, 0.35),
    Tier("drain_now", 0.8, 0.6),
)


def config(**overrides):
    values = {
        "tiers": TIERS,
        "recovery_period": 24 * H,
        "cooldown": 6 * H,
        "breaker_max_nodes": 2,
        "breaker_max_fraction": 0.05,
        "breaker_window": 24 * H,
    }
    return PolicyConfig(**{**values, **overrides})


def nodes(**risks):
    return [NodeRisk(key=f"c/{n}", cluster="c", node=n, risk=r) for n, r in risks.items()]


def by_node(decisions):
    return {d.node: d for d in decisions}


def test_each_tier_is_entered_at_its_enter_threshold():
    decisions, state = decide(
        nodes(a=0.05, b=0.2, c=0.4, d=0.5, e=0.9), PolicyState(), config(breaker_max_nodes=10), T0
    )
    tiers = {d.node: d.tier for d in decisions}
    assert tiers == {"a": "none", "b": "watch", "c": "avoid", "d": "drain_after_job", "e": "drain_now"}
    assert [d.node for d in decisions] == ["e", "d", "c", "b", "a"]  # riskiest first
    assert state.nodes["c/e"].tier == "drain_now" and state.nodes["c/e"].since == T0
    assert "c/a" not in state.nodes
    assert (
        by_node(decisions)["d"].action == "raise"
        and "0.500 >= drain_after_job enter threshold" in by_node(decisions)["d"].reason
    )


def test_the_array_form_enters_the_same_tier_as_one_risk_at_a_time():
    import numpy as np

    cfg = config()
    risks = np.array([0.0, *[t.enter for t in cfg.tiers], *[t.enter - 1e-9 for t in cfg.tiers], 1.0])
    assert cfg.entered_tiers(risks).tolist() == [cfg.entered_tier(float(r)) for r in risks]
    assert cfg.entered_tiers(np.array([1.0]))[0] == cfg.strongest


def test_hysteresis_keeps_the_tier_between_exit_and_enter_and_recovers_only_after_the_period():
    cfg = config()
    _, state = decide(nodes(a=0.55), PolicyState(), cfg, T0)
    d, state = decide(nodes(a=0.4), state, cfg, T0 + H)  # below enter 0.5, above exit 0.35
    assert (d[0].action, d[0].tier) == ("keep", "drain_after_job")
    d, state = decide(nodes(a=0.1), state, cfg, T0 + 2 * H)  # below exit: the clock starts
    assert (d[0].action, d[0].tier) == ("keep", "drain_after_job") and "recovery after" in d[0].reason
    d, state = decide(nodes(a=0.4), state, cfg, T0 + 3 * H)  # back above exit: the clock resets
    assert state.nodes["c/a"].below_since is None
    d, state = decide(nodes(a=0.1), state, cfg, T0 + 4 * H)
    d, state = decide(nodes(a=0.1), state, cfg, T0 + 27 * H)  # 23 h below: not yet
    assert d[0].tier == "drain_after_job"
    d, state = decide(nodes(a=0.1), state, cfg, T0 + 28 * H)
    assert (d[0].action, d[0].previous_tier, d[0].tier) == ("lower", "drain_after_job", "none")


def test_recovery_falls_to_the_tier_the_risk_enters_now():
    cfg = config()
    _, state = decide(nodes(a=0.9), PolicyState(), cfg, T0)
    decide_times = [T0 + H, T0 + 26 * H]
    for t in decide_times:
        d, state = decide(nodes(a=0.4), state, cfg, t)
    assert (d[0].action, d[0].tier) == ("lower", "avoid")


def test_a_repair_after_entering_the_tier_clears_it():
    cfg = config()
    _, state = decide(nodes(a=0.6), PolicyState(), cfg, T0)
    old_repair = [NodeRisk(key="c/a", cluster="c", node="a", risk=0.6, repaired_at=T0 - H)]
    d, state = decide(old_repair, state, cfg, T0 + H)
    assert d[0].action == "keep"
    repaired = [NodeRisk(key="c/a", cluster="c", node="a", risk=0.6, repaired_at=T0 + 2 * H)]
    d, state = decide(repaired, state, cfg, T0 + 3 * H)
    assert (d[0].action, d[0].tier) == ("lower", "none") and "repaired at" in d[0].reason


def test_cooldown_holds_a_raise_but_not_one_to_the_strongest_tier():
    cfg = config()
    _, state = decide(nodes(a=0.25), PolicyState(), cfg, T0)  # watch
    d, state = decide(nodes(a=0.4), state, cfg, T0 + H)
    assert (d[0].action, d[0].tier) == ("cooldown_held", "watch") and "cooldown" in d[0].reason
    d, state = decide(nodes(a=0.4), state, cfg, T0 + 7 * H)
    assert (d[0].action, d[0].tier) == ("raise", "avoid")
    d, state = decide(nodes(a=0.9), state, cfg, T0 + 8 * H)
    assert (d[0].action, d[0].tier) == ("raise", "drain_now")


def test_breaker_acts_on_the_riskiest_up_to_the_limit_then_trips_until_reset():
    cfg = config(breaker_max_nodes=2, breaker_max_fraction=0.05)
    flood = nodes(**{f"n{i:02d}": 0.9 - i * 0.01 for i in range(7)}, **{f"q{i:02d}": 0.01 for i in range(9)})
    d, state = decide(flood, PolicyState(), cfg, T0)
    actions = {x.node: x.action for x in d}
    assert [n for n, a in actions.items() if a == "raise"] == ["n00", "n01"]
    assert sorted(n for n, a in actions.items() if a == "breaker_held") == [f"n{i:02d}" for i in range(2, 7)]
    assert state.breaker.tripped and "more than 2 nodes" in state.breaker.reason
    assert by_node(d)["n02"].tier == "none" and "circuit breaker tripped" in by_node(d)["n02"].reason
    assert "circuit breaker is open" in by_node(d)["n03"].reason
    # A day later (window over), the breaker stays open: nothing more is raised.
    d, state = decide(flood, state, cfg, T0 + 48 * H)
    assert {x.action for x in d if x.node.startswith("n") and x.node not in ("n00", "n01")} == {"breaker_held"}
    assert "--reset-breaker" in by_node(d)["n02"].reason
    # Watch needs no budget even while the breaker is open.
    d, _ = decide(nodes(w=0.25), state, cfg, T0 + 49 * H)
    assert d[0].action == "raise" and d[0].tier == "watch"
    state = reset_breaker(state)
    d, state = decide(flood, state, cfg, T0 + 50 * H)
    assert sum(x.action == "raise" for x in d) == 2 and state.breaker.tripped


def test_breaker_limit_is_the_larger_of_count_and_share():
    assert config(breaker_max_nodes=2, breaker_max_fraction=0.05).breaker_limit(1000) == 50
    assert config(breaker_max_nodes=2, breaker_max_fraction=0.05).breaker_limit(16) == 2
    assert config(breaker_max_nodes=0, breaker_max_fraction=0.2).breaker_limit(10) == 2


def test_a_node_already_counted_in_the_window_raises_again_without_new_budget():
    cfg = config(breaker_max_nodes=1, cooldown=timedelta(0))
    _, state = decide(nodes(a=0.4), PolicyState(), cfg, T0)
    d, state = decide(nodes(a=0.6, b=0.01), state, cfg, T0 + H)
    assert by_node(d)["a"].action == "raise" and not state.breaker.tripped


def test_unavailable_nodes_are_skipped_and_use_no_budget():
    cfg = config(breaker_max_nodes=1)
    inputs = [
        NodeRisk(key="c/a", cluster="c", node="a", risk=0.9, unavailable="drained by an operator"),
        NodeRisk(key="c/b", cluster="c", node="b", risk=0.8),
    ]
    d, state = decide(inputs, PolicyState(), cfg, T0)
    assert (by_node(d)["a"].action, by_node(d)["a"].tier) == ("skip", "none")
    assert "drained by an operator" in by_node(d)["a"].reason
    assert by_node(d)["b"].action == "raise" and not state.breaker.tripped


def test_state_round_trips_through_json():
    cfg = config(breaker_max_nodes=1)
    _, state = decide(nodes(a=0.9, b=0.8, c=0.3), PolicyState(), cfg, T0)
    state = PolicyState(
        nodes={**state.nodes, "c/a": NodeState(**{**state.nodes["c/a"].__dict__, "saved": {"weight": 7}})},
        breaker=state.breaker,
    )
    assert PolicyState.from_json(state.to_json()) == state
    assert PolicyState.from_json(None) == PolicyState()


def test_bad_state_and_config_are_refused_with_what_was_expected():
    with pytest.raises(InputError, match="where.json: not a gpufail policy state"):
        PolicyState.from_json({"nodes": {"c/a": {"tier": "drained"}}, "breaker": {}}, "where.json")
    with pytest.raises(InputError, match="exit <= enter"):
        config(tiers=(Tier("watch", 0.2, 0.3),))
    with pytest.raises(InputError, match="stronger tier must not have a lower enter"):
        config(tiers=(Tier("watch", 0.5, 0.1), Tier("avoid", 0.3, 0.2)))
    with pytest.raises(InputError, match="'none' is not a tier"):
        config(tiers=(Tier("none", 0.5, 0.1),))
    with pytest.raises(InputError, match="timezone-aware"):
        decide([], PolicyState(), config(), datetime(2026, 1, 1))


BUDGETED = (
    Tier("watch", 0.2, 0.1),
    Tier("avoid", 0.3, 0.2, budget_per_day=2),
    Tier("drain_now", 0.8, 0.6),
)


def test_an_alarm_budget_admits_the_riskiest_nodes_up_to_n_per_day():
    cfg = config(tiers=BUDGETED, breaker_max_nodes=10)
    decisions, state = decide(nodes(a=0.6, b=0.5, c=0.4, d=0.25, e=0.9), PolicyState(), cfg, T0)
    got = by_node(decisions)
    # Two nodes enter avoid (the riskiest that reach it); the third falls to watch, the tier
    # below with room. drain_now has no budget.
    assert (got["a"].tier, got["b"].tier, got["c"].tier, got["e"].tier) == ("avoid", "avoid", "watch", "drain_now")
    assert "avoid's alarm budget of 2 nodes per day is used" in got["c"].reason and got["c"].action == "raise"
    assert got["d"].tier == "watch"
    assert sorted(key for _, tier, key in state.entries if tier == "avoid") == ["c/a", "c/b"]
    # Later the same day, a node held at watch cannot enter avoid yet: budget_held.
    later, state2 = decide(nodes(a=0.6, b=0.5, c=0.45), state, cfg, T0 + 8 * H)
    assert by_node(later)["c"].action == "budget_held" and by_node(later)["c"].tier == "watch"
    # A day after the first entries the budget has room again.
    next_day, _ = decide(nodes(a=0.6, b=0.5, c=0.45), state2, cfg, T0 + 25 * H)
    assert by_node(next_day)["c"].action == "raise" and by_node(next_day)["c"].tier == "avoid"


def test_a_budget_below_one_a_day_counts_over_several_days_and_survives_json():
    tier = Tier("avoid", 0.3, 0.2, budget_per_day=0.5)
    assert (tier.budget_window, tier.budget_count) == (timedelta(days=2), 1)
    cfg = config(tiers=(tier,), breaker_max_nodes=10)
    _, state = decide(nodes(a=0.6), PolicyState(), cfg, T0)
    state = PolicyState.from_json(state.to_json())
    held, _ = decide(nodes(a=0.6, b=0.5), state, cfg, T0 + 30 * H)
    assert by_node(held)["b"].action == "budget_held" and by_node(held)["b"].tier == "none"
    freed, _ = decide(nodes(a=0.6, b=0.5), state, cfg, T0 + 49 * H)
    assert by_node(freed)["b"].action == "raise"
    # States written before budgets existed have no entries.
    old = state.to_json()
    del old["entries"]
    assert PolicyState.from_json(old).entries == ()
    with pytest.raises(InputError, match="budget_per_day: expected a positive number"):
        config(tiers=(Tier("avoid", 0.3, 0.2, budget_per_day=0.0),))


def test_a_tier_another_policy_wants_counts_against_its_budget_and_keeps_its_reason():
    cfg = config(tiers=BUDGETED, breaker_max_nodes=10)
    wanted = [
        NodeRisk(key=f"c/{n}", cluster="c", node=n, risk=r, wanted="avoid", why=f"job cost on {n}")
        for n, r in {"a": 0.25, "b": 0.24, "c": 0.22}.items()
    ]
    got = by_node(decide(wanted, PolicyState(), cfg, T0)[0])
    # Below avoid's enter threshold, yet wanted there: the first two take the budget, the third
    # falls to watch (its risk reaches it), each with the other policy's reason.
    assert (got["a"].tier, got["b"].tier, got["c"].tier) == ("avoid", "avoid", "watch")
    assert got["a"].reason.startswith("job cost on a")
    assert "job cost on c" in got["c"].reason and "avoid's alarm budget of 2 nodes per day is used" in got["c"].reason


# -- the fail_slow alarm class ----------------------------------------------------------------


def slow_nodes(**scores):
    """Nodes of low risk whose slowest GPU has the given fail-slow score."""
    return [
        NodeRisk(key=f"c/{n}", cluster="c", node=n, risk=0.01, slow=s, slow_gpu=f"{n}-g0") for n, s in scores.items()
    ]


def test_a_straggler_is_put_in_avoid_with_its_reason_and_kept_while_it_stays_slow():
    cfg = config(fail_slow_threshold=0.05)
    decisions, state = decide(slow_nodes(a=0.12, b=0.04, c=None), PolicyState(), cfg, T0)
    d = by_node(decisions)
    assert (d["a"].action, d["a"].tier) == ("raise", "avoid")
    assert d["a"].reason.startswith("fail-slow: GPU a-g0 runs 12.0% slower than its peers")
    assert (d["b"].tier, d["c"].tier) == ("none", "none")
    assert state.breaker.raised == ((T0, "c/a"),)  # it uses the breaker's budget like any raise
    later, state = decide(slow_nodes(a=0.08), state, cfg, T0 + 30 * H)
    assert (later[0].action, later[0].tier) == ("keep", "avoid")
    # Back to speed: it leaves after the recovery period, as a risk below the exit threshold does.
    held, state = decide(slow_nodes(a=0.0), state, cfg, T0 + 31 * H)
    assert (held[0].action, held[0].tier) == ("keep", "avoid") and "recovery after" in held[0].reason
    done, state = decide(slow_nodes(a=0.0), state, cfg, T0 + 55 * H)
    assert (done[0].action, done[0].tier) == ("lower", "none")


def test_stragglers_trip_the_breaker_like_risky_nodes_and_are_off_without_a_threshold():
    cfg = config(fail_slow_threshold=0.05, breaker_max_nodes=1, breaker_max_fraction=0.0)
    decisions, state = decide(slow_nodes(a=0.2, b=0.1), PolicyState(), cfg, T0)
    assert sorted(d.action for d in decisions) == ["breaker_held", "raise"] and state.breaker.tripped
    off, _ = decide(slow_nodes(a=0.2, b=0.1), PolicyState(), config(), T0)
    assert {d.tier for d in off} == {"none"}


def test_a_stronger_tier_by_risk_wins_over_the_stragglers_avoid():
    cfg = config(fail_slow_threshold=0.05)
    node = NodeRisk(key="c/a", cluster="c", node="a", risk=0.6, slow=0.3, slow_gpu="a-g0")
    (d,), _ = decide([node], PolicyState(), cfg, T0)
    assert d.tier == "drain_after_job" and not d.reason.startswith("fail-slow")
    with pytest.raises(InputError, match="fail_slow_threshold"):
        config(fail_slow_threshold=1.5)


def test_a_straggler_whose_avoid_the_breaker_holds_still_enters_the_tier_its_risk_asks():
    cfg = config(fail_slow_threshold=0.05, breaker_max_nodes=0, breaker_max_fraction=0.0)
    node = NodeRisk(key="c/a", cluster="c", node="a", risk=0.25, slow=0.2, slow_gpu="a-g0")
    (d,), state = decide([node], PolicyState(), cfg, T0)
    assert (d.action, d.tier) == ("raise", "watch") and state.nodes["c/a"].tier == "watch"
    assert "watch enter threshold" in d.reason and "circuit breaker tripped" in d.reason
