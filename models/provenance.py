"""Where a model comes from: a fingerprint of the datasets it was trained on and the version of
the code that trained it, recorded with every training run (`models.registry`) so that a model
can be traced back to its data and code."""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Iterable
from pathlib import Path

from ingest.store import Store


def dataset_fingerprint(store: Store, datasets: Iterable[str]) -> dict[str, str]:
    """A digest per dataset of its visible part files (path relative to the root and size).
    Files are written once under unique names, so equal digests mean equal data."""
    out = {}
    base = store.path()
    for dataset in datasets:
        digest = hashlib.sha256()
        for path in store.files(dataset):
            size = store.fs.size(path)
            digest.update(f"{path.removeprefix(base)}\t{size}\n".encode())
        out[dataset] = digest.hexdigest()[:16]
    return out


def code_version() -> str:
    """The git commit of this checkout (with `-dirty` when it has uncommitted changes), else the
    installed gpufail package's version."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"gpufail {version('gpufail')}"
        except PackageNotFoundError:
            return "unknown"
