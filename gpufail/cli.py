"""`gpufail`: the one command-line tool. Cron, the Makefile and people use the same commands.

Each command reads its inputs, calls one function, writes, and prints a one-line summary
(CONVENTIONS.md 9). Heavy libraries are imported inside the commands so `gpufail --help`
stays fast. Errors a user can cause (`GpufailError`) print as one line and exit with status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ingest.errors import GpufailError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None, help="TOML configuration file (default: $GPUFAIL_CONFIG, else built-in defaults).")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None) -> None:
    """Predict GPU failures in training fleets from telemetry and XID kernel-log events."""
    from gpufail.config import load_settings

    ctx.obj = load_settings(config_path)


def _settings(ctx: click.Context) -> Any:
    return ctx.find_root().obj


def _data_option(f: Any) -> Any:
    return click.option("--data", "data", default=None, help="Data root: folder or fsspec URL (default: [store] root).")(f)


def _root(ctx: click.Context, data: str | None) -> str:
    return data or _settings(ctx).store.root


@cli.command()
@click.option("--out", required=True, type=click.Path(file_okay=False), help="New folder to write the simulated fleet into.")
@click.option("--preset", default=None, help="demo (a few hundred GPUs, 2 months) or paper (~30k GPUs, 4 months).")
@click.option("--seed", type=int, default=None, help="Random seed (default: [simulate] seed).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.pass_context
def simulate(ctx: click.Context, out: str, preset: str | None, seed: int | None, quiet: bool) -> None:
    """Simulate a GPU fleet: telemetry, kernel logs, repairs and ground truth."""
    from ingest.simulator.run import simulate as run_simulation

    settings = _settings(ctx)
    cfg = settings.simulate
    summary = run_simulation(
        out, preset or cfg.preset, cfg.seed if seed is None else seed, progress=not quiet, cluster=settings.ingest.cluster
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
@click.argument("files", nargs=-1, type=click.Path())
@click.pass_context
def ingest_kernel_log(ctx: click.Context, data: str | None, node: str | None, files: tuple[str, ...]) -> None:
    """Parse NVRM/Xid kernel-log lines into the xid_events dataset.

    FILES default to DATA/raw/kernel-log/*.log (what `gpufail simulate` writes)."""
    from ingest.kernel_log_ingest import ingest_kernel_logs
    from ingest.store import Store

    settings = _settings(ctx)
    root = _root(ctx, data)
    store = Store.open(root)
    paths = [Path(f) for f in files] or sorted(Path(store.path("raw", "kernel-log")).glob("*.log"))
    if not paths:
        raise GpufailError(f"no kernel-log files given and none under {store.path('raw', 'kernel-log')}")
    summary = ingest_kernel_logs(store, paths, cluster=settings.ingest.cluster, dedup_window=settings.ingest.xid_dedup_window, node=node)
    click.echo(f"kernel-log: {summary}")


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
        exc.show()
        sys.exit(exc.exit_code)
