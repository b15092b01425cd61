"""What a training run records of its origin: the datasets' fingerprint and the code version."""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import date
from pathlib import Path

import pyarrow as pa
import pytest

import models.provenance
from ingest.store import Store
from models.provenance import code_version, dataset_fingerprint


def _day(value: int) -> pa.Table:
    return pa.table({"ts": pa.array([0], pa.timestamp("us", tz="UTC")), "value": [value]})


def test_the_fingerprint_follows_the_files_of_each_dataset_and_not_the_root(tmp_path):
    store = Store.create(str(tmp_path / "a"))
    store.write_owned("features", date(2026, 1, 1), _day(1))
    store.write_owned("predictions", date(2026, 1, 1), _day(1))
    first = dataset_fingerprint(store, ["features", "predictions"])
    assert set(first) == {"features", "predictions"} and all(len(d) == 16 for d in first.values())
    assert dataset_fingerprint(store, ["features", "predictions"]) == first

    # The same files under another root: the same digests (paths are taken relative to it).
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert dataset_fingerprint(Store.open(str(tmp_path / "b")), ["features", "predictions"]) == first

    # A new file in one dataset changes its digest only.
    store.write_owned("features", date(2026, 1, 2), _day(2))
    second = dataset_fingerprint(store, ["features", "predictions"])
    assert second["features"] != first["features"] and second["predictions"] == first["predictions"]


def test_the_code_version_is_the_commit_of_this_checkout():
    here = Path(models.provenance.__file__).parent
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", code_version())
    assert code_version().removesuffix("-dirty") == head.stdout.strip()


def test_without_git_the_code_version_is_the_installed_packages(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(models.provenance.subprocess, "run", no_git)
    assert re.fullmatch(r"gpufail \S+|unknown", code_version())
