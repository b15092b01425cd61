"""Commands that score and act: `score`, `publish` and the REST endpoint `serve`."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpufail.cli.options import data_option, data_root, json_option, report, settings_of, when
from gpufail.logs import log_format_option
from ingest.errors import GpufailError

if TYPE_CHECKING:
    from gpufail.config import Settings


@click.command()
@data_option
@click.option(
    "--model",
    "model_path",
    required=True,
    type=click.Path(file_okay=False),
    help="A model folder written by `gpufail train`.",
)
@click.option("--at", default=None, help="Score the grid time this time falls in (ISO, UTC) instead of the newest.")
@click.option("--start", default=None, help="With --end: score every grid time from this one (ISO, UTC).")
@click.option("--end", default=None, help="With --start: the end of the range to score, exclusive (ISO, UTC).")
@json_option
@click.pass_context
def score(
    ctx: click.Context,
    data: str | None,
    model_path: str,
    at: str | None,
    start: str | None,
    end: str | None,
    as_json: bool,
) -> None:
    """Score every GPU's latest grid time: the predictions snapshot of that grid time and model
    version (scoring them again replaces it). Refused when the features were built with other
    settings than the model's. A backtest scores another grid time (--at) or every grid time
    of a range (--start/--end), one snapshot each."""
    from ingest.store import Store
    from models.train import load_model
    from serving.score_store import score_range, score_store

    root = data_root(ctx, data)
    first, last, moment = when(start, "'--start'"), when(end, "'--end'"), when(at, "'--at'")
    if moment is not None and (first is not None or last is not None):
        raise click.UsageError("--at scores one grid time; --start/--end a range: give one or the other")
    if (first is None) != (last is None):
        raise click.UsageError("--start and --end go together (the range [start, end) to score)")
    model = load_model(model_path)
    if first is not None and last is not None:
        if last <= first:
            raise GpufailError(f"--end {end}: expected a time after --start {start}")
        done = score_range(Store.open(root), model, first, last)
        report(
            as_json,
            f"scored {done.grid_times:,} grid times ({done.rows:,} GPU rows) from {done.first:%Y-%m-%d %H:%M} "
            f"to {done.last:%Y-%m-%d %H:%M} with model {model.version} into predictions"
            + (f"; replaced {done.replaced} earlier snapshot files" if done.replaced else ""),
            {"command": "score", "model_version": model.version, **vars(done)},
        )
        return
    scored = score_store(Store.open(root), model, at=moment)
    predictions = scored.predictions
    top = predictions.nsmallest(3, "rank")
    facts = {
        "command": "score",
        "gpus": len(predictions),
        "ts": predictions["ts"].max(),
        "model_version": model.version,
        "riskiest": [
            {"node": r.node, "gpu_index": r.gpu_index, "gpu_uuid": r.gpu_uuid, "risk": r.risk} for r in top.itertuples()
        ],
        "replaced": scored.replaced,
        "snapshot": scored.path,
    }
    riskiest = ", ".join(f"{r['node']}/{r['gpu_index']} {r['risk']:.2f}" for r in facts["riskiest"])
    again = "; replaced the earlier snapshot of this grid time and model" if scored.replaced else ""
    report(
        as_json,
        f"scored {len(predictions):,} GPUs at {facts['ts']:%Y-%m-%d %H:%M}; riskiest: {riskiest}{again} -> {scored.path}",
        facts,
    )


@click.command()
@data_option
@click.option(
    "--to",
    "target",
    type=click.Choice(["log", "slurm", "kubernetes", "webhook"]),
    default=None,
    help="Where to publish (default: [publish] target).",
)
@click.option(
    "--dry-run/--no-dry-run",
    default=None,
    help="Record what would be done without doing it (default: [publish] dry_run, true).",
)
@click.option("--shadow", is_flag=True, default=None, help="Run the policy on its own state; touch nothing.")
@click.option("--reset-breaker", is_flag=True, help="Close a tripped circuit breaker (with a fresh budget) and exit.")
@click.option(
    "--adopt",
    "adopt",
    multiple=True,
    metavar="NODE",
    help="With --to slurm: hand an orphaned gpufail drain of NODE to gpufail (repeatable) and exit.",
)
@click.option(
    "--lock-wait",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds to wait for another publish run on this data root to finish (default 60), then refuse.",
)
@click.option("--quiet", is_flag=True, help="Print only the summary line.")
@json_option
@click.pass_context
def publish(
    ctx: click.Context,
    data: str | None,
    target: str | None,
    dry_run: bool | None,
    shadow: bool | None,
    reset_breaker: bool,
    adopt: tuple[str, ...],
    lock_wait: float | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Turn the newest predictions snapshot into risk tiers through the action policy
    (hysteresis, cooldown, circuit breaker), apply them to the scheduler unless in dry run, and
    append every decision to the actions audit log. One run at a time per data root."""
    from ingest.store import Store
    from serving.policy import reset_breaker as closed_breaker
    from serving.predictions import newest_snapshot
    from serving.publish import state_name
    from serving.publishing import (
        LOCK_WAIT_S,
        adopt_drains,
        publish_latest,
        update_policy_state,
    )

    options = settings_of(ctx).publish_options(target=target, dry_run=dry_run, shadow=shadow)
    target, mode = options.target, options.mode
    wait = LOCK_WAIT_S if lock_wait is None else lock_wait
    root = data_root(ctx, data)
    store = Store.open(root)
    name = state_name(target, mode)
    where = f"{root}: _state/{name}.json"
    if adopt:
        if target != "slurm":
            raise click.UsageError("--adopt goes with --to slurm (only Slurm drains can be orphaned)")
        lines = adopt_drains(store, options.publisher, list(adopt), lock_wait_s=wait)
        report(
            as_json,
            "\n".join(f"publish (slurm): {line}" for line in lines),
            {"command": "publish --adopt", "target": target, "nodes": list(adopt), "results": lines},
        )
        return
    if reset_breaker:
        was = update_policy_state(store, name, closed_breaker, wait).breaker
        status = f"was open since {was.tripped_at:%Y-%m-%d %H:%M}Z ({was.reason})" if was.tripped else "was closed"
        report(
            as_json,
            f"publish ({target}): circuit breaker reset; it {status} -> {where}",
            {
                "command": "publish --reset-breaker",
                "target": target,
                "was_open": was.tripped,
                "tripped_at": was.tripped_at if was.tripped else None,
                "reason": was.reason if was.tripped else None,
                "state": where,
            },
        )
        return
    snapshot = newest_snapshot(store)
    if snapshot is None:
        raise GpufailError(f"{root}: no predictions; run `gpufail score` first")
    outcome, path = publish_latest(store, snapshot.frame, options, lock_wait_s=wait)
    for notice in outcome.notices:
        click.echo(f"publish ({target}): note: {notice}", err=True)
    facts = publish_facts(outcome, snapshot.key, target, mode, path)
    lines = [] if quiet else [_decision_line(d) for d in facts["decisions"]]
    report(as_json, "\n".join([*lines, publish_line(facts)]), facts)


