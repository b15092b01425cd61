"""`python -m benchmarks`: the demo pipeline stage by stage and the hot loops (`make bench`), the
paper-scale pipeline (`make bench-paper`), or the demo comparison pooled over fleets (`--fleets`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--out",
    default="bench-results",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for bench.md and bench.json (bench-paper.md and bench-paper.json with --paper).",
)
@click.option(
    "--paper",
    is_flag=True,
    help="Instead: the paper preset (~31k GPUs) end to end, stage by stage (tens of minutes, ~10 GB of disk a 100 days).",
)
@click.option(
    "--days",
    type=click.IntRange(min=10),
    default=None,
    help="With --paper or --fleets: simulate this many days instead of the preset's.",
)
@click.option(
    "--work",
    type=click.Path(file_okay=False),
    default=None,
    help="With --paper or --fleets: keep the simulated stores here (default: a temporary folder, removed after).",
)
@click.option(
    "--reuse",
    is_flag=True,
    help="With --paper and --work: the store simulated and ingested in WORK before, without its aggregates; "
    "the later stages only.",
)
@click.option(
    "--fleets",
    default=None,
    help="Instead: the demo comparison on one small fleet per seed of this comma-separated list (1,2,3), "
    "pooled (pooled.md and pooled.json; a fleet of 12 nodes takes a few minutes).",
)
@click.option(
    "--nodes",
    type=click.IntRange(min=1),
    default=12,
    show_default=True,
    help="With --fleets: nodes per fleet.",
)
@click.option(
    "--preset",
    type=click.Choice(["demo", "paper"]),
    default="demo",
    show_default=True,
    help="With --fleets: the simulator's preset of each fleet (paper: its questions, the cascade among the contenders).",
)
def main(
    out: str,
    paper: bool,
    days: int | None,
    work: str | None,
    reuse: bool,
    fleets: str | None,
    nodes: int,
    preset: str,
) -> None:
    """Measure the demo pipeline stage by stage (time, peak memory) and the hot loops; or, with
    --paper, the paper-scale pipeline; or, with --fleets, the comparison pooled over fleets."""
    from benchmarks.paper import run_paper_bench
    from benchmarks.pipeline import run_bench

    if fleets is not None:
        from benchmarks.fleets import run_fleets_bench

        if paper or reuse:
            raise click.UsageError("--fleets goes without --paper and --reuse")
        try:
            seeds = [int(s) for s in fleets.split(",") if s.strip()]
        except ValueError:
            raise click.UsageError(f"--fleets: expected comma-separated seeds like 1,2,3, got {fleets!r}") from None
        if not seeds or len(set(seeds)) != len(seeds):
            raise click.UsageError(f"--fleets: expected distinct seeds like 1,2,3, got {fleets!r}")
        if work is not None:
            report = run_fleets_bench(Path(out), Path(work), seeds, nodes=nodes, days=days, preset=preset)
        else:
            with tempfile.TemporaryDirectory(prefix="gpufail-fleets-") as tmp:
                report = run_fleets_bench(Path(out), Path(tmp), seeds, nodes=nodes, days=days, preset=preset)
        click.echo(report.read_text())
        return
    if preset != "demo":
        raise click.UsageError("--preset goes with --fleets")
    if not paper and (days is not None or work is not None):
        raise click.UsageError("--days and --work go with --paper")
    if reuse and work is None:
        raise click.UsageError("--reuse goes with --paper --work")
    if paper and work is not None:
        report = run_paper_bench(Path(out), Path(work), days=days, reuse=reuse)
    else:
        with tempfile.TemporaryDirectory(prefix="gpufail-bench-") as tmp:
            report = run_paper_bench(Path(out), Path(tmp), days=days) if paper else run_bench(Path(out), Path(tmp))
    click.echo(report.read_text())


if __name__ == "__main__":
    main(prog_name="python -m benchmarks")
