"""`gpufail`: the one command-line tool. Cron, the Makefile and people use the same commands.

Each command reads its inputs, calls one function, writes, and prints a one-line summary
(CONVENTIONS.md 9). Heavy libraries are imported inside the commands so `gpufail --help`
stays fast. Errors a user can cause (`GpufailError`) print as one line and exit with status 2.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from ingest.errors import GpufailError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML configuration file (default: $GPUFAIL_CONFIG, else built-in defaults).",
)
@click.pass_context
def cli(ctx: click.Context, config_path: str | None) -> None:
    """Predict GPU failures in training fleets from telemetry and XID kernel-log events."""
    from gpufail.config import load_settings

    ctx.obj = load_settings(config_path)


def _settings(ctx: click.Context) -> Any:
    return ctx.find_root().obj


def _data_option(f: Any) -> Any:
    return click.option(
        "--data", "data", default=None, help="Data root: folder or fsspec URL (default: [store] root)."
    )(f)


def _root(ctx: click.Context, data: str | None) -> str:
    return data or _settings(ctx).store.root


@cli.command()
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="New folder to write the simulated fleet into."
)
@click.option("--preset", default=None, help="demo (a few hundred GPUs, 2 months) or paper (~30k GPUs, 4 months).")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Random seed (default: [simulate] seed).")
@click.option(
    "--days", type=click.IntRange(min=1), default=None, help="Simulate this many days instead of the preset's."
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.pass_context
def simulate(ctx: click.Context, out: str, preset: str | None, seed: int | None, days: int | None, quiet: bool) -> None:
    """Simulate a GPU fleet: telemetry, kernel logs, repairs and ground truth."""
    from ingest.simulator.run import simulate as run_simulation

    settings = _settings(ctx)
    cfg = settings.simulate
    summary = run_simulation(
        out,
        preset or cfg.preset,
        cfg.seed if seed is None else seed,
        progress=not quiet,
        cluster=settings.ingest.cluster,
        **({} if days is None else {"days": days}),
    )
    modes = ", ".join(f"{k} {v}" for k, v in summary.failures_by_mode.items())
    click.echo(
        f"simulated {summary.gpus} GPUs on {summary.nodes} nodes over {summary.days} days: "
        f"{summary.telemetry_rows:,} telemetry rows, {summary.kernel_log_lines:,} kernel-log lines, "
        f"{summary.failures} failures ({modes}) in {summary.seconds:.1f}s -> {summary.out}"
    )


@cli.group()
def ingest() -> None:
    """Bring data into the store (kernel logs, ...)."""


@ingest.command("kernel-log")
@_data_option
@click.option("--node", default=None, help="Node name for formats without a host field (default: the file name).")
@click.option(
    "--boot-time", default=None, help="When the host booted (ISO, UTC): places /dev/kmsg and [uptime] stamps in time."
)
@click.option(
    "--tz", default=None, help="Time zone of naive stamps such as `dmesg -T` (default: UTC), e.g. Europe/Warsaw."
)
@click.argument("files", nargs=-1, type=click.Path())
@click.pass_context
def ingest_kernel_log(
    ctx: click.Context,
    data: str | None,
    node: str | None,
    boot_time: str | None,
    tz: str | None,
    files: tuple[str, ...],
) -> None:
    """Parse NVRM/Xid kernel-log lines into the xid_events dataset.

    FILES (plain, rotated or gzip-compressed) default to everything under DATA/raw/kernel-log/
    (what `gpufail simulate` writes). Files already ingested are skipped; a grown file is read
    from where the last run stopped."""
    from ingest.kernel_log_ingest import ingest_kernel_logs
    from ingest.store import Store

    settings = _settings(ctx)
    root = _root(ctx, data)
    store = Store.open(root)
    paths = [Path(f) for f in files] or sorted(
        p for p in Path(store.path("raw", "kernel-log")).glob("*") if p.is_file()
    )
    if not paths:
        raise GpufailError(f"no kernel-log files given and none under {store.path('raw', 'kernel-log')}")
    summary = ingest_kernel_logs(
        store,
        paths,
        cluster=settings.ingest.cluster,
        dedup_window=settings.ingest.xid_dedup_window,
        node=node,
        boot_time=_when(boot_time, "'--boot-time'"),
        tz=tz,
        workers=_ingest_workers(settings),
    )
    click.echo(f"kernel-log: {summary}")


def _ingest_workers(settings: Any) -> int:
    """`[ingest] workers`, 0 meaning one per core."""
    return settings.ingest.workers or os.cpu_count() or 1


@ingest.command("dcgm-exporter")
@_data_option
@click.option("--node", default=None, help="Node name (default: each GPU's Hostname label).")
@click.argument("sources", nargs=-1, required=True)
@click.pass_context
def ingest_dcgm_exporter(ctx: click.Context, data: str | None, node: str | None, sources: tuple[str, ...]) -> None:
    """Read dcgm-exporter scrapes into the telemetry dataset, stamped with the current time.

    SOURCES are /metrics URLs (scraped now) or files holding saved scrapes."""
    from ingest.dcgm_exporter import fetch_scrape, parse_scrape
    from ingest.store import Store

    settings = _settings(ctx)
    # Parse every source before touching the store, so one bad source writes nothing at all.
    tables = [
        parse_scrape(
            fetch_scrape(source), now=datetime.now(UTC), cluster=settings.ingest.cluster, node=node, source=source
        )
        for source in sources
    ]
    store = Store.create(_root(ctx, data))
    for table in tables:
        store.write("telemetry", table)
    rows = sum(table.num_rows for table in tables)
    click.echo(f"dcgm-exporter: {rows} GPU samples from {len(sources)} scrape(s) -> {store.path('telemetry')}")


@ingest.command("nvidia-smi")
@_data_option
@click.option("--node", default=None, help="Node name (default: the file name without its extensions).")
@click.option("--time", "time_", default=None, help="Capture time (ISO) for output with no timestamp of its own.")
@click.option("--tz", default=None, help="Time zone of nvidia-smi's local-time stamps (default: UTC).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.pass_context
def ingest_nvidia_smi(
    ctx: click.Context,
    data: str | None,
    node: str | None,
    time_: str | None,
    tz: str | None,
    quiet: bool,
    files: tuple[str, ...],
) -> None:
    """Import saved nvidia-smi output into the telemetry dataset.

    FILES hold `nvidia-smi --query-gpu=timestamp,uuid,... --format=csv` output (with its
    header; looped runs and `nounits` are fine) or `nvidia-smi -q -x` XML, plain or gzip."""
    from ingest.nvidia_smi import import_nvidia_smi
    from ingest.store import Store

    try:
        summary = import_nvidia_smi(
            Store.create(_root(ctx, data)),
            [Path(f) for f in files],
            cluster=_settings(ctx).ingest.cluster,
            node=node,
            time=_when(time_, "'--time'"),
            tz=tz,
            progress=not quiet,
        )
    except ValueError as exc:  # an unknown --tz
        raise click.BadParameter(str(exc), param_hint="'--tz'") from None
    click.echo(f"nvidia-smi: {summary.line()}")


@ingest.command("table")
@_data_option
@click.option("--map", "mapping_file", required=True, type=click.Path(dir_okay=False), help="TOML mapping file.")
@click.argument("file", type=click.Path(dir_okay=False))
@click.pass_context
def ingest_table(ctx: click.Context, data: str | None, mapping_file: str, file: str) -> None:
    """Import another system's telemetry (CSV or Parquet), and optionally its failure and
    repair records, as the mapping file says (see examples/table_import/mapping.toml)."""
    from ingest.store import Store
    from ingest.table_import import import_table
    from ingest.table_mapping import load_mapping

    mapping = load_mapping(Path(mapping_file))
    summary = import_table(
        Store.create(_root(ctx, data)),
        Path(file),
        mapping,
        mapping_path=Path(mapping_file),
        cluster=_settings(ctx).ingest.cluster,
    )
    click.echo(f"table: {summary.line()}")


@cli.command()
@click.option("--out", "--data", "data", default=None, help="Data root to write to (default: [store] root).")
@click.option("--source", "sources", default=None, help="Comma-separated collectors (default: [collect] sources).")
@click.option("--interval", default=None, help="Time between collections, e.g. 30s (default: [collect] interval).")
@click.option("--once", is_flag=True, help="Collect once, flush and exit.")
@click.option("--max-runs", type=click.IntRange(min=1), default=None, help="Stop after this many collections.")
@click.option("--node", default=None, help="Node name (default: [collect] node, else the hostname).")
@click.option(
    "--listen",
    default=None,
    help='Serve /metrics, /healthz, /readyz on host:port; "" for none (default: [collect] listen).',
)
@click.pass_context
def collect(
    ctx: click.Context,
    data: str | None,
    sources: str | None,
    interval: str | None,
    once: bool,
    max_runs: int | None,
    node: str | None,
    listen: str | None,
) -> None:
    """Run the live collectors (NVML, kernel log, dcgm-exporter) into the store until SIGTERM
    or SIGINT, flushing on a size/time policy; prints a line per flush and a summary. Exits
    non-zero when the last flush failed or when every source failed, naming each and why."""
    import socket

    from gpufail.config import parse_duration
    from ingest.collect.daemon import CollectOptions, StopFlag, parse_sources, run_collect, stop_on_signals
    from ingest.store import Store

    settings = _settings(ctx)
    cfg = settings.collect
    try:
        every = parse_duration(interval) if interval is not None else cfg.interval
    except ValueError as exc:
        raise GpufailError(f"--interval: {exc}") from None
    options = CollectOptions(
        cluster=settings.ingest.cluster,
        node=node or cfg.node or socket.gethostname(),
        sources=parse_sources(sources if sources is not None else cfg.sources),
        interval=every,
        flush_rows=cfg.flush_rows,
        flush_interval=cfg.flush_interval,
        dcgm_exporter_url=cfg.dcgm_exporter_url,
        kernel_log_source=cfg.kernel_log_source,
        kernel_log_paths=tuple(cfg.kernel_log_paths),
        dedup_window=settings.ingest.xid_dedup_window,
        max_lines=cfg.max_lines_per_run,
        listen=cfg.listen if listen is None else listen,
    )
    store = Store.create(_root(ctx, data))
    with stop_on_signals(StopFlag()) as stop:
        summary = run_collect(store, options, once=once, max_runs=max_runs, stop=stop, report=click.echo)
    click.echo(f"collect: stopped ({summary.stop_reason}) on {options.node}: {summary.line()}")
    failed = summary.every_source_failed()
    if failed:
        for name, error in failed:
            click.echo(f"collect: {name} failed: {error}", err=True)
        raise GpufailError(f"collect: every source failed ({', '.join(n for n, _ in failed)}); nothing was collected")


def _finite(value: float | None, param: click.Parameter) -> float | None:
    """A FloatRange lets NaN and infinity through (every comparison with NaN is false)."""
    import math

    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value}: expected a finite number", param=param)
    return value


def _when(text: str | None, option: str) -> datetime | None:
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: expected an ISO date or time such as 2026-02-01 or 2026-02-01T06:00", param_hint=option
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@cli.command()
@_data_option
@click.option("--start", default=None, help="First grid time (ISO, UTC); default: the start of the telemetry.")
@click.option("--end", default=None, help="End of the grid, exclusive (ISO, UTC); default: the end of the telemetry.")
@click.option("--overwrite", is_flag=True, help="Rebuild days that already have features.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option(
    "--dictionary",
    "dictionary_path",
    default=None,
    type=click.Path(dir_okay=False, writable=True),
    help="Write the feature dictionary (name, meaning, unit, window) as Markdown to this file ('-': stdout) and build nothing.",
)
@click.pass_context
def features(
    ctx: click.Context,
    data: str | None,
    start: str | None,
    end: str | None,
    overwrite: bool,
    quiet: bool,
    dictionary_path: str | None,
) -> None:
    """Build sliding-window features and labels into the features dataset."""
    settings = _settings(ctx)
    if dictionary_path is not None:
        from features.dictionary import dictionary_markdown

        text = dictionary_markdown(settings.features.grid, settings.features.windows)
        if dictionary_path == "-":
            click.echo(text, nl=False)
        else:
            Path(dictionary_path).parent.mkdir(parents=True, exist_ok=True)
            Path(dictionary_path).write_text(text)
            click.echo(f"feature dictionary -> {dictionary_path}")
        return
    from features.build import build_features_from_store
    from ingest.store import Store

    first, last = _when(start, "'--start'"), _when(end, "'--end'")
    if first is not None and last is not None and last <= first:
        raise GpufailError(f"--end {end}: expected a time after --start {start}")
    common = dict(
        start=first,
        end=last,
        grid=settings.features.grid,
        windows=settings.features.windows,
        max_silence=settings.features.max_silence,
        horizon=settings.labels.horizon,
        failure_xids=settings.labels.failure_xids,
        merge_window=settings.labels.merge_window,
        lost_after=settings.labels.lost_after,
        overwrite=overwrite,
    )
    if settings.dask.scheduler:
        # [dask] scheduler set: the same features, built in partitions on the cluster.
        from features.distributed import build_features_distributed

        d = settings.dask
        with _dask_client(settings) as client:
            summary = build_features_distributed(
                client,
                Store.open(_root(ctx, data)),
                partition_nodes=d.partition_nodes,
                partition_days=d.partition_days,
                **common,
            )
    else:
        summary = build_features_from_store(
            Store.open(_root(ctx, data)),
            max_buckets_in_memory=settings.features.buckets_in_memory,
            rows_per_part=settings.features.rows_per_part,
            block_days=settings.features.block_days,
            workers=settings.features.workers,
            read_ahead=settings.features.read_ahead,
            write_ahead=settings.features.write_ahead,
            progress=not quiet,
            **common,
        )
    click.echo(str(summary))


def _dask_client(settings: Any) -> Any:
    """The Dask client of the `[dask]` settings (docs/fleet-scale.md)."""
    from gpufail.dask_cluster import dask_client

    d = settings.dask
    return dask_client(
        d.scheduler,
        n_workers=d.n_workers,
        threads_per_worker=d.threads_per_worker,
        connect_timeout=d.connect_timeout,
    )


def _load_features(root: str, newest_grid_time: bool = False) -> Any:
    """The features dataset: all of it, or only its newest grid time (`newest_grid_time`)."""
    from features.build import read_features, read_newest_grid_time
    from ingest.store import Store

    store = Store.open(root)
    frame = read_newest_grid_time(store) if newest_grid_time else read_features(store)
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


def _model_params(settings: Any) -> dict[str, Any]:
    m = settings.model
    if m.kind == "parallel":
        return {"n_jobs": m.threads, "members": list(m.members), "combine": m.combine, "top_k": m.top_k}
    if m.kind == "cascade":
        return {
            "n_jobs": m.threads,
            "first": m.cascade_first,
            "second": m.cascade_second,
            "first_params": dict(m.cascade_first_params),
            "second_params": dict(m.cascade_second_params),
            "target_recall": m.cascade_recall,
        }
    return {"n_jobs": m.threads} if m.kind in ("lightgbm", "xgboost", "random_forest") else {}


def _train_options(settings: Any) -> Any:
    """`gpufail train`'s options for `train_model` and its store and Dask forms."""
    from models.train import TrainOptions

    return TrainOptions(
        kind=settings.model.kind,
        train_window=settings.model.train_window,
        horizon=settings.labels.horizon,
        params=_model_params(settings),
        negative_fraction=settings.model.negative_fraction,
        max_negatives_per_positive=settings.model.max_negatives_per_positive,
        monotone_increasing=settings.model.monotone_increasing,
        calibration=settings.model.calibration,
        calibration_window=settings.model.calibration_window,
    )


