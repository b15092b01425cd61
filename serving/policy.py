"""The action policy: from node risks to risk tiers, safely. Pure: no I/O, no clock.

Tiers, weakest first: `none`, `watch` (recorded only), `avoid` (keep new large jobs off the
node), `drain_after_job` (no new jobs; the running one finishes), `drain_now` (the strongest).
How each publisher expresses a tier is in `serving/publishers/`.

The risk is the calibrated probability that a GPU fails within the model's horizon
(`models.calibration`), combined per node (`serving.score.node_risk`), so a threshold means
what it says: a node at 0.5 fails about half the time. A tier is set either by thresholds
alone, or as an **alarm budget** (`Tier.budget_per_day`): at most that many nodes may enter it
per day (riskiest first, each still at or above `enter`, the least risk that may enter at
all); a node over the budget enters the strongest weaker tier it reaches that has room, or
stays where it is (`budget_held`). A budget below one a day is counted over as many days as
make one node (0.5: one node per two days).

Per node, on each call (`decide`):

- **Hysteresis**: a node enters a tier when its risk reaches the tier's `enter` threshold and
  leaves it only when its risk has stayed below the tier's `exit` threshold (lower than
  `enter`) for `recovery_period`; it then falls to the tier its risk enters now (often
  `none`). A risk that wobbles around a threshold does not make the node flap.
- **Repair**: a repair record for the node after it entered its tier clears the tier at once
  (the part that was predicted to fail has been dealt with).
- **Cooldown**: a node whose tier changed less than `cooldown` ago is not raised again, except
  to the strongest tier (a node about to fail is not kept in service by a timer).
- **Circuit breaker**: at most `breaker_limit` distinct nodes may be raised into an acting
  tier (`avoid` and above) within `breaker_window`: the larger of `breaker_max_nodes` and
  `breaker_max_fraction` of the fleet. Nodes are served riskiest first; when the budget runs
  out the breaker trips, and from then on no node is raised (tiers may still fall) until an
  operator resets it (`reset_breaker`). Mass drains after an XID flood or a bad model are the
  top complaint about existing tools (NVSentinel, NHC).
- **Unavailable nodes** (down, drained by an operator, unknown to the scheduler) are skipped:
  their tier is kept and they never use the breaker's budget.

The state (`PolicyState`) is plain JSON (`to_json` / `from_json`), persisted by the caller so a
restart neither acts twice nor forgets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from ingest.errors import InputError

TIERS = ("none", "watch", "avoid", "drain_after_job", "drain_now")
"""Every tier, weakest first."""
ACTING_TIERS = frozenset({"avoid", "drain_after_job", "drain_now"})
"""Tiers that change what the scheduler does; raising a node into one uses the breaker's budget."""

ACTIONS = ("raise", "lower", "keep", "breaker_held", "cooldown_held", "budget_held", "skip")
HELD = frozenset({"breaker_held", "cooldown_held", "budget_held"})
"""Decisions that would have raised the node but for a rule."""


def tier_rank(tier: str) -> int:
    try:
        return TIERS.index(tier)
    except ValueError:
        raise InputError(f"tier: expected one of {', '.join(TIERS)}, got {tier!r}") from None


@dataclass(frozen=True)
class Tier:
    name: str
    enter: float
    exit: float
    budget_per_day: float | None = None
    """At most this many nodes enter the tier per day (None: no limit; see the module notes)."""

    @property
    def budget_window(self) -> timedelta:
        """The window the budget is counted over: a day, or as many days as make one node."""
        per_day = self.budget_per_day or 1.0
        return timedelta(days=max(1, math.ceil(1.0 / per_day - 1e-9)))

    @property
    def budget_count(self) -> int:
        """Entries allowed within `budget_window`."""
        per_day = self.budget_per_day or 0.0
        return math.floor(per_day * self.budget_window.days + 1e-9)


