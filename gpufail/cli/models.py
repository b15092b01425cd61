"""Commands that train and judge models: `train`, `evaluate` and `summary`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from gpufail.cli.options import (
    dask_client,
    data_option,
    data_root,
    finite,
    json_option,
    quiet_option,
    report,
    settings_of,
    when,
)
from ingest.errors import GpufailError


@click.command()
@data_option
@click.option(
    "--model-out", required=True, type=click.Path(file_okay=False), help="Folder to write the trained model into."
)
@click.option(
    "--until",
    default=None,
    help="Training cut-off (ISO, UTC): train as of this time, on rows whose labels look no further "
    "(the window ends a horizon before it), for a backtest on the time after it.",
)
@click.pass_context
def train(ctx: click.Context, data: str | None, model_out: str, until: str | None) -> None:
    """Train the configured model on the most recent training window (with --until: the one
    that ends a horizon before the cut-off)."""
    from dataclasses import replace

    from ingest.store import Store
    from models.train import save_model

    settings = settings_of(ctx)
    # The model carries the spec the features record (a different configured one is refused).
    options = settings.train_options()
    cutoff = when(until, "'--until'")
    if cutoff is not None:
        options = replace(options, as_of=cutoff)
    store = Store.open(data_root(ctx, data))
    if settings.dask.scheduler:
        # [dask] scheduler set: lightgbm.dask / xgboost.dask; the workers read the features.
        from models.distributed import train_model_distributed

        with dask_client(settings) as client:
            model = train_model_distributed(client, store, options)
    else:
        # The same rows and model as train_model over all history, reading the wide feature
        # columns of the sampled rows only (a paper-size fleet's window is ~28 GB in full).
        from models.train_store import train_model_from_store

        model = train_model_from_store(store, options)
    path = save_model(model, model_out)
    click.echo(
        f"trained {model.kind} on {model.n_rows:,} rows ({model.n_positives:,} positive) "
        f"from {model.train_start:%Y-%m-%d %H:%M} to {model.train_end:%Y-%m-%d %H:%M}, "
        f"{_calibration_text(model.calibration_info())} -> {path}"
    )


def _calibration_text(info: dict[str, Any] | None) -> str:
    if info is None:
        return "not calibrated"
    return (
        f"calibrated ({info['method']}) on {info['slice_start'][:16]} .. {info['slice_end'][:16]} "
        f"({info['n_rows']:,} rows, {info['n_positives']:,} positive)"
    )


@click.command()
@data_option
@click.option(
    "--report",
    "report_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder for report.md and metrics.json.",
)
@click.option(
    "--test-days",
    type=click.FloatRange(min=0, min_open=True),
    callback=finite,
    default=None,
    help="Length of the walk-forward test period at the end of the data (default: [evaluate] test_days).",
)
@click.option(
    "--policy",
    "replay_policies",
    is_flag=True,
    help="Also replay the test period through the action policies with the jobs of DATA/jobs/trace.parquet: "
    "GPU-hours lost with no action, the rule, the tiers and the cost policy (docs/actions.md).",
)
@quiet_option
@json_option
@click.pass_context
def evaluate(
    ctx: click.Context,
    data: str | None,
    report_dir: str,
    test_days: float | None,
    replay_policies: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Walk-forward comparison of the [evaluate] contenders and baselines; writes report.md,
    metrics.json and plots."""
    from features.dataset import feature_days
    from ingest.store import Store
    from models.comparison import evaluate_walk_forward
    from models.report import write_walk_forward_report
    from models.walk_forward import Contender

    settings = settings_of(ctx)
    cfg = settings.evaluate
    root = data_root(ctx, data)
    store = Store.open(root)
    if not feature_days(store):
        raise GpufailError(f"{root}: the features dataset is empty; run `gpufail features --data {root}` first")
    failures = (
        store.read("failures", columns=["ts", "gpu_uuid", "mode"]).to_pandas() if store.exists("failures") else None
    )
    plan = settings.walk_forward_plan(test_days=test_days)
    contenders = [Contender(c.name, c.kind, c.mode, dict(c.params), c.train_window) for c in cfg.contenders]
    options: dict[str, Any] = {
        "top_k": cfg.top_k,
        "failures": failures,
        "bootstrap_samples": cfg.bootstrap_samples,
        "progress": not quiet,
        "alarm_rules": settings.alarm_rules(),
        "budgets": tuple(cfg.alarm_budgets),
        "fail_slow_window": settings.feature_spec().fail_slow_label,
    }
    if replay_policies:
        options["replay"] = _policy_replay(store, root, settings, plan.horizon)
    truth = Path(root) / "ground_truth" / "gpus.parquet"
    if "://" not in root and truth.exists():
        import pyarrow.parquet as pq

        if "fail_slow_since" in pq.read_schema(truth).names:
            options["fail_slow_truth"] = pq.read_table(truth, columns=["gpu_uuid", "fail_slow_since"]).to_pandas()
    # [dask] scheduler set: the walk-forward's fits and scoring are tasks of the cluster.
    with dask_client(settings) as client:
        options["client"] = client
        if cfg.seeds:
            from models.comparison import evaluate_seeds

            metrics = evaluate_seeds(store, contenders, plan, cfg.seeds, **options)
        else:
            metrics = evaluate_walk_forward(store, contenders, plan, **options)
    metrics_path, report_path = write_walk_forward_report(metrics, report_dir)
    facts = evaluate_facts(metrics, metrics_path, report_path)
    report(as_json, evaluate_line(facts), facts)


