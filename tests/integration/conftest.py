"""Fixtures that start real components: a Slurm controller with 16 virtual GPU nodes.

Locally, without Slurm (or without root), the tests that need it are skipped with the reason.
In CI (`CI=true`) they must run: a cluster that does not start fails them, with the reason,
so a missing install step cannot pass as green.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.integration.slurm_cluster import SlurmCluster, SlurmUnavailable, start_slurm_cluster
from tests.real_components import skip_missing


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    try:
        cluster = start_slurm_cluster(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: the Slurm integration tests need a real controller and it did not start: {exc}")
        skip_missing("Slurm", f"no Slurm controller here: {exc}")
    yield cluster
    cluster.stop()


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> SlurmCluster:
    """The session's cluster with every node idle, undrained and at weight 1."""
    slurm_cluster.reset_nodes()
    return slurm_cluster
