"""A real headless Chromium driven by Selenium (Debian's `chromium` and `chromium-driver`; no
browser download), started with the flags that keep it off the network, in a fresh profile."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMEDRIVER = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--window-size=1600,1000",
    "--hide-scrollbars",
)
SCREENSHOTS = Path(__file__).resolve().parents[3] / "build" / "screenshots"
"""The latest screenshots, for people to look at (git-ignored); each test's own are under its tmp folder."""


class BrowserUnavailable(RuntimeError):
    pass


def _first(paths: tuple[str, ...], name: str) -> str:
    for p in paths:
        if os.path.exists(p):
            return p
    found = shutil.which(name)
    if found is None:
        raise BrowserUnavailable(
            f"{name} not found (looked at {', '.join(paths)} and PATH); apt-get install chromium chromium-driver"
        )
    return found


def start_browser() -> tuple[Any, str]:
    """(a Selenium Chrome driver, its profile folder). Raises `BrowserUnavailable` with the reason."""
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        raise BrowserUnavailable(f"selenium is not installed ({exc})") from None
    binary, driver = _first(CHROMIUM, "chromium"), _first(CHROMEDRIVER, "chromedriver")
    profile = tempfile.mkdtemp(prefix="gpufail-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    try:
        return webdriver.Chrome(options=options, service=Service(driver)), profile
    except WebDriverException as exc:
        shutil.rmtree(profile, ignore_errors=True)
        raise BrowserUnavailable(f"chromium did not start: {str(exc).splitlines()[0]}") from None


def screenshot(driver: Any, folder: Path, name: str) -> Path:
    """The whole page as a PNG in `folder` (the test's artifacts), copied to `SCREENSHOTS`."""
    height = driver.execute_script("return Math.max(document.body.scrollHeight, 600)")
    driver.set_window_size(1600, min(int(height) + 20, 6000))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    driver.save_screenshot(str(path))
    driver.set_window_size(1600, 1000)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, SCREENSHOTS / path.name)
    return path