@cli.command()
@_data_option
@click.option(
    "--model-out", required=True, type=click.Path(file_okay=False), help="Folder to write the trained model into."
)
@click.pass_context
def train(ctx: click.Context, data: str | None, model_out: str) -> None:
    """Train the configured model on the most recent training window."""
    from models.train import save_model

    settings = _settings(ctx)
    options = _train_options(settings)
    if settings.dask.scheduler:
        # [dask] scheduler set: lightgbm.dask / xgboost.dask; the workers read the features.
        from ingest.store import Store
        from models.distributed import train_model_distributed

        with _dask_client(settings) as client:
            model = train_model_distributed(client, Store.open(_root(ctx, data)), options)
    else:
        # The same rows and model as train_model over all history, reading the wide feature
        # columns of the sampled rows only (a paper-size fleet's window is ~28 GB in full).
        from ingest.store import Store
        from models.train_store import train_model_from_store

        model = train_model_from_store(Store.open(_root(ctx, data)), options)
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


@cli.command()
@_data_option
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
    callback=lambda _ctx, param, value: _finite(value, param),
    default=None,
    help="Length of the walk-forward test period at the end of the data (default: [evaluate] test_days).",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.pass_context
def evaluate(ctx: click.Context, data: str | None, report_dir: str, test_days: float | None, quiet: bool) -> None:
    """Walk-forward comparison of the [evaluate] contenders and baselines; writes report.md,
    metrics.json and plots."""
    from ingest.store import Store
    from models.comparison import evaluate_walk_forward
    from models.report import write_walk_forward_report
    from models.walk_forward import Contender, WalkForwardPlan

    settings = _settings(ctx)
    cfg = settings.evaluate
    root = _root(ctx, data)
    store = Store.open(root)
    _check_evaluate_fits(store, cfg.max_memory_gb)
    frame = _load_features(root)
    failures = (
        store.read("failures", columns=["ts", "gpu_uuid", "mode"]).to_pandas() if store.exists("failures") else None
    )
    plan = WalkForwardPlan(
        horizon=settings.labels.horizon,
        test_days=cfg.test_days if test_days is None else test_days,
        retrain_every=cfg.retrain_every,
        train_window=cfg.train_window,
        candidate_windows=tuple(cfg.candidate_windows),
        validation_window=cfg.validation_window,
        switch_margin=cfg.switch_margin,
        negative_fraction=cfg.negative_fraction,
        seed=cfg.seed,
        jobs=cfg.jobs,
        monotone_increasing=tuple(settings.model.monotone_increasing),
        # The served model's calibration: the comparison scores what `gpufail train` makes.
        calibration=settings.model.calibration,
        calibration_window=settings.model.calibration_window,
    )
    contenders = [Contender(c.name, c.kind, c.mode, dict(c.params), c.train_window) for c in cfg.contenders]
    options = {
        "top_k": cfg.top_k,
        "failures": failures,
        "bootstrap_samples": cfg.bootstrap_samples,
        "progress": not quiet,
        **_alarm_options(settings),
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


def _alarm_options(settings: Any) -> dict[str, Any]:
    """`evaluate_walk_forward`'s alarm settings from [evaluate]."""
    from models.alarms import AlarmRules

    cfg = settings.evaluate
    quiet = cfg.alarm_quiet_period
    rules = AlarmRules(
        horizon=settings.labels.horizon,
        long_horizon=cfg.long_horizon,
        lookback=cfg.alarm_lookback,
        quiet_period=quiet if quiet.total_seconds() > 0 else None,
    )
    return {"alarm_rules": rules, "budgets": tuple(cfg.alarm_budgets)}


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


@cli.command()
@_data_option
@click.option(
    "--model",
    "model_path",
    required=True,
    type=click.Path(file_okay=False),
    help="A model folder written by `gpufail train`.",
)
@click.pass_context
def score(ctx: click.Context, data: str | None, model_path: str) -> None:
    """Score every GPU's latest grid time: the predictions snapshot of that grid time and model
    version (scoring them again replaces it)."""

    from ingest.store import Store
    from models.train import load_model
    from serving.predictions import write_snapshot
    from serving.score import score_latest

    root = _root(ctx, data)
    model = load_model(model_path)
    # Score the fleet as it is now, the latest grid time only: GPUs that failed or left earlier
    # have no row there (the feature grid is dense for every GPU still in service).
    frame = _load_features(root, newest_grid_time=True)
    # With each GPU's top 5 features, so that the publish audit log says why (models.explain).
    predictions = score_latest(model, frame, top_features=5)
    path, replaced = write_snapshot(Store.open(root), predictions)
    top = predictions.nsmallest(3, "rank")
    riskiest = ", ".join(f"{r.node}/{r.gpu_index} {r.risk:.2f}" for r in top.itertuples())
    again = "; replaced the earlier snapshot of this grid time and model" if replaced else ""
    click.echo(
        f"scored {len(predictions):,} GPUs at {predictions['ts'].max():%Y-%m-%d %H:%M}; riskiest: {riskiest}"
        f"{again} -> {path}"
    )


@cli.command()
@_data_option
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
) -> None:
    """Turn the newest predictions snapshot into risk tiers through the action policy
    (hysteresis, cooldown, circuit breaker), apply them to the scheduler unless in dry run, and
    append every decision to the actions audit log. One run at a time per data root."""
    from gpufail.publishing import (
        LOCK_WAIT_S,
        adopt_drains,
        publish_latest,
        publish_lock,
        publish_mode,
        read_policy_state,
        write_policy_state,
    )
    from ingest.store import Store
    from serving.policy import reset_breaker as closed_breaker
    from serving.predictions import newest_snapshot
    from serving.publish import state_name

    settings = _settings(ctx).publish
    target = target or settings.target
    dry = settings.dry_run if dry_run is None else dry_run
    mode = publish_mode(dry, settings.shadow if shadow is None else shadow)
    wait = LOCK_WAIT_S if lock_wait is None else lock_wait
    root = _root(ctx, data)
    store = Store.open(root)
    name = state_name(target, mode)
    where = f"{root}: _state/{name}.json"
    if adopt:
        if target != "slurm":
            raise click.UsageError("--adopt goes with --to slurm (only Slurm drains can be orphaned)")
        for line in adopt_drains(store, settings, list(adopt), lock_wait_s=wait):
            click.echo(f"publish (slurm): {line}")
        return
    if reset_breaker:
        with publish_lock(store, wait):
            state = read_policy_state(store, name)
            was = state.breaker
            write_policy_state(store, name, closed_breaker(state))
        status = f"was open since {was.tripped_at:%Y-%m-%d %H:%M}Z ({was.reason})" if was.tripped else "was closed"
        click.echo(f"publish ({target}): circuit breaker reset; it {status} -> {where}")
        return
    snapshot = newest_snapshot(store)
    if snapshot is None:
        raise GpufailError(f"{root}: no predictions; run `gpufail score` first")
    outcome, path = publish_latest(store, snapshot.frame, settings, target=target, mode=mode, lock_wait_s=wait)
    for notice in outcome.notices:
        click.echo(f"publish ({target}): note: {notice}", err=True)
    if not quiet:
        for row in outcome.rows:
            if row.action != "keep" or row.result != "unchanged":
                click.echo(
                    f"  {row.node:<14} risk {row.risk:.3f}  {row.previous_tier} -> {row.tier:<15} {row.action:<13} {row.result}"
                )
    counts = Counter(r.action for r in outcome.rows)
    tiers = Counter(r.tier for r in outcome.rows if r.tier != "none")
    label = {"dry-run": "dry run", "shadow": "shadow", "live": "live"}[mode]
    breaker = (
        "; circuit breaker OPEN"
        if outcome.state.breaker.tripped or any(r.action == "breaker_held" for r in outcome.rows)
        else ""
    )
    unreachable = f"; scheduler unreachable: {outcome.scheduler_error}" if outcome.scheduler_error else ""
    click.echo(
        f"publish ({label}, {target}): {len(outcome.rows)} nodes of the snapshot at "
        f"{snapshot.key.ts:%Y-%m-%d %H:%M}Z (model {snapshot.key.model_version}); "
        + ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
        + "; tiers: "
        + (", ".join(f"{n} {t}" for t, n in sorted(tiers.items())) or "none")
        + f"{breaker}{unreachable} -> {path}"
    )


