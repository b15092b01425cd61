"""What the commands share: the settings of the run, the data root option and its default, and
the parsing of option values that click does not do for us."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from gpufail.config import Settings
    from ingest.store import Store

F = TypeVar("F", bound=Callable[..., Any])


def settings_of(ctx: click.Context) -> Settings:
    """The settings `gpufail --config ...` loaded for this run (`gpufail.config.load_settings`)."""
    settings: Settings = ctx.find_root().obj
    return settings


def data_option(f: F) -> F:
    """`--data`: the data root, a folder or an fsspec URL (default: [store] root)."""
    return click.option(
        "--data", "data", default=None, help="Data root: folder or fsspec URL (default: [store] root)."
    )(f)


def quiet_option(f: F) -> F:
    return click.option("--quiet", is_flag=True, help="No progress bar.")(f)


def data_root(ctx: click.Context, data: str | None) -> str:
    """`--data`, else the [store] root."""
    return data or settings_of(ctx).store.root


@contextmanager
def import_root(ctx: click.Context, data: str | None, as_json: bool) -> Iterator[Store]:
    """The data root an `ingest` command writes to: created when absent or empty (and said so
    on stderr, once the import worked: stdout keeps the summary), and removed again when the
    import into it fails."""
    from ingest.store import Store

    root = data_root(ctx, data)
    with Store.for_import(root) as (store, created):
        yield store
    if created:
        click.echo(f"created data root {root}", err=True)


def when(text: str | None, option: str) -> datetime | None:
    """An ISO date or time given to `option` (UTC when it names no zone)."""
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: expected an ISO date or time such as 2026-02-01 or 2026-02-01T06:00", param_hint=option
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def finite(_ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A click callback: a FloatRange lets NaN and infinity through (every comparison with NaN
    is false)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value}: expected a finite number", param=param)
    return value


def dask_client(settings: Settings) -> Any:
    """The Dask client of the `[dask]` settings (docs/fleet-scale.md)."""
    from gpufail.dask_cluster import dask_client as client_of

    d = settings.dask
    return client_of(
        d.scheduler, n_workers=d.n_workers, threads_per_worker=d.threads_per_worker, connect_timeout=d.connect_timeout
    )


def json_option(f: F) -> F:
    """`--json`: print the command's one JSON object (docs/cli.md) instead of its text summary."""
    return click.option(
        "--json", "as_json", is_flag=True, help="Print one JSON object on stdout instead of the text (docs/cli.md)."
    )(f)


def report(as_json: bool, text: str, facts: Any) -> None:
    """Print a command's result: `text` for people, or `facts` as one JSON object for scripts.
    Both come from the same summary, so they cannot tell different stories."""
    if as_json:
        import json

        click.echo(json.dumps(jsonable(facts), sort_keys=True, allow_nan=False))
    else:
        click.echo(text)


SKIPPED_INPUT_EXIT = 3
"""The exit status of a command that did its work but skipped input it could not read (a
corrupt `.gz` among kernel logs): distinct from 2 (nothing done), so that a scheduler alerts
without the next steps being held back."""


def exit_if_input_skipped(skipped: list[str], what: str) -> None:
    """Say on stderr, in one line, that `skipped` inputs were left out, and exit with
    `SKIPPED_INPUT_EXIT`; nothing when there are none."""
    if skipped:
        click.echo(
            f"gpufail: warning: {len(skipped)} {what} could not be read and were skipped (first: {skipped[0]}); "
            "the rest was processed",
            err=True,
        )
        sys.exit(SKIPPED_INPUT_EXIT)


def progress_echo(as_json: bool) -> Callable[[str], None]:
    """Where a command's progress lines go: stdout for people, stderr under `--json` (stdout
    then holds only the JSON object)."""
    return (lambda line: click.echo(line, err=True)) if as_json else click.echo


def jsonable(value: Any) -> Any:
    """`value` as plain JSON types: dataclasses as objects of their fields, times in ISO 8601,
    paths as strings, tuples and sets as lists, non-finite numbers as null."""
    import dataclasses
    from datetime import date, timedelta
    from pathlib import PurePath

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value) if isinstance(value, set | frozenset) else value
        return [jsonable(v) for v in items]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, PurePath):
        return str(value)
    if hasattr(value, "item"):  # numpy and pandas scalars
        return jsonable(value.item())
    if hasattr(value, "isoformat"):  # pandas Timestamp
        return value.isoformat()
    return str(value)