NOT_ACTED = ("skip", "breaker_held", "cooldown_held")
"""Decisions that leave a node as it is for a reason the operator should see (an operator's
drain, a node the scheduler does not know, the cooldown, the circuit breaker)."""


def publish_facts(outcome: Any, key: Any, target: str, mode: str, audit_path: str | None) -> dict[str, Any]:
    """`gpufail publish --json`: the run's counts, and each decision that changed something or
    left a node alone for a reason (`NOT_ACTED`), with that reason."""
    rows = outcome.rows
    decisions = [
        {
            "node": r.node,
            "cluster": r.cluster,
            "risk": r.risk,
            "previous_tier": r.previous_tier,
            "tier": r.tier,
            "action": r.action,
            "result": r.result,
            "reason": r.reason,
        }
        for r in rows
        if r.action != "keep" or r.result != "unchanged"
    ]
    return {
        "command": "publish",
        "mode": mode,
        "target": target,
        "snapshot": {"ts": key.ts, "model_version": key.model_version},
        "nodes": len(rows),
        "actions": dict(sorted(Counter(r.action for r in rows).items())),
        "tiers": dict(sorted(Counter(r.tier for r in rows if r.tier != "none").items())),
        "breaker_open": outcome.state.breaker.tripped or any(r.action == "breaker_held" for r in rows),
        "scheduler_error": outcome.scheduler_error or None,
        "decisions": decisions,
        "not_acted": [
            {k: d[k] for k in ("node", "cluster", "action", "reason")} for d in decisions if d["action"] in NOT_ACTED
        ],
        "audit": audit_path,
    }


