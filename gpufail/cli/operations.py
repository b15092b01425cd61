"""Commands that run the system: the `nightly` job and the embedded `mlflow` server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from gpufail.cli.options import data_option, data_root, exit_if_input_skipped, json_option, report, settings_of
from gpufail.logs import log_format_option


@click.command()
@data_option
@click.option("--dry-run/--no-dry-run", default=None, help="Publish as a dry run (default: [publish] dry_run, true).")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@log_format_option
@click.pass_context
def nightly(ctx: click.Context, data: str | None, dry_run: bool | None, quiet: bool, log_format: str) -> None:
    """Retrain, gate, score and publish for the newest day of data; resumes after a failure,
    does nothing when the day is already done. Exits non-zero if a step fails (the champion
    keeps serving)."""
    from gpufail.logs import json_logs, line_writer, log_result, use_log_format

    use_log_format(log_format)
    from gpufail.nightly import policy_publisher, run_nightly

    settings = settings_of(ctx)
    root = data_root(ctx, data)
    # Progress bars redraw one line: no place in a log of one JSON object per line.
    options = settings.nightly_options(root, progress=not (quiet or json_logs()))
    publish = policy_publisher(settings.publish_options(dry_run=dry_run))
    summary = run_nightly(root, options, publish=publish, report=line_writer())
    if json_logs():
        log_result(summary.line(), {"command": "nightly", **vars(summary)})
    else:
        click.echo(summary.line())
    exit_if_input_skipped(summary.unreadable_kernel_logs(), "kernel-log files")


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


@click.group()
def config() -> None:
    """The configuration in effect (file discovery: docs/cli.md)."""


@config.command("show")
@json_option
@click.pass_context
def config_show(ctx: click.Context, as_json: bool) -> None:
    """Print every setting in effect and where it came from (a file, an environment variable or
    the default), with secrets masked."""
    import os

    from gpufail.config import load_settings_and_origins
    from gpufail.config_show import effective_settings

    settings, origins = load_settings_and_origins(ctx.find_root().params.get("config_path"), os.environ)
    rows = effective_settings(settings, origins, os.environ)
    facts = {
        "command": "config show",
        "file": origins.path,
        "found_by": origins.found_by,
        "settings": [vars(r) for r in rows],
    }
    lines = [f"config file: {origins.path or 'none'} ({origins.found_by})"]
    table = None
    for r in rows:
        if r.table != table:
            lines.append(f"[{r.table}]")
            table = r.table
        note = f"  ; {r.note}" if r.note else ""
        lines.append(f"{r.key} = {json.dumps(r.value)}  # {r.source}{note}")
    report(as_json, "\n".join(lines), facts)
