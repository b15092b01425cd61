"""The demo pipeline end to end through the real CLI, on a fleet small enough for CI:
simulate -> ingest kernel-log -> features -> train -> evaluate -> score -> publish -> summary."""

from __future__ import annotations

import json
import subprocess
import sys

import polars as pl
import pytest

from ingest.simulator.run import simulate
from ingest.store import Store

GPUFAIL = [sys.executable, "-c", "from gpufail.cli import main; main()"]


def gpufail(*args: str) -> str:
    result = subprocess.run([*GPUFAIL, *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)  # every stage in its own process: 150 s alone, twice that beside another worker
def test_the_demo_pipeline_runs_end_to_end_and_beats_random(tmp_path):
    data = tmp_path / "fleet"
    out = tmp_path / "out"
    simulate(
        data, "demo", seed=3, progress=False, nodes=12, days=24, sample_interval_s=900, acceleration=80.0,
        fail_slow_fraction=0.02,
    )  # fmt: skip

    assert "0 rejected lines" in gpufail("ingest", "kernel-log", "--data", str(data))
    assert "features:" in gpufail("features", "--data", str(data), "--quiet")
    trained = gpufail("train", "--data", str(data), "--model-out", str(out / "model"))
    assert "trained lightgbm" in trained and "calibrated (platt) on " in trained
    assert_train_reads_its_window_and_fits_what_all_history_gives(data, out / "model")
    evaluated = gpufail(
        "evaluate", "--data", str(data), "--report", str(out / "report"), "--test-days", "6", "--policy"
    )
    assert "precision@10" in evaluated
    assert "at a daily quota of 1 per 1,000 GPUs: " in evaluated
    scored = gpufail("score", "--data", str(data), "--model", str(out / "model"))
    published = gpufail("publish", "--data", str(data), "--dry-run")
    summary = gpufail("summary", "--data", str(data), "--report", str(out / "report"))

    store = Store.open(str(data))
    predictions = pl.from_arrow(store.read_owned("predictions"))
    # The fleet as of the last grid time: GPUs that failed earlier are not scored.
    assert predictions["ts"].n_unique() == 1
    failed = pl.from_arrow(store.read("failures"))["gpu_uuid"].to_list()
    assert not predictions["gpu_uuid"].is_in(failed).any()
    assert f"scored {predictions.height} GPUs" in scored
    assert predictions["rank"].sort().to_list() == list(range(1, predictions.height + 1))

    actions = pl.from_arrow(store.read_owned("actions"))
    assert actions["dry_run"].all()
    assert actions["node"].n_unique() == predictions["node"].n_unique()
    assert "dry run" in published

    metrics = json.loads((out / "report" / "metrics.json").read_text())
    scores = metrics["scores"]
    assert scores["model"]["precision_at_k_pooled"] > scores["random"]["precision_at_k_pooled"]
    # The replay of the action policies over the jobs the simulator ran, and the fail-slow class.
    replayed = metrics["replay"]
    assert set(replayed["policies"]) == {"none", "rule", "tiers", "cost"}
    assert replayed["jobs"] > 0 and replayed["hours"] == 6 * 24
    none = replayed["policies"]["none"]
    assert none["drains"] == none["hints"] == none["drained_gpu_h"] == 0
    assert none["failure_gpu_h"] > 0  # the failures of the period hit running jobs
    report_md = (out / "report" / "report.md").read_text()
    assert "## What the actions would have cost the jobs (replay)" in report_md
    assert "## Fail-slow GPUs (stragglers)" in report_md
    assert metrics["fail_slow"]["n_slow_gpus"] >= 1
    assert "simulated failures (ground truth)" in summary
    assert "calibrated risk on the test period: ECE " in summary
    assert f"outputs: features {data / 'buckets'}, " in summary  # where the feature rows come from
    # It leads with every scorer at the same volume, and the chosen configuration's differences.
    budget = f"{metrics['alarm_headline_budget']:g}"
    assert f"alarms at equal volume (a daily quota of {budget} per 1,000 GPUs per day" in summary
    quota = metrics["alarms"]["quota"][budget]
    assert len({p["n_alarms"] for p in quota["points"].values()}) == 1
    assert f"  {metrics['primary']}: {quota['points'][metrics['primary']]['n_alarms']} alarms (" in summary
    chosen = metrics["claims"]["chosen_on_validation"]["name"]
    assert f"chosen on validation, {chosen}, minus the baselines at that quota: heuristic " in summary


def test_pipeline_steps_out_of_order_say_what_to_run_first(tmp_path):
    data = tmp_path / "fleet"
    simulate(data, "demo", seed=1, progress=False, nodes=2, days=2, sample_interval_s=3600)
    result = subprocess.run(
        [*GPUFAIL, "train", "--data", str(data), "--model-out", str(tmp_path / "m")], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "the features dataset is empty; run `gpufail features" in result.stderr
    result = subprocess.run([*GPUFAIL, "publish", "--data", str(data), "--dry-run"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "no predictions; run `gpufail score` first" in result.stderr


def assert_train_reads_its_window_and_fits_what_all_history_gives(data, model_dir) -> None:
    """`gpufail train` reads the sampled rows of its window date file by date file
    (`models.train_store`), not the whole features dataset; the model must be the one all
    history gives."""
    import numpy as np

    from features.dataset import read_features
    from gpufail.config import load_settings
    from models.train import load_model, train_model

    everything = read_features(Store.open(str(data)))
    model = train_model(everything, load_settings(environ={}).train_options())
    trained = load_model(model_dir)
    assert trained.version == model.version
    probe = everything.tail(300)
    np.testing.assert_allclose(trained.predict_risk(probe), model.predict_risk(probe), rtol=1e-12)