def _decision_line(d: dict[str, Any]) -> str:
    why = f"  ({d['reason']})" if d["action"] in NOT_ACTED else ""
    return (
        f"  {d['node']:<14} risk {d['risk']:.3f}  {d['previous_tier']} -> {d['tier']:<15} {d['action']:<13} "
        f"{d['result']}{why}"
    )


def publish_line(f: dict[str, Any]) -> str:
    """The summary line of `gpufail publish`, from the facts its `--json` prints."""
    label = {"dry-run": "dry run", "shadow": "shadow", "live": "live"}[f["mode"]]
    breaker = "; circuit breaker OPEN" if f["breaker_open"] else ""
    unreachable = f"; scheduler unreachable: {f['scheduler_error']}" if f["scheduler_error"] else ""
    snap = f["snapshot"]
    return (
        f"publish ({label}, {f['target']}): {f['nodes']} nodes of the snapshot at "
        f"{snap['ts']:%Y-%m-%d %H:%M}Z (model {snap['model_version']}); "
        + ", ".join(f"{n} {a}" for a, n in f["actions"].items())
        + "; tiers: "
        + (", ".join(f"{n} {t}" for t, n in f["tiers"].items()) or "none")
        + f"{breaker}{unreachable} -> {f['audit']}"
    )


@click.command()
@data_option
@click.option("--host", default=None, help="Address to listen on (default: [serve] host, 127.0.0.1).")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Port (default: [serve] port, 8080).")
@click.option(
    "--model",
    "model_path",
    default=None,
    type=click.Path(file_okay=False),
    help="A model folder written by `gpufail train` (default: [serve] model, else the registry's champion).",
)
@click.option("--access-log/--no-access-log", default=True, help="Log one line per request (never the token).")
@log_format_option
@click.pass_context
def serve(
    ctx: click.Context,
    data: str | None,
    host: str | None,
    port: int | None,
    model_path: str | None,
    access_log: bool,
    log_format: str,
) -> None:
    """Serve predictions over HTTP (FastAPI under uvicorn, one worker) until interrupted."""
    from gpufail.logs import line_writer, use_log_format, uvicorn_log_config

    use_log_format(log_format)
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from serving.http_timeouts import read_timeout_protocol

    settings = settings_of(ctx)
    cfg = settings.serve
    root = data_root(ctx, data)
    app, source = _serve_app(settings, root, model_path)
    host, port = host or cfg.host, port or cfg.port
    line_writer()(f"serve: {source} and the features of {root} at http://{host}:{port} (Ctrl-C stops it)")
    protocol = read_timeout_protocol(cfg.header_timeout.total_seconds(), cfg.body_timeout.total_seconds())
    uvicorn.run(
        app,
        host=host,
        port=port,
        workers=1,
        access_log=access_log,
        log_level="info",
        http=protocol,
        log_config=uvicorn_log_config(log_format) or LOGGING_CONFIG,
    )


def _serve_app(settings: Settings, root: str, model_path: str | None) -> tuple[Any, str]:
    """The REST app for `gpufail serve` from the settings, and a description of its model source.
    Features a request sends telemetry for are built with the served model's spec, not with the
    [features] and [labels] settings (`serving.api_payloads`)."""
    import os

    from ingest.urls import described_url
    from serving.api import create_app
    from serving.api_state import ModelFolder, RegistryChampion

    cfg, ml = settings.serve, settings.mlflow
    admin, read = os.environ.get(cfg.admin_token_env) or None, os.environ.get(cfg.read_token_env) or None
    if cfg.read_requires_token and not (read or admin):
        raise GpufailError(
            f"[serve] read_requires_token is true, but neither {cfg.read_token_env} nor {cfg.admin_token_env} holds a token"
        )
    options = settings.serve_options(root, admin_token=admin, read_token=read)
    path = model_path or cfg.model
    if path:
        return create_app(options, ModelFolder(path)), f"model folder {path}"
    local = "://" not in root
    source = RegistryChampion(
        ml.tracking_uri,
        ml.model_name,
        cache_dir=Path(root) / "_serve" if local else None,
        retries=ml.retries,
        backoff_s=ml.backoff.total_seconds(),
    )
    return create_app(options, source), f"the champion of {ml.model_name!r} at {described_url(ml.tracking_uri)}"


