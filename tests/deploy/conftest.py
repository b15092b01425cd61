"""deploy/kubernetes's base and overlays, rendered once per test module that asks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.deploy.kubectl import render

KUBERNETES = Path(__file__).parents[2] / "deploy" / "kubernetes"
FOLDERS = ["base", "overlays/example", "overlays/kmsg"]


@pytest.fixture(scope="module", params=FOLDERS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(KUBERNETES / request.param)
