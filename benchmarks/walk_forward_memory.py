"""`python -m benchmarks.walk_forward_memory --data DATA ...`: the walk-forward's peak memory, in
every process it runs in, read from the store (`models.walk_forward.run_walk_forward_from_store`)
or over the whole features frame in memory (`run_walk_forward(read_features(store), ...)`, what
`gpufail evaluate` ran before).

Each run is a child process (`--child`); this process samples the resident memory of the child
and of every process under it (the `jobs` workers, a LocalCluster's workers) every 0.2 s and
reports, per run: wall time, the child's own peak (its VmHWM, exact), the largest peak of any
process, and the largest sum over all of them at one moment. The plan is the configuration's
`[evaluate]` walk-forward (`gpufail.config`); the contenders are `--contenders` of the configured
ones (default: all).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import click

_MODES = ("stream", "memory")


@dataclass
class MemoryRun:
    data: str
    mode: str
    contenders: list[str]
    jobs: int
    dask_workers: int
    seconds: float
    n_fits: int
    n_test_rows: int
    main_peak_mb: float
    """The child's own VmHWM."""
    largest_process_peak_mb: float
    """The largest sampled peak of any one process of the run (the child included, at least its VmHWM)."""
    total_peak_mb: float
    """The largest sampled sum of every process's resident memory at one moment."""
    processes: int


def _tree_rss(pid: int) -> dict[int, int]:
    """Resident bytes of `pid` and of every process under it (those that exist right now)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            out[p.pid] = p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return out


def measure(data: str, mode: str, contenders: list[str], jobs: int, dask_workers: int) -> MemoryRun:
    """Run the walk-forward in a child process and sample its processes' memory (module notes)."""
    args = [sys.executable, "-m", "benchmarks.walk_forward_memory", "--child", "--data", data, "--mode", mode]
    args += ["--jobs", str(jobs), "--dask-workers", str(dask_workers)]
    for name in contenders:
        args += ["--contender", name]
    started = time.perf_counter()
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    total = 0
    while child.poll() is None:
        now = _tree_rss(child.pid)
        for pid, rss in now.items():
            peaks[pid] = max(peaks.get(pid, 0), rss)
        total = max(total, sum(now.values()))
        time.sleep(0.2)
    out, err = child.communicate()
    seconds = time.perf_counter() - started
    if child.returncode != 0:
        raise RuntimeError(f"walk-forward ({mode}) on {data} failed:\n{err[-3000:]}")
    facts = json.loads(out.strip().splitlines()[-1])
    mb = 1024 * 1024
    main_mb = facts["main_peak_kb"] / 1024
    return MemoryRun(
        data=data,
        mode=mode,
        contenders=facts["contenders"],
        jobs=jobs,
        dask_workers=dask_workers,
        seconds=round(seconds, 1),
        n_fits=facts["n_fits"],
        n_test_rows=facts["n_test_rows"],
        main_peak_mb=round(main_mb, 1),
        largest_process_peak_mb=round(max([main_mb, *(p / mb for p in peaks.values())]), 1),
        total_peak_mb=round(max(total / mb, main_mb), 1),
        processes=len(peaks),
    )


def _child(data: str, mode: str, names: list[str], jobs: int, dask_workers: int) -> dict[str, Any]:
    """The walk-forward itself, in this process: what `measure` runs as its child."""
    from dataclasses import replace

    from features.dataset import read_features
    from gpufail.config import load_settings
    from gpufail.dask_cluster import dask_client
    from ingest.store import Store
    from models.walk_forward import Contender, run_walk_forward, run_walk_forward_from_store

    settings = load_settings()
    plan = replace(settings.walk_forward_plan(), jobs=jobs)
    configured = [
        Contender(c.name, c.kind, c.mode, dict(c.params), c.train_window) for c in settings.evaluate.contenders
    ]
    unknown = sorted(set(names) - {c.name for c in configured})
    if unknown:
        raise click.UsageError(
            f"--contender: {unknown} are not configured; expected some of {[c.name for c in configured]}"
        )
    contenders = [c for c in configured if not names or c.name in names]
    store = Store.open(data)
    with dask_client("local" if dask_workers else "", n_workers=max(dask_workers, 1)) as client:
        if mode == "stream":
            result = run_walk_forward_from_store(store, contenders, plan, client=client)
        else:
            result = run_walk_forward(read_features(store), contenders, plan, client=client)
    with open("/proc/self/status") as status:
        hwm = [line.split()[1] for line in status if line.startswith("VmHWM:")]
    return {
        "contenders": [c.name for c in contenders],
        "n_fits": result.n_fits,
        "n_test_rows": len(result.test),
        "main_peak_kb": int(hwm[0]),
    }


def table(runs: list[MemoryRun]) -> str:
    lines = [
        "| data | mode | contenders | processes | fits | test rows | seconds | main peak MB | largest process MB | all processes MB |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        how = f"Dask {r.dask_workers} workers" if r.dask_workers else f"jobs {r.jobs}"
        lines.append(
            f"| {r.data} | {r.mode} | {', '.join(r.contenders)} | {how} | {r.n_fits} | {r.n_test_rows:,} | "
            f"{r.seconds:.0f} | {r.main_peak_mb:,.0f} | {r.largest_process_peak_mb:,.0f} | {r.total_peak_mb:,.0f} |"
        )
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--data", "datas", multiple=True, required=True, help="A data root with features (repeat for several).")
@click.option("--mode", "modes", multiple=True, type=click.Choice(_MODES), help="stream (default) and/or memory.")
@click.option("--contender", "names", multiple=True, help="A configured contender to run (repeat; default: all).")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True, help="Fit processes.")
@click.option(
    "--dask-workers", type=click.IntRange(min=0), default=0, show_default=True, help="A LocalCluster of this many."
)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Also write the runs here.")
@click.option("--child", is_flag=True, hidden=True)
def main(
    datas: tuple[str, ...],
    modes: tuple[str, ...],
    names: tuple[str, ...],
    jobs: int,
    dask_workers: int,
    json_out: str | None,
    child: bool,
) -> None:
    """The walk-forward's peak memory in every process, on each DATA (module notes)."""
    if child:
        click.echo(json.dumps(_child(datas[0], (modes or ("stream",))[0], list(names), jobs, dask_workers)))
        return
    runs = []
    for data in datas:
        for mode in modes or ("stream",):
            runs.append(measure(data, mode, list(names), jobs, dask_workers))
            print(table(runs[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    click.echo(table(runs))
    if json_out:
        with open(json_out, "w") as fh:
            json.dump([asdict(r) for r in runs], fh, indent=1)


if __name__ == "__main__":
    main()
