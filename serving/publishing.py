"""The `gpufail publish` flow, shared by the command and the nightly job: run the action policy
(`PublishOptions.policy`, and the job-aware `PublishOptions.actions`) on the newest predictions
snapshot (`serving.predictions`), apply it through the publisher of the target
(`PublisherConfig`), keep the policy's state and append every decision to the audit log.

One run at a time per data root: every run holds `publish_lock` (the nightly's `flock`
mechanism, `serving.locking`) from reading the state to committing it, so that runs started
together act one after the other, and the later ones see what the first did.

A live or shadow run commits in this order, so that a kill at any point leaves its decisions
recorded once or not at all: the audit file is staged complete under a hidden name, the state
is written with the names of the staged file (`audit`), and the file is then renamed into
place. The next run first finishes a rename that a kill interrupted (`_finish_committed`) and
removes staged files that were never committed. A run killed before its state was written has
changed nothing but the scheduler, where applying the same change again is harmless (a Slurm
drain with the same reason; a webhook delivery with the same idempotency key).
"""

from __future__ import annotations

import hashlib
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ingest.errors import GpufailError, InputError
from ingest.store import Store
from serving.locking import exclusive_lock
from serving.policy import PolicyConfig

if TYPE_CHECKING:
    from serving.publish import JobActions

LOCK_WAIT_S = 60.0
"""How long a publish run waits for another to finish before it refuses (see docs/serving.md)."""


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    """How the publishers reach their schedulers (the [publish] settings of each target)."""

    attempts: int = 3
    """Tries per scheduler call, with exponential back-off from `backoff_s`."""
    backoff_s: float = 2.0
    timeout_s: float = 30.0
    slurm_bin_dir: str = ""
    """Folder of sinfo/scontrol; empty: PATH."""
    slurm_conf: str = ""
    """SLURM_CONF for sinfo/scontrol; empty: Slurm's default."""
    slurm_avoid_weight: int = 100_000
    slurm_checkpoint_signal: str = "USR1"
    """The signal of a checkpoint hint (`scancel --signal=... --batch JOB`)."""
    slurm_standby_users: tuple[str, ...] = ("root",)
    """Users who may run jobs in the standby reservation."""
    kubeconfig: str = ""
    """Empty: the in-cluster service account, else ~/.kube/config."""
    webhook_url: str = ""
    webhook_secret_env: str = "GPUFAIL_WEBHOOK_SECRET"
    """Environment variable holding the webhook's HMAC-SHA256 secret."""
    jobs_url: str = ""
    """log and webhook targets: a URL or file of the job document; empty: none."""


@dataclass(frozen=True, kw_only=True)
class PublishOptions:
    """One publish run: where to, in which mode, with which policy and publisher settings."""

    target: str
    """"log", "slurm", "kubernetes" or "webhook"."""
    mode: str
    """"dry-run", "shadow" or "live" (`publish_mode`)."""
    policy: PolicyConfig
    publisher: PublisherConfig
    actions: JobActions | None = None
    """The job-aware actions (the cost policy, checkpoint hints, placement, standbys); None:
    the tiers alone."""


