"""`gpufail`: the one command-line tool. Cron, the Makefile and people use the same commands.

Each command reads its inputs, calls one function, writes, and prints a one-line summary:
cron, the Makefile and people use the same commands. The commands live in one module per group (`data`: bring data in;
`features`; `models`: train and judge; `serving`: score and act; `operations`: the nightly job
and tools), and take their option objects from the settings (`gpufail.config.Settings`). A
command's module is imported when the command runs (`COMMANDS`), and heavy libraries inside the
commands, so `gpufail --help` stays fast and a quick command loads only what it uses. Errors a
user can cause (`GpufailError`) print as one line and exit with status 2.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence

import click

from ingest.errors import GpufailError

COMMANDS = {
    "simulate": "gpufail.cli.data:simulate",
    "ingest": "gpufail.cli.data:ingest",
    "collect": "gpufail.cli.data:collect",
    "ship": "gpufail.cli.storage:ship",
    "compact": "gpufail.cli.storage:compact",
    "features": "gpufail.cli.features:features",
    "train": "gpufail.cli.models:train",
    "evaluate": "gpufail.cli.models:evaluate",
    "summary": "gpufail.cli.models:summary",
    "score": "gpufail.cli.serving:score",
    "at-risk": "gpufail.cli.serving:at_risk",
    "publish": "gpufail.cli.serving:publish",
    "serve": "gpufail.cli.serving:serve",
    "nightly": "gpufail.cli.operations:nightly",
    "mlflow": "gpufail.cli.operations:mlflow_command",
    "config": "gpufail.cli.operations:config",
}
"""Each command of `gpufail`, by name: the module and the name of its click command."""


class _Commands(click.Group):
    """A group whose commands are imported by name (`module:attribute`) when run or listed:
    importing every command's module (and what each imports) was a tenth of a quick command."""

    def __init__(self, *args: object, commands: Mapping[str, str], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lazy = dict(commands)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            module, name = self.lazy[cmd_name].split(":")
            self.add_command(getattr(importlib.import_module(module), name), cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=_Commands, commands=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gpufail", prog_name="gpufail", message="%(prog)s %(version)s")
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

    ctx.obj = load_settings(config_path, tables=QUICK_COMMANDS.get(ctx.invoked_subcommand or ""))


QUICK_COMMANDS = {"at-risk": ("store", "publish", "serve")}
"""Commands that check only the settings tables they read (`load_settings`' `tables`): a quick
look at the fleet should not pay for checking every table of the file."""


def main(args: Sequence[str] | None = None) -> None:
    """Run `gpufail ARGS` (default: this process's command line). An error exits with one line on
    stderr: status 2 for bad input (`GpufailError`, click's usage errors) and for a module of an
    extra this install lacks (`gpufail.extras`), 130 when aborted."""
    from gpufail.logs import reset_log_format

    reset_log_format()
    argv = sys.argv[1:] if args is None else list(args)
    try:
        _run(argv)
    finally:
        reset_log_format()


def _run(argv: list[str]) -> None:
    try:
        cli.main(args=argv, prog_name="gpufail", standalone_mode=False)
    except GpufailError as exc:
        from ingest.urls import redact_urls

        # A message may quote a URL the settings gave (a webhook's key, a tracking server's
        # password): masked here whatever raised it.
        _fail(redact_urls(str(exc)), 2)
    except click.exceptions.Abort:
        _fail("aborted", 130, prefix="gpufail: ")
    except click.ClickException as exc:
        # One line like every other error (click's own shows usage lines first), naming the
        # command whose option or argument was wrong.
        ctx = getattr(exc, "ctx", None)
        where = f"{ctx.command_path}: " if ctx is not None and ctx.parent is not None else ""
        _fail(f"{where}{' '.join(exc.format_message().split())}", exc.exit_code)
    except ModuleNotFoundError as exc:
        from gpufail.extras import missing_extra_line

        line = missing_extra_line(exc.name, _command_name(argv))
        if line is None:
            raise
        _fail(line, 2)


def _fail(message: str, status: int, prefix: str = "gpufail: error: ") -> None:
    from gpufail.logs import json_logs, log_error

    if json_logs():
        log_error(message)
    else:
        click.echo(f"{prefix}{message}", err=True)
    sys.exit(status)


def _command_name(argv: Sequence[str]) -> str | None:
    """The command `argv` runs (its first word that names one), for the missing-extra line."""
    words = iter(argv)
    for word in words:
        if word == "--config":
            next(words, None)
        elif word in COMMANDS:
            return word
    return None
