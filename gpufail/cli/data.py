"""Commands that bring data into the store: `simulate`, `ingest ...` and the `collect` daemon."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpufail.cli.failures import ingest_kubernetes, ingest_slurm
from gpufail.cli.options import (
    data_option,
    data_root,
    exit_if_input_skipped,
    import_root,
    json_option,
    progress_echo,
    report,
    settings_of,
    when,
)
from gpufail.logs import log_format_option
from ingest.errors import GpufailError

if TYPE_CHECKING:
    from gpufail.config import Settings
    from ingest.prometheus_api import PrometheusClient
    from ingest.prometheus_labels import LabelMap


@click.command()
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="New folder to write the simulated fleet into."
)
@click.option("--preset", default=None, help="demo (a few hundred GPUs, 2 months) or paper (~30k GPUs, 4 months).")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Random seed (default: [simulate] seed).")
@click.option(
    "--days", type=click.IntRange(min=1), default=None, help="Simulate this many days instead of the preset's."
)
@click.option(
    "--nodes", type=click.IntRange(min=1), default=None, help="Simulate this many nodes instead of the preset's."
)
@click.option(
    "--fail-slow",
    type=click.FloatRange(min=0, max=1),
    default=None,
    help="Share of GPUs that turn fail-slow (stragglers) at some point (default: the preset's, 0).",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.pass_context
def simulate(
    ctx: click.Context,
    out: str,
    preset: str | None,
    seed: int | None,
    days: int | None,
    nodes: int | None,
    fail_slow: float | None,
    quiet: bool,
) -> None:
    """Simulate a GPU fleet: telemetry, kernel logs, repairs and ground truth."""
    from ingest.simulator.run import simulate as run_simulation

    settings = settings_of(ctx)
    cfg = settings.simulate
    summary = run_simulation(
        out,
        preset or cfg.preset,
        cfg.seed if seed is None else seed,
        progress=not quiet,
        cluster=settings.ingest.cluster,
        **{
            name: value
            for name, value in (("days", days), ("nodes", nodes), ("fail_slow_fraction", fail_slow))
            if value is not None
        },
    )
    modes = ", ".join(f"{k} {v}" for k, v in summary.failures_by_mode.items())
    click.echo(
        f"simulated {summary.gpus} GPUs on {summary.nodes} nodes over {summary.days} days: "
        f"{summary.telemetry_rows:,} telemetry rows, {summary.kernel_log_lines:,} kernel-log lines, "
        f"{summary.failures} failures ({modes}), {summary.jobs:,} jobs in {summary.seconds:.1f}s -> {summary.out}"
    )


@click.group()
def ingest() -> None:
    """Bring data into the store (kernel logs, ...)."""


@ingest.command("kernel-log")
@data_option
@click.option("--node", default=None, help="Node name for formats without a host field (default: the file name).")
@click.option(
    "--boot-time", default=None, help="When the host booted (ISO, UTC): places /dev/kmsg and [uptime] stamps in time."
)
@click.option(
    "--tz", default=None, help="Time zone of naive stamps such as `dmesg -T` (default: UTC), e.g. Europe/Warsaw."
)
@click.option(
    "--time",
    "capture_time",
    default=None,
    help="When lines with no stamp at all were captured (ISO, UTC): plain dmesg payloads, journalctl -o cat.",
)
@json_option
@click.argument("files", nargs=-1, type=click.Path())
@click.pass_context
def ingest_kernel_log(
    ctx: click.Context,
    data: str | None,
    node: str | None,
    boot_time: str | None,
    tz: str | None,
    capture_time: str | None,
    as_json: bool,
    files: tuple[str, ...],
) -> None:
    """Parse NVRM/Xid kernel-log lines into the xid_events dataset.

    FILES (plain, rotated or gzip-compressed) default to everything under DATA/raw/kernel-log/
    (what `gpufail simulate` writes). Files already ingested are skipped; a grown file is read
    from where the last run stopped. Given FILES, a new (absent or empty) data root is created."""
    from ingest.kernel_log_import import IngestSummary, ingest_kernel_logs
    from ingest.store import Store

    settings = settings_of(ctx)
    root = data_root(ctx, data)
    booted, captured = when(boot_time, "'--boot-time'"), when(capture_time, "'--time'")

    def ingest_into(store: Store, paths: list[Path]) -> IngestSummary:
        return ingest_kernel_logs(
            store,
            paths,
            cluster=settings.ingest.cluster,
            dedup_window=settings.ingest.xid_dedup_window,
            node=node,
            boot_time=booted,
            tz=tz,
            workers=settings.ingest_workers(),
            capture_time=captured,
        )

    if files:
        # Given files can start a new data root (someone holding only kernel logs).
        with import_root(ctx, data, as_json) as store:
            summary = ingest_into(store, [Path(f) for f in files])
    else:
        store = Store.open(root)
        paths = sorted(p for p in Path(store.path("raw", "kernel-log")).glob("*") if p.is_file())
        if not paths:
            raise GpufailError(f"no kernel-log files given and none under {store.path('raw', 'kernel-log')}")
        summary = ingest_into(store, paths)
    report(as_json, f"kernel-log: {summary}", {"command": "ingest kernel-log", **vars(summary)})
    exit_if_input_skipped(summary.unreadable_files, "kernel-log files")


@ingest.command("dcgm-exporter")
@data_option
@click.option("--node", default=None, help="Node name (default: each GPU's Hostname label).")
@click.option(
    "--time", "time_", default=None, help="Stamp the samples with this time (ISO): a saved scrape's capture time."
)
@json_option
@click.argument("sources", nargs=-1, required=True)
@click.pass_context
def ingest_dcgm_exporter(
    ctx: click.Context, data: str | None, node: str | None, time_: str | None, as_json: bool, sources: tuple[str, ...]
) -> None:
    """Read dcgm-exporter scrapes into the telemetry dataset, stamped with the current time
    (or --time).

    SOURCES are /metrics URLs (scraped now) or files holding saved scrapes."""
    from collections import Counter

    from ingest.dcgm_scrape import fetch_scrape, parse_scrape_detailed
    from ingest.user_metrics import record_metrics

    settings = settings_of(ctx)
    stamp = when(time_, "'--time'")
    with import_root(ctx, data, as_json) as store:
        # Extra DCGM fields go to the user's metrics that name them: the root's and the configuration's.
        record_metrics(store, settings.user_metrics())
        # Parse every source before writing, so one bad source writes no rows at all.
        parsed = [
            parse_scrape_detailed(
                fetch_scrape(source),
                now=stamp or datetime.now(UTC),
                cluster=settings.ingest.cluster,
                node=node,
                source=source,
            )
            for source in sources
        ]
        for scrape in parsed:
            store.write("telemetry", scrape.table)
    rows = sum(scrape.table.num_rows for scrape in parsed)
    out_of_range: Counter[str] = sum((scrape.out_of_range for scrape in parsed), Counter())
    text = f"dcgm-exporter: {rows} GPU samples from {len(sources)} scrape(s) -> {store.path('telemetry')}"
    if out_of_range:
        per_metric = ", ".join(f"{metric} {n}" for metric, n in out_of_range.most_common())
        text += f"; {out_of_range.total()} readings outside their metric's valid range left missing ({per_metric})"
    report(
        as_json,
        text,
        {
            "command": "ingest dcgm-exporter",
            "samples": rows,
            "scrapes": len(sources),
            "dataset": store.path("telemetry"),
            "out_of_range": dict(out_of_range),
        },
    )


@ingest.command("prometheus")
@data_option
@click.option(
    "--url",
    default=None,
    help="The Prometheus HTTP API, e.g. http://prometheus:9090 (default: [ingest.prometheus] url).",
)
@click.option("--start", required=True, help="First time to import (ISO, UTC unless it names a zone).")
@click.option("--end", required=True, help="Import up to this time (ISO), not included.")
@click.option(
    "--match",
    default=None,
    help="Series selector narrowing the import, e.g. '{cluster=\"a\"}' (default: [ingest.prometheus] match).",
)
@click.option(
    "--step", default=None, help="The series' scrape interval, e.g. 30s (default: detected from the samples)."
)
@click.option("--ca-file", default=None, type=click.Path(dir_okay=False), help="PEM certificates to trust for https.")
@json_option
@click.pass_context
def ingest_prometheus(
    ctx: click.Context,
    data: str | None,
    url: str | None,
    start: str,
    end: str,
    match: str | None,
    step: str | None,
    ca_file: str | None,
    as_json: bool,
) -> None:
    """Import the dcgm-exporter history a Prometheus server holds (also Thanos, Mimir,
    VictoriaMetrics) into the telemetry and xid_events datasets.

    Samples keep their own timestamps; a range imported before is not imported again, and a
    run stopped midway is finished by the next. Credentials come from the environment:
    GPUFAIL_PROMETHEUS_TOKEN, or GPUFAIL_PROMETHEUS_USER and GPUFAIL_PROMETHEUS_PASSWORD."""
    from gpufail.config import parse_duration
    from ingest.prometheus_import import ImportOptions, import_prometheus
    from ingest.user_metrics import record_metrics

    settings = settings_of(ctx)
    cfg = settings.ingest.prometheus
    first, last = when(start, "'--start'"), when(end, "'--end'")
    assert first is not None and last is not None
    try:
        every = parse_duration(step) if step is not None else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--step'") from None
    if every is not None and every.total_seconds() <= 0:
        raise click.BadParameter(f"{step!r}: expected a scrape interval above zero such as 30s", param_hint="'--step'")
    client = prometheus_client(settings, url, ca_file)
    options = ImportOptions(
        start=first,
        end=last,
        match=cfg.match if match is None else match,
        labels=prometheus_labels(settings),
        dedup_window=settings.ingest.xid_dedup_window,
        concurrency=cfg.concurrency,
        step=every,
    )
    with import_root(ctx, data, as_json) as store:
        # Extra DCGM fields go to the user's metrics that name them: the root's and the configuration's.
        record_metrics(store, settings.user_metrics())
        summary = import_prometheus(store, client, options)
    report(
        as_json, f"prometheus: {summary.line()}", {"command": "ingest prometheus", "url": client.shown, **vars(summary)}
    )


def prometheus_client(settings: Settings, url: str | None, ca_file: str | None) -> PrometheusClient:
    """A client of the server the command line or [ingest.prometheus] names."""
    from ingest.prometheus_api import PrometheusClient

    cfg = settings.ingest.prometheus
    address = url or cfg.url
    if not address:
        raise GpufailError("--url: no Prometheus server given; expected --url or [ingest.prometheus] url")
    return PrometheusClient(
        address,
        timeout_s=cfg.timeout.total_seconds(),
        retries=cfg.retries,
        ca_file=ca_file or cfg.ca_file or None,
    )


def prometheus_labels(settings: Settings) -> LabelMap:
    from ingest.prometheus_labels import LabelMap

    return LabelMap.of(settings.ingest.prometheus.labels, settings.ingest.cluster)


@ingest.command("nvidia-smi")
@data_option
@click.option("--node", default=None, help="Node name (default: the file name without its extensions).")
@click.option("--time", "time_", default=None, help="Capture time (ISO) for output with no timestamp of its own.")
@click.option("--tz", default=None, help="Time zone of nvidia-smi's local-time stamps (default: UTC).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@json_option
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.pass_context
def ingest_nvidia_smi(
    ctx: click.Context,
    data: str | None,
    node: str | None,
    time_: str | None,
    tz: str | None,
    quiet: bool,
    as_json: bool,
    files: tuple[str, ...],
) -> None:
    """Import saved nvidia-smi output into the telemetry dataset.

    FILES hold `nvidia-smi --query-gpu=timestamp,uuid,... --format=csv` output (with its
    header; looped runs and `nounits` are fine) or `nvidia-smi -q -x` XML, plain or gzip."""
    from ingest.nvidia_smi import import_nvidia_smi

    try:
        with import_root(ctx, data, as_json) as store:
            summary = import_nvidia_smi(
                store,
                [Path(f) for f in files],
                cluster=settings_of(ctx).ingest.cluster,
                node=node,
                time=when(time_, "'--time'"),
                tz=tz,
                progress=not quiet,
            )
    except ValueError as exc:  # an unknown --tz
        raise click.BadParameter(str(exc), param_hint="'--tz'") from None
    report(as_json, f"nvidia-smi: {summary.line()}", {"command": "ingest nvidia-smi", **vars(summary)})


@ingest.command("table")
@data_option
@click.option("--map", "mapping_file", required=True, type=click.Path(dir_okay=False), help="TOML mapping file.")
@json_option
@click.argument("file", type=click.Path(dir_okay=False))
@click.pass_context
def ingest_table(ctx: click.Context, data: str | None, mapping_file: str, as_json: bool, file: str) -> None:
    """Import another system's telemetry (CSV or Parquet), and optionally its failure and
    repair records, as the mapping file says (see examples/table_import/mapping.toml)."""
    from ingest.table_import import import_table
    from ingest.table_mapping import load_mapping
    from ingest.user_metrics import record_metrics

    with import_root(ctx, data, as_json) as store:
        # The mapping may name the user's metrics: the root's and the configuration's.
        record_metrics(store, settings_of(ctx).user_metrics())
        mapping = load_mapping(Path(mapping_file))
        summary = import_table(
            store, Path(file), mapping, mapping_path=Path(mapping_file), cluster=settings_of(ctx).ingest.cluster
        )
    report(as_json, f"table: {summary.line()}", {"command": "ingest table", **vars(summary)})


@click.command()
@click.option("--out", "--data", "data", default=None, help="Data root to write to (default: [store] root).")
@click.option(
    "--source",
    "sources",
    default=None,
    help="Comma-separated collectors: nvml, kernel-log, dcgm-exporter, prometheus (default: [collect] sources).",
)
@click.option("--interval", default=None, help="Time between collections, e.g. 30s (default: [collect] interval).")
@click.option("--once", is_flag=True, help="Collect once, flush and exit.")
@click.option("--max-runs", type=click.IntRange(min=1), default=None, help="Stop after this many collections.")
@click.option("--node", default=None, help="Node name (default: [collect] node, else the hostname).")
@click.option(
    "--listen",
    default=None,
    help='Serve /metrics, /healthz, /readyz on host:port; "" for none (default: [collect] listen).',
)
@json_option
@log_format_option
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
    as_json: bool,
    log_format: str,
) -> None:
    """Run the live collectors (NVML, kernel log, dcgm-exporter, Prometheus) into the store
    until SIGTERM or SIGINT, flushing on a size/time policy; prints a line per flush and a summary. Exits
    non-zero when the last flush failed or when every source failed, naming each and why."""
    from gpufail.config import parse_duration
    from gpufail.logs import json_logs, line_writer, log_result, use_log_format
    from ingest.collect.daemon import StopFlag, run_collect, stop_on_signals
    from ingest.store import Store
    from ingest.user_metrics import record_metrics

    use_log_format(log_format)
    try:
        every = parse_duration(interval) if interval is not None else None
    except ValueError as exc:
        raise GpufailError(f"--interval: {exc}") from None
    options = settings_of(ctx).collect_options(node=node, sources=sources, interval=every, listen=listen)
    store = Store.create(data_root(ctx, data))
    # The collectors store the user's metrics they can read (extra dcgm-exporter fields).
    record_metrics(store, settings_of(ctx).user_metrics())
    with stop_on_signals(StopFlag()) as stop:
        lines = line_writer() if json_logs() else progress_echo(as_json)
        summary = run_collect(store, options, once=once, max_runs=max_runs, stop=stop, report=lines)
    failed = summary.every_source_failed()
    text = f"collect: stopped ({summary.stop_reason}) on {options.node}: {summary.line()}"
    facts = {
        "command": "collect",
        "node": options.node,
        **vars(summary),
        "failed_sources": [{"source": n, "error": e} for n, e in failed],
    }
    if json_logs():
        log_result(text, facts)
    else:
        report(as_json, text, facts)
    if failed:
        for name, error in failed:
            line_writer(err=True)(f"collect: {name} failed: {error}")
        raise GpufailError(f"collect: every source failed ({', '.join(n for n, _ in failed)}); nothing was collected")


# Failure records from the schedulers (gpufail.cli.failures).
ingest.add_command(ingest_slurm)
ingest.add_command(ingest_kubernetes)
