"""The job map: which jobs run on which node, and what a failure of the node would cost them.

A failure stops every job with a GPU on the node, and each of them loses the work of all its
GPUs since its last checkpoint (MegaScale restarts a job from its last checkpoint;
docs/actions.md). Per node (`node_loads`):

- **blast radius**: the GPUs of the jobs on it (all their GPUs, on every node);
- **work at risk**: GPU-hours since each job's last checkpoint, summed over those jobs;
- when its jobs end (their time limits), and how many of its GPUs they use;
- per job, its `Exposure`: GPUs, hours since its last checkpoint, hours to its next one, hours
  to its end (what the cost policy needs to price a failure later in the horizon).

The last checkpoint is reported by the job (docs/actions.md):
- Slurm: a `gpufail_checkpoint=<ISO time>` word in the job's comment, set at submission
  (`sbatch --comment`) and after each checkpoint (`scontrol update JobId=$SLURM_JOB_ID
  Comment=gpufail_checkpoint=...`);
- Kubernetes: the pod annotation `gpufail.io/checkpoint-at` (the newest of the job's pods);
- a custom scheduler: `checkpoint_at` in the job document (`job_map_from_document`).
A job that reports none is taken to checkpoint every `checkpoint_interval` from its start.
A job reports when it checkpointed, not how often: its next checkpoint is taken to come one
`checkpoint_interval` after its last; a job already past that (it checkpoints less often than
configured) is taken to checkpoint within the next `checkpoint_interval` (`Exposure`).

Readers take what the scheduler printed (`squeue --json`, the pod list, a JSON document) and
never call it: the publishers do (`serving.publishers`). A record that cannot be read at all
(not JSON, not the scheduler's shape) raises `JobMapUnreadable` with one line; a field of one job
that cannot be read (a checkpoint time that is not a time) is left out with a notice, and the
job is still counted.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from ingest.errors import GpufailError

CHECKPOINT_WORD = "gpufail_checkpoint"
"""Slurm: the job comment word `gpufail_checkpoint=<ISO time>` reports the last checkpoint."""
CHECKPOINT_ANNOTATION = "gpufail.io/checkpoint-at"
"""Kubernetes: the pod annotation that reports the job's last checkpoint."""
JOB_LABEL = "gpufail.io/job"
"""Kubernetes: a pod label that names the job the pod belongs to (gang jobs whose pods have
different owners)."""
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
GPU_RESOURCES = ("nvidia.com/gpu",)
SLURM_ACTIVE_STATES = frozenset({"RUNNING", "SUSPENDED"})
"""Slurm job states that hold their nodes (a pending job has none; a completing one is done)."""

_CHECKPOINT_RE = re.compile(rf"(?:^|\s){CHECKPOINT_WORD}=(\S+)")
_GRES_GPU_RE = re.compile(r"(?:^|,)gpu(?::[^:(,]+)?:(\d+)")
_TRES_GPU_RE = re.compile(r"gres[:/]gpu(?::[^:=,]+)?[:=](\d+)")


class JobMapUnreadable(GpufailError):
    """The scheduler's job list could not be read (one line: what, where, expected)."""


@dataclass(frozen=True)
class Job:
    id: str
    """The scheduler's id: the Slurm job id, `namespace/Kind/name` in Kubernetes."""
    gpus_on: Mapping[str, int]
    """Node -> GPUs of the job on it."""
    start: datetime | None = None
    checkpoint_at: datetime | None = None
    """The last checkpoint the job reported (None: none reported)."""
    end_by: datetime | None = None
    """When its time limit ends it (None: no limit)."""
    owner: str = ""
    """Slurm: the user; Kubernetes: the owning object."""
    group: str = ""
    """Slurm: the partition; Kubernetes: the namespace."""
    pods: tuple[str, ...] = ()
    """Kubernetes: its pods as `namespace/name` (where a checkpoint hint goes)."""

    @property
    def gpus(self) -> int:
        return sum(self.gpus_on.values())

    def hours_since_checkpoint(self, now: datetime, interval: timedelta) -> tuple[float, bool]:
        """Hours since the job's last checkpoint, and whether that checkpoint is assumed (none
        reported: one every `interval` from the start). A report older than the start (a
        requeued job keeps its comment) counts from the start; one in the future as now."""
        if self.start is None:
            return interval.total_seconds() / 3600, True
        ran = max((now - self.start).total_seconds(), 0.0)
        if self.checkpoint_at is not None:
            since = (now - max(self.checkpoint_at, self.start)).total_seconds()
            return min(max(since, 0.0), ran) / 3600, False
        step = interval.total_seconds()
        return (ran % step if step > 0 else ran) / 3600, True


