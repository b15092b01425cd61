"""The replay (serving/replay.py): GPU-hours each policy loses, counted on hand-made jobs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest.errors import InputError
from serving.cost_policy import CostConfig
from serving.policy import PolicyConfig, Tier
from serving.replay import TRACE_COLUMNS, Trace, read_trace, refill_after_job_ends, replay

T0 = datetime(2026, 3, 1, tzinfo=UTC)
TIERS = PolicyConfig(
    tiers=(
        Tier("watch", 0.2, 0.1),
        Tier("avoid", 0.35, 0.25),
        Tier("drain_after_job", 0.5, 0.35),
        Tier("drain_now", 0.8, 0.6),
    ),
    breaker_max_nodes=100,
)
NO_OVERHEAD = CostConfig(hang_time=timedelta(0), restart_time=timedelta(0))


def at(hours: float) -> pd.Timestamp:
    return pd.Timestamp(T0 + timedelta(hours=hours))


def trace(jobs: list[dict]) -> Trace:
    """Placements of `jobs`: {id, nodes: {node: gpus}, start, end, interval (hours)}."""
    rows = []
    for j in jobs:
        total = sum(j["nodes"].values())
        for node, gpus in j["nodes"].items():
            rows.append(
                {
                    "job_id": j["id"],
                    "node": node,
                    "gpus": gpus,
                    "start": at(j["start"]),
                    "end": at(j["end"]),
                    "job_gpus": total,
                    "job_start": at(j["start"]),
                    "job_end_by": at(j["end"]),
                    "checkpoint_interval_s": int(j["interval"] * 3600),
                }
            )
    return Trace.from_frame(pd.DataFrame(rows, columns=list(TRACE_COLUMNS)))


def grid(
    nodes: list[str], hours: int, risk: dict[tuple[str, int], float] | None = None
) -> tuple[pd.DataFrame, np.ndarray]:
    """One GPU row per node per hour; `risk[(node, hour)]` where not 0."""
    rows = [
        {"ts": at(h), "cluster": "c", "node": n, "gpu_uuid": f"GPU-{n}", "gpu_index": 0}
        for h in range(hours)
        for n in nodes
    ]
    frame = pd.DataFrame(rows)
    risks = np.array([(risk or {}).get((r["node"], int((r["ts"] - at(0)) / pd.Timedelta(hours=1))), 0.0) for r in rows])
    return frame, risks


def failures(*events: tuple[str, float]) -> pd.DataFrame:
    return pd.DataFrame({"ts": [at(h) for _, h in events], "node": [n for n, _ in events]})


NODES = [f"n{i}" for i in range(8)]
GANG = {"id": "big", "nodes": dict.fromkeys(NODES, 8), "start": 0, "end": 20, "interval": 4}


def test_a_64_gpu_job_whose_node_fails_3_h_after_its_checkpoint_loses_192_gpu_hours():
    rows, risk = grid(NODES, 12)
    out = replay(rows, risk, None, trace([GANG]), failures(("n3", 7.0)), TIERS, NO_OVERHEAD)
    none = out["policies"]["none"]
    assert none["failure_gpu_h"] == pytest.approx(192.0)
    assert none["failures_hitting_jobs"] == 1
    # With a hang of 15 min and a restart of 10 min on every GPU of the job.
    out = replay(rows, risk, None, trace([GANG]), failures(("n3", 7.0)), TIERS, CostConfig())
    assert out["policies"]["none"]["failure_gpu_h"] == pytest.approx(64 * (3 + 25 / 60))
    # Nothing at risk, nothing done: every policy loses the same.
    assert {p["total_gpu_h"] for p in out["policies"].values()} == {out["policies"]["none"]["total_gpu_h"]}


def test_a_failure_on_an_idle_node_or_after_the_job_costs_no_job_anything():
    rows, risk = grid([*NODES, "idle"], 12)
    out = replay(rows, risk, None, trace([GANG]), failures(("idle", 5.0)), TIERS, NO_OVERHEAD)
    assert out["policies"]["none"]["failure_gpu_h"] == 0
    short = {**GANG, "end": 6}
    out = replay(rows, risk, None, trace([short]), failures(("n1", 7.0)), TIERS, NO_OVERHEAD)
    assert out["policies"]["none"]["failure_gpu_h"] == 0


def test_drain_now_before_the_failure_restarts_the_job_and_spares_it_the_failure():
    risk_at = {("n3", h): 0.95 for h in range(5, 12)}
    rows, risk = grid(NODES, 12, risk_at)
    out = replay(rows, risk, None, trace([GANG]), failures(("n3", 7.0)), TIERS, NO_OVERHEAD)
    tiers = out["policies"]["tiers"]
    assert tiers["failure_gpu_h"] == 0
    assert tiers["failures_on_drained_nodes"] == 1
    assert tiers["drain_restart_gpu_h"] == pytest.approx(64 * 1.0)  # drained at 05:00, checkpoint at 04:00
    assert tiers["drained_gpu_h"] == pytest.approx(8 * 2.0)  # out from 05:00 until it fails at 07:00
    assert tiers["drains"] == 1 and tiers["false_drains"] == 0
    assert tiers["total_gpu_h"] == pytest.approx(64 + 16)
    assert tiers["saved_gpu_h"] == pytest.approx(192 - 80)


def test_a_drain_of_a_node_that_does_not_fail_is_false_and_its_gpus_out_of_service_count():
    risk_at = {("n0", h): 0.95 for h in range(2, 4)}
    rows, risk = grid(["n0"], 12, risk_at)
    out = replay(rows, risk, None, trace([]), failures(), TIERS, NO_OVERHEAD)
    tiers = out["policies"]["tiers"]
    assert tiers["false_drains"] == 1
    # Risk falls at 04:00, the node stays drained for the recovery period (24 h): to the end.
    assert tiers["drained_gpu_h"] == pytest.approx(8 * 10)
    assert tiers["false_drain_gpu_h"] == tiers["drained_gpu_h"]
    assert out["policies"]["none"]["total_gpu_h"] == 0


def test_the_cost_policy_hints_a_checkpoint_and_the_failure_then_costs_less():
    nodes = [f"n{i}" for i in range(64)]
    # A 512-GPU job that checkpoints every 12 h: at 06:00, 6 h of work at risk on a node at 0.9.
    huge = {"id": "huge", "nodes": dict.fromkeys(nodes, 8), "start": 0, "end": 30, "interval": 12}
    risk_at = {("n5", h): 0.9 for h in range(6, 8)}
    rows, risk = grid(nodes, 12, risk_at)
    out = replay(rows, risk, None, trace([huge]), failures(("n5", 7.5)), TIERS, NO_OVERHEAD)
    none, cost = out["policies"]["none"], out["policies"]["cost"]
    assert none["failure_gpu_h"] == pytest.approx(512 * 7.5)
    # Told at 06:00 (saves 0.9 x 512 x 6 h / 24 for 43); at 07:00, 1 h after the hint, another
    # would save 0.9 x 512 x 1 h / 24: not worth it. The failure at 07:30 costs the 1.5 h since.
    assert cost["hints"] == 1
    assert cost["failure_gpu_h"] == pytest.approx(512 * 1.5)
    assert cost["checkpoint_gpu_h"] == pytest.approx(512 * 5 / 60)
    assert cost["total_gpu_h"] < none["total_gpu_h"]
    assert cost["drains"] == 0


def test_the_rule_baseline_drains_what_it_flags():
    rows, risk = grid(NODES, 12)
    flags = ((rows["node"] == "n3") & (rows["ts"] >= at(6))).to_numpy()
    out = replay(rows, risk, flags, trace([GANG]), failures(("n3", 7.0)), TIERS, NO_OVERHEAD)
    rule = out["policies"]["rule"]
    assert rule["failure_gpu_h"] == 0 and rule["drain_restart_gpu_h"] == pytest.approx(64 * 2.0)
    assert out["policies"]["tiers"]["failure_gpu_h"] == pytest.approx(192.0)


def test_a_tripped_breaker_holds_raises_until_an_operator_resets_it():
    config = PolicyConfig(tiers=TIERS.tiers, breaker_max_nodes=1, breaker_max_fraction=0.0)
    risk_at = {(n, h): 0.95 for n in ("n0", "n1") for h in range(2, 12)}
    rows, risk = grid(["n0", "n1"], 12, risk_at)
    out = replay(rows, risk, None, trace([]), failures(), config, NO_OVERHEAD, breaker_reset_after=timedelta(hours=5))
    tiers = out["policies"]["tiers"]
    assert tiers["breaker_trips"] >= 1
    assert tiers["drains"] == 2  # the second node only after the reset


def test_bad_inputs_are_refused_with_one_line(tmp_path):
    rows, risk = grid(["n0"], 3)
    with pytest.raises(InputError, match="one risk per row"):
        replay(rows, risk[:-1], None, trace([]), failures(), TIERS, NO_OVERHEAD)
    with pytest.raises(InputError, match=r"missing columns \['job_gpus'"):
        Trace.from_frame(pd.DataFrame({"job_id": ["a"], "node": ["n0"], "gpus": [1], "start": [at(0)], "end": [at(1)]}))
    with pytest.raises(InputError, match="no job trace"):
        read_trace(str(tmp_path / "absent.parquet"))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(InputError, match="not a readable Parquet job trace"):
        read_trace(str(tmp_path / "junk.parquet"))
    good = tmp_path / "trace.parquet"
    pq.write_table(pa.table({"job_id": ["a"], "node": ["n0"]}), good)
    with pytest.raises(InputError, match=f"{good}: missing columns"):
        read_trace(str(good))


def test_a_job_steps_at_its_slowest_gpu_and_loses_its_share_to_a_straggler():
    rows, risk = grid([*NODES, "solo"], 12)
    small = {"id": "small", "nodes": {"solo": 2}, "start": 0, "end": 12, "interval": 1}
    slow = pd.DataFrame(
        {
            "node": ["n2", "n4", "solo"],
            "since": [at(2), at(6), at(0)],
            "until": [at(8), None, None],
            "deficit": [0.1, 0.2, 0.4],
        }
    )
    out = replay(rows, risk, None, trace([GANG, small]), failures(), TIERS, NO_OVERHEAD, slow=slow)
    none = out["policies"]["none"]
    # The gang job (64 GPUs): 0.1 from 02:00, then 0.2 (its slowest) from 06:00 to the end at 12:00;
    # the 2-GPU job holds a quarter of its node: on the slow board with a chance of 1/4.
    gang = 64 * (4 * 0.1 + 6 * 0.2)
    assert none["slow_gpu_h"] == pytest.approx(gang + 2 * 12 * 0.4 * 2 / 8)
    assert none["total_gpu_h"] == pytest.approx(none["slow_gpu_h"])


def test_the_days_add_up_to_the_totals_and_the_cost_policy_is_compared_day_by_day():
    risk_at = {("n3", h): 0.95 for h in range(5, 40)}
    rows, risk = grid(NODES, 48, risk_at)
    out = replay(rows, risk, None, trace([GANG]), failures(("n3", 30.0)), TIERS, NO_OVERHEAD)
    for name, days in out["daily_total_gpu_h"].items():
        assert len(days) == 2
        assert sum(days) == pytest.approx(out["policies"][name]["total_gpu_h"])
    against = out["cost_against"]["tiers"]
    expected = out["policies"]["cost"]["total_gpu_h"] - out["policies"]["tiers"]["total_gpu_h"]
    assert against["difference_gpu_h"] == pytest.approx(expected)
    assert against["ci95"][0] <= expected <= against["ci95"][1]


def test_the_refill_after_a_job_leaves_a_node_is_measured_from_the_trace():
    # n0: a job ends at 10 h, the next starts at 12 h and holds the node's 8 GPUs to 40 h, so the
    # 24 h after the first job's end are 22 h busy. n1: a job moved off at 5 h (it goes on on n2)
    # is not a job end; its last placement on n2 ends at 8 h and n2 stays free. The job on n0
    # that ends at 40 h is within a horizon of the trace's end and is not counted.
    jobs = trace(
        [
            {"id": "a", "nodes": {"n0": 8}, "start": 0, "end": 10, "interval": 1},
            {"id": "b", "nodes": {"n0": 8}, "start": 12, "end": 40, "interval": 1},
            {"id": "c", "nodes": {"n1": 8}, "start": 0, "end": 5, "interval": 1},
            {"id": "c", "nodes": {"n2": 8}, "start": 5, "end": 8, "interval": 1},
        ]
    )
    refill = refill_after_job_ends(jobs, horizon_h=24.0)
    assert refill["job_ends"] == 2  # a on n0, c on n2
    assert refill["busy_share"] == pytest.approx((22 / 24 + 0.0) / 2)
    assert refill["median_hours_to_next"] == pytest.approx(2.0)  # only n0 is refilled


def test_the_replay_and_its_report_give_the_refill_of_its_trace_at_the_cost_policys_horizon():
    from models.report_replay import replay_section

    # The gang leaves its 8 nodes at 20 h; a job takes n0 from 22 h to 60 h: over the 24 h after
    # the gang's end n0 is busy 22 h, the other seven not at all.
    later = {"id": "next", "nodes": {"n0": 8}, "start": 22, "end": 60, "interval": 4}
    frame, risks = grid(NODES, 48)
    out = replay(frame, risks, None, trace([GANG, later]), failures(), TIERS, NO_OVERHEAD)
    assert out["refill"]["job_ends"] == 8
    assert out["refill"]["busy_share"] == pytest.approx(22 / 24 / 8)
    assert out["refill"]["median_hours_to_next"] == pytest.approx(2.0)
    text = "\n".join(replay_section({"replay": {"model": "m", **out}}))
    assert "its GPUs were busy 11% of the next 24 h (8 job ends; the next job came a median 2.0 h later)" in text


def test_a_trace_with_no_job_end_a_horizon_before_its_last_has_no_refill():
    jobs = trace([{"id": "a", "nodes": {"n0": 8}, "start": 0, "end": 10, "interval": 1}])
    assert refill_after_job_ends(jobs, horizon_h=24.0) == {
        "horizon_h": 24.0,
        "job_ends": 0,
        "busy_share": None,
        "median_hours_to_next": None,
    }