def publish_lock_path(store: Store) -> Path:
    """The lock file of a data root: in its `_state/` when the root is a local folder; else in
    this machine's temporary folder, named after the root (it then keeps apart only the runs
    on one machine)."""
    if store.is_local:
        return Path(store.path("_state", "publish.lock"))
    digest = hashlib.sha256(store.root.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"gpufail-publish-{digest}.lock"


@contextmanager
def publish_lock(store: Store, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold the data root's publish lock, waiting up to `wait_s` for a run that holds it."""
    with exclusive_lock(publish_lock_path(store), "`gpufail publish`", wait_s=wait_s):
        yield


def publish_latest(
    store: Store, latest: Any, options: PublishOptions, *, lock_wait_s: float = LOCK_WAIT_S
) -> tuple[Any, str | None]:
    """Publish `latest` (a checked predictions snapshot, `serving.predictions.Snapshot.frame`)
    as `options` say, holding the publish lock. The policy state is read from the store, and
    committed unless in dry run (which must not advance it). Returns the outcome of
    `serving.publish.publish` and the audit file written (None when there was nothing to
    record)."""
    from serving.cost_policy import hinted_from_json, hinted_to_json
    from serving.publish import finish_audit, stage_audit, state_name
    from serving.publish import publish as run_publish

    mode = options.mode
    name = state_name(options.target, mode)
    with publish_lock(store, lock_wait_s):
        state = read_policy_state(store, name)
        hinted = hinted_from_json(
            (store.read_state(name) or {}).get("checkpoint_hints"), f"{store.root}: _state/{name}.json"
        )
        outcome = run_publish(
            latest,
            make_publisher(options.publisher, options.target, store),
            options.policy,
            state,
            mode=mode,
            now=datetime.now(UTC),
            repairs=latest_repairs(store),
            top_features=top_features_by_gpu(latest),
            actions=options.actions,
            hinted=hinted,
        )
        staged = stage_audit(outcome.rows, store.path("actions"), fs=store.fs, run_id=_run_id(name))
        if mode == "dry-run":
            return outcome, None if staged is None else finish_audit(staged, store.fs)
        # Relative to the data root, so that a root moved or copied in between still finishes.
        committed = (
            {"pending": _relative(store, staged.pending), "final": _relative(store, staged.final)} if staged else None
        )
        store.write_state(
            name, {**outcome.state.to_json(), "checkpoint_hints": hinted_to_json(outcome.hinted), "audit": committed}
        )
        return outcome, _finish_committed(store, name)


def _relative(store: Store, path: str) -> str:
    return path.removeprefix(store.path(""))


def _run_id(name: str) -> str:
    # The state's name ends the audit file's name, so that a run sweeps only its own state's
    # staged files (a shadow run never removes what a live run committed).
    return f"{uuid.uuid4().hex}.{name}"


def read_policy_state(store: Store, name: str) -> Any:
    """The policy state `name` of the store, after finishing what a killed run committed."""
    from serving.policy import PolicyState

    _finish_committed(store, name)
    return PolicyState.from_json(store.read_state(name), f"{store.root}: _state/{name}.json")


def write_policy_state(store: Store, name: str, state: Any) -> None:
    """Save a policy state changed outside a run (--reset-breaker, --adopt), keeping the record
    of the last run's audit file."""
    previous = store.read_state(name) or {}
    store.write_state(
        name,
        {**state.to_json(), "checkpoint_hints": previous.get("checkpoint_hints"), "audit": previous.get("audit")},
    )


def _finish_committed(store: Store, name: str) -> str | None:
    """Rename the audit file the state `name` committed into place if a kill left it staged,
    and remove staged files of runs killed before their commit; returns the committed file."""
    from serving.publish import PENDING_PREFIX, StagedAudit, finish_audit

    audit = (store.read_state(name) or {}).get("audit")
    if audit is not None and not (isinstance(audit, dict) and {"pending", "final"} <= set(audit)):
        raise InputError(
            f"{store.root}: _state/{name}.json: 'audit' is {audit!r}; expected null or the names of an audit file"
        )
    committed = StagedAudit(store.path(str(audit["pending"])), store.path(str(audit["final"]))) if audit else None
    if committed is not None:
        finish_audit(committed, store.fs)
    for stale in store.fs.glob(store.path("actions", "date=*", f"{PENDING_PREFIX}*.{name}.parquet")):
        if committed is None or stale.rstrip("/") != committed.pending.rstrip("/"):
            store.fs.rm(stale)
    return committed.final if committed else None


def adopt_drains(
    store: Store, publisher: PublisherConfig, nodes: list[str], lock_wait_s: float = LOCK_WAIT_S
) -> list[str]:
    """Hand orphaned Slurm drains of gpufail (drained with a `gpufail:` reason that the state
    does not record) to gpufail: record each in the drain ledger and put the node in the tier
    its reason names in the live policy state, so that the policy resumes it once its risk
    allows. Returns one line per node."""
    from serving.policy import NodeState
    from serving.predictions import newest_snapshot
    from serving.publish import state_name

    name = state_name("slurm", "live")
    lines = []
    with publish_lock(store, lock_wait_s):
        snapshot = newest_snapshot(store)
        clusters = {} if snapshot is None else dict(zip(snapshot.frame["node"], snapshot.frame["cluster"], strict=True))
        missing = [n for n in nodes if n not in clusters]
        if missing:
            raise InputError(
                f"--adopt {', '.join(missing)}: not in the newest predictions of {store.root}; expected nodes "
                "that gpufail scores (their cluster names them in the policy state)"
            )
        slurm = make_publisher(publisher, "slurm", store)
        state = read_policy_state(store, name)
        adopted = dict(state.nodes)
        for node in nodes:
            tier, entry = slurm.adopt(node)
            key = f"{clusters[node]}/{node}"
            before = adopted.get(key, NodeState())
            adopted[key] = replace(
                before, tier=tier, applied=tier, since=entry.at, changed_at=entry.at, below_since=None
            )
            lines.append(f"{node}: adopted the drain {entry.reason!r} as {tier} -> {slurm.ledger.where}")
        write_policy_state(store, name, replace(state, nodes=adopted))
    return lines


def publish_mode(dry_run: bool, shadow: bool) -> str:
    """The `serving.publish` mode: a dry run wins over shadow."""
    return "dry-run" if dry_run else "shadow" if shadow else "live"


def make_publisher(config: PublisherConfig, target: str, store: Store) -> Any:
    """The publisher of `target` (`serving.publishers`), configured by `config`."""
    import os

    if target == "slurm":
        from serving.publishers.slurm import SlurmPublisher, StoreLedger

        return SlurmPublisher(
            bin_dir=config.slurm_bin_dir,
            slurm_conf=config.slurm_conf,
            avoid_weight=config.slurm_avoid_weight,
            timeout=config.timeout_s,
            ledger=StoreLedger(store),
            checkpoint_signal=config.slurm_checkpoint_signal,
            standby_users=config.slurm_standby_users,
            attempts=config.attempts,
            backoff=config.backoff_s,
        )
    if target == "kubernetes":
        from serving.publishers.kubernetes import KubernetesPublisher, kubernetes_api

        return KubernetesPublisher(
            kubernetes_api(config.kubeconfig), attempts=config.attempts, backoff=config.backoff_s
        )
    if target == "webhook":
        from serving.publishers.webhook import WebhookPublisher

        secret = os.environ.get(config.webhook_secret_env, "")
        if not config.webhook_url or not secret:
            raise GpufailError(
                "publish --to webhook: expected [publish] webhook_url and a secret in the environment variable "
                f"{config.webhook_secret_env}, got url {config.webhook_url!r} and "
                f"{'a secret' if secret else 'no secret'}"
            )
        return WebhookPublisher(
            config.webhook_url,
            secret.encode(),
            timeout=config.timeout_s,
            jobs_url=config.jobs_url,
            attempts=config.attempts,
            backoff=config.backoff_s,
        )
    from serving.publishers.log import LogPublisher

    return LogPublisher(jobs_url=config.jobs_url, timeout=config.timeout_s)


def latest_repairs(store: Any) -> dict[tuple[str, str], datetime]:
    """(cluster, node) -> its latest repair record, from the optional repairs dataset."""
    if not store.exists("repairs"):
        return {}
    repairs = store.read("repairs", columns=["ts", "cluster", "node"]).to_pandas()
    if repairs.empty:
        return {}
    latest = repairs.groupby(["cluster", "node"])["ts"].max()
    return {(str(c), str(n)): ts.to_pydatetime() for (c, n), ts in latest.items()}


def top_features_by_gpu(predictions: Any) -> dict[str, list[str]]:
    """gpu_uuid -> its top features, when the predictions carry a `top_features` column; empty
    otherwise (the audit then records an empty list)."""
    if "top_features" not in predictions:
        return {}
    return {
        str(u): [str(f) for f in (fs if fs is not None else [])]
        for u, fs in zip(predictions["gpu_uuid"], predictions["top_features"], strict=True)
    }