@dataclass(frozen=True)
class JobMap:
    jobs: tuple[Job, ...]
    source: str = ""
    """Where it was read (for messages)."""
    notices: tuple[str, ...] = ()
    """Fields of single jobs that could not be read (the job is still counted)."""

    def by_id(self) -> dict[str, Job]:
        return {j.id: j for j in self.jobs}


@dataclass(frozen=True)
class Exposure:
    """One job on a node, as a failure of the node later in the horizon would find it."""

    gpus: int
    """All its GPUs (on every node)."""
    since: float
    """Hours since its last checkpoint."""
    to_checkpoint: float
    """Hours to its next periodic checkpoint."""
    interval: float
    """Hours between its periodic checkpoints."""
    to_end: float
    """Hours until its time limit ends it (inf: none)."""
    assumed: bool = False
    """Whether its last checkpoint is assumed (none reported)."""


def exposure(job: Job, now: datetime, checkpoint_interval: timedelta) -> Exposure:
    """The job's `Exposure` at `now`. Its interval is `checkpoint_interval` (a job reports when it
    checkpointed, not how often); one past it is taken to checkpoint within the next interval."""
    since, assumed = job.hours_since_checkpoint(now, checkpoint_interval)
    interval = checkpoint_interval.total_seconds() / 3600
    to_checkpoint = interval - since if since < interval else interval
    to_end = math.inf if job.end_by is None else max((job.end_by - now).total_seconds() / 3600, 0.0)
    return Exposure(job.gpus, since, to_checkpoint, interval, to_end, assumed)


@dataclass(frozen=True)
class NodeLoad:
    """What runs on one node, for the cost policy."""

    jobs: tuple[str, ...] = ()
    used_gpus: int = 0
    """GPUs of this node the jobs use."""
    blast_radius: int = 0
    """GPUs of every job on the node (all their nodes)."""
    work_at_risk: float = 0.0
    """GPU-hours since the jobs' last checkpoints."""
    hours_to_end: float = 0.0
    """Until the last of its jobs ends by its time limit (inf: one has none; 0: no job)."""
    assumed: tuple[str, ...] = ()
    """Jobs whose checkpoint is assumed (none reported)."""
    exposures: tuple[Exposure, ...] = ()
    """Each job's `Exposure`, in the order of `jobs`."""

    @property
    def busy(self) -> bool:
        return bool(self.jobs)


IDLE = NodeLoad()


def node_loads(job_map: JobMap, now: datetime, checkpoint_interval: timedelta) -> dict[str, NodeLoad]:
    """Each node that runs a job -> its `NodeLoad` (nodes without a job are left out: `IDLE`)."""
    acc: dict[str, list[Any]] = {}
    for job in job_map.jobs:
        exp = exposure(job, now, checkpoint_interval)
        for node, on_node in job.gpus_on.items():
            a = acc.get(node)
            if a is None:
                a = acc[node] = [[], 0, 0, 0.0, 0.0, [], []]
            a[0].append(job.id)
            a[1] += on_node
            a[2] += exp.gpus
            a[3] += exp.gpus * exp.since
            a[4] = max(a[4], exp.to_end)
            if exp.assumed:
                a[5].append(job.id)
            a[6].append(exp)
    return {
        node: NodeLoad(tuple(a[0]), a[1], a[2], a[3], a[4], tuple(a[5]), tuple(a[6]))  # type: ignore[arg-type]
        for node, a in acc.items()
    }


# --- Slurm -----------------------------------------------------------------------------------


