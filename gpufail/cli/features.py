"""`gpufail features`: build the features dataset (or write the feature dictionary)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from datetime import datetime

    from features.plan import FeatureBuildSummary
    from features.spec import FeatureSpec
    from gpufail.config import Settings
    from ingest.store import Store


@click.command()
@data_option
@click.option("--start", default=None, help="First grid time (ISO, UTC); default: the start of the telemetry.")
@click.option("--end", default=None, help="End of the grid, exclusive (ISO, UTC); default: the end of the telemetry.")
@click.option("--overwrite", is_flag=True, help="Rebuild days that already have features.")
@click.option(
    "--materialise",
    is_flag=True,
    help="Write the whole features table (every feature of every GPU-hour, the `features` dataset) for "
    "notebooks or export, instead of the stored aggregates the features are computed from.",
)
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
    materialise: bool,
    quiet: bool,
    dictionary_path: str | None,
    as_json: bool,
) -> None:
    """Prepare the store's features, with the [features] and [labels] settings (the store
    records them): the per GPU-hour aggregates every feature row is computed from when training,
    evaluation, scoring or serving asks for it (docs/store.md). Settings of another grid or
    silence rebuild every day with --overwrite, or are refused; other settings are recorded and
    apply at once.

    By default it builds what is missing: days not built yet, and days built before their
    telemetry ended. Run again with nothing new, it builds nothing and says so. --overwrite
    rebuilds every day of --start/--end (default: all of them).

    --materialise writes the whole features table instead (every feature of every GPU-hour, for
    notebooks or export), keeping its days as above and rebuilding those whose labels the data
    added since can now settle. Both run on Dask when [dask] scheduler is set."""
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
    from features.plan import FeaturesExistError
    from ingest.store import Store

    first, last = when(start, "'--start'"), when(end, "'--end'")
    if first is not None and last is not None and last <= first:
        raise GpufailError(f"--end {end}: expected a time after --start {start}")
    store = Store.open(data_root(ctx, data))
    summary: FeatureBuildSummary
    try:
        if materialise:
            summary = _build(settings, store, spec, first, last, overwrite=overwrite, quiet=quiet)
        else:
            summary = _aggregates(settings, store, spec, first, last, overwrite=overwrite, quiet=quiet)
    except FeaturesExistError as done:
        asked = "" if first is None and last is None else " asked for"
        report(
            as_json,
            f"features: up to date: {done.files} files cover {done.start}..{done.last}, every day{asked}, built from "
            "the data as it is now; nothing to build (gpufail features --overwrite rebuilds them, "
            "--start/--end a range of them)",
            {"command": "features", "up_to_date": True, "files": done.files, "start": done.start, "last": done.last},
        )
        return
    report(as_json, str(summary), {"command": "features", "up_to_date": False, **vars(summary)})


def _aggregates(
    settings: Settings,
    store: Store,
    spec: FeatureSpec,
    first: datetime | None,
    last: datetime | None,
    *,
    overwrite: bool,
    quiet: bool,
) -> FeatureBuildSummary:
    """The stored aggregates of [first, last): on Dask when [dask] scheduler is set."""
    if settings.dask.scheduler:
        from features.distributed import build_aggregates_distributed

        d = settings.dask
        with dask_client(settings) as client:
            return build_aggregates_distributed(
                client,
                store,
                spec,
                start=first,
                end=last,
                partition_nodes=d.partition_nodes,
                partition_days=d.partition_days,
                overwrite=overwrite,
            )
    from features.aggregates import build_aggregates

    return build_aggregates(store, spec, start=first, end=last, overwrite=overwrite, progress=not quiet)


def _build(
    settings: Settings,
    store: Store,
    spec: FeatureSpec,
    first: datetime | None,
    last: datetime | None,
    *,
    overwrite: bool,
    quiet: bool,
) -> FeatureBuildSummary:
    """The features table of [first, last) with the settings' runner: Dask when [dask] scheduler is set."""
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
    return summary