@click.command("at-risk")
@data_option
@click.option(
    "--url",
    default=None,
    help="Ask a running `gpufail serve` at this base URL instead of reading the data root, with the token in "
    "the [serve] read_token_env (else admin_token_env) variable.",
)
@click.option(
    "--limit", type=click.IntRange(min=1), default=20, show_default=True, help="How many GPUs, riskiest first."
)
@json_option
@click.pass_context
def at_risk(ctx: click.Context, data: str | None, url: str | None, limit: int, as_json: bool) -> None:
    """The riskiest GPUs: node, GPU, risk, tier and the features that drive it, from the newest
    predictions snapshot of the data root (`gpufail score`), or from a server with --url."""
    from serving.display import EXPLAINED

    settings = settings_of(ctx)
    if url is not None:
        if data is not None:
            raise click.UsageError("--url and --data: give one (the server reads its own data root)")
        answer = _server_at_risk(settings, url, limit, EXPLAINED)
        source = url
    else:
        from ingest.store import Store
        from serving.at_risk import snapshot_at_risk

        store = Store.open(data_root(ctx, data))
        answer = snapshot_at_risk(store, settings.publish.policy_config(), top=limit, top_features=EXPLAINED)
        source = answer.pop("source")
    report(as_json, at_risk_table(answer, source), {"command": "at-risk", "source": source, **answer})


def _server_at_risk(settings: Settings, url: str, limit: int, top_features: int) -> dict[str, Any]:
    """`GET /v1/gpus/at-risk` of the server at `url`; a one-line error when it does not answer."""
    import os

    import httpx

    cfg = settings.serve
    token = os.environ.get(cfg.read_token_env) or os.environ.get(cfg.admin_token_env)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    endpoint = url.rstrip("/") + "/v1/gpus/at-risk"
    try:
        response = httpx.get(endpoint, params={"top": limit, "top_features": top_features}, headers=headers, timeout=60)
    except (httpx.HTTPError, ValueError) as exc:
        raise GpufailError(
            f"--url {url}: no answer from {endpoint} ({exc}); expected a running `gpufail serve`"
        ) from None
    if response.status_code != 200:
        try:
            detail = str(response.json().get("detail", ""))
        except ValueError:
            detail = response.text[:200]
        hint = f"; set {cfg.read_token_env} to a read token" if response.status_code in (401, 403) and not token else ""
        raise GpufailError(
            f"--url {url}: {endpoint} answered HTTP {response.status_code} {' '.join(detail.split())}{hint}"
        )
    try:
        answer: dict[str, Any] = response.json()
        answer["gpus"]
    except (ValueError, KeyError, TypeError):
        raise GpufailError(
            f"--url {url}: {endpoint} did not answer an at-risk object; is it a `gpufail serve`?"
        ) from None
    return answer


def at_risk_table(answer: dict[str, Any], source: str) -> str:
    """The terminal table of `gpufail at-risk`, from the API's at-risk object."""
    from serving.display import fmt_value

    gpus = answer["gpus"]
    head = (
        f"at-risk: the {len(gpus)} riskiest of {answer['n_gpus']:,} GPUs at {answer['ts']} "
        f"(model {answer['model_version']}) from {source}"
    )
    rows = [("rank", "node", "gpu", "risk", "tier", "node risk", "top features (value)")]
    for g in gpus:
        features = ", ".join(f"{e['feature']}={fmt_value(e['value'])}" for e in g["top_features"])
        rows.append(
            (
                str(g["rank"]),
                g["node"],
                str(g["gpu_index"]),
                f"{g['risk']:.3f}",
                g["tier"],
                f"{g['node_risk']:.3f}",
                features,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    right = {0, 2, 3, 5}
    lines = [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r[:-1], widths, strict=True)))
        + "  "
        + r[-1]
        for r in rows
    ]
    return "\n".join([head, *(line.rstrip() for line in lines)])