def expand_hostlist(expression: str) -> list[str]:
    """Slurm's hostlist syntax -> node names: `gpu[001-003,007],cpu1` -> gpu001, gpu002, gpu003,
    gpu007, cpu1 (zero padding kept; several bracket groups in one name multiply out)."""
    names: list[str] = []
    for item in _top_level_items(expression):
        parts = re.split(r"(\[[^\]]*\])", item)
        expanded = [""]
        for part in parts:
            if part.startswith("["):
                choices = []
                for piece in part[1:-1].split(","):
                    lo, sep, hi = piece.partition("-")
                    if not lo.isdigit() or (sep and not hi.isdigit()):
                        raise ValueError(f"hostlist {expression!r}: expected ranges like [001-004,007], got {part!r}")
                    if not sep:
                        choices.append(lo)
                        continue
                    width = len(lo)
                    choices.extend(f"{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
                expanded = [e + c for e in expanded for c in choices]
            elif "[" in part or "]" in part:
                raise ValueError(f"hostlist {expression!r}: unbalanced brackets")
            else:
                expanded = [e + part for e in expanded]
        names.extend(expanded)
    return names


def _top_level_items(expression: str) -> Iterable[str]:
    depth, start = 0, 0
    for i, ch in enumerate(expression):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            if expression[start:i].strip():
                yield expression[start:i].strip()
            start = i + 1
    if expression[start:].strip():
        yield expression[start:].strip()


def slurm_job_map(text: str | bytes, source: str = "squeue --json") -> JobMap:
    """The running jobs of `squeue --json` output (Slurm 22.05; the number and state shapes of
    later releases are read too)."""
    try:
        answer = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JobMapUnreadable(f"{source}: not JSON ({exc})") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("jobs"), list):
        raise JobMapUnreadable(f"{source}: expected Slurm's {{'jobs': [...]}}, got {type(answer).__name__}")
    if answer.get("errors"):
        raise JobMapUnreadable(f"{source} reported {answer['errors']}")
    jobs: list[Job] = []
    notices: list[str] = []
    for i, record in enumerate(answer["jobs"]):
        try:
            job = _slurm_job(record, notices)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise JobMapUnreadable(
                f"{source}: job record {i} is not a Slurm job ({type(exc).__name__}: {exc}); expected job_id, "
                "job_state, nodes and start_time"
            ) from None
        if job is not None:
            jobs.append(job)
    return JobMap(tuple(jobs), source, tuple(notices))


def _slurm_job(record: Mapping[str, Any], notices: list[str]) -> Job | None:
    state = record["job_state"]
    states = {str(s).upper() for s in state} if isinstance(state, list) else {str(state).upper()}
    if not states & SLURM_ACTIVE_STATES:
        return None
    job_id = str(record["job_id"])
    nodes = _slurm_nodes(record)
    if not nodes:
        notices.append(f"job {job_id}: {sorted(states)[0].lower()} but no nodes listed; left out of the job map")
        return None
    per_node = _slurm_gpus_per_node(record, len(nodes))
    start = _epoch(record.get("start_time"))
    limit = _number(record.get("time_limit"))
    end_by = start + timedelta(minutes=limit) if start is not None and limit is not None else None
    comment = record.get("comment") or ""
    if isinstance(comment, Mapping):  # later releases: {"job": ..., "administrator": ..., "system": ...}
        comment = comment.get("job") or ""
    return Job(
        id=job_id,
        gpus_on=dict(zip(nodes, per_node, strict=True)),
        start=start,
        checkpoint_at=_reported_checkpoint(str(comment), f"job {job_id}: comment", notices),
        end_by=end_by,
        owner=str(record.get("user_name") or ""),
        group=str(record.get("partition") or ""),
    )


def _slurm_nodes(record: Mapping[str, Any]) -> list[str]:
    resources = record.get("job_resources") or {}
    allocated = resources.get("allocated_nodes")  # 22.05
    if allocated:
        return [str(n["nodename"]) for n in allocated]
    inner = resources.get("nodes")
    if isinstance(inner, Mapping) and inner.get("allocation"):  # 23.11 and later
        return [str(n["name"]) for n in inner["allocation"]]
    return expand_hostlist(str(record.get("nodes") or ""))


