"""Commands that run the system: the `nightly` job and the embedded `mlflow` server."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gpufail.cli.options import data_option, data_root, settings_of


@click.command()
@data_option
@click.option("--dry-run/--no-dry-run", default=None, help="Publish as a dry run (default: [publish] dry_run, true).")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.pass_context
def nightly(ctx: click.Context, data: str | None, dry_run: bool | None, quiet: bool) -> None:
    """Retrain, gate, score and publish for the newest day of data; resumes after a failure,
    does nothing when the day is already done. Exits non-zero if a step fails (the champion
    keeps serving)."""
    from gpufail.nightly import policy_publisher, run_nightly

    settings = settings_of(ctx)
    root = data_root(ctx, data)
    options = settings.nightly_options(root, progress=not quiet)
    publish = policy_publisher(settings.publish_options(dry_run=dry_run))
    summary = run_nightly(root, options, publish=publish, report=click.echo)
    click.echo(summary.line())


@click.command("mlflow")
@click.option("--home", default=None, help="Folder of the SQLite store and artifacts (default: [mlflow] home).")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Port (default: [mlflow] port).")
@click.pass_context
def mlflow_command(ctx: click.Context, home: str | None, port: int | None) -> None:
    """Run the embedded MLflow tracking server (SQLite store, local artifacts) on 127.0.0.1
    until interrupted."""
    from gpufail.mlflow_server import serve_forever, tracking_url

    cfg = settings_of(ctx).mlflow
    folder = Path(home or cfg.home)
    port = port or cfg.port
    click.echo(f"mlflow: serving {folder.resolve()} at {tracking_url(cfg.host, port)} (Ctrl-C stops it)")
    sys.exit(serve_forever(folder, host=cfg.host, port=port))
