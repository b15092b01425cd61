"""The `failure_events` dataset: failures that someone other than the GPU's own log saw.

Three sources write it (`ingest.schema.FAILURE_EVENTS_SCHEMA`), and `features.labels` reads all
of them the same way, beside the failure XIDs:

- `record`: a fleet's tickets or failure records (`gpufail ingest table` with `[failures]`);
- `slurm`: jobs that ended `NODE_FAIL` (`sacct --json`, or the controller's job-completion
  record `jobcomp/filetxt` where there is no accounting database) and nodes that are DOWN with a
  reason (`scontrol show node --json`);
- `kubernetes`: nodes whose `Ready` condition is `False` or `Unknown`, from their transition time.

The parsers here take what those tools print (plain JSON, text) and return rows; running the
tools is the CLI's business. Writing is idempotent: an event already stored (same time, node,
GPU, source and reference) is not written again, so a scheduler can be read every hour.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import polars as pl

from ingest.errors import InputError
from ingest.schema import FAILURE_EVENT_KEY, FAILURE_EVENTS_SCHEMA
from ingest.store import Store

DATASET = "failure_events"
GPUFAIL_REASON_PREFIX = "gpufail"
"""Slurm reasons gpufail itself sets start with this: its own drains are not failures."""

_POLARS_SCHEMA = pl.DataFrame(schema=pl.from_arrow(FAILURE_EVENTS_SCHEMA.empty_table()).schema).schema  # type: ignore[union-attr]


def event_frame(rows: Iterable[Mapping[str, Any]]) -> pl.DataFrame:
    """Rows (dicts with some of the dataset's columns) as a frame of the dataset's columns."""
    records = [{name: row.get(name) for name in _POLARS_SCHEMA} for row in rows]
    return pl.DataFrame(records, schema=_POLARS_SCHEMA)


def write_failure_events(store: Store, events: pl.DataFrame) -> int:
    """Append the events the store does not hold yet; returns how many were new."""
    events = events.unique(FAILURE_EVENT_KEY, keep="first", maintain_order=True)
    if events.height and store.exists(DATASET):
        held = pl.from_arrow(store.read(DATASET, columns=FAILURE_EVENT_KEY))
        assert isinstance(held, pl.DataFrame)
        events = events.join(held, on=FAILURE_EVENT_KEY, how="anti", nulls_equal=True)
    if events.height:
        store.write(DATASET, events.to_arrow().cast(FAILURE_EVENTS_SCHEMA))
    return events.height


# -- Slurm ------------------------------------------------------------------------------------

_HOSTLIST = re.compile(r"([^,\[]+)(?:\[([^\]]+)\])?(?:,|$)")


def expand_hostlist(text: str) -> list[str]:
    """`gpu[001-003,007],login1` -> gpu001, gpu002, gpu003, gpu007, login1 (Slurm's node lists)."""
    names: list[str] = []
    for prefix, ranges in _HOSTLIST.findall(text.strip()):
        if not ranges:
            names.append(prefix)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            if not last:
                names.append(prefix + first)
                continue
            width = len(first)
            names.extend(f"{prefix}{i:0{width}d}" for i in range(int(first), int(last) + 1))
    return [n for n in names if n and n != "None assigned"]


def _epoch(value: Any) -> datetime | None:
    """A Slurm time: epoch seconds, or `{"set": bool, "number": n}` in newer JSON."""
    if isinstance(value, dict):
        value = value.get("number") if value.get("set", True) else None
    if value in (None, 0):
        return None
    return datetime.fromtimestamp(int(value), tz=UTC)


def _state_words(value: Any) -> list[str]:
    """A job or node state as upper-case words: `"NODE_FAIL"`, `["DOWN", "DRAIN"]`,
    `{"current": ...}` all occur across Slurm versions."""
    if isinstance(value, dict):
        value = value.get("current", value.get("base", []))
    if isinstance(value, str):
        value = re.split(r"[+,\s]+", value)
    return [str(v).upper() for v in value or [] if v]


def sacct_node_failures(document: Mapping[str, Any], *, cluster: str, where: str) -> pl.DataFrame:
    """Events of the jobs that ended NODE_FAIL in `sacct --json` output: one per node of the job,
    at the job's end."""
    jobs = document.get("jobs")
    if not isinstance(jobs, list):
        raise InputError(f"{where}: no 'jobs' list; expected the output of sacct --json")
    rows = []
    for job in jobs:
        if "NODE_FAIL" not in _state_words(job.get("state")):
            continue
        end = _epoch((job.get("time") or {}).get("end"))
        if end is None:
            continue
        for node in expand_hostlist(str(job.get("nodes") or "")):
            reason = f"job {job.get('job_id')} ended NODE_FAIL"
            rows.append(
                {
                    "ts": end,
                    "cluster": cluster,
                    "node": node,
                    "source": "slurm",
                    "reason": reason,
                    "ref": f"job:{job.get('job_id')}",
                }
            )
    return event_frame(rows)


_JOBCOMP_FIELD = re.compile(r"(\w+)=(\S*)")


def jobcomp_node_failures(text: str, *, cluster: str, where: str) -> pl.DataFrame:
    """Events of the NODE_FAIL jobs in a `jobcomp/filetxt` record (one `Key=value ...` line per
    job, times in the controller's local time as `YYYY-MM-DDTHH:MM:SS`, taken as UTC: run the
    controller in UTC or convert the file)."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = dict(_JOBCOMP_FIELD.findall(line))
        if fields.get("JobState") != "NODE_FAIL":
            continue
        try:
            end = datetime.fromisoformat(fields["EndTime"]).replace(tzinfo=UTC)
        except (KeyError, ValueError):
            raise InputError(f"{where} line {number}: no EndTime=YYYY-MM-DDTHH:MM:SS in a NODE_FAIL job") from None
        job = fields.get("JobId", "?")
        for node in expand_hostlist(fields.get("NodeList", "")):
            rows.append(
                {
                    "ts": end,
                    "cluster": cluster,
                    "node": node,
                    "source": "slurm",
                    "reason": f"job {job} ended NODE_FAIL",
                    "ref": f"job:{job}",
                }
            )
    return event_frame(rows)


def slurm_down_nodes(document: Mapping[str, Any], *, cluster: str, where: str) -> pl.DataFrame:
    """Events of the nodes that `sinfo --json` (or a newer `scontrol show node --json`) reports
    DOWN or FAIL, at the time their reason was set. A drain is not a failure: gpufail drains
    nodes itself, and an operator's drain is maintenance until they set the node DOWN."""
    nodes = document.get("nodes")
    if not isinstance(nodes, list):
        raise InputError(f"{where}: no 'nodes' list; expected the output of sinfo --json")
    rows = []
    for node in nodes:
        words = set(_state_words(node.get("state"))) | set(_state_words(node.get("state_flags")))
        reason = str(node.get("reason") or "")
        if not ({"DOWN", "FAIL"} & words) or reason.lower().startswith(GPUFAIL_REASON_PREFIX):
            continue
        since = _epoch(node.get("reason_changed_at")) or _epoch(node.get("last_busy"))
        if since is None:
            continue
        name = str(node.get("name") or node.get("hostname"))
        state = "+".join(sorted(words & {"DOWN", "FAIL"}))
        rows.append(
            {
                "ts": since,
                "cluster": cluster,
                "node": name,
                "source": "slurm",
                "reason": f"node {state}: {reason}" if reason else f"node {state}",
                "ref": "node",
            }
        )
    return event_frame(rows)


# -- Kubernetes -------------------------------------------------------------------------------


def kubernetes_not_ready(nodes: Iterable[Mapping[str, Any]], *, cluster: str) -> pl.DataFrame:
    """Events of the nodes (Kubernetes Node objects as plain dicts) whose `Ready` condition is
    False or Unknown, at its `lastTransitionTime`."""
    rows = []
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name"))
        for condition in (node.get("status") or {}).get("conditions") or []:
            if condition.get("type") != "Ready" or condition.get("status") == "True":
                continue
            when = condition.get("lastTransitionTime") or condition.get("last_transition_time")
            if when is None:
                continue
            ts = when if isinstance(when, datetime) else datetime.fromisoformat(str(when).replace("Z", "+00:00"))
            reason = condition.get("reason") or f"Ready={condition.get('status')}"
            rows.append(
                {
                    "ts": ts.astimezone(UTC),
                    "cluster": cluster,
                    "node": name,
                    "source": "kubernetes",
                    "reason": str(reason),
                    "ref": "node",
                }
            )
    return event_frame(rows)


def kubernetes_failure_events(api: Any, *, cluster: str) -> pl.DataFrame:
    """`kubernetes_not_ready` of the nodes a `kubernetes.client.CoreV1Api` lists."""
    from kubernetes.client import ApiClient

    listed = api.list_node()
    return kubernetes_not_ready([ApiClient().sanitize_for_serialization(n) for n in listed.items], cluster=cluster)