@cli.command()
@_data_option
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

    root = _root(ctx, data)
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


@cli.command("mlflow")
@click.option("--home", default=None, help="Folder of the SQLite store and artifacts (default: [mlflow] home).")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Port (default: [mlflow] port).")
@click.pass_context
def mlflow_command(ctx: click.Context, home: str | None, port: int | None) -> None:
    """Run the embedded MLflow tracking server (SQLite store, local artifacts) on 127.0.0.1
    until interrupted."""
    from gpufail.mlflow_server import serve_forever, tracking_url

    cfg = _settings(ctx).mlflow
    folder = Path(home or cfg.home)
    port = port or cfg.port
    click.echo(f"mlflow: serving {folder.resolve()} at {tracking_url(cfg.host, port)} (Ctrl-C stops it)")
    sys.exit(serve_forever(folder, host=cfg.host, port=port))


@cli.command()
@_data_option
@click.option("--dry-run/--no-dry-run", default=None, help="Publish as a dry run (default: [publish] dry_run, true).")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.pass_context
def nightly(ctx: click.Context, data: str | None, dry_run: bool | None, quiet: bool) -> None:
    """Retrain, gate, score and publish for the newest day of data; resumes after a failure,
    does nothing when the day is already done. Exits non-zero if a step fails (the champion
    keeps serving)."""
    from gpufail.nightly import NightlyOptions, default_work_dir, policy_publisher, run_nightly

    settings = _settings(ctx)
    root = _root(ctx, data)
    cfg, ml = settings.nightly, settings.mlflow
    options = NightlyOptions(
        work_dir=default_work_dir(root, cfg.work_dir),
        tracking_uri=ml.tracking_uri,
        model_name=ml.model_name,
        experiment=ml.experiment,
        kind=settings.model.kind,
        train_window=settings.model.train_window,
        horizon=settings.labels.horizon,
        top_k=settings.model.top_k,
        holdout_days=cfg.holdout_days,
        promotion_margin=cfg.promotion_margin,
        recall_tolerance=cfg.recall_tolerance,
        precision_floor=cfg.precision_floor,
        negative_fraction=cfg.negative_fraction,
        max_negatives_per_positive=settings.model.max_negatives_per_positive,
        monotone_increasing=tuple(settings.model.monotone_increasing),
        calibration=settings.model.calibration,
        calibration_window=settings.model.calibration_window,
        params={**_model_params(settings), **cfg.params},
        retries=ml.retries,
        backoff_s=ml.backoff.total_seconds(),
        cluster=settings.ingest.cluster,
        dedup_window=settings.ingest.xid_dedup_window,
        ingest_workers=_ingest_workers(settings),
        grid=settings.features.grid,
        windows=tuple(settings.features.windows),
        failure_xids=tuple(settings.labels.failure_xids),
        merge_window=settings.labels.merge_window,
        max_silence=settings.features.max_silence,
        lost_after=settings.labels.lost_after,
        buckets_in_memory=settings.features.buckets_in_memory,
        rows_per_part=settings.features.rows_per_part,
        block_days=settings.features.block_days,
        workers=settings.features.workers,
        read_ahead=settings.features.read_ahead,
        write_ahead=settings.features.write_ahead,
        progress=not quiet,
    )
    dry = settings.publish.dry_run if dry_run is None else dry_run
    summary = run_nightly(root, options, publish=policy_publisher(settings.publish, dry_run=dry), report=click.echo)
    click.echo(summary.line())