@dataclass(frozen=True)
class PolicyConfig:
    tiers: tuple[Tier, ...]
    """The enabled tiers (any subset of watch..drain_now), in any order."""
    recovery_period: timedelta = timedelta(hours=24)
    cooldown: timedelta = timedelta(hours=6)
    breaker_max_nodes: int = 2
    breaker_max_fraction: float = 0.05
    breaker_window: timedelta = timedelta(hours=24)
    fail_slow_threshold: float | None = None
    """The `fail_slow` alarm class: a node with a GPU whose fail-slow score reaches this (a
    sustained deficit against its peers, `features.fail_slow`) wants at least `FAIL_SLOW_TIER`,
    through the same rules as a risk (module notes); None: stragglers are not acted on."""

    def __post_init__(self) -> None:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names) or not self.tiers:
            raise InputError(f"tiers: expected at least one tier, each at most once, got {names}")
        for t in self.tiers:
            if tier_rank(t.name) == 0:
                raise InputError("tiers: 'none' is not a tier to configure; it is every node below the first")
            if not 0.0 <= t.exit <= t.enter <= 1.0:
                raise InputError(
                    f"tiers.{t.name}: expected 0 <= exit <= enter <= 1, got enter {t.enter}, exit {t.exit}"
                )
            if t.budget_per_day is not None and not (math.isfinite(t.budget_per_day) and t.budget_per_day > 0):
                raise InputError(
                    f"tiers.{t.name}.budget_per_day: expected a positive number of nodes per day, got {t.budget_per_day}"
                )
        ordered = sorted(self.tiers, key=lambda t: tier_rank(t.name))
        enters = [t.enter for t in ordered]
        if enters != sorted(enters):
            raise InputError(f"tiers: a stronger tier must not have a lower enter threshold, got {names} -> {enters}")
        object.__setattr__(self, "tiers", tuple(ordered))
        if self.breaker_max_nodes < 0 or not 0.0 <= self.breaker_max_fraction <= 1.0:
            raise InputError(
                "breaker: expected breaker_max_nodes >= 0 and breaker_max_fraction in [0, 1], "
                f"got {self.breaker_max_nodes} and {self.breaker_max_fraction}"
            )
        for name in ("recovery_period", "cooldown", "breaker_window"):
            if getattr(self, name) < timedelta(0):
                raise InputError(f"{name}: expected a duration >= 0, got {getattr(self, name)}")
        slow = self.fail_slow_threshold
        if slow is not None and not (math.isfinite(slow) and 0.0 < slow < 1.0):
            raise InputError(f"fail_slow_threshold: expected a share of the peers' speed in (0, 1), got {slow}")

    def breaker_limit(self, fleet_nodes: int) -> int:
        # The epsilon keeps 0.2 * 10 at 2 despite binary floating point.
        return max(self.breaker_max_nodes, math.floor(self.breaker_max_fraction * fleet_nodes + 1e-9))

    def entered_tier(self, risk: float) -> str:
        """The strongest tier whose enter threshold `risk` reaches ('none' if none)."""
        reached = [t.name for t in self.tiers if risk >= t.enter]
        return reached[-1] if reached else "none"

    def entered_tiers(self, risk: np.ndarray) -> np.ndarray:
        """`entered_tier` of each risk, for a whole array at once (object array of names)."""
        out = np.full(len(risk), "none", dtype=object)
        for t in self.tiers:  # weakest first: a stronger tier overwrites
            out[np.asarray(risk) >= t.enter] = t.name
        return out

    def tier(self, name: str) -> Tier | None:
        return next((t for t in self.tiers if t.name == name), None)

    def exit_threshold(self, tier: str) -> float:
        for t in self.tiers:
            if t.name == tier:
                return t.exit
        return 0.0  # a tier no longer configured: leave it as soon as recovery allows

    @property
    def strongest(self) -> str:
        return self.tiers[-1].name


@dataclass(frozen=True)
class NodeState:
    tier: str = "none"
    since: datetime | None = None
    """When the node entered its tier."""
    changed_at: datetime | None = None
    """When the tier last changed (the cooldown runs from here)."""
    below_since: datetime | None = None
    """Since when the risk has stayed below the tier's exit threshold (None: it has not)."""
    applied: str = "none"
    """The tier the scheduler was last told (differs from `tier` until a publisher succeeds)."""
    saved: Mapping[str, Any] = field(default_factory=dict)
    """What a publisher saved to undo its change (e.g. the node's Slurm weight before ours)."""


