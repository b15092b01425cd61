"""The `gpufail publish` flow, shared by the command and the nightly job: build the policy and
the publisher from the [publish] settings, run the policy on the newest predictions snapshot
(`serving.predictions`), keep its state and append every decision to the audit log.

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
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from ingest.errors import GpufailError, InputError
from ingest.journal import Journal
from ingest.store import Store, guarded

LOCK_WAIT_S = 60.0
"""How long a publish run waits for another to finish before it refuses (see docs/serving.md)."""
PUBLISH_LOCK = "publish"
"""The lock every publish run of a data root holds (`_state/publish.lock` on a local root)."""


@contextmanager
def policy_journal(store: Store, name: str, wait_s: float = LOCK_WAIT_S) -> Iterator[Journal]:
    """The journal of the policy state `name` and its audit files, holding the publish lock
    (waiting up to `wait_s` for a run that holds it)."""
    from serving.publish import AUDIT_DATASET

    with store.journal(name, [AUDIT_DATASET], lock=PUBLISH_LOCK, wait_s=wait_s, holder="`gpufail publish`") as journal:
        _finish_legacy_audit(store, name, journal.state)
        yield journal


def publish_latest(
    store: Store, latest: Any, settings: Any, *, target: str, mode: str, lock_wait_s: float = LOCK_WAIT_S
) -> tuple[Any, str | None]:
    """Publish `latest` (a checked predictions snapshot, `serving.predictions.Snapshot.frame`)
    to `target` in `mode` ("dry-run" | "shadow" | "live"), with `settings` the [publish] table,
    holding the publish lock. The policy state is read from the store, and committed with the
    audit file unless in dry run (which must not advance it). Returns the outcome of
    `serving.publish.publish` and the audit file written (None when there was nothing to record)."""
    from serving.publish import AUDIT_DATASET, decisions_table, state_name
    from serving.publish import publish as run_publish

    name = state_name(target, mode)
    with policy_journal(store, name, lock_wait_s) as journal:
        outcome = run_publish(
            latest,
            make_publisher(settings, target, store),
            policy_config(settings),
            policy_state(journal),
            mode=mode,
            now=datetime.now(UTC),
            repairs=latest_repairs(store),
            top_features=top_features_by_gpu(latest),
        )
        staged = []
        if outcome.rows:
            first = min(row.time for row in outcome.rows).date()
            staged.append(journal.staging().write_owned(AUDIT_DATASET, first, decisions_table(outcome.rows)))
        if mode == "dry-run" and not staged:
            return outcome, None
        written = journal.commit(None if mode == "dry-run" else outcome.state.to_json(), staged=staged)
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
        journal.commit(change(before).to_json())
    return before


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


def adopt_drains(store: Store, settings: Any, nodes: list[str], lock_wait_s: float = LOCK_WAIT_S) -> list[str]:
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
        clusters = {} if snapshot is None else dict(zip(snapshot.frame["node"], snapshot.frame["cluster"], strict=True))
        missing = [n for n in nodes if n not in clusters]
        if missing:
            raise InputError(
                f"--adopt {', '.join(missing)}: not in the newest predictions of {store.root}; expected nodes "
                "that gpufail scores (their cluster names them in the policy state)"
            )
        publisher = make_publisher(settings, "slurm", store)
        state = policy_state(journal)
        adopted = dict(state.nodes)
        for node in nodes:
            tier, entry = publisher.adopt(node)
            key = f"{clusters[node]}/{node}"
            before = adopted.get(key, NodeState())
            adopted[key] = replace(
                before, tier=tier, applied=tier, since=entry.at, changed_at=entry.at, below_since=None
            )
            lines.append(f"{node}: adopted the drain {entry.reason!r} as {tier} -> {publisher.ledger.where}")
        journal.commit(replace(state, nodes=adopted).to_json())
    return lines


def publish_mode(dry_run: bool, shadow: bool) -> str:
    """The `serving.publish` mode: a dry run wins over shadow."""
    return "dry-run" if dry_run else "shadow" if shadow else "live"


def policy_config(settings: Any) -> Any:
    from serving.policy import PolicyConfig, Tier

    configured = {name: getattr(settings.tiers, name) for name in type(settings.tiers).model_fields}
    tiers = tuple(Tier(name, t.enter, t.exit) for name, t in configured.items() if t is not None)
    return PolicyConfig(
        tiers=tiers,
        recovery_period=settings.recovery_period,
        cooldown=settings.cooldown,
        breaker_max_nodes=settings.breaker_max_nodes,
        breaker_max_fraction=settings.breaker_max_fraction,
        breaker_window=settings.breaker_window,
    )


def make_publisher(settings: Any, target: str, store: Store) -> Any:
    import os

    retry = {"attempts": settings.attempts, "backoff": settings.backoff.total_seconds()}
    if target == "slurm":
        from serving.publishers.slurm import SlurmPublisher, StoreLedger

        return SlurmPublisher(
            bin_dir=settings.slurm_bin_dir,
            slurm_conf=settings.slurm_conf,
            avoid_weight=settings.slurm_avoid_weight,
            timeout=settings.timeout.total_seconds(),
            ledger=StoreLedger(store),
            **retry,
        )
    if target == "kubernetes":
        from serving.publishers.kubernetes import KubernetesPublisher, kubernetes_api

        return KubernetesPublisher(kubernetes_api(settings.kubeconfig), **retry)
    if target == "webhook":
        from serving.publishers.webhook import WebhookPublisher

        secret = os.environ.get(settings.webhook_secret_env, "")
        if not settings.webhook_url or not secret:
            raise GpufailError(
                "publish --to webhook: expected [publish] webhook_url and a secret in the environment variable "
                f"{settings.webhook_secret_env}, got url {settings.webhook_url!r} and "
                f"{'a secret' if secret else 'no secret'}"
            )
        return WebhookPublisher(
            settings.webhook_url, secret.encode(), timeout=settings.timeout.total_seconds(), **retry
        )
    from serving.publishers.log import LogPublisher

    return LogPublisher()


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
