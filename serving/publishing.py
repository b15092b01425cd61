"""The `gpufail publish` flow, shared by the command and the nightly job: run the action policy
(`PublishOptions.policy`, and the job-aware `PublishOptions.actions`) on the newest predictions
snapshot (`serving.predictions`), apply it through the publisher of the target
(`PublisherConfig`), keep the policy's state and append every decision to the audit log.

A policy state and its audit files are one journal of the store (`ingest.journal`), named after
the state (`serving.publish.state_name`): a run commits its decisions' audit file together with
the state they lead to, so that a run killed at any point has recorded its decisions once or
not at all. A run killed before its commit has changed nothing but the scheduler, where applying
the same change again is harmless (a Slurm drain with the same reason; a webhook delivery with
the same idempotency key). A dry run commits its audit file with the state unchanged.

One run at a time per data root: every journal of a policy state takes the data root's one
publish lock (`PUBLISH_LOCK`), from reading the state to committing it, so that runs started
together act one after the other, and the later ones see what the first did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ingest.errors import GpufailError, InputError
from ingest.journal import Journal
from ingest.store import Store, guarded
from serving.policy import PolicyConfig

if TYPE_CHECKING:
    from serving.publish import JobActions

LOCK_WAIT_S = 60.0
"""How long a publish run waits for another to finish before it refuses (see docs/serving.md)."""
PUBLISH_LOCK = "publish"
"""The lock every publish run of a data root holds (`_state/publish.lock` on a local root)."""


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
    cluster: str = ""
    """slurm and kubernetes targets: the cluster (of the predictions) whose nodes they act on;
    empty: the predictions must hold one cluster."""


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


@contextmanager
def policy_journal(store: Store, name: str, wait_s: float = LOCK_WAIT_S) -> Iterator[Journal]:
    """The journal of the policy state `name` and its audit files, holding the publish lock
    (waiting up to `wait_s` for a run that holds it)."""
    from serving.publish import AUDIT_DATASET

    with store.journal(name, [AUDIT_DATASET], lock=PUBLISH_LOCK, wait_s=wait_s, holder="`gpufail publish`") as journal:
        _finish_legacy_audit(store, name, journal.state)
        yield journal


def publish_latest(
    store: Store, latest: Any, options: PublishOptions, *, lock_wait_s: float = LOCK_WAIT_S
) -> tuple[Any, str | None]:
    """Publish `latest` (a checked predictions snapshot, `serving.predictions.Snapshot.frame`)
    as `options` say, holding the publish lock. The policy state is read from the store, and
    committed with the audit file unless in dry run (which must not advance it). Returns the
    outcome of `serving.publish.publish` and the audit file written (None when there was
    nothing to record)."""
    from serving.cost_policy import hinted_from_json, hinted_to_json
    from serving.publish import AUDIT_DATASET, decisions_table, state_name
    from serving.publish import publish as run_publish

    mode = options.mode
    name = state_name(options.target, mode)
    with policy_journal(store, name, lock_wait_s) as journal:
        hinted = hinted_from_json((journal.state or {}).get("checkpoint_hints"), f"{store.root}: _state/{name}.json")
        outcome = run_publish(
            latest,
            make_publisher(options.publisher, options.target, store),
            options.policy,
            policy_state(journal),
            mode=mode,
            now=datetime.now(UTC),
            repairs=latest_repairs(store),
            top_features=top_features_by_gpu(latest),
            actions=options.actions,
            hinted=hinted,
        )
        staged = []
        if outcome.rows:
            first = min(row.time for row in outcome.rows).date()
            staged.append(journal.staging().write_owned(AUDIT_DATASET, first, decisions_table(outcome.rows)))
        if mode == "dry-run" and not staged:
            return outcome, None
        kept = {**outcome.state.to_json(), "checkpoint_hints": hinted_to_json(outcome.hinted)}
        written = journal.commit(None if mode == "dry-run" else kept, staged=staged)
    return outcome, written[0] if written else None


def policy_state(journal: Journal) -> Any:
    """The policy state a journal of `policy_journal` committed last."""
    from serving.policy import PolicyState

    return PolicyState.from_json(journal.state, f"{journal.store.root}: _state/{journal.name}.json")


def update_policy_state(store: Store, name: str, change: Callable[[Any], Any], lock_wait_s: float = LOCK_WAIT_S) -> Any:
    """Commit `change(state)` as the policy state `name` (--reset-breaker), holding the publish
    lock; returns the state before."""
    with policy_journal(store, name, lock_wait_s) as journal:
        before = policy_state(journal)
        commit_policy_state(journal, change(before))
    return before


def commit_policy_state(journal: Journal, state: Any) -> None:
    """Commit a policy state changed outside a run (--reset-breaker, --adopt), keeping the
    checkpoint hints of the last run."""
    journal.commit({**state.to_json(), "checkpoint_hints": (journal.state or {}).get("checkpoint_hints")})


def _finish_legacy_audit(store: Store, name: str, state: dict[str, Any] | None) -> None:
    """gpufail before the store's journal staged a run's audit file under a hidden
    `.pending-` name and recorded its names in the state (`audit`) before the rename: finish a
    rename a kill left undone, and remove staged files no state names."""
    from serving.publish import AUDIT_DATASET

    audit = (state or {}).get("audit")
    fs = store.fs
    with guarded("finish an audit file staged by an earlier gpufail in", store.path(AUDIT_DATASET)):
        if isinstance(audit, dict) and {"pending", "final"} <= set(audit):
            pending, final = store.path(str(audit["pending"]).lstrip("/")), store.path(str(audit["final"]).lstrip("/"))
            if fs.exists(pending) and not fs.exists(final):
                fs.mv(pending, final)
        for stale in fs.glob(store.path(AUDIT_DATASET, "date=*", f".pending-*.{name}.parquet")):
            fs.rm(stale)


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
    with policy_journal(store, name, lock_wait_s) as journal:
        snapshot = newest_snapshot(store)
        clusters: dict[str, set[str]] = {}
        if snapshot is not None:
            for node, cluster in zip(snapshot.frame["node"], snapshot.frame["cluster"], strict=True):
                if not publisher.cluster or str(cluster) == publisher.cluster:
                    clusters.setdefault(str(node), set()).add(str(cluster))
        missing = [n for n in nodes if n not in clusters]
        if missing:
            raise InputError(
                f"--adopt {', '.join(missing)}: not in the newest predictions of {store.root}"
                + (f" for [publish] cluster {publisher.cluster!r}" if publisher.cluster else "")
                + "; expected nodes that gpufail scores (their cluster names them in the policy state)"
            )
        shared = [n for n in nodes if len(clusters[n]) > 1]
        if shared:
            raise InputError(
                f"--adopt {', '.join(shared)}: a node of that name in the clusters "
                f"{', '.join(sorted(clusters[shared[0]]))}; expected [publish] cluster naming the one Slurm runs"
            )
        slurm = make_publisher(publisher, "slurm", store)
        state = policy_state(journal)
        adopted = dict(state.nodes)
        for node in nodes:
            tier, entry = slurm.adopt(node)
            key = f"{next(iter(clusters[node]))}/{node}"
            before = adopted.get(key, NodeState())
            adopted[key] = replace(
                before, tier=tier, applied=tier, since=entry.at, changed_at=entry.at, below_since=None
            )
            lines.append(f"{node}: adopted the drain {entry.reason!r} as {tier} -> {slurm.ledger.where}")
        commit_policy_state(journal, replace(state, nodes=adopted))
    return lines


def publish_mode(dry_run: bool, shadow: bool) -> str:
    """The `serving.publish` mode: a dry run wins over shadow."""
    return "dry-run" if dry_run else "shadow" if shadow else "live"


def make_publisher(config: PublisherConfig, target: str, store: Store) -> Any:
    """The publisher of `target` (`serving.publishers`), configured by `config`."""
    import os

    if target == "slurm":
        from serving.publishers.slurm import SlurmPublisher, StoreLedger, ledger_name

        return SlurmPublisher(
            bin_dir=config.slurm_bin_dir,
            slurm_conf=config.slurm_conf,
            avoid_weight=config.slurm_avoid_weight,
            timeout=config.timeout_s,
            ledger=StoreLedger(store, ledger_name(config.cluster)),
            checkpoint_signal=config.slurm_checkpoint_signal,
            standby_users=config.slurm_standby_users,
            attempts=config.attempts,
            backoff=config.backoff_s,
            cluster=config.cluster,
        )
    if target == "kubernetes":
        from serving.publishers.kubernetes import KubernetesPublisher, kubernetes_api

        return KubernetesPublisher(
            kubernetes_api(config.kubeconfig),
            attempts=config.attempts,
            backoff=config.backoff_s,
            cluster=config.cluster,
        )
    if target == "webhook":
        from ingest.urls import described_url
        from serving.publishers.webhook import WebhookPublisher

        secret = os.environ.get(config.webhook_secret_env, "")
        if not config.webhook_url or not secret:
            raise GpufailError(
                "publish --to webhook: expected [publish] webhook_url and a secret in the environment variable "
                f"{config.webhook_secret_env}, got url {described_url(config.webhook_url)!r} and "
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
