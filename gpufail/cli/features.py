"""`gpufail features`: build the features dataset (or write the feature dictionary)."""

from __future__ import annotations

from pathlib import Path

import click

from gpufail.cli.options import (
    dask_client,
    data_option,
    data_root,
    json_option,
    quiet_option,
    report,
    settings_of,
    when,
)
from ingest.errors import GpufailError


@click.command()
@data_option
@click.option("--start", default=None, help="First grid time (ISO, UTC); default: the start of the telemetry.")
@click.option("--end", default=None, help="End of the grid, exclusive (ISO, UTC); default: the end of the telemetry.")
@click.option("--overwrite", is_flag=True, help="Rebuild days that already have features.")
@quiet_option
@click.option(
    "--dictionary",
    "dictionary_path",
    default=None,
    type=click.Path(dir_okay=False, writable=True),
    help="Write the feature dictionary (name, meaning, unit, window) as Markdown to this file ('-': stdout) and build nothing.",
)
@json_option
@click.pass_context
def features(
    ctx: click.Context,
    data: str | None,
    start: str | None,
    end: str | None,
    overwrite: bool,
    quiet: bool,
    dictionary_path: str | None,
    as_json: bool,
) -> None:
    """Build sliding-window features and labels into the features dataset, with the [features]
    and [labels] settings (the dataset records them; a build with other settings rebuilds every
    day with --overwrite, or is refused)."""
    settings = settings_of(ctx)
    spec = settings.feature_spec()
    if dictionary_path is not None:
        from features.dictionary import dictionary_markdown

        text = dictionary_markdown(spec)
        if dictionary_path == "-":
            if as_json:
                raise click.UsageError("--json needs --dictionary FILE (with '-' the Markdown itself is stdout)")
            click.echo(text, nl=False)
        else:
            Path(dictionary_path).parent.mkdir(parents=True, exist_ok=True)
            Path(dictionary_path).write_text(text)
            report(
                as_json,
                f"feature dictionary -> {dictionary_path}",
                {"command": "features --dictionary", "path": dictionary_path},
            )
        return
    from ingest.store import Store

    first, last = when(start, "'--start'"), when(end, "'--end'")
    if first is not None and last is not None and last <= first:
        raise GpufailError(f"--end {end}: expected a time after --start {start}")
    store = Store.open(data_root(ctx, data))
    if settings.dask.scheduler:
        # [dask] scheduler set: the same features, built in partitions on the cluster.
        from features.distributed import build_features_distributed

        d = settings.dask
        with dask_client(settings) as client:
            summary = build_features_distributed(
                client,
                store,
                spec,
                start=first,
                end=last,
                partition_nodes=d.partition_nodes,
                partition_days=d.partition_days,
                overwrite=overwrite,
            )
    else:
        from features.runner import build_features_from_store

        options = settings.build_options(progress=not quiet)
        summary = build_features_from_store(store, spec, options, start=first, end=last, overwrite=overwrite)
    report(as_json, str(summary), {"command": "features", **vars(summary)})
