"""Scoring and publishing under faults: scoring again, kill -9 at random points, concurrent
runs, bad predictions. Each run is the real `gpufail` command in its own process
(`tests.faults.kill_points`), on a small store with a trained LightGBM model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest.store import Store
from serving.predictions import newest_snapshot
from serving.publish import read_audit
from serving.publishing import policy_journal
from tests.faults import kill_points

pytestmark = pytest.mark.slow

SEED = 25
KILLS = 12
LIVE_LOG = ["--to", "log", "--no-dry-run", "--quiet"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A data root with features (200 GPUs on 25 nodes, 10 days) and a LightGBM model beside it."""
    from tests.models import data_root_with_model

    return data_root_with_model(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def scored(base, tmp_path_factory) -> Path:
    """`base` scored once: one predictions snapshot."""
    folder = copy(base, tmp_path_factory.mktemp("scored"))
    assert gpufail(folder, "score") == 0
    return folder


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def command(folder: Path, name: str, *args: str) -> list[str]:
    extra = ["--model", str(folder / "model")] if name == "score" else []
    return [name, "--data", str(folder / "data"), *extra, *args]


def gpufail(folder: Path, name: str, *args: str, kill: kill_points.Kill | None = None) -> int:
    status, _ = kill_points.run(command(folder, name, *args), kill=kill)
    return status


def killed(status: int, kill: kill_points.Kill) -> bool:
    """Whether the run died as planned (a delayed kill may come after a short run ended)."""
    return status == -9 or (kill.after_s is not None and status == 0)


def snapshot_rows(folder: Path) -> pd.DataFrame:
    snapshot = newest_snapshot(Store.open(str(folder / "data")))
    assert snapshot is not None
    return snapshot.frame.sort_values("gpu_uuid", ignore_index=True)


def audit(folder: Path) -> pd.DataFrame:
    return read_audit(str(folder / "data" / "actions"))


def acted(rows: pd.DataFrame) -> list[tuple]:
    """The decisions that changed something, without their times (each run has its own)."""
    changed = rows[rows["action"] != "keep"]
    return sorted(zip(changed["node"], changed["previous_tier"], changed["tier"], changed["action"], strict=True))


def tiers(folder: Path) -> dict[str, tuple[str, str]]:
    state = Store.open(str(folder / "data")).read_state("publish-log") or {"nodes": {}}
    return {key: (s["tier"], s["applied"]) for key, s in state["nodes"].items()}


def test_scoring_twice_gives_the_snapshot_and_the_decisions_of_scoring_once(base, tmp_path):
    once, twice = copy(base, tmp_path / "once"), copy(base, tmp_path / "twice")
    assert gpufail(once, "score") == 0
    assert gpufail(twice, "score") == 0 and gpufail(twice, "score") == 0
    assert gpufail(once, "publish", *LIVE_LOG) == 0 and gpufail(twice, "publish", *LIVE_LOG) == 0
    decided = [
        audit(f)[["node", "risk", "tier", "action"]].sort_values("node", ignore_index=True) for f in (once, twice)
    ]
    assert (decided[0]["tier"] != "none").any()  # the test fleet has a node the policy acts on
    pd.testing.assert_frame_equal(decided[1], decided[0])
    assert len(kill_points.visible_files(twice / "data", "predictions")) == 1
    pd.testing.assert_frame_equal(snapshot_rows(twice), snapshot_rows(once))


def test_kill_9_of_score_at_random_points_then_a_rerun_gives_one_clean_snapshot(base, scored, tmp_path):
    clean = snapshot_rows(scored)
    # Half the kills in a first scoring, half in a scoring that replaces a snapshot.
    first = kill_points.plan(command(copy(base, tmp_path / "plan-first"), "score"), KILLS // 2, SEED)
    again = kill_points.plan(command(copy(scored, tmp_path / "plan-again"), "score"), KILLS // 2, SEED)
    for i, (start, kill) in enumerate([(base, k) for k in first] + [(scored, k) for k in again]):
        folder = copy(start, tmp_path / f"kill-{i}")
        assert killed(gpufail(folder, "score", kill=kill), kill), kill
        # Right after the kill, a reader sees no snapshot or a whole one, never a mix.
        after_kill = newest_snapshot(Store.open(str(folder / "data")))
        if after_kill is not None:
            pd.testing.assert_frame_equal(after_kill.frame.sort_values("gpu_uuid", ignore_index=True), clean)
        assert gpufail(folder, "score") == 0
        assert len(kill_points.visible_files(folder / "data", "predictions")) == 1, kill
        assert kill_points.hidden_files(folder / "data") == [], kill  # a killed write's file swept
        pd.testing.assert_frame_equal(snapshot_rows(folder), clean)


def test_kill_9_of_live_publish_at_random_points_then_a_rerun_records_each_decision_once(scored, tmp_path):
    reference = copy(scored, tmp_path / "clean")
    assert gpufail(reference, "publish", *LIVE_LOG) == 0
    clean_actions, clean_tiers = acted(audit(reference)), tiers(reference)
    assert clean_actions, "the clean run must change something for this test to mean anything"
    nodes = audit(reference)["node"].nunique()
    for i, kill in enumerate(
        kill_points.plan(command(copy(scored, tmp_path / "plan"), "publish", *LIVE_LOG), KILLS, SEED)
    ):
        folder = copy(scored, tmp_path / f"kill-{i}")
        assert killed(gpufail(folder, "publish", *LIVE_LOG, kill=kill), kill), kill
        audit(folder)  # every visible audit file is whole
        assert gpufail(folder, "publish", *LIVE_LOG) == 0
        rows = audit(folder)
        assert acted(rows) == clean_actions, kill
        assert tiers(folder) == clean_tiers, kill
        files = kill_points.visible_files(folder / "data", "actions")
        assert len(files) in (1, 2) and len(rows) == nodes * len(files), f"{kill}: {len(rows)} rows"
        assert kill_points.hidden_files(folder / "data") == [], kill


def test_concurrent_live_publish_runs_raise_each_node_once(scored, tmp_path):
    import multiprocessing.pool

    folder = copy(scored, tmp_path / "data")
    with multiprocessing.pool.ThreadPool(3) as pool:
        statuses = pool.map(lambda _: gpufail(folder, "publish", *LIVE_LOG), range(3))
    assert statuses == [0, 0, 0]
    rows = audit(folder)
    raised = rows[rows["action"] == "raise"]
    assert len(raised) == raised["node"].nunique() >= 1
    assert len(kill_points.visible_files(folder / "data", "actions")) == 3


def test_a_run_refuses_in_one_line_while_another_holds_the_lock(scored, tmp_path, capfd):
    import os

    folder = copy(scored, tmp_path / "data")
    with policy_journal(Store.open(str(folder / "data")), "publish-log"):
        status = gpufail(folder, "publish", *LIVE_LOG, "--lock-wait", "0.3")
    err = capfd.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1
    lock = folder / "data" / "_state" / "publish.lock"
    assert f"another `gpufail publish` holds the lock {lock} (pid {os.getpid()} since" in err[0]
    assert "waited 0.3s" in err[0]
    assert not (folder / "data" / "actions").exists()


def _with(**columns):
    def change(frame: pd.DataFrame) -> pa.Table:
        for name, values in columns.items():
            frame[name] = values(frame) if callable(values) else values
        table = pa.Table.from_pandas(frame, preserve_index=False)
        for name in ("risk", "node_risk"):
            if frame[name].dtype.kind == "f":  # a NaN stays a NaN (from_pandas reads it as null)
                table = table.set_column(table.schema.get_field_index(name), name, pa.array(frame[name].to_numpy()))
        return table

    return change


def _first(value):
    return lambda f: [value, *f.iloc[1:, f.columns.get_loc("risk")]]


BAD_PREDICTIONS = {
    "a NaN risk": (_with(risk=_first(float("nan"))), "1 'risk' value not a probability in [0, 1] (e.g. nan"),
    "a risk of 7.5": (_with(risk=_first(7.5)), "(e.g. 7.5 for GPU"),
    "a negative risk": (_with(risk=_first(-0.2)), "(e.g. -0.2 for GPU"),
    "an infinite node risk": (_with(node_risk=float("inf")), "'node_risk' values not a probability"),
    "a null node column": (_with(node=None), "null 'node' values"),
    "an empty node name": (_with(node=""), "empty 'node' values"),
    "a null GPU id": (_with(gpu_uuid=lambda f: [None, *f["gpu_uuid"].iloc[1:]]), "1 null 'gpu_uuid' value"),
    "a GPU listed twice": (
        lambda f: pa.Table.from_pandas(pd.concat([f, f.iloc[:1]]), preserve_index=False),
        "1 GPU listed more than once",
    ),
    "no risk column": (
        lambda f: pa.Table.from_pandas(f.drop(columns="risk"), preserve_index=False),
        "missing column ['risk']",
    ),
    "a text risk column": (_with(risk="high"), "column 'risk' is large_string, expected double"),
    "a null risk": (
        lambda f: pa.Table.from_pandas(f.assign(risk=[None, *f["risk"].iloc[1:]]), preserve_index=False),
        "1 null 'risk' value",
    ),
    "no rows": (lambda f: pa.Table.from_pandas(f.iloc[:0], preserve_index=False), "no rows"),
}


def _write_newest(folder: Path, table: pa.Table | bytes) -> Path:
    """A predictions file an hour after the snapshot's grid time: the newest one."""
    ts = snapshot_rows(folder)["ts"].iloc[0] + pd.Timedelta("1h")
    day = folder / "data" / "predictions" / f"date={ts:%Y-%m-%d}"
    day.mkdir(parents=True, exist_ok=True)
    path = day / "part-bad.parquet"
    if isinstance(table, bytes):
        path.write_bytes(table)
    else:
        pq.write_table(table, path)
    return path


def _garbled(folder: Path, how: str) -> bytes:
    data = kill_points.visible_files(folder / "data", "predictions")[0].read_bytes()
    return data[: len(data) // 2] if how == "truncated" else b"not a parquet file\n" * 20


@pytest.mark.parametrize("case", [*BAD_PREDICTIONS, "a truncated file", "a file that is not Parquet"])
def test_bad_predictions_are_refused_in_one_line_before_anything_acts(scored, tmp_path, capfd, case):
    folder = copy(scored, tmp_path / "data")
    if case in BAD_PREDICTIONS:
        make, expected = BAD_PREDICTIONS[case]
        frame = snapshot_rows(folder)
        frame["ts"] = frame["ts"] + pd.Timedelta("1h")
        path = _write_newest(folder, make(frame))
    else:
        path = _write_newest(folder, _garbled(folder, "truncated" if "truncated" in case else "garbage"))
        expected = "not a readable predictions file"
    status = gpufail(folder, "publish", *LIVE_LOG)
    err = capfd.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"gpufail: error: {path}: ") and expected in err[0], err[0]
    assert not (folder / "data" / "actions").exists() and not (folder / "data" / "_state" / "publish-log.json").exists()