@cli.command()
@_data_option
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
@click.pass_context
def serve(
    ctx: click.Context, data: str | None, host: str | None, port: int | None, model_path: str | None, access_log: bool
) -> None:
    """Serve predictions over HTTP (FastAPI under uvicorn, one worker) until interrupted."""
    import uvicorn

    from serving.http_timeouts import read_timeout_protocol

    settings = _settings(ctx)
    cfg = settings.serve
    root = _root(ctx, data)
    app, source = _serve_app(settings, root, model_path)
    host, port = host or cfg.host, port or cfg.port
    click.echo(f"serve: {source} and the features of {root} at http://{host}:{port} (Ctrl-C stops it)")
    protocol = read_timeout_protocol(cfg.header_timeout.total_seconds(), cfg.body_timeout.total_seconds())
    uvicorn.run(app, host=host, port=port, workers=1, access_log=access_log, log_level="info", http=protocol)


def _serve_app(settings: Any, root: str, model_path: str | None) -> tuple[Any, str]:
    """The REST app for `gpufail serve` from the settings, and a description of its model source."""
    import os

    from gpufail.publishing import policy_config
    from serving.api import create_app
    from serving.api_state import ModelFolder, RegistryChampion, ServeOptions

    cfg, ml = settings.serve, settings.mlflow
    admin, read = os.environ.get(cfg.admin_token_env) or None, os.environ.get(cfg.read_token_env) or None
    if cfg.read_requires_token and not (read or admin):
        raise GpufailError(
            f"[serve] read_requires_token is true, but neither {cfg.read_token_env} nor {cfg.admin_token_env} holds a token"
        )
    options = ServeOptions(
        data_root=root,
        tiers=policy_config(settings.publish),
        model_name=ml.model_name,
        admin_token=admin,
        read_token=read,
        read_requires_token=cfg.read_requires_token,
        admin_token_env=cfg.admin_token_env,
        max_body_bytes=cfg.max_body_bytes,
        max_gpus_per_request=cfg.max_gpus_per_request,
        max_top_features=cfg.max_top_features,
        reload_poll_s=cfg.reload_poll.total_seconds(),
        features_max_age_s=cfg.features_max_age.total_seconds(),
        metrics_top=cfg.metrics_top,
        featurise={
            "grid": settings.features.grid,
            "windows": list(settings.features.windows),
            "max_silence": settings.features.max_silence,
            "horizon": settings.labels.horizon,
            "failure_xids": list(settings.labels.failure_xids),
            "merge_window": settings.labels.merge_window,
            "lost_after": settings.labels.lost_after,
        },
    )
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
    return create_app(options, source), f"the champion of {ml.model_name!r} at {ml.tracking_uri}"