def _policy_replay(store: Any, root: str, settings: Any, horizon: Any) -> Any:
    """`--policy`: the replay hook over the data root's job trace, failures and repairs, with the
    [publish] tiers and [publish.cost] prices (at the model's label horizon: what its risk means)."""
    from dataclasses import replace

    import pandas as pd

    from serving.replay import evaluation_replay, read_trace

    trace = read_trace(str(Path(root) / "jobs" / "trace.parquet"))
    if not store.exists("failures"):
        raise GpufailError(f"{root}: evaluate --policy needs the failures dataset (the GPUs that failed, and when)")
    failures = store.read("failures", columns=["ts", "node"]).to_pandas()
    repairs = store.read("repairs", columns=["ts", "node"]).to_pandas() if store.exists("repairs") else None
    actions = settings.publish.job_actions()
    cost = replace(actions.cost, horizon=pd.Timedelta(horizon).to_pytimedelta())
    return evaluation_replay(trace, failures, repairs, settings.publish.policy_config(), cost, slow=_slow_truth(root))


def _slow_truth(root: str) -> Any:
    """The simulator's fail-slow GPUs (node, since, until, deficit), or None where unknown."""
    import pyarrow.parquet as pq

    path = Path(root) / "ground_truth" / "gpus.parquet"
    if "://" in root or not path.exists() or "fail_slow_since" not in pq.read_schema(path).names:
        return None
    gpus = pq.read_table(path, columns=["node", "failed", "fail_slow_since", "fail_slow_deficit"]).to_pandas()
    gpus = gpus[gpus["fail_slow_since"].notna()]
    return gpus.rename(columns={"fail_slow_since": "since", "failed": "until", "fail_slow_deficit": "deficit"})


def evaluate_facts(metrics: dict[str, Any], metrics_path: Path, report_path: Path) -> dict[str, Any]:
    """`gpufail evaluate --json`: the headline precisions at the top-k (daily mean), the primary
    model's alarms at the headline budget, and the files."""
    k, scores, claims = metrics["top_k"], metrics["scores"], metrics["claims"]
    return {
        "command": "evaluate",
        "top_k": k,
        "best": claims["best"],
        "best_precision": claims["best_precision"],
        "random_precision": scores["random"]["by_k"][k]["precision_daily_mean"],
        "rule_precision": claims.get("rule_precision"),
        "oracle_precision": claims["oracle_precision"],
        "alarms": alarm_facts(metrics),
        "metrics": str(metrics_path),
        "report": str(report_path),
    }


def evaluate_line(f: dict[str, Any]) -> str:
    return (
        f"precision@{f['top_k']} (daily mean): best {f['best']} {f['best_precision']:.3f}, "
        f"random {f['random_precision']:.3f}, "
        + (f"rule {f['rule_precision']:.3f}, " if f["rule_precision"] is not None else "")
        + f"oracle {f['oracle_precision']:.3f}; "
        + (_primary_alarm_text(f["alarms"]) + " " if f["alarms"] is not None else "")
        + f"-> {f['metrics']}"
    )


def _primary_alarm_text(f: dict[str, Any]) -> str:
    p = f["at_equal_volume"][f["model"]]
    precision = "-" if p["precision"] is None else f"{100 * p['precision']:.1f}%"
    return (
        f"{f['model']} at a daily quota of {f['budget_per_1000_gpus_per_day']:g} per 1,000 GPUs: "
        f"{p['n_alarms']} alarms, precision {precision} within {f['horizon_h']:g} h;"
    )


