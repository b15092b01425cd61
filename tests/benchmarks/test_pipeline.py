"""`python -m benchmarks` (`make bench`): its stage runner reports each stage's own peak memory,
the paper report, and its arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.paper import write_paper_results
from benchmarks.pipeline import StageResult, run_stage


def test_a_stage_reports_its_own_peak_memory_not_the_bench_process_size():
    # Linux carries ru_maxrss across fork + exec: a child of a 400 MB parent would say 400 MB.
    ballast = np.ones(400 * 2**20 // 8)
    ballast[::512] = 2.0  # touch every page so it is resident
    stage = run_stage("help", ["--help"])
    assert "Usage" in stage.output
    assert 5 < stage.peak_rss_mb < 200
    assert ballast.sum() > 0


def test_the_paper_report_gives_each_stage_and_the_feature_rates(tmp_path):
    def stage(name, seconds, output=""):
        return StageResult(name, f"gpufail {name}", seconds, 1234.5, output)

    stages = [
        stage("simulate", 100.0),
        stage(
            "features (all days but the newest)",
            50.0,
            "features: 1,000,000 rows for 31,000 GPUs (1 positive, 2 censored) from 4,000,000 telemetry rows in 49.0 s",
        ),
        stage("nightly (the newest day)", 30.0),
    ]
    simulation = {
        "gpus": 31574,
        "nodes": 3938,
        "days": 30,
        "telemetry_rows": 20_000_000,
        "kernel_log_lines": 5,
        "failures": 7,
    }
    report = write_paper_results(tmp_path, stages, simulation).read_text()
    assert "31,574 GPUs on 3,938 nodes over 30 days, 20,000,000 telemetry rows" in report
    assert "| simulate | 100.0 | 1,234 | 200,000 telemetry rows/s |" in report  # 1234.5 MB rounds to even
    assert "80,000 telemetry rows/s read; 20,000 feature rows/s (the rows readers compute)" in report
    assert "| nightly (the newest day) | 30.0 | 1,234 |  |" in report
    assert "Total: 180 s." in report
    data = json.loads((tmp_path / "bench-paper.json").read_text())
    assert [s["stage"] for s in data["stages"]] == [s.stage for s in stages]


def test_a_stage_gets_the_extra_environment_and_this_process_keeps_its_own(tmp_path):
    import os

    # The setting reaches the child: its configuration refuses the preset it names.
    with pytest.raises(
        RuntimeError,
        match=r"GPUFAIL_SIMULATE__PRESET \(\[simulate\] preset\): Input should be 'demo' or 'paper', got 'huge'",
    ):
        run_stage("simulate", ["simulate", "--out", str(tmp_path / "x")], {"GPUFAIL_SIMULATE__PRESET": "huge"})
    assert "GPUFAIL_SIMULATE__PRESET" not in os.environ


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--out", "{tmp}/x", "--days", "30"], "--days and --work go with --paper"),
        (["--out", "{tmp}/x", "--paper", "--days", "3"], "Invalid value for '--days'"),
        (["--out", "{tmp}/x", "--paper", "--reuse"], "--reuse goes with --paper --work"),
        (["--out", "{tmp}/x", "--fleets", "1,1"], "--fleets: expected distinct seeds like 1,2,3, got '1,1'"),
        (["--out", "{tmp}/x", "--fleets", "1,a"], "--fleets: expected comma-separated seeds like 1,2,3, got '1,a'"),
        (["--out", "{tmp}/x", "--fleets", "1,2", "--paper"], "--fleets goes without --paper and --reuse"),
        (["--out", "{tmp}/x", "--preset", "paper"], "--preset goes with --fleets"),
    ],
)
def test_bad_arguments_are_refused_and_nothing_is_written(tmp_path, args, message):
    from click.testing import CliRunner

    from benchmarks.__main__ import main

    result = CliRunner().invoke(main, [a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.exit_code == 2
    assert message in result.stderr
    assert not (tmp_path / "x").exists()


def test_python_m_benchmarks_answers_from_the_checkout():
    """`make bench` runs `python -m benchmarks` from the repository root."""
    from benchmarks import CHECKOUT

    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"],
        capture_output=True,
        text=True,
        cwd=CHECKOUT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--paper" in result.stdout and "Usage: python -m benchmarks" in result.stdout


def test_reusing_a_work_folder_without_a_simulated_store_is_refused(tmp_path):
    from benchmarks.paper import run_paper_bench

    with pytest.raises(FileNotFoundError, match=r"paper-data/simulation.json: no simulated store to reuse"):
        run_paper_bench(tmp_path / "out", tmp_path / "work", reuse=True)
    assert not (tmp_path / "out").exists()


def test_a_fleets_run_resumes_where_a_kept_work_folder_stopped(tmp_path, monkeypatch):
    """A run of many 1,000-node fleets takes hours: run again on its work folder, it neither
    simulates a fleet ingested before nor evaluates one whose report is written, and starts
    again a fleet whose simulation was cut short. (The stages are recorded here, not run.)"""
    import benchmarks.fleets as fleets
    import models.pooled

    ran: list[str] = []

    def stage(name, args, env=None):
        ran.append(name)
        if name.endswith("simulate"):
            Path(args[args.index("--out") + 1], "raw").mkdir(parents=True)
        if name.endswith("ingest"):
            Path(args[args.index("--data") + 1], "xid_events").mkdir()
        if name.endswith("evaluate"):
            Path(args[args.index("--report") + 1]).mkdir(parents=True, exist_ok=True)
            Path(args[args.index("--report") + 1], "metrics.json").write_text("{}")
        return StageResult(name, " ".join(args), 1.0, 1.0, "")

    monkeypatch.setattr(fleets, "run_stage", stage)
    monkeypatch.setattr(models.pooled, "pool_fleets", lambda reports: {"fleets": sorted(reports)})
    monkeypatch.setattr(models.pooled, "pooled_markdown", lambda pooled: "")
    out, work = tmp_path / "out", tmp_path / "work"
    (work / "fleet-2").mkdir(parents=True)  # a simulation of seed 2 killed part-way
    (work / "fleet-2" / "partial").write_text("")
    fleets.run_fleets_bench(out, work, [1, 2], nodes=3, days=None, preset="paper")
    assert ran == [f"fleet {s}: {stage}" for s in (1, 2) for stage in ("simulate", "ingest", "features", "evaluate")]
    assert not (work / "fleet-2" / "partial").exists()
    assert "cascade sliding" in (work / "fleets.toml").read_text()
    ran.clear()
    (out / "fleet-2" / "metrics.json").unlink()  # its evaluation cut short
    fleets.run_fleets_bench(out, work, [1, 2], nodes=3, days=None, preset="paper")
    assert ran == ["fleet 1: features", "fleet 2: features", "fleet 2: evaluate"]