@cli.command()
@click.option(
    "--out",
    default="bench-results",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for bench.md and bench.json (bench-paper.md and bench-paper.json with --paper).",
)
@click.option(
    "--paper",
    is_flag=True,
    help="Instead: the paper preset (~31k GPUs) end to end, stage by stage (tens of minutes, ~10 GB of disk a 100 days).",
)
@click.option(
    "--days",
    type=click.IntRange(min=10),
    default=None,
    help="With --paper: simulate this many days instead of the preset's 120.",
)
@click.option(
    "--work",
    type=click.Path(file_okay=False),
    default=None,
    help="With --paper: keep the simulated store here (default: a temporary folder, removed after).",
)
def bench(out: str, paper: bool, days: int | None, work: str | None) -> None:
    """Measure the demo pipeline stage by stage (time, peak memory) and the hot loops; or, with
    --paper, the paper-scale pipeline."""
    import tempfile

    from gpufail.bench import run_bench
    from gpufail.bench_paper import run_paper_bench

    if not paper and (days is not None or work is not None):
        raise click.UsageError("--days and --work go with --paper")
    if paper and work is not None:
        report = run_paper_bench(Path(out), Path(work), days=days)
    else:
        with tempfile.TemporaryDirectory(prefix="gpufail-bench-") as tmp:
            report = run_paper_bench(Path(out), Path(tmp), days=days) if paper else run_bench(Path(out), Path(tmp))
    click.echo(report.read_text())


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except GpufailError as exc:
        click.echo(f"gpufail: error: {exc}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("gpufail: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        # One line like every other error (click's own shows usage lines first), naming the
        # command whose option or argument was wrong.
        ctx = getattr(exc, "ctx", None)
        where = f"{ctx.command_path}: " if ctx is not None and ctx.parent is not None else ""
        click.echo(f"gpufail: error: {where}{' '.join(exc.format_message().split())}", err=True)
        sys.exit(exc.exit_code)
