"""The tests that run real components a newcomer's machine may lack (Slurm, Chromium and its
driver, promtool and the prometheus server, systemd-analyze, kubectl): without one they are
skipped with a reason that names it, and `make test` ends with one line counting them and naming
the command that installs them all, the step CI runs (`.ci/run --tools`). In CI (`CI=true`) the
fixtures fail instead, so a missing install step cannot pass as green."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any, NoReturn

import pytest

INSTALL = ".ci/run --tools"
"""Installs every real component the tests use (as root or with sudo), then the venv: the
first steps of `.ci/run`, without the test run."""
_PREFIX = "needs a real component, "
_REASON = re.compile(re.escape(_PREFIX) + r"([^:]+): ")


def skip_missing(component: str, reason: str) -> NoReturn:
    """Skip the test: `component` is not installed here (`reason` says how it was found missing).
    The skip is reported at the caller's line, not this one."""
    __tracebackhide__ = True
    pytest.skip(f"{_PREFIX}{component}: {reason}")


def skipped_components(reports: Iterable[Any]) -> Counter[str]:
    """Skipped tests per missing real component, from pytest's skip reports."""
    found: Counter[str] = Counter()
    for report in reports:
        longrepr = getattr(report, "longrepr", None)
        message = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        match = _REASON.search(message)
        if match:
            found[match[1]] += 1
    return found


def summary_line(skipped: Counter[str]) -> str | None:
    """The line `make test` ends with when real-component tests were skipped, else None."""
    if not skipped:
        return None
    total = sum(skipped.values())
    parts = ", ".join(f"{component} {n}" for component, n in sorted(skipped.items()))
    tests = "test" if total == 1 else "tests"
    return f"{total} real-component {tests} skipped ({parts}): `{INSTALL}` installs what they need"
