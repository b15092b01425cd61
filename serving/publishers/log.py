"""The `log` publisher: no scheduler. Decisions go to the audit log (and the command's output)
only; every node counts as available."""

from __future__ import annotations

from collections.abc import Sequence

from serving.publishers import Applied, Change, NodeView, tier_phrase


class LogPublisher:
    name = "log"

    def observe(self, nodes: Sequence[str]) -> dict[str, NodeView]:
        return {node: NodeView() for node in nodes}

    def apply(self, changes: Sequence[Change]) -> list[Applied]:
        return [
            Applied(True, f"recorded: {tier_phrase(c.old)} -> {tier_phrase(c.new)} (no scheduler)") for c in changes
        ]