def _slurm_gpus_per_node(record: Mapping[str, Any], count: int) -> list[int]:
    # gres_detail: one entry per allocated node, in node order ("gpu:h100:8(IDX:0-7)").
    detail = record.get("gres_detail") or []
    if len(detail) == count:
        return [sum(int(m) for m in _GRES_GPU_RE.findall(str(d))) for d in detail]
    per_node = _TRES_GPU_RE.search(str(record.get("tres_per_node") or ""))
    if per_node:
        return [int(per_node.group(1))] * count
    total = _TRES_GPU_RE.search(str(record.get("tres_alloc_str") or "")) or _TRES_GPU_RE.search(
        str(record.get("tres_per_job") or "")
    )
    if total:
        share, rest = divmod(int(total.group(1)), count)
        return [share + (1 if i < rest else 0) for i in range(count)]
    return [0] * count


def _number(value: Any) -> float | None:
    """Slurm's number: 22.05 prints a plain number (None for unlimited), later releases
    {"set": bool, "infinite": bool, "number": n}."""
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if value is None or isinstance(value, bool):
        return None
    return float(value)


def _epoch(value: Any) -> datetime | None:
    seconds = _number(value)
    return None if not seconds else datetime.fromtimestamp(seconds, UTC)


def _reported_checkpoint(text: str, where: str, notices: list[str]) -> datetime | None:
    match = _CHECKPOINT_RE.search(text)
    if match is None:
        return None
    return _iso_time(match.group(1), where, notices)


def _iso_time(value: str, where: str, notices: list[str]) -> datetime | None:
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00") if value.endswith("Z") else value)
    except ValueError:
        notices.append(
            f"{where}: {value!r} is not an ISO time such as 2026-01-05T10:00:00Z; the assumed checkpoint interval is used"
        )
        return None
    if moment.tzinfo is None:
        notices.append(f"{where}: {value!r} has no time zone (expected e.g. 2026-01-05T10:00:00Z); taken as UTC")
        moment = moment.replace(tzinfo=UTC)
    return moment


# --- Kubernetes ------------------------------------------------------------------------------


def kubernetes_job_map(pods: Sequence[Any], source: str = "kubernetes pods") -> JobMap:
    """The running pods that request GPUs (`pods`: client `V1Pod`s or their JSON dicts), grouped
    into jobs: by the pod label `gpufail.io/job`, else the JobSet label, else the pod's
    controlling owner (a Job, a PyTorchJob, a StatefulSet...), else the pod alone."""
    grouped: dict[str, dict[str, Any]] = {}
    notices: list[str] = []
    for i, raw in enumerate(pods):
        try:
            pod = _as_dict(raw)
            meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
            if status.get("phase") != "Running" or not spec.get("nodeName"):
                continue
            gpus = _pod_gpus(spec)
            if gpus <= 0:
                continue
            namespace, name = str(meta.get("namespace") or "default"), str(meta["name"])
            key = _pod_job(meta, namespace)
            where = f"pod {namespace}/{name}: annotation {CHECKPOINT_ANNOTATION}"
            checkpoint = (meta.get("annotations") or {}).get(CHECKPOINT_ANNOTATION)
            reported = _iso_time(str(checkpoint), where, notices) if checkpoint else None
            started = _k8s_time(status.get("startTime"))
            deadline = spec.get("activeDeadlineSeconds")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise JobMapUnreadable(
                f"{source}: item {i} is not a pod ({type(exc).__name__}: {exc}); expected metadata.name, spec, status"
            ) from None
        g = grouped.setdefault(
            key, {"gpus_on": {}, "start": None, "checkpoint": None, "end": None, "pods": [], "namespace": namespace}
        )
        g["gpus_on"][spec["nodeName"]] = g["gpus_on"].get(spec["nodeName"], 0) + gpus
        g["pods"].append(f"{namespace}/{name}")
        if started is not None:
            g["start"] = started if g["start"] is None else min(g["start"], started)
            if deadline:
                end = started + timedelta(seconds=float(deadline))
                g["end"] = end if g["end"] is None else min(g["end"], end)
        if reported is not None:
            g["checkpoint"] = reported if g["checkpoint"] is None else max(g["checkpoint"], reported)
    jobs = tuple(
        Job(
            id=key,
            gpus_on=g["gpus_on"],
            start=g["start"],
            checkpoint_at=g["checkpoint"],
            end_by=g["end"],
            owner=key,
            group=g["namespace"],
            pods=tuple(sorted(g["pods"])),
        )
        for key, g in grouped.items()
    )
    return JobMap(jobs, source, tuple(notices))


