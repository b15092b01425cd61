"""The Dask client of a fleet-scale run: none (one machine), a LocalCluster, or a scheduler.

The CLI opens it from the `[dask]` settings and passes it to `features.distributed` and
`models.distributed`; nothing below the CLI creates clusters (settings are
read once and passed down). A LocalCluster listens on 127.0.0.1 only and starts no dashboard,
so a run on a laptop or a CI machine opens no port beyond loopback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from ingest.errors import ConfigError


class ClusterError(ConfigError):
    """The configured Dask scheduler cannot be reached or started."""


@contextmanager
def dask_client(
    scheduler: str,
    *,
    n_workers: int = 2,
    threads_per_worker: int = 1,
    connect_timeout: timedelta = timedelta(seconds=10),
    processes: bool = True,
) -> Iterator[Any]:
    """Yield a `distributed.Client` for `scheduler` ("" yields None: the single-machine path),
    closed (and a LocalCluster shut down) on exit.

    "local": a LocalCluster of `n_workers` x `threads_per_worker` on 127.0.0.1 (worker processes
    unless `processes` is false, which tests use to start in a second). Anything else is a
    running scheduler's address; one that does not answer within `connect_timeout` raises
    `ClusterError` naming it."""
    if not scheduler:
        yield None
        return
    from distributed import Client, LocalCluster

    if scheduler == "local":
        cluster = LocalCluster(
            n_workers=n_workers,
            threads_per_worker=threads_per_worker,
            processes=processes,
            protocol="tcp://",
            host="127.0.0.1",
            scheduler_port=0,
            dashboard_address=None,
            worker_dashboard_address=None,
            silence_logs=40,  # logging.ERROR
        )
        try:
            with Client(cluster) as client:
                yield client
        finally:
            cluster.close()
        return
    seconds = connect_timeout.total_seconds()
    try:
        client = Client(scheduler, timeout=f"{seconds}s")
    except (OSError, TimeoutError) as exc:
        raise ClusterError(
            f"[dask] scheduler {scheduler!r}: no Dask scheduler answered within {seconds:g} s ({exc}); "
            "expected the address of a running `dask scheduler` (tcp://HOST:8786), 'local' for a "
            "LocalCluster on this machine, or '' to run without Dask"
        ) from None
    try:
        yield client
    finally:
        client.close()
