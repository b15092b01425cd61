"""Placement hints and warm standbys: which nodes the scheduler should prefer, and which idle ones
it should keep free. Pure: no I/O, no clock (docs/actions.md).

- **Placement levels** (Aryl-style): each available node gets a level from 0 (healthiest) to
  `count - 1`, its risk in `count` equal steps up to the avoid tier's enter threshold (a node
  above it is in the avoid tier or higher, whose own marks keep large jobs away). Slurm adds the
  level to the node's weight (it fills lower weights first); Kubernetes labels a score, 100 for
  level 0 down to 0 for the last, for preferred node affinity or a scheduler plugin.
- **Warm standbys** (ByteRobust-style): the `count` lowest-risk nodes that are available, run no
  job and have no tier, so that a job evicted from a risky node restarts without waiting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from serving.jobs import NodeLoad
from serving.policy import NodeRisk, PolicyConfig


def placement_levels(nodes: Sequence[NodeRisk], count: int, config: PolicyConfig) -> dict[str, int]:
    """Node name -> its placement level, for the available nodes (none when `count` is 0)."""
    if count <= 0:
        return {}
    ceiling = next((t.enter for t in config.tiers if t.name == "avoid"), 1.0) or 1.0
    return {n.node: min(count - 1, max(0, math.floor(count * n.risk / ceiling))) for n in nodes if not n.unavailable}


def standby_nodes(
    nodes: Sequence[NodeRisk], loads: Mapping[str, NodeLoad], tiers: Mapping[str, str], count: int
) -> list[str]:
    """The `count` lowest-risk nodes that are available, run no job (`loads`, by node name) and
    have no tier (`tiers`, by node key), lowest risk first (a tie: by name)."""
    if count <= 0:
        return []
    idle = [
        n
        for n in nodes
        if not n.unavailable and not (loads.get(n.node) and loads[n.node].busy) and tiers.get(n.key, "none") == "none"
    ]
    return [n.node for n in sorted(idle, key=lambda n: (n.risk, n.node))[:count]]
