"""The simulated jobs (ingest/simulator/jobs.py) and the repairs they wait for, as measured
properties of the plan and of what `simulate` writes."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from ingest.simulator.fleet import plan_fleet
from ingest.simulator.jobs import STEP_H, TRACE_SCHEMA, JobMix, plan_jobs, trace_table
from ingest.simulator.presets import get_preset
from ingest.simulator.run import ground_truth_repairs, simulate
from ingest.store import Store
from serving.replay import read_trace

FLEET = {"nodes": 300, "days": 30, "acceleration": 20.0}


@pytest.fixture(scope="module")
def planned():
    plan = plan_fleet(get_preset("paper", **FLEET), seed=4)
    return plan, plan_jobs(plan, seed=4)


def test_every_replaced_board_has_a_repair_record_naming_it():
    plan = plan_fleet(get_preset("demo", nodes=24, days=40), seed=2)
    replaced = np.flatnonzero(plan.replaced_by >= 0)
    failed = np.flatnonzero(np.isfinite(plan.gpu_end_h))
    assert len(replaced) > 20
    # Every failed board but those failing too late for a replacement in the period is replaced,
    # by a board in its own slot that arrives after it failed.
    assert set(replaced) <= set(failed)
    late = failed[plan.gpu_end_h[failed] > plan.hours - 72]
    assert set(failed) - set(late) <= set(replaced)
    new = plan.replaced_by[replaced]
    assert np.all(plan.gpu_node[new] == plan.gpu_node[replaced])
    assert np.all(plan.gpu_slot[new] == plan.gpu_slot[replaced])
    assert np.all(plan.repair_h[replaced] > plan.gpu_end_h[replaced])
    assert np.all(plan.gpu_start_h[new] == plan.repair_h[replaced])
    assert ground_truth_repairs(plan).num_rows == len(replaced)


def test_jobs_range_from_one_gpu_to_thousands_and_fill_most_of_the_fleet(planned):
    plan, trace = planned
    sizes = np.asarray(trace.job_gpus)
    assert sizes.min() == 1 and sizes.max() >= 512
    assert {1, 2, 4, 8, 64, 256} <= set(sizes.tolist())
    # Most jobs are small, most GPU-hours are in multi-node jobs.
    gpu_h = (np.asarray(trace.end_h) - np.asarray(trace.start_h)) * np.asarray(trace.gpus)
    multi = sizes[np.array([int(j[1:]) for j in trace.job_id])] > 8
    assert np.mean(sizes <= 8) > 0.5
    assert gpu_h[multi].sum() > 0.5 * gpu_h.sum()
    used = gpu_h.sum() / (len(plan.node_names) * 8 * plan.hours)
    assert 0.5 < used < 0.9
    intervals = set(trace.job_interval_h)
    assert intervals <= set(JobMix().checkpoint_hours) and len(intervals) > 1
    assert np.all(np.asarray(trace.job_end_by_h) > np.asarray(trace.job_start_h))


def test_no_node_holds_more_gpus_than_it_has_and_gang_jobs_take_whole_nodes(planned):
    plan, trace = planned
    node, gpus = np.asarray(trace.node), np.asarray(trace.gpus)
    start, end = np.asarray(trace.start_h), np.asarray(trace.end_h)
    sizes = np.asarray(trace.job_gpus)[[int(j[1:]) for j in trace.job_id]]
    assert np.all(gpus[sizes >= 8] == 8)
    assert np.all(end >= start)
    for t in np.arange(0, plan.hours, 37.3):
        on = (start <= t) & (end > t)
        assert np.bincount(node[on], weights=gpus[on], minlength=len(plan.node_names)).max() <= 8
        # A gang node holds nothing else.
        gang = node[on & (sizes >= 8)]
        assert not np.intersect1d(gang, node[on & (sizes < 8)]).size


def test_a_failure_under_a_job_ends_its_placement_there_and_nothing_starts_on_a_broken_node(planned):
    plan, trace = planned
    node, start, end = np.asarray(trace.node), np.asarray(trace.start_h), np.asarray(trace.end_h)
    reason = np.asarray(trace.end_reason)
    failed = np.flatnonzero(np.isfinite(plan.gpu_end_h) & (plan.gpu_end_h < plan.hours))
    hit = 0
    for g in failed:
        n, t = plan.gpu_node[g], plan.gpu_end_h[g]
        running = (node == n) & (start < t) & (end > t)
        assert not running.any(), f"a placement on node {n} runs through its failure at {t:.2f} h"
        ended = (node == n) & (end == t)
        hit += int(ended.any())
        assert set(reason[ended]) <= {"failure"}
        # Until the replacement arrives nothing new starts on the node.
        repaired = plan.repair_h[g]
        assert not ((node == n) & (start > t) & (start < min(repaired, plan.hours) - STEP_H)).any()
    assert hit > 10


def test_simulate_writes_the_trace_the_replay_reads(tmp_path):
    out = tmp_path / "fleet"
    summary = simulate(out, "demo", seed=5, progress=False, nodes=6, days=4, sample_interval_s=3600)
    table = pq.read_table(out / "jobs" / "trace.parquet")
    assert table.schema.equals(TRACE_SCHEMA, check_metadata=False)
    assert table.num_rows == summary.job_placements > 0
    assert len(table.column("job_id").unique()) == summary.jobs
    trace = read_trace(str(out / "jobs" / "trace.parquet"))
    assert len(trace.job_ids) == summary.jobs
    nodes = set(Store.open(str(out)).read("telemetry", columns=["node"]).column("node").to_pylist())
    assert set(table.column("node").to_pylist()) <= nodes


def test_the_jobs_do_not_change_a_seeds_fleet():
    preset = get_preset("demo", nodes=8, days=6)
    plan = plan_fleet(preset, seed=9)
    before = plan.gpu_end_h.copy()
    trace_table(plan, plan_jobs(plan, seed=9))
    again = plan_fleet(preset, seed=9)
    np.testing.assert_array_equal(again.gpu_end_h, before)
    a, b = plan_jobs(plan, seed=9), plan_jobs(again, seed=9)
    assert a.start_h == b.start_h and a.node == b.node
