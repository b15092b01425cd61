"""Shared test helpers: small, valid tables for each dataset."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest

from ingest.schema import schema_for

T0 = datetime(2026, 1, 5, tzinfo=UTC)

pytest_plugins = ("tests.fake_nvml.fixtures",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests marked `slow` first (in their usual order, then the rest in theirs): with
    several workers (`make test`), a minutes-long test left to the end of the order runs alone
    while the other workers have finished."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _no_user_metrics_between_tests():
    """The user's metrics are the process's (the data root opened last): a test that opened a
    root with some must not leave them to the next test."""
    from ingest.schema import use_user_metrics

    yield
    use_user_metrics(())


def make_rows(dataset: str, times: list[datetime], **values: object) -> pa.Table:
    """Rows of `dataset` at `times`: required columns get plain values, the rest nulls."""
    schema = schema_for(dataset)
    n = len(times)
    columns = {}
    for field in schema:
        if field.name in values:
            v = values[field.name]
            columns[field.name] = pa.array(v if isinstance(v, list) else [v] * n, type=field.type)
        elif field.name in ("ts", "last_ts"):
            columns[field.name] = pa.array(times, type=field.type)
        elif not field.nullable:
            default = {"string": "x", "int16": 0, "int32": 1}.get(str(field.type), 0)
            columns[field.name] = pa.array([default] * n, type=field.type)
        else:
            columns[field.name] = pa.nulls(n, type=field.type)
    return pa.table(columns, schema=schema)


@pytest.fixture
def hours():
    return lambda *hs: [T0 + timedelta(hours=h) for h in hs]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (SQLite store, local artifacts) on 127.0.0.1 and a free
    port, started once per session when a test asks for it; yields (url, home folder)."""
    from gpufail.mlflow_server import start_server, stop_server

    home = tmp_path_factory.mktemp("mlflow")
    # Slow to start on a loaded 2-core machine (database migrations): allow minutes.
    process, url = start_server(home, timeout=300)
    try:
        yield url, home
    finally:
        stop_server(process)


def pytest_unconfigure(config: pytest.Config) -> None:
    """End the output with one line for the tests skipped for want of a real component and
    the command that installs them (tests/real_components.py). Here rather than in the terminal
    summary, which pytest follows with its own sections and the counts line."""
    from tests.real_components import skipped_components, summary_line

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    line = summary_line(skipped_components(reporter.stats.get("skipped", []))) if reporter else None
    if line:
        reporter.write_line(line, yellow=True, bold=True)
