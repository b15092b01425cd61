"""`make bench-paper`: the pipeline at the reference paper's scale, stage by stage.

The `paper` simulator preset is ~31k GPUs (3,750 nodes of 8, plus 5% added during the period)
at one sample every 15 minutes for 120 days: ~350M telemetry rows, ~10 GB of Parquet. Each
stage is the `gpufail` command a user runs, in its own process (`benchmarks.pipeline.run_stage`), so
its wall time and peak memory are its own:

1. simulate the fleet (`--days` shortens the period; the fleet keeps its size);
2. ingest the kernel logs;
3. build the features of every day but the newest (the history a deployment starts from);
   then serving readiness: the newest grid time's features in a fresh process, with nothing
   cached, with the fleet facts cached, then with the rows cached
   (`benchmarks.on_demand.serving_readiness`);
4. train once on the configured window (what the nightly job's retrain costs);
5. score the fleet's latest grid time with that model;
6. `gpufail nightly` for the newest day against an MLflow server started here on 127.0.0.1:
   that day's features, a retrain, the held-out evaluation, registration, the gate, scoring
   and a dry-run publish: the nightly job's wall time.

Results go to `bench-paper.md` and `bench-paper.json`.
"""

from __future__ import annotations

import json
import platform
import re
import sys
from dataclasses import asdict
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

from benchmarks.on_demand import forget_newest_rows, serving_readiness
from benchmarks.pipeline import StageResult, cores, run_stage

_ROWS_READ = re.compile(r"from ([\d,]+) telemetry rows")
_FEATURE_ROWS = re.compile(r"features: ([\d,]+) rows")


def paper_pipeline(work: Path, days: int | None, *, reuse: bool = False) -> tuple[list[StageResult], dict[str, object]]:
    """Run the stages (module notes) in `work`; returns their results and the simulation summary.
    With `reuse`, the store simulated and ingested there before is used as it is (stages 1-2 not
    run): the later stages measured again on the same fleet. Its aggregates must not be built."""
    from gpufail.mlflow_server import start_server, stop_server

    data, model = str(work / "paper-data"), str(work / "model")
    results: list[StageResult] = []

    def stage(name: str, args: list[str], env: dict[str, str] | None = None) -> StageResult:
        print(f"  {name}: gpufail {' '.join(args)}", file=sys.stderr, flush=True)
        results.append(run_stage(name, args, env))
        print(f"  {name}: {results[-1].seconds:.1f} s, {results[-1].peak_rss_mb:.0f} MB", file=sys.stderr, flush=True)
        return results[-1]

    if reuse:
        if not (Path(data) / "simulation.json").exists():
            raise FileNotFoundError(f"{data}/simulation.json: no simulated store to reuse (run without --reuse first)")
    else:
        stage(
            "simulate",
            ["simulate", "--out", data, "--preset", "paper", "--quiet", *(["--days", str(days)] if days else [])],
        )
    simulation = json.loads((Path(data) / "simulation.json").read_text())
    first = date.fromisoformat(str(simulation["preset_parameters"]["start"]))  # type: ignore[index]
    newest = first + timedelta(days=int(simulation["days"]) - 1)
    if not reuse:
        stage("ingest kernel-log", ["ingest", "kernel-log", "--data", data])
    stage("features (all days but the newest)", ["features", "--data", data, "--end", newest.isoformat(), "--quiet"])
    for how, f in serving_readiness(data).items():
        results.append(
            StageResult(
                f"serving readiness ({f['gpus']:,.0f} GPUs, {how})",
                f"python -m benchmarks.on_demand --data {data} --serving",
                f["seconds"],
                f["peak_mb"],
                "",
            )
        )
        print(f"  {results[-1].stage}: {f['seconds']:.1f} s, {f['peak_mb']:.0f} MB", file=sys.stderr, flush=True)
    stage("train", ["train", "--data", data, "--model-out", model])
    # Serving readiness left the newest rows cached; the score stage measures computing them.
    forget_newest_rows(data)
    stage("score", ["score", "--data", data, "--model", model])

    home = work / "mlflow"
    home.mkdir(exist_ok=True)
    process, url = start_server(home, timeout=300)
    try:
        stage("nightly (the newest day)", ["nightly", "--data", data, "--quiet"], {"GPUFAIL_MLFLOW__TRACKING_URI": url})
    finally:
        stop_server(process)
    return results, simulation


def _count(pattern: re.Pattern[str], text: str) -> int | None:
    found = pattern.search(text)
    return int(found.group(1).replace(",", "")) if found else None


def write_paper_results(out: Path, stages: list[StageResult], simulation: dict[str, object]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {cores()} cores, Python {platform.python_version()}"
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    rows = int(simulation["telemetry_rows"])  # type: ignore[call-overload]
    lines = [
        f"# gpufail bench --paper ({when}; {machine})",
        "",
        f"The `paper` preset: {simulation['gpus']:,} GPUs on {simulation['nodes']:,} nodes over {simulation['days']} days,"
        f" {rows:,} telemetry rows, {simulation['kernel_log_lines']:,} kernel-log lines, {simulation['failures']:,}"
        " failures. Each stage is its own process:",
        "",
        "| stage | seconds | peak memory (MB) | throughput |",
        "| --- | ---: | ---: | --- |",
    ]
    for s in stages:
        rate = ""
        if s.stage == "simulate":
            rate = f"{rows / s.seconds:,.0f} telemetry rows/s"
        elif s.stage.startswith("features"):
            read, built = _count(_ROWS_READ, s.output), _count(_FEATURE_ROWS, s.output)
            if read and built:
                rate = f"{read / s.seconds:,.0f} telemetry rows/s read; {built / s.seconds:,.0f} feature rows/s (the rows readers compute)"
        lines.append(f"| {s.stage} | {s.seconds:.1f} | {s.peak_rss_mb:,.0f} | {rate} |")
    lines += ["", f"Total: {sum(s.seconds for s in stages):,.0f} s.", ""]
    lines += ["Commands:", ""] + [f"- {s.stage}: `{s.command}`" for s in stages]
    (out / "bench-paper.md").write_text("\n".join(lines) + "\n")
    (out / "bench-paper.json").write_text(
        json.dumps(
            {"when": when, "machine": machine, "simulation": simulation, "stages": [asdict(s) for s in stages]},
            indent=1,
            default=str,
        )
    )
    return out / "bench-paper.md"


def run_paper_bench(out: Path, work: Path, *, days: int | None = None, reuse: bool = False) -> Path:
    print(f"bench --paper: the paper preset in {work}", file=sys.stderr)
    work.mkdir(parents=True, exist_ok=True)
    stages, simulation = paper_pipeline(work, days, reuse=reuse)
    return write_paper_results(out, stages, simulation)
