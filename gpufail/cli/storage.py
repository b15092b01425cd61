"""Commands that keep a fleet's data root in shape: `compact` (a settled day's small part files
rewritten as a few) and `ship` (a node's spool moved to the data root)."""

from __future__ import annotations

import socket
from datetime import timedelta

import click

from gpufail.cli.options import data_option, data_root, json_option, report, settings_of, when
from ingest.errors import GpufailError


def _duration(text: str | None, option: str) -> timedelta | None:
    from gpufail.config import parse_duration

    if text is None:
        return None
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise GpufailError(f"{option}: {exc}") from None


@click.command()
@data_option
@click.option(
    "--dataset",
    "datasets",
    multiple=True,
    help="Dataset to compact; repeat for several (default: telemetry, xid_events, collector_runs).",
)
@click.option("--start", default=None, help="First day to compact (ISO date; default: the first).")
@click.option("--end", default=None, help="Day after the last one to compact (ISO date; default: no end).")
@click.option(
    "--settle", default=None, help="Leave a day alone until this long after its end (default: [store] compact_settle)."
)
@json_option
@click.pass_context
def compact(
    ctx: click.Context,
    data: str | None,
    datasets: tuple[str, ...],
    start: str | None,
    end: str | None,
    settle: str | None,
    as_json: bool,
) -> None:
    """Rewrite each settled day's part files as a few files sorted by node (kill-safe: readers
    see the old files or the new ones). Days with one file, and days still being written, are
    left alone; run it again at any time."""
    from ingest.compact import DATASETS
    from ingest.compact import compact as run_compact
    from ingest.store import Store

    settings = settings_of(ctx)
    first, after = when(start, "'--start'"), when(end, "'--end'")
    given = _duration(settle, "--settle")
    summary = run_compact(
        Store.open(data_root(ctx, data)),
        datasets or DATASETS,
        settle=settings.store.compact_settle if given is None else given,
        first_day=first.date() if first else None,
        last_day=(after - timedelta(microseconds=1)).date() if after else None,
    )
    report(as_json, summary.line(), {"command": "compact", **vars(summary)})


@click.command()
@click.option("--spool", required=True, help="The node-local data root the collector writes (`collect --data`).")
@data_option
@click.option("--node", default=None, help="Node name (default: [collect] node, else the hostname).")
@click.option(
    "--keep", default="1d", show_default=True, help="Shipped files stay in the spool while their day is this recent."
)
@click.option("--every", default=None, help="Ship again at this interval until SIGTERM or SIGINT (default: once).")
@json_option
@click.pass_context
def ship(
    ctx: click.Context,
    spool: str,
    data: str | None,
    node: str | None,
    keep: str,
    every: str | None,
    as_json: bool,
) -> None:
    """Move the part files a collector committed to its node-local spool to the data root
    (a shared folder or an object store), each exactly once, resuming where a killed run
    stopped."""
    from ingest.collect.daemon import StopFlag, stop_on_signals
    from ingest.ship import ship as run_ship
    from ingest.store import Store

    name = node or settings_of(ctx).collect.node or socket.gethostname()
    kept = _duration(keep, "--keep") or timedelta(0)
    interval = _duration(every, "--every")
    root = data_root(ctx, data)
    with stop_on_signals(StopFlag()) as stop:
        while True:
            try:
                summary = run_ship(Store.open(spool), Store.create(root), name, keep=kept)
            except GpufailError as exc:
                if interval is None:
                    raise
                # The data root may be back (or the collector's spool made) at the next try; the
                # spool keeps the rows meanwhile.
                click.echo(f"ship: failed, trying again in {every}: {exc}", err=True)
            else:
                report(as_json, summary.line(spool, root), {"command": "ship", "node": name, **vars(summary)})
            if interval is None or stop.wait(interval.total_seconds()):
                return
