"""`python -m benchmarks --fleets 1,2,3`: the demo comparison over several simulated fleets,
pooled (`models.pooled`): one fleet's alarms are too few to tell contenders apart, so the power
comes from pooling fleets of different seeds, not from model seeds on one fleet.

Each fleet: `gpufail simulate --preset demo --seed S --nodes N`, `ingest kernel-log`,
`features`, then `gpufail evaluate` with the contenders of `FLEET_CONFIG` (the single kinds
static and sliding where they answer a question of the report, and the paper's intersection:
small enough that several fleets fit a 2-core machine). Every stage is its own process
(`benchmarks.pipeline.run_stage`). Results: per fleet its report under `OUT/fleet-S/`, and
`OUT/pooled.json` and `OUT/pooled.md`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.pipeline import StageResult, run_stage

FLEET_CONFIG = """\
[evaluate]
jobs = 1
bootstrap_samples = 1000
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


def run_fleets_bench(out: Path, work: Path, seeds: Sequence[int], *, nodes: int, days: int | None) -> Path:
    """Simulate, evaluate and pool one fleet per seed of `seeds` (`nodes` nodes each, `days`
    days or the preset's); returns `out/pooled.md`."""
    from models.pooled import pool_fleets, pooled_markdown

    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    config = work / "fleets.toml"
    config.write_text(FLEET_CONFIG)
    stages: list[StageResult] = []

    def stage(name: str, args: list[str]) -> None:
        print(f"  {name}: gpufail {' '.join(args)}", file=sys.stderr, flush=True)
        stages.append(run_stage(name, ["--config", str(config), *args]))
        print(f"  {name}: {stages[-1].seconds:.1f} s, {stages[-1].peak_rss_mb:.0f} MB", file=sys.stderr, flush=True)

    reports = {}
    for seed in seeds:
        data, report = work / f"fleet-{seed}", out / f"fleet-{seed}"
        simulate = ["simulate", "--out", str(data), "--preset", "demo", "--seed", str(seed), "--nodes", str(nodes)]
        stage(f"fleet {seed}: simulate", simulate + ([] if days is None else ["--days", str(days)]) + ["--quiet"])
        stage(f"fleet {seed}: ingest", ["ingest", "kernel-log", "--data", str(data)])
        stage(f"fleet {seed}: features", ["features", "--data", str(data), "--quiet"])
        stage(f"fleet {seed}: evaluate", ["evaluate", "--data", str(data), "--report", str(report), "--quiet"])
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
        + ("" if days is None else f" --days {days}")
        + "`",
        "",
    ]
    path = out / "pooled.md"
    path.write_text(pooled_markdown(pooled) + "\n".join(timing))
    return path
