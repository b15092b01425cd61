"""The `gpufail publish` flow, shared by the command and the nightly job: build the policy and
the publisher from the [publish] settings, run the policy on the latest predictions, keep its
state and append every decision to the audit log."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ingest.errors import GpufailError
from ingest.store import Store


def publish_latest(
    store: Store, latest: Any, settings: Any, *, target: str, mode: str, state: Any | None = None
) -> tuple[Any, str | None]:
    """Publish `latest` (the predictions of one grid time, a pandas frame) to `target` in `mode`
    ("dry-run" | "shadow" | "live"), with `settings` the [publish] table. The policy state is
    read from the store unless given, and saved unless in dry run (which must not advance it).
    Returns the outcome of `serving.publish.publish` and the audit file written (None when
    there was nothing to record)."""
    from serving.policy import PolicyState
    from serving.publish import append_audit, state_name
    from serving.publish import publish as run_publish

    name = state_name(target, mode)
    if state is None:
        state = PolicyState.from_json(store.read_state(name), f"{store.root}: _state/{name}.json")
    outcome = run_publish(
        latest,
        make_publisher(settings, target),
        policy_config(settings),
        state,
        mode=mode,
        now=datetime.now(UTC),
        repairs=latest_repairs(store),
        top_features=top_features_by_gpu(latest),
    )
    if mode != "dry-run":
        store.write_state(name, outcome.state.to_json())
    return outcome, append_audit(outcome.rows, store.path("actions"), fs=store.fs)


def publish_mode(dry_run: bool, shadow: bool) -> str:
    """The `serving.publish` mode: a dry run wins over shadow."""
    return "dry-run" if dry_run else "shadow" if shadow else "live"


def latest_predictions(store: Store) -> Any | None:
    """The predictions of the newest grid time (a pandas frame), or None when there are none.
    Reads only the newest day that has a file, not the whole history."""
    for day in reversed(store.dates("predictions")):
        table = store.read_owned("predictions", day, day)
        if table is not None:
            predictions = table.to_pandas()
            return predictions[predictions["ts"] == predictions["ts"].max()]
    return None


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


def make_publisher(settings: Any, target: str) -> Any:
    import os

    retry = {"attempts": settings.attempts, "backoff": settings.backoff.total_seconds()}
    if target == "slurm":
        from serving.publishers.slurm import SlurmPublisher

        return SlurmPublisher(
            bin_dir=settings.slurm_bin_dir,
            slurm_conf=settings.slurm_conf,
            avoid_weight=settings.slurm_avoid_weight,
            timeout=settings.timeout.total_seconds(),
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
