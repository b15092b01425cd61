"""`gpufail`: the one command-line tool. Cron, the Makefile and people use the same commands.

Each command reads its inputs, calls one function, writes, and prints a one-line summary:
cron, the Makefile and people use the same commands. The commands live in one module per group (`data`: bring data in;
`features`; `models`: train and judge; `serving`: score and act; `operations`: the nightly job
and tools), and take their option objects from the settings (`gpufail.config.Settings`). Heavy
libraries are imported inside the commands so `gpufail --help` stays fast. Errors a user can
cause (`GpufailError`) print as one line and exit with status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from gpufail.cli import data, failures, features, models, operations, serving
from ingest.errors import GpufailError
from ingest.urls import redact_urls


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML configuration file (default: $GPUFAIL_CONFIG, else ./gpufail.toml, else /etc/gpufail/gpufail.toml, "
    "else built-in defaults; `gpufail config show` says which).",
)
@click.pass_context
def cli(ctx: click.Context, config_path: str | None) -> None:
    """Predict GPU failures in training fleets from telemetry and XID kernel-log events."""
    from gpufail.config import load_settings

    ctx.obj = load_settings(config_path)


for command in (
    data.simulate,
    data.ingest,
    data.collect,
    features.features,
    models.train,
    models.evaluate,
    models.summary,
    serving.score,
    serving.at_risk,
    serving.publish,
    serving.serve,
    operations.nightly,
    operations.mlflow_command,
    operations.config,
):
    cli.add_command(command)
data.ingest.add_command(failures.ingest_slurm)
data.ingest.add_command(failures.ingest_kubernetes)


def main(args: Sequence[str] | None = None) -> None:
    """Run `gpufail ARGS` (default: this process's command line). An error exits with one line on
    stderr: status 2 for bad input (`GpufailError`, click's usage errors), 130 when aborted."""
    try:
        cli.main(args=None if args is None else list(args), prog_name="gpufail", standalone_mode=False)
    except GpufailError as exc:
        # A message may quote a URL the settings gave (a webhook's key, a tracking server's
        # password): masked here whatever raised it.
        click.echo(f"gpufail: error: {redact_urls(str(exc))}", err=True)
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
