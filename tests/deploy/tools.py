"""System tools the deployment tests run (installed by .ci/run from Debian's packages)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.real_components import skip_missing


def require(tool: str, package: str) -> str:
    """The path of `tool`; where it is missing the test is skipped with the reason, except in
    CI (CI=true), where .ci/run installs it and its absence is a failure."""
    __tracebackhide__ = True
    path = shutil.which(tool)
    if path is None:
        reason = f"{tool} is not installed (Debian package {package}; .ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        skip_missing(tool, reason)
    return path
