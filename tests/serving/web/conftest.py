"""Fixtures of the operator's pages: the web fleet served by a real `gpufail serve`, and a real
headless Chromium. Without Chromium (or Selenium) the browser tests skip with the reason; in
CI (`CI=true`) they fail instead, so a missing install step cannot pass as green."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.real_components import skip_missing
from tests.serving.api_server import ADMIN_TOKEN, READ_TOKEN
from tests.serving.web.browser import BrowserUnavailable, start_browser
from tests.serving.web.web_fleet import prepare, serve


@pytest.fixture(scope="session")
def web_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(data root, model folder) of the web fleet (`web_fleet.build_store`); read-only."""
    return prepare(tmp_path_factory.mktemp("web-data"))


@pytest.fixture(scope="session")
def web_server(tmp_path_factory: pytest.TempPathFactory, web_data: tuple[Path, Path]) -> Iterator[Any]:
    """`gpufail serve` over the web fleet; reads need no token. Its data root is `.data`."""
    srv = serve(tmp_path_factory.mktemp("web"), *web_data)
    srv.data = web_data[0]
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def token_server(tmp_path_factory: pytest.TempPathFactory, web_data: tuple[Path, Path]) -> Iterator[Any]:
    """The same, with [serve] read_requires_token, a read token and an admin token."""
    srv = serve(
        tmp_path_factory.mktemp("web-token"),
        *web_data,
        serve={"read_requires_token": True},
        env={"GPUFAIL_SERVE_READ_TOKEN": READ_TOKEN, "GPUFAIL_SERVE_ADMIN_TOKEN": ADMIN_TOKEN},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    try:
        driver, profile = start_browser()
    except BrowserUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: the browser tests need Debian's chromium and chromium-driver: {exc}")
        skip_missing("Chromium", f"no headless Chromium here: {exc}")
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)