@dataclass(frozen=True)
class BreakerState:
    tripped_at: datetime | None = None
    reason: str = ""
    raised: tuple[tuple[datetime, str], ...] = ()
    """(time, node key) of each raise into an acting tier, within the window."""

    @property
    def tripped(self) -> bool:
        return self.tripped_at is not None


@dataclass(frozen=True)
class PolicyState:
    nodes: Mapping[str, NodeState] = field(default_factory=dict)
    breaker: BreakerState = BreakerState()
    entries: tuple[tuple[datetime, str, str], ...] = ()
    """(time, tier, node key) of each raise into a tier with an alarm budget, within its window."""

    def to_json(self) -> dict[str, Any]:
        return {
            "version": 1,
            "nodes": {
                key: {
                    "tier": s.tier,
                    "since": _iso(s.since),
                    "changed_at": _iso(s.changed_at),
                    "below_since": _iso(s.below_since),
                    "applied": s.applied,
                    "saved": dict(s.saved),
                }
                for key, s in sorted(self.nodes.items())
            },
            "breaker": {
                "tripped_at": _iso(self.breaker.tripped_at),
                "reason": self.breaker.reason,
                "raised": [[_iso(t), key] for t, key in self.breaker.raised],
            },
            "entries": [[_iso(t), tier, key] for t, tier, key in self.entries],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, where: str = "policy state") -> PolicyState:
        if not data:
            return cls()
        try:
            nodes = {
                key: NodeState(
                    tier=_known_tier(s["tier"]),
                    since=_time(s.get("since")),
                    changed_at=_time(s.get("changed_at")),
                    below_since=_time(s.get("below_since")),
                    applied=_known_tier(s.get("applied", "none")),
                    saved=dict(s.get("saved") or {}),
                )
                for key, s in data["nodes"].items()
            }
            b = data["breaker"]
            raised = tuple((_required_time(t), str(key)) for t, key in b.get("raised", []))
            breaker = BreakerState(
                tripped_at=_time(b.get("tripped_at")), reason=str(b.get("reason", "")), raised=raised
            )
            # Absent from states written before tiers could have a budget.
            entries = tuple(
                (_required_time(t), _known_tier(tier), str(key)) for t, tier, key in data.get("entries", [])
            )
        except (KeyError, TypeError, ValueError, AttributeError, InputError) as exc:
            raise InputError(f"{where}: not a gpufail policy state ({type(exc).__name__}: {exc})") from None
        return cls(nodes=nodes, breaker=breaker, entries=entries)


@dataclass(frozen=True)
class NodeRisk:
    """One node's input to the policy."""

    key: str
    """Identifies the node in the state: `cluster/node`."""
    cluster: str
    node: str
    risk: float
    gpus: tuple[str, ...] = ()
    top_features: tuple[str, ...] = ()
    unavailable: str = ""
    """Why the scheduler's node must not be touched ('' when it may be)."""
    repaired_at: datetime | None = None
    """The node's latest repair record, if any."""
    wanted: str = ""
    """The tier another policy chose for the node (`serving.cost_policy`), with `why`; '' = the
    tier its risk enters. The rules here (repair, cooldown, breaker, recovery) apply to either."""
    why: str = ""
    slow: float | None = None
    """The largest fail-slow score of the node's GPUs (None: not known)."""
    slow_gpu: str = ""
    """The GPU with that score."""


@dataclass(frozen=True)
class Decision:
    time: datetime
    key: str
    cluster: str
    node: str
    gpus: tuple[str, ...]
    risk: float
    previous_tier: str
    tier: str
    action: str
    reason: str
    top_features: tuple[str, ...]


def reset_breaker(state: PolicyState) -> PolicyState:
    """The breaker closed, with a fresh budget (an operator's explicit decision)."""
    return replace(state, breaker=BreakerState())


