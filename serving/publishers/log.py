"""The `log` publisher: no scheduler. Decisions go to the audit log (and the command's output)
only; every node counts as available. Its job map, for the cost policy, is the document at
`jobs_url` (`serving.jobs.job_map_from_document`), if one is given."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from serving.cost_policy import Hint
from serving.jobs import JobMap, JobMapUnreadable, read_job_document
from serving.publishers import Applied, Change, NodeView, tier_phrase


@dataclass
class LogPublisher:
    jobs_url: str = ""
    """A URL or file of the job document ('' = no job map)."""
    timeout: float = 30.0
    name = "log"

    def observe(self, nodes: Sequence[str]) -> dict[str, NodeView]:
        return {node: NodeView() for node in nodes}

    def apply(self, changes: Sequence[Change]) -> list[Applied]:
        return [
            Applied(True, f"recorded: {tier_phrase(c.old)} -> {tier_phrase(c.new)} (no scheduler)") for c in changes
        ]

    def read_jobs(self) -> JobMap:
        if not self.jobs_url:
            raise JobMapUnreadable("log: no job map; expected [publish] jobs_url (a URL or file of the job document)")
        return read_job_document(self.jobs_url, self.timeout)

    def checkpoint(self, hints: Sequence[Hint]) -> list[Applied]:
        return [Applied(True, f"recorded: checkpoint hint to job {h.job.id} (no scheduler)") for h in hints]