def alarm_facts(metrics: dict[str, Any]) -> dict[str, Any] | None:
    """The alarms at the headline budget's daily quota (every scorer at the same volume) and the
    primary contender's calibrated risk, as `gpufail evaluate` and `gpufail summary` report them
    (None for a report written before the quota was scored)."""
    if "quota" not in metrics.get("alarms", {}):
        return None
    budget = metrics["alarm_headline_budget"]
    name = metrics["primary"]
    quota = metrics["alarms"]["quota"][f"{budget:g}"]
    keys = (
        "n_alarms",
        "alarms_per_1000_gpu_days",
        "precision",
        "n_hits",
        "n_alarms_known",
        "precision_long",
        "n_hits_long",
        "n_alarms_known_long",
        "recall",
        "recall_long",
        "n_caught",
        "n_caught_long",
        "n_failures",
        "lead_time_h_median",
    )
    calibration = metrics["calibration"][name]
    chosen = metrics["claims"].get("chosen_on_validation") or {}
    return {
        "model": name,
        "budget_per_1000_gpus_per_day": budget,
        "horizon_h": metrics["alarms"]["rules"]["horizon_h"],
        "long_horizon_h": metrics["alarms"]["rules"]["long_horizon_h"],
        "volume_ratio": quota["volume_ratio"],
        "at_equal_volume": {scorer: {key: point[key] for key in keys} for scorer, point in quota["points"].items()},
        "at_matched_thresholds": {
            scorer: {key: point[key] for key in keys}
            for scorer, point in metrics["alarms"].get("matched", {}).get(f"{budget:g}", {}).get("points", {}).items()
        },
        "chosen": chosen.get("name"),
        "chosen_versus": {
            pair: {
                "difference": c["precision"]["difference"],
                "ci": c["precision"]["ci"],
                "detectable": c["precision"]["detectable"],
                "verdict": c["precision"]["verdict"],
            }
            for pair, c in quota["comparisons"].items()
            if c["first"] == chosen.get("name") and c["question"] == "baseline"
        },
        "calibration": {
            "ece": calibration["ece"],
            "brier": calibration["brier"],
            "high_risk": calibration["high_risk"],
        },
        "ensemble_at_quota": metrics["claims"].get("ensemble_at_quota", {}),
    }


def alarm_lines(f: dict[str, Any]) -> list[str]:
    """The lines of `alarm_facts`: every scorer at the same daily quota first."""
    from models.report_format import pct

    h, long = f"{f['horizon_h']:g} h", f"{f['long_horizon_h']:g} h"
    ratio = f["volume_ratio"]
    lines = [
        f"alarms at equal volume (a daily quota of {f['budget_per_1000_gpus_per_day']:g} per 1,000 GPUs per day"
        + ("" if ratio is None else f"; realised volumes within a factor {ratio:.2f}")
        + f"): precision within {h} / {long}, recall within {h} / {long}:"
    ]
    for scorer, p in f["at_equal_volume"].items():
        lead = p["lead_time_h_median"]
        lines.append(
            f"  {scorer}: {p['n_alarms']} alarms ({p['alarms_per_1000_gpu_days']:.2f} per 1,000 GPU-days), "
            f"precision {pct(p['precision'])} ({p['n_hits']}/{p['n_alarms_known']}) / {pct(p['precision_long'])} "
            f"({p['n_hits_long']}/{p['n_alarms_known_long']}), recall {pct(p['recall'])} / {pct(p['recall_long'])} "
            f"({p['n_caught']}, {p['n_caught_long']} of {p['n_failures']} failures)"
            + ("" if lead is None else f", median lead {lead:.1f} h")
        )
    if f.get("at_matched_thresholds"):
        lines.append(
            "at thresholds matched on the test scores (the same volume, alarms the hour the risk crosses): "
            + "; ".join(
                f"{scorer} {pct(p['precision'])} ({p['n_hits']}/{p['n_alarms_known']})"
                for scorer, p in f["at_matched_thresholds"].items()
            )
        )
    if f["chosen_versus"]:
        parts = [
            f"{pair.split(' - ', 1)[1]} {100 * c['difference']:+.1f} pts "
            f"[{100 * c['ci'][0]:+.1f}, {100 * c['ci'][1]:+.1f}] {c['verdict']}"
            + ("" if c["detectable"] is None else f" (detectable {100 * c['detectable']:.1f} pts)")
            if c["difference"] is not None and c["ci"][0] is not None
            else f"{pair.split(' - ', 1)[1]} not shown (no interval)"
            for pair, c in f["chosen_versus"].items()
        ]
        lines.append(f"chosen on validation, {f['chosen']}, minus the baselines at that quota: " + "; ".join(parts))
    calibration = f["calibration"]
    high = calibration["high_risk"]
    lines.append(
        f"{f['model']}'s calibrated risk on the test period: ECE {calibration['ece']:.4f}, Brier "
        f"{calibration['brier']:.5f}; rows at risk >= {high['level']:g}: {high['n_rows']}"
        + (
            ""
            if high["mean_risk"] is None
            else f", predicted {high['mean_risk']:.2f}, observed {high['observed_rate']:.2f} ({high['verdict']})"
        )
    )
    lines += [
        f"the paper's ensemble gain at that quota ({n}, against every single contender): {v}"
        for n, v in f["ensemble_at_quota"].items()
    ]
    return lines


