"""Commands that train and judge models: `train`, `evaluate` and `summary`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from gpufail.cli.options import dask_client, data_option, data_root, finite, quiet_option, settings_of
from ingest.errors import GpufailError


@click.command()
@data_option
@click.option(
    "--model-out", required=True, type=click.Path(file_okay=False), help="Folder to write the trained model into."
)
@click.pass_context
def train(ctx: click.Context, data: str | None, model_out: str) -> None:
    """Train the configured model on the most recent training window."""
    from ingest.store import Store
    from models.train import save_model

    settings = settings_of(ctx)
    # The model carries the spec the features record (a different configured one is refused).
    options = settings.train_options()
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


def _load_features(root: str) -> Any:
    """The whole features dataset."""
    from features.build import read_features
    from ingest.store import Store

    store = Store.open(root)
    frame = read_features(store)
    if frame.height == 0:
        raise GpufailError(f"{root}: the features dataset is empty; run `gpufail features --data {root}` first")
    return frame


def _check_evaluate_fits(store: Any, max_memory_gb: float | None) -> None:
    """Refuse before reading when the whole features dataset would not fit (`gpufail.memory`)."""
    from features.build import FEATURES_DATASET, features_shape
    from gpufail.memory import available_bytes, check_evaluate_fits

    rows, columns = features_shape(store)
    budget = available_bytes() if max_memory_gb is None else int(max_memory_gb * 1e9)
    check_evaluate_fits(store.path(FEATURES_DATASET), rows, columns, budget)


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
@quiet_option
@click.pass_context
def evaluate(ctx: click.Context, data: str | None, report_dir: str, test_days: float | None, quiet: bool) -> None:
    """Walk-forward comparison of the [evaluate] contenders and baselines; writes report.md,
    metrics.json and plots."""
    from ingest.store import Store
    from models.comparison import evaluate_walk_forward
    from models.report import write_walk_forward_report
    from models.walk_forward import Contender

    settings = settings_of(ctx)
    cfg = settings.evaluate
    root = data_root(ctx, data)
    store = Store.open(root)
    _check_evaluate_fits(store, cfg.max_memory_gb)
    frame = _load_features(root)
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
    }
    if cfg.seeds:
        from models.comparison import evaluate_seeds

        metrics = evaluate_seeds(frame, contenders, plan, cfg.seeds, **options)
    else:
        metrics = evaluate_walk_forward(frame, contenders, plan, **options)
    report, _ = write_walk_forward_report(metrics, report_dir)
    scores, claims = metrics["scores"], metrics["claims"]
    click.echo(
        f"precision@{metrics['top_k']} (daily mean): best {claims['best']} "
        f"{claims['best_precision']:.3f}, random {scores['random']['by_k'][metrics['top_k']]['precision_daily_mean']:.3f}, "
        + (f"rule {claims['rule_precision']:.3f}, " if "rule_precision" in claims else "")
        + f"oracle {claims['oracle_precision']:.3f}; "
        + _alarm_lines(metrics)[0]
        + f" -> {report}"
    )


def _alarm_lines(metrics: dict[str, Any]) -> list[str]:
    """What `gpufail evaluate` and `gpufail summary` say of the primary contender's alarms at
    the headline budget, and of its calibrated risk."""
    budget = metrics["alarm_headline_budget"]
    name = metrics["primary"]
    point = metrics["alarms"]["by_budget"][f"{budget:g}"][name]
    calibration = metrics["calibration"][name]
    high = calibration["high_risk"]

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}%"

    lead = point["lead_time_h_median"]
    lines = [
        f"{name} at {budget:g} alarms per 1,000 GPUs per day (threshold chosen before the test): "
        f"{point['n_alarms']} alarms ({point['alarms_per_1000_gpu_days']:.2f} per 1,000 GPU-days), precision "
        f"{pct(point['precision'])} within the horizon, {pct(point['precision_long'])} within "
        f"{metrics['alarms']['rules']['long_horizon_h']:g} h, recall {pct(point['recall'])} "
        f"({point['n_caught']} of {point['n_failures']} failures)"
        + ("" if lead is None else f", median lead {lead:.1f} h"),
        f"calibrated risk on the test period: ECE {calibration['ece']:.4f}, Brier {calibration['brier']:.5f}; "
        f"rows at risk >= {high['level']:g}: {high['n_rows']}"
        + (
            ""
            if high["mean_risk"] is None
            else f", predicted {high['mean_risk']:.2f}, observed {high['observed_rate']:.2f} ({high['verdict']})"
        ),
    ]
    verdicts = metrics["claims"].get("ensemble_at_equal_volume", {})
    lines += [f"the paper's ensemble gain at equal alarm volume ({n}): {v}" for n, v in verdicts.items()]
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
@click.pass_context
def summary(ctx: click.Context, data: str | None, report_dir: str) -> None:
    """Print what the pipeline found and where its outputs are."""
    import json

    from ingest.store import Store

    root = data_root(ctx, data)
    store = Store.open(root)
    metrics_path = Path(report_dir) / "metrics.json"
    if not metrics_path.exists():
        raise GpufailError(f"{metrics_path}: not found; run `gpufail evaluate --report {report_dir}` first")
    metrics = json.loads(metrics_path.read_text())
    lines = [f"gpufail summary for {root}"]
    if store.exists("failures"):
        lines.append(f"  simulated failures (ground truth): {store.read('failures', columns=['ts']).num_rows}")
    xids = store.read("xid_events", columns=["xid", "repeat_count"])
    lines.append(
        f"  XID incidents parsed from kernel logs: {xids.num_rows:,} (from {sum(xids['repeat_count'].to_pylist()):,} lines)"
    )
    lines.extend("  " + line for line in _metric_lines(metrics))
    lines.append(
        f"  outputs: features {store.path('features')}, predictions {store.path('predictions')}, actions {store.path('actions')}, report {metrics_path.parent / 'report.md'}"
    )
    click.echo("\n".join(lines))


def _metric_lines(metrics: dict[str, Any]) -> list[str]:
    k = metrics["top_k"]
    scores = metrics["scores"]
    model = scores["model"]
    others = ", ".join(f"{name} {s['precision_at_k_pooled']:.3f}" for name, s in scores.items() if name != "model")
    lines = [
        f"held-out test period: {metrics['test']['start']} to {metrics['test']['end']} ({metrics['test']['n_gpus']} GPUs)",
    ]
    if "alarms" in metrics:  # reports written before alarms were scored have none
        lines += _alarm_lines(metrics)
    return [
        *lines,
        f"ranking, precision@{k}: model {model['precision_at_k_pooled']:.3f} ({others})",
        f"failures caught in the top {k} before they happened: {model['n_caught_at_k']} of {model['n_episodes']}"
        + (f", median lead {lead:.1f} h" if (lead := model["lead_time_h_median_at_k"]) is not None else ""),
    ]