def _as_dict(pod: Any) -> dict[str, Any]:
    if isinstance(pod, Mapping):
        return dict(pod)
    from kubernetes.client import ApiClient

    return dict(ApiClient().sanitize_for_serialization(pod))


def _pod_gpus(spec: Mapping[str, Any]) -> int:
    total = 0
    for container in spec.get("containers") or []:
        resources = container.get("resources") or {}
        # Extended resources: a request must equal the limit, and either alone sets both.
        amounts = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
        total += sum(int(str(amounts[r])) for r in GPU_RESOURCES if r in amounts)
    return total


def _pod_job(meta: Mapping[str, Any], namespace: str) -> str:
    labels = meta.get("labels") or {}
    if labels.get(JOB_LABEL):
        return f"{namespace}/{labels[JOB_LABEL]}"
    if labels.get(JOBSET_LABEL):
        return f"{namespace}/JobSet/{labels[JOBSET_LABEL]}"
    owners = meta.get("ownerReferences") or []
    owner = next((o for o in owners if o.get("controller")), owners[0] if owners else None)
    if owner is not None:
        return f"{namespace}/{owner['kind']}/{owner['name']}"
    return f"{namespace}/Pod/{meta['name']}"


def _k8s_time(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


# --- A custom scheduler's document -----------------------------------------------------------


def job_map_from_document(text: str | bytes, source: str) -> JobMap:
    """The job map a custom scheduler publishes (docs/actions.md):
    `{"jobs": [{"id": "...", "nodes": {"node": gpus, ...}, "start": ISO, "checkpoint_at": ISO
    or null, "end_by": ISO or null, "owner": "...", "group": "..."}]}`."""
    try:
        answer = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JobMapUnreadable(f"{source}: not JSON ({exc})") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("jobs"), list):
        raise JobMapUnreadable(f'{source}: expected {{"jobs": [...]}} (docs/actions.md), got {str(answer)[:80]!r}')
    jobs: list[Job] = []
    notices: list[str] = []
    for i, record in enumerate(answer["jobs"]):
        try:
            job_id = str(record["id"])
            gpus_on = {str(n): int(g) for n, g in record["nodes"].items()}
            if any(g < 0 for g in gpus_on.values()):
                raise ValueError("a negative GPU count")
            start = _document_time(record.get("start"))
            checkpoint = record.get("checkpoint_at")
            reported = (
                _iso_time(str(checkpoint), f"{source}: job {job_id}: checkpoint_at", notices) if checkpoint else None
            )
            jobs.append(
                Job(
                    id=job_id,
                    gpus_on=gpus_on,
                    start=start,
                    checkpoint_at=reported,
                    end_by=_document_time(record.get("end_by")),
                    owner=str(record.get("owner") or ""),
                    group=str(record.get("group") or ""),
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise JobMapUnreadable(
                f"{source}: jobs[{i}] is not a job ({type(exc).__name__}: {exc}); expected id, nodes "
                '{"node": gpus} and ISO times start, checkpoint_at, end_by'
            ) from None
    return JobMap(tuple(jobs), source, tuple(notices))


def _document_time(value: Any) -> datetime | None:
    if value is None:
        return None
    moment = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    if moment.tzinfo is None:
        raise ValueError(f"time {value!r} has no time zone")
    return moment


def read_job_document(location: str, timeout: float) -> JobMap:
    """The job document at `location`: an http(s) URL (GET) or a file path."""
    import urllib.error
    import urllib.request

    from ingest.urls import described_url

    url = location.startswith(("http://", "https://"))
    shown = described_url(location) if url else location
    if url:
        try:
            with urllib.request.urlopen(location, timeout=timeout) as response:
                text = response.read()
        except (urllib.error.URLError, OSError) as exc:
            raise JobMapUnreadable(f"job map {shown}: no answer ({getattr(exc, 'reason', exc)})") from None
    else:
        try:
            with open(location, "rb") as fh:
                text = fh.read()
        except OSError as exc:
            raise JobMapUnreadable(f"job map {location}: cannot be read ({exc.strerror or exc})") from None
    return job_map_from_document(text, f"job map {shown}")