def decide(
    nodes: Sequence[NodeRisk], state: PolicyState, config: PolicyConfig, now: datetime, fleet_nodes: int | None = None
) -> tuple[list[Decision], PolicyState]:
    """One decision per node (riskiest first) and the state after them. `fleet_nodes` (default:
    the number of nodes given) is the fleet size the breaker's fraction applies to."""
    if now.tzinfo is None:
        raise InputError("now: expected a timezone-aware time")
    fleet = len(nodes) if fleet_nodes is None else fleet_nodes
    limit = config.breaker_limit(fleet)
    window_start = now - config.breaker_window
    breaker = replace(state.breaker, raised=tuple(r for r in state.breaker.raised if r[0] > window_start))
    entries = [e for e in state.entries if (t := config.tier(e[1])) is not None and e[0] > now - t.budget_window]
    new_nodes = dict(state.nodes)
    decisions = []
    for own in sorted(nodes, key=lambda n: (-n.risk, n.key)):
        n = _with_fail_slow(own, config)
        previous = state.nodes.get(n.key, NodeState())
        decision, after, breaker = _decide_node(n, previous, config, now, breaker, limit, fleet, entries)
        if n is not own and decision.action in HELD:
            # The straggler's avoid is held back: the node still gets what its own risk asks.
            alone, alone_after, alone_breaker = _decide_node(own, previous, config, now, breaker, limit, fleet, entries)
            if alone.action == "raise":
                decision = replace(alone, reason=f"{alone.reason}; {decision.reason}")
                after, breaker = alone_after, alone_breaker
        decisions.append(decision)
        if decision.action == "raise" and (tier := config.tier(decision.tier)) and tier.budget_per_day:
            entries.append((now, decision.tier, n.key))
        if after != NodeState():
            new_nodes[n.key] = after
        else:
            new_nodes.pop(n.key, None)
    return decisions, PolicyState(nodes=new_nodes, breaker=breaker, entries=tuple(entries))


FAIL_SLOW_TIER = "avoid"
"""What a straggler wants: keep new large gang jobs off the node (every synchronous job steps at
its slowest GPU's pace); it is not predicted to fail, so it is not drained."""
FAIL_SLOW_REASON = "fail-slow"
"""How the reason of a decision made for a straggler starts (the audit, the publishers' marks)."""


def _with_fail_slow(n: NodeRisk, config: PolicyConfig) -> NodeRisk:
    """`n`, wanting `FAIL_SLOW_TIER` when a GPU of it is a straggler and nothing else wants as
    much: the tier then goes through the same rules (breaker, cooldown, hysteresis: it is kept
    while the GPU stays slow and left after `recovery_period` once it is not)."""
    threshold = config.fail_slow_threshold
    if threshold is None or n.slow is None or not n.slow >= threshold or config.tier(FAIL_SLOW_TIER) is None:
        return n
    wanted = n.wanted or config.entered_tier(n.risk)
    if tier_rank(wanted) >= tier_rank(FAIL_SLOW_TIER):
        return n
    why = (
        f"{FAIL_SLOW_REASON}: GPU {n.slow_gpu} runs {n.slow:.1%} slower than its peers "
        f"(fail-slow score {n.slow:.3f} >= {threshold:g}); node risk {n.risk:.3f}"
    )
    return replace(n, wanted=FAIL_SLOW_TIER, why=why + (f"; {n.why}" if n.why else ""))


def _within_budget(target: str, risk: float, config: PolicyConfig, entries: list[tuple[datetime, str, str]]) -> str:
    """`target`, or the strongest weaker tier the risk reaches whose alarm budget has room
    ('none' if none): the tiers with a budget admit at most `budget_count` nodes per window."""
    if config.tier(target) is None:  # not a configured tier: it has no budget
        return target
    for tier in reversed(config.tiers):
        # The target itself even below its enter threshold: another policy may have chosen it.
        if tier_rank(tier.name) > tier_rank(target) or (tier.name != target and risk < tier.enter):
            continue
        if tier.budget_per_day is None or sum(e[1] == tier.name for e in entries) < tier.budget_count:
            return tier.name
    return "none"


