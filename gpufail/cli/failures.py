"""`gpufail ingest slurm` and `gpufail ingest kubernetes`: failures the scheduler saw, as
failure events (`ingest.failure_events`), a label source beside the failure XIDs."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click

from gpufail.cli.options import data_option, import_root, json_option, report, settings_of, when
from ingest.errors import GpufailError


def _slurm_json(tool: str, *args: str, bin_dir: str, slurm_conf: str, timeout: float) -> dict[str, Any]:
    command = [os.path.join(bin_dir, tool) if bin_dir else tool, *args]
    env = {**os.environ, "SLURM_CONF": slurm_conf} if slurm_conf else None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GpufailError(f"{tool}: cannot run it ({exc}); set [publish] slurm_bin_dir or put it on PATH") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise GpufailError(f"{' '.join([tool, *args])} exited {done.returncode}: {said[0] if said else ''}")
    try:
        answer: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise GpufailError(f"{tool} {' '.join(args)}: not JSON; expected Slurm 21.08 or newer") from None
    return answer


def _json_file(path: str, option: str) -> dict[str, Any]:
    try:
        answer: dict[str, Any] = json.loads(Path(path).read_text())
    except OSError as exc:
        raise GpufailError(f"{option} {path}: cannot read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise GpufailError(f"{option} {path}: not JSON ({exc})") from None
    return answer


@click.command("slurm")
@data_option
@click.option(
    "--jobcomp",
    default=None,
    type=click.Path(dir_okay=False),
    help="The job-completion record (JobCompType=jobcomp/filetxt) to read NODE_FAIL jobs from, "
    "where there is no accounting database for sacct.",
)
@click.option(
    "--sacct-json", default=None, type=click.Path(dir_okay=False), help="Saved `sacct --json` output instead of sacct."
)
@click.option(
    "--sinfo-json", default=None, type=click.Path(dir_okay=False), help="Saved `sinfo --json` output instead of sinfo."
)
@click.option("--since", default=None, help="sacct: job ends from this time (ISO; default: 30 days ago).")
@json_option
@click.pass_context
def ingest_slurm(
    ctx: click.Context,
    data: str | None,
    jobcomp: str | None,
    sacct_json: str | None,
    sinfo_json: str | None,
    since: str | None,
    as_json: bool,
) -> None:
    """Import the failures Slurm saw: jobs that ended NODE_FAIL (sacct --json, or the
    job-completion record) and nodes that are DOWN with a reason (sinfo --json). They become
    failure events (source slurm), labels beside the failure XIDs; importing again adds only
    what is new."""
    from ingest.failure_events import (
        jobcomp_node_failures,
        sacct_node_failures,
        slurm_down_nodes,
        write_failure_events,
    )

    settings = settings_of(ctx)
    cluster, publish = settings.ingest.cluster, settings.publish
    run = {
        "bin_dir": publish.slurm_bin_dir,
        "slurm_conf": publish.slurm_conf,
        "timeout": publish.timeout.total_seconds(),
    }
    if jobcomp is not None:
        try:
            text = Path(jobcomp).read_text()
        except OSError as exc:
            raise GpufailError(f"--jobcomp {jobcomp}: cannot read ({exc.strerror})") from None
        jobs = jobcomp_node_failures(text, cluster=cluster, where=jobcomp)
    else:
        if sacct_json is not None:
            document = _json_file(sacct_json, "--sacct-json")
        else:
            start = when(since, "'--since'") or datetime.now(UTC) - timedelta(days=30)
            try:
                document = _slurm_json("sacct", "--json", "--allusers", f"--starttime={start:%Y-%m-%dT%H:%M:%S}", **run)  # type: ignore[arg-type]
            except GpufailError as exc:
                raise GpufailError(
                    f"{exc}; without an accounting database (slurmdbd), read the job-completion record "
                    "with --jobcomp FILE (JobCompType=jobcomp/filetxt)"
                ) from None
        jobs = sacct_node_failures(document, cluster=cluster, where=sacct_json or "sacct --json")
    nodes_document = _json_file(sinfo_json, "--sinfo-json") if sinfo_json else _slurm_json("sinfo", "--json", **run)  # type: ignore[arg-type]
    down = slurm_down_nodes(nodes_document, cluster=cluster, where=sinfo_json or "sinfo --json")
    import polars as pl

    with import_root(ctx, data, as_json) as store:
        new = write_failure_events(store, pl.concat([jobs, down]))
    found = jobs.height + down.height
    report(
        as_json,
        f"slurm: {jobs.height} NODE_FAIL job-node ends and {down.height} down nodes; "
        f"{new} new failure events stored, {found - new} stored already",
        {"command": "ingest slurm", "node_fail_ends": jobs.height, "down_nodes": down.height, "new": new},
    )


@click.command("kubernetes")
@data_option
@click.option("--kubeconfig", default=None, help="kubeconfig file (default: [publish] kubeconfig).")
@json_option
@click.pass_context
def ingest_kubernetes(ctx: click.Context, data: str | None, kubeconfig: str | None, as_json: bool) -> None:
    """Import the failures Kubernetes saw: nodes whose Ready condition is False or Unknown, from
    its last transition. They become failure events (source kubernetes); run it as often as
    nodes change (each transition is stored once)."""
    from ingest.failure_events import kubernetes_failure_events, write_failure_events
    from serving.publishers import SchedulerUnavailable
    from serving.publishers.kubernetes import kubernetes_api

    settings = settings_of(ctx)
    try:
        api = kubernetes_api(kubeconfig if kubeconfig is not None else settings.publish.kubeconfig)
        events = kubernetes_failure_events(api, cluster=settings.ingest.cluster)
    except SchedulerUnavailable as exc:
        raise GpufailError(str(exc)) from None
    except Exception as exc:  # the client's errors (connection, HTTP status) in one line
        if type(exc).__module__.startswith(("kubernetes", "urllib3")):
            raise GpufailError(f"kubernetes: cannot list nodes ({str(exc).splitlines()[0]})") from None
        raise
    with import_root(ctx, data, as_json) as store:
        new = write_failure_events(store, events)
    report(
        as_json,
        f"kubernetes: {events.height} nodes not Ready; {new} new failure events stored, {events.height - new} stored already",
        {"command": "ingest kubernetes", "not_ready": events.height, "new": new},
    )