@click.command()
@data_option
@click.option(
    "--report",
    "report_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="The folder `gpufail evaluate` wrote.",
)
@json_option
@click.pass_context
def summary(ctx: click.Context, data: str | None, report_dir: str, as_json: bool) -> None:
    """Print what the pipeline found and where its outputs are."""
    import json

    from features.dataset import features_dataset
    from ingest.store import Store
    from models.report import own_volume_picks

    root = data_root(ctx, data)
    store = Store.open(root)
    metrics_path = Path(report_dir) / "metrics.json"
    if not metrics_path.exists():
        raise GpufailError(f"{metrics_path}: not found; run `gpufail evaluate --report {report_dir}` first")
    metrics = json.loads(metrics_path.read_text())
    xids = store.read("xid_events", columns=["xid", "repeat_count"])
    k = metrics["top_k"]
    model = metrics["scores"]["model"]
    facts = {
        "command": "summary",
        "data": root,
        "failures": store.read("failures", columns=["ts"]).num_rows if store.exists("failures") else None,
        "xid_incidents": xids.num_rows,
        "xid_lines": sum(xids["repeat_count"].to_pylist()),
        "test": {key: metrics["test"][key] for key in ("start", "end", "n_gpus")},
        "top_k": k,
        "precision_at_k": {
            name: s["precision_at_k_pooled"]
            for name, s in metrics["scores"].items()
            if name == "model" or own_volume_picks(metrics, name, k) is None
        },
        "not_comparable_at_k": {
            name: picks
            for name in metrics["scores"]
            if name != "model" and (picks := own_volume_picks(metrics, name, k)) is not None
        },
        "caught_at_k": model["n_caught_at_k"],
        "episodes": model["n_episodes"],
        "lead_time_h_median_at_k": model["lead_time_h_median_at_k"],
        "alarms": alarm_facts(metrics),
        "outputs": {
            # The dataset feature rows come from: the stored aggregates, or a materialised table.
            "features": store.path(features_dataset(store)),
            "predictions": store.path("predictions"),
            "actions": store.path("actions"),
            "report": str(metrics_path.parent / "report.md"),
        },
    }
    report(as_json, summary_text(facts), facts)


def summary_text(f: dict[str, Any]) -> str:
    """`gpufail summary`'s lines, from the facts its `--json` prints."""
    k, test, precision, out = f["top_k"], f["test"], f["precision_at_k"], f["outputs"]
    others = ", ".join(f"{name} {p:.3f}" for name, p in precision.items() if name != "model")
    lines = [f"gpufail summary for {f['data']}"]
    if f["failures"] is not None:
        lines.append(f"  simulated failures (ground truth): {f['failures']}")
    lines += [
        f"  XID incidents parsed from kernel logs: {f['xid_incidents']:,} (from {f['xid_lines']:,} lines)",
        f"  held-out test period: {test['start']} to {test['end']} ({test['n_gpus']} GPUs)",
        *("  " + line for line in (alarm_lines(f["alarms"]) if f["alarms"] is not None else [])),
        f"  ranking, precision@{k}: model {precision['model']:.3f} ({others})"
        + "".join(
            f"; {name} not comparable ({picks:.2f} picks per grid time, not {k})"
            for name, picks in f.get("not_comparable_at_k", {}).items()
        ),
        f"  failures caught in the top {k} before they happened: {f['caught_at_k']} of {f['episodes']}"
        + (f", median lead {lead:.1f} h" if (lead := f["lead_time_h_median_at_k"]) is not None else ""),
        f"  outputs: features {out['features']}, predictions {out['predictions']}, actions {out['actions']}, report {out['report']}",
    ]
    return "\n".join(lines)