def _decide_node(
    n: NodeRisk,
    previous: NodeState,
    config: PolicyConfig,
    now: datetime,
    breaker: BreakerState,
    limit: int,
    fleet: int,
    entries: list[tuple[datetime, str, str]],
) -> tuple[Decision, NodeState, BreakerState]:
    current = previous.tier

    def decision(action: str, tier: str, reason: str) -> Decision:
        return Decision(now, n.key, n.cluster, n.node, n.gpus, n.risk, current, tier, action, reason, n.top_features)

    def moved(tier: str) -> NodeState:
        return replace(previous, tier=tier, since=now, changed_at=now, below_since=None)

    risk_text = f"node risk {n.risk:.3f}"
    if n.unavailable:
        return decision("skip", current, f"not touched: {n.unavailable}"), previous, breaker
    if current != "none" and n.repaired_at is not None and (previous.since is None or n.repaired_at > previous.since):
        reason = f"repaired at {n.repaired_at:%Y-%m-%d %H:%M}Z after entering {current}; {risk_text}"
        return decision("lower", "none", reason), moved("none"), breaker

    target = n.wanted or config.entered_tier(n.risk)
    if tier_rank(target) > tier_rank(current):
        allowed = _within_budget(target, n.risk, config, entries)
        if allowed != target:
            tier = config.tier(target)
            assert tier is not None and tier.budget_per_day is not None
            full = (
                f"{target}'s alarm budget of {tier.budget_per_day:g} nodes per day is used "
                f"({tier.budget_count} within {tier.budget_window})"
            )
            if tier_rank(allowed) <= tier_rank(current):
                reason = f"would raise to {target} ({n.why or f'{risk_text} >= enter threshold {tier.enter:.3f}'}), but {full}"
                return decision("budget_held", current, reason), replace(previous, below_since=None), breaker
            n_note = f"; {full}"
            target = allowed
        else:
            n_note = ""
        enter = next((t.enter for t in config.tiers if t.name == target), 0.0)
        why = (n.why or f"{risk_text} >= {target} enter threshold {enter:.3f}") + n_note
        cooling = previous.changed_at is not None and now - previous.changed_at < config.cooldown
        if cooling and target != config.strongest:
            reason = f"would raise to {target} ({why}), but the tier changed at {previous.changed_at:%Y-%m-%d %H:%M}Z, within the cooldown of {config.cooldown}"
            return decision("cooldown_held", current, reason), replace(previous, below_since=None), breaker
        if target in ACTING_TIERS:
            counted = {key for _, key in breaker.raised}
            if breaker.tripped:
                reason = f"would raise to {target} ({why}), but the circuit breaker is open since {breaker.tripped_at:%Y-%m-%d %H:%M}Z ({breaker.reason}); reset it with `gpufail publish --reset-breaker`"
                return decision("breaker_held", current, reason), previous, breaker
            if n.key not in counted:
                if len(counted) >= limit:
                    trip = (
                        f"more than {limit} nodes (the larger of {config.breaker_max_nodes} and "
                        f"{config.breaker_max_fraction:.0%} of {fleet}) to raise within {config.breaker_window}"
                    )
                    breaker = replace(breaker, tripped_at=now, reason=trip)
                    reason = f"would raise to {target} ({why}), but the circuit breaker tripped: {trip}"
                    return decision("breaker_held", current, reason), previous, breaker
                breaker = replace(breaker, raised=(*breaker.raised, (now, n.key)))
        return decision("raise", target, why), moved(target), breaker

    if current == "none":
        return decision("keep", "none", n.why or f"{risk_text} below every enter threshold"), previous, breaker
    exit_at = config.exit_threshold(current)
    if tier_rank(target) >= tier_rank(current) if n.wanted else n.risk >= exit_at:
        reason = n.why or f"{risk_text} >= {current} exit threshold {exit_at:.3f}"
        return decision("keep", current, reason), replace(previous, below_since=None), breaker
    below = f"{n.why}; {target} wanted" if n.wanted else f"{risk_text} below {current} exit threshold {exit_at:.3f}"
    below_since = previous.below_since or now
    if now - below_since >= config.recovery_period:
        reason = f"{below} since {below_since:%Y-%m-%d %H:%M}Z (recovery period {config.recovery_period})"
        return decision("lower", target, reason), moved(target), breaker
    reason = f"{below} since {below_since:%Y-%m-%d %H:%M}Z; recovery after {config.recovery_period}"
    return decision("keep", current, reason), replace(previous, below_since=below_since), breaker


def _iso(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat()


def _time(value: Any) -> datetime | None:
    return None if value is None else _required_time(value)


def _required_time(value: Any) -> datetime:
    t = datetime.fromisoformat(str(value))
    if t.tzinfo is None:
        raise ValueError(f"time {value!r} has no timezone")
    return t


def _known_tier(value: Any) -> str:
    tier_rank(str(value))
    return str(value)
