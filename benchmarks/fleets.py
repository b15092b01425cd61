"""`python -m benchmarks --fleets 1,2,3`: the comparison over several simulated fleets, pooled
(`models.pooled`): one fleet's alarms are too few to tell contenders apart, so the power comes
from pooling fleets of different seeds, not from model seeds on one fleet.

Each fleet: `gpufail simulate --preset P --seed S --nodes N`, `ingest kernel-log`, `features`,
then `gpufail evaluate` with the contenders of `fleet_config` (the single kinds static and
sliding where they answer a question of the report, and the paper's intersection: small enough
that several fleets fit a 2-core machine); on the paper preset the cascade too
(`PAPER_CONTENDERS`), for the paper's question of its ensembles against the best single model.
Every stage is its own process (`benchmarks.pipeline.run_stage`); with a kept work folder a
fleet whose stage finished before is not run again, so a long run resumes where it stopped.
Results: per fleet its report under `OUT/fleet-S/`, and `OUT/pooled.json` and `OUT/pooled.md`.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.pipeline import StageResult, run_stage

EVALUATE = """\
[evaluate]
jobs = 1
bootstrap_samples = 1000
"""
PAPER_EVALUATE = """\
retrain_every = "2d"
"""
"""The paper preset's fleets retrain every second day: their fits (a 21-day draw of about 0.2M
rows at 1,000 nodes, five contenders) are most of an evaluation's time, and every second day
halves them; the sliding contenders are then up to a day staler than the nightly's model, the
static one two weeks."""
CONTENDERS = """\
[[evaluate.contenders]]
name = "lightgbm static"
kind = "lightgbm"
mode = "static"
params = { n_estimators = 100 }
[[evaluate.contenders]]
name = "lightgbm sliding"
kind = "lightgbm"
mode = "sliding"
params = { n_estimators = 100 }
[[evaluate.contenders]]
name = "logistic sliding"
kind = "logistic"
mode = "sliding"
[[evaluate.contenders]]
name = "parallel sliding"
kind = "parallel"
mode = "sliding"
params = { members = ["lightgbm", "logistic"], combine = "top_k_intersection", top_k = 10 }
"""
PAPER_CONTENDERS = """\
[[evaluate.contenders]]
name = "cascade sliding"
kind = "cascade"
mode = "sliding"
params = { first = "lightgbm", second = "lightgbm", first_params = { n_estimators = 20, num_leaves = 7 }, target_recall = 0.95 }
"""
PRESETS = ("demo", "paper")


def fleet_config(preset: str) -> str:
    """The configuration every fleet of `preset` is evaluated with."""
    if preset == "paper":
        return EVALUATE + PAPER_EVALUATE + CONTENDERS + PAPER_CONTENDERS
    return EVALUATE + CONTENDERS


def run_fleets_bench(
    out: Path, work: Path, seeds: Sequence[int], *, nodes: int, days: int | None, preset: str = "demo"
) -> Path:
    """Simulate, evaluate and pool one fleet per seed of `seeds` (`nodes` nodes each of
    `preset`, `days` days or the preset's); returns `out/pooled.md`."""
    from models.pooled import pool_fleets, pooled_markdown

    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    config = work / "fleets.toml"
    config.write_text(fleet_config(preset))
    stages: list[StageResult] = []

    def stage(name: str, args: list[str], done: Path | None = None) -> None:
        if done is not None and done.exists():
            print(f"  {name}: done before ({done})", file=sys.stderr, flush=True)
            return
        print(f"  {name}: gpufail {' '.join(args)}", file=sys.stderr, flush=True)
        stages.append(run_stage(name, ["--config", str(config), *args]))
        print(f"  {name}: {stages[-1].seconds:.1f} s, {stages[-1].peak_rss_mb:.0f} MB", file=sys.stderr, flush=True)

    reports = {}
    for seed in seeds:
        data, report = work / f"fleet-{seed}", out / f"fleet-{seed}"
        simulate = ["simulate", "--out", str(data), "--preset", preset, "--seed", str(seed), "--nodes", str(nodes)]
        if (data / "xid_events").exists():  # simulated and ingested by an earlier run
            print(f"  fleet {seed}: simulated and ingested before ({data})", file=sys.stderr, flush=True)
        else:
            if data.exists():  # a simulation or an ingest cut short: start the fleet again
                shutil.rmtree(data)
            stage(f"fleet {seed}: simulate", simulate + ([] if days is None else ["--days", str(days)]) + ["--quiet"])
            stage(f"fleet {seed}: ingest", ["ingest", "kernel-log", "--data", str(data)])
        stage(f"fleet {seed}: features", ["features", "--data", str(data), "--quiet"])  # up to date: a no-op
        evaluate = ["evaluate", "--data", str(data), "--report", str(report), "--quiet"]
        stage(f"fleet {seed}: evaluate", evaluate, done=report / "metrics.json")
        reports[f"seed {seed}"] = json.loads((report / "metrics.json").read_text())
    pooled = pool_fleets(reports)
    pooled["stages"] = [
        {"stage": s.stage, "seconds": s.seconds, "peak_rss_mb": s.peak_rss_mb, "command": s.command} for s in stages
    ]
    (out / "pooled.json").write_text(json.dumps(pooled, indent=2, allow_nan=False) + "\n")
    timing = [
        "",
        "## Stages",
        "",
        "| stage | s | peak MB |",
        "| --- | ---: | ---: |",
        *(f"| {s.stage} | {s.seconds:.1f} | {s.peak_rss_mb:.0f} |" for s in stages),
        "",
        f"Command: `python -m benchmarks --fleets {','.join(str(s) for s in seeds)} --nodes {nodes}"
        + ("" if preset == "demo" else f" --preset {preset}")
        + ("" if days is None else f" --days {days}")
        + "`",
        "",
    ]
    path = out / "pooled.md"
    path.write_text(pooled_markdown(pooled) + "\n".join(timing))
    return path
