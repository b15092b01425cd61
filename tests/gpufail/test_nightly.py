"""`gpufail nightly` against a real MLflow server on 127.0.0.1 (session fixture
`mlflow_server`), on a small simulated fleet that grows by one day between runs: the day's
telemetry, XID events and repair records are copied from a fleet simulated in full, the way a
collector would have written them that day."""

from __future__ import annotations

import errno
import gc
import itertools
import json
import shutil
import subprocess
import sys
import weakref
from dataclasses import replace
from datetime import UTC, date, datetime, timedelta
from functools import cache
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from features.runner import BuildOptions
from gpufail.nightly import STEPS, NightlyError, NightlyOptions, job_lock, retrain_reach, run_nightly
from ingest.kernel_log_import import ingest_kernel_logs
from ingest.simulator.run import simulate
from ingest.store import Store
from models.registry import Registry, load_champion
from models.train import TrainOptions

pytestmark = pytest.mark.slow
_names = itertools.count()
FLEET_DAYS = 20


@cache
def simulated_fleet(tmp_root: Path, acceleration: float) -> Path:
    source = tmp_root / f"fleet-{acceleration:g}"
    simulate(
        source,
        "demo",
        seed=3,
        progress=False,
        nodes=12,
        days=FLEET_DAYS,
        sample_interval_s=900,
        acceleration=acceleration,
    )
    store = Store.open(str(source))
    ingest_kernel_logs(
        store,
        sorted((source / "raw" / "kernel-log").glob("*.log")),
        cluster="default",
        dedup_window=timedelta(minutes=5),
    )
    return source


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Path:
    return simulated_fleet(tmp_path_factory.mktemp("source"), 80.0)


def grow(source: Path, target: Path, through: date) -> None:
    """Copy the partitions dated up to `through` that `target` lacks."""
    src, dst = Store.open(str(source)), Store.create(str(target))
    for dataset in ("telemetry", "xid_events", "repairs"):
        have = set(dst.dates(dataset))
        for day in src.dates(dataset):
            if day <= through and day not in have:
                shutil.copytree(src.path(dataset, f"date={day}"), dst.path(dataset, f"date={day}"))


def first_day(source: Path) -> date:
    return Store.open(str(source)).dates("telemetry")[0]


def options(tmp_path: Path, url: str, name: str, **overrides) -> NightlyOptions:
    values = dict(
        work_dir=tmp_path / "work",
        tracking_uri=url,
        model_name=name,
        experiment=f"test-nightly-{name}",
        train=TrainOptions(
            kind="lightgbm",
            train_window=timedelta(days=10),
            horizon=timedelta(hours=24),
            negative_fraction=0.5,
            params={"n_estimators": 30, "n_jobs": 1},
        ),
        top_k=5,
        holdout_days=3.0,
        promotion_margin=0.01,
        recall_tolerance=0.05,
        precision_floor=0.0,
        build=BuildOptions(progress=False),
        retries=1,
        backoff_s=0.0,
    )
    return NightlyOptions(**{**values, **overrides})


def log_publish(store: Store, latest) -> dict:
    """A publish step that records what it was given (the policy publisher has its own tests)."""
    log = store.read_state("test-published") or {"calls": []}
    log["calls"].append({"ts": str(latest["ts"].max()), "model_version": sorted(set(latest["model_version"]))})
    store.write_state("test-published", log)
    return {"gpus": len(latest)}


def runs_of(url: str, experiment: str) -> list:
    registry = Registry(url, "unused", experiment=experiment)
    found = registry.client.get_experiment_by_name(experiment)
    return [] if found is None else registry.client.search_runs([found.experiment_id])


def test_three_nights_give_three_runs_justified_promotions_and_a_champion_serving_loads(
    mlflow_server, fleet, tmp_path, monkeypatch
):
    import models.gate
    import serving.score_store

    url, _ = mlflow_server
    passes: list[list[str]] = []  # each pass over the held-out window: the models it scored
    real_metrics = models.gate.holdout_metrics_of
    held_out: list[weakref.ref] = []
    real_score = serving.score_store.score_store

    def counted(models, holdout, *args, **kwargs):
        passes.append(sorted(models))
        held_out.append(weakref.ref(holdout))
        # The window computed on demand is read in parts of whole GPUs, never whole.
        assert kwargs.get("in_gpu_parts")
        return real_metrics(models, holdout, *args, **kwargs)

    def score_without_the_holdout(*args, **kwargs):
        # The held-out rows are let go before scoring computes the newest hour beside them.
        gc.collect()
        assert held_out and all(ref() is None for ref in held_out)
        return real_score(*args, **kwargs)

    monkeypatch.setattr(models.gate, "holdout_metrics_of", counted)
    monkeypatch.setattr(models.gate, "holdout_metrics", lambda *a, **k: pytest.fail("the window was read again"))
    monkeypatch.setattr(serving.score_store, "score_store", score_without_the_holdout)
    import models.registry

    real_load_champion = models.registry.load_champion
    champion_loads: list[str] = []  # each champion the job loaded, by version

    def counted_load(*args, **kwargs):
        loaded = real_load_champion(*args, **kwargs)
        champion_loads.append(loaded.version)
        return loaded

    monkeypatch.setattr(models.registry, "load_champion", counted_load)
    name = f"nightly-{next(_names)}"
    data = tmp_path / "data"
    plain = options(tmp_path, url, name)
    opts = options(
        tmp_path, url, name, train=replace(plain.train, calibration="platt", calibration_window=timedelta(days=1))
    )
    start = first_day(fleet)
    days = [start + timedelta(days=d) for d in (FLEET_DAYS - 3, FLEET_DAYS - 2, FLEET_DAYS - 1)]
    summaries, loads_per_night = [], []
    for day in days:
        grow(fleet, data, day)
        champion_loads.clear()
        summaries.append(run_nightly(str(data), opts, publish=log_publish, report=lambda _: None))
        loads_per_night.append(len(champion_loads))
        assert summaries[-1].day == day.isoformat() and summaries[-1].done == list(STEPS)
        # Each step's duration is recorded, and together they fit in the night's wall time.
        seconds = [summaries[-1].results[step]["seconds"] for step in STEPS]
        assert all(s >= 0 for s in seconds) and sum(seconds) <= summaries[-1].seconds + 0.05 * len(
            STEPS
        )  # each rounded to 0.1 s
        assert summaries[-1].results["features"]["seconds"] > 0
    # One pass over each night's held-out window scored the night's model and the champion of
    # the night (none on the first); the gate judged them by those metrics.
    assert passes == [["model"], ["champion", "model"], ["champion", "model"]]
    # A night loads the champion once for its feature spec and evaluation, and once more to
    # score after the gate (the first night has none before its gate).
    assert loads_per_night == [1, 2, 2]

    # The same day again changes nothing: no step, no run, no prediction file.
    predictions_before = Store.open(str(data)).files("predictions")
    again = run_nightly(str(data), opts, publish=log_publish, report=lambda _: None)
    assert again.already_done and "already complete" in again.line()
    assert Store.open(str(data)).files("predictions") == predictions_before

    runs = runs_of(url, opts.experiment)
    assert len(runs) == 3
    assert sorted(r.data.tags["gpufail.day"] for r in runs) == [d.isoformat() for d in days]
    for r in runs:
        assert r.data.tags["gpufail.gate_reason"]  # every decision says why
    gates = [s.results["gate"] for s in summaries]
    assert gates[0]["promote"] and "no champion yet" in gates[0]["reason"]
    for g in gates[1:]:
        # A promotion is justified by the margin on the held-out window, a refusal says so.
        assert ("beats the champion" in g["reason"]) if g["promote"] else ("champion" in g["reason"])
    promoted = [g["version"] for g in gates if g["promote"]]
    champion = load_champion(url, name)
    assert champion.version == promoted[-1]
    # The champion is trained up to its window's end, a horizon before the held-out window, and
    # carries the calibration fitted on the window's last days as scored by an earlier fit.
    train = next(s.results["train"] for s in summaries if s.results["train"]["model_version"] == champion.model.version)
    assert champion.model.calibrated
    info = champion.model.calibration_info()
    assert info["slice_end"] == train["calibration_end"] and info["slice_start"] == train["calibration_start"]
    window_end = datetime.fromisoformat(train["window_end"])
    assert datetime.fromisoformat(train["calibration_end"]) == window_end
    assert window_end - opts.feature_spec.grid <= champion.model.train_end < window_end
    assert datetime.fromisoformat(info["scored_by_train_end"]) < datetime.fromisoformat(train["calibration_start"])
    assert window_end < datetime.fromisoformat(train["holdout_start"])

    # Each night scored the fleet's latest grid time with that night's champion.
    store = Store.open(str(data))
    predictions = pl.from_arrow(store.read_owned("predictions"))
    assert predictions["ts"].n_unique() == 3
    assert predictions.filter(pl.col("ts") == pl.col("ts").max())["model_version"].unique().to_list() == [
        champion.model.version
    ]
    assert len(store.read_state("test-published")["calls"]) == 3

    # The retrain read the label keys from `retrain_reach` on, not the whole history, and its
    # window lies within them.
    feature_days = store.dates("buckets")
    reach = retrain_reach(feature_days[-1], opts, opts.feature_spec)
    assert reach > datetime.combine(feature_days[0], datetime.min.time(), tzinfo=UTC)
    assert datetime.fromisoformat(summaries[-1].results["train"]["window_start"]) >= reach


def test_an_ensemble_that_ranks_each_grid_time_is_evaluated_on_whole_grid_times(
    mlflow_server, fleet, tmp_path, monkeypatch
):
    import models.gate

    url, _ = mlflow_server
    passes: list[tuple[list[str], bool]] = []
    real_metrics = models.gate.holdout_metrics_of

    def recorded(models, holdout, *args, **kwargs):
        passes.append((sorted(models), kwargs.get("in_gpu_parts", False)))
        return real_metrics(models, holdout, *args, **kwargs)

    monkeypatch.setattr(models.gate, "holdout_metrics_of", recorded)
    data = tmp_path / "data"
    plain = options(tmp_path, url, f"nightly-{next(_names)}")
    members = {"members": ["lightgbm", "logistic"], "top_k": 5, "member_params": {"lightgbm": {"n_estimators": 20}}}
    opts = replace(plain, train=replace(plain.train, kind="parallel", params={"n_jobs": 1, **members}))
    grow(fleet, data, first_day(fleet) + timedelta(days=FLEET_DAYS - 1))

    night = run_nightly(str(data), opts, publish=log_publish, report=lambda _: None)

    assert night.done == list(STEPS)
    # The parallel ensemble ranks the GPUs of a grid time against each other: its window is
    # read in whole grid times, not in parts of GPUs.
    assert passes == [(["model"], False)]
    assert night.results["evaluate"]["episodes"] > 0


def test_the_night_uses_the_champions_feature_spec_and_refuses_features_of_another(mlflow_server, fleet, tmp_path):
    from features.aggregates import build_aggregates
    from features.manifest import recorded_spec
    from features.spec import FeatureSpec
    from models.train import load_model

    url, _ = mlflow_server
    name = f"nightly-{next(_names)}"
    data = tmp_path / "data"
    champions = FeatureSpec()
    start = first_day(fleet)
    grow(fleet, data, start + timedelta(days=FLEET_DAYS - 3))
    first = run_nightly(str(data), options(tmp_path, url, name), publish=log_publish, report=lambda _: None)
    assert first.results["gate"]["promote"] and load_champion(url, name).model.feature_spec == champions

    # Today's configuration has other feature settings: the night keeps the champion's, says so,
    # and its challenger carries them.
    today = FeatureSpec(windows=[timedelta(hours=1), timedelta(hours=6)], lost_after=timedelta(hours=3))
    lines: list[str] = []
    grow(fleet, data, start + timedelta(days=FLEET_DAYS - 2))
    second = run_nightly(
        str(data), options(tmp_path, url, name, feature_spec=today), publish=log_publish, report=lines.append
    )
    assert second.done == list(STEPS) and second.results["features"]["feature_spec"] == champions.fingerprint
    assert any(
        "the configured feature settings (windows, lost_after) differ from the champion's feature spec" in line
        for line in lines
    )
    store = Store.open(str(data))
    assert recorded_spec(store) == champions
    assert load_model(second.results["train"]["model_dir"]).feature_spec == champions

    # The aggregates rebuilt by hand with today's settings and another silence: the night does not
    # overwrite them, and the champion cannot score features computed with them.
    today = replace(today, max_silence=timedelta(hours=12))
    build_aggregates(store, today, overwrite=True)
    grow(fleet, data, start + timedelta(days=FLEET_DAYS - 1))
    with pytest.raises(NightlyError) as refused:
        run_nightly(str(data), options(tmp_path, url, name), publish=log_publish, report=lambda _: None)
    message = str(refused.value)
    assert "step features failed: " in message and "no champion could score the fleet (" in message
    assert message.count(f"were built with feature spec {today.fingerprint}") == 2
    assert f"needs feature spec {champions.fingerprint}; they differ in windows (" in message
    assert "\n" not in message


def test_a_crash_resumes_from_the_failed_step_without_logging_twice(mlflow_server, fleet, tmp_path, monkeypatch):
    url, _ = mlflow_server
    name = f"nightly-{next(_names)}"
    data = tmp_path / "data"
    opts = options(tmp_path, url, name)
    grow(fleet, data, first_day(fleet) + timedelta(days=FLEET_DAYS - 1))

    real_write = Store.write_part

    def disk_full(self, dataset, *args, **kwargs):
        if dataset == "predictions":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, dataset, *args, **kwargs)

    monkeypatch.setattr(Store, "write_part", disk_full)
    messages: list[str] = []
    with pytest.raises(NightlyError, match=r"step score failed: OSError: \[Errno 28\] No space left on device"):
        run_nightly(str(data), opts, publish=log_publish, report=messages.append)
    state = Store.open(str(data)).read_state("nightly")
    assert list(state["steps"]) == ["ingest", "compact", "features", "train", "evaluate", "register", "gate"]
    assert state["failed"]["step"] == "score"
    assert Store.open(str(data)).files("predictions") == []  # nothing half-written

    monkeypatch.setattr(Store, "write_part", real_write)
    resumed = run_nightly(str(data), opts, publish=log_publish, report=messages.append)
    assert resumed.done == ["score", "publish"]
    assert len(runs_of(url, opts.experiment)) == 1
    assert "failed" not in Store.open(str(data)).read_state("nightly")


def test_a_failed_step_keeps_the_champion_serving_and_exits_with_the_reason(
    mlflow_server, fleet, tmp_path, monkeypatch
):
    url, _ = mlflow_server
    name = f"nightly-{next(_names)}"
    data = tmp_path / "data"
    opts = options(tmp_path, url, name)
    start = first_day(fleet)
    grow(fleet, data, start + timedelta(days=FLEET_DAYS - 2))
    run_nightly(str(data), opts, publish=log_publish, report=lambda _: None)
    champion = load_champion(url, name).model.version

    grow(fleet, data, start + timedelta(days=FLEET_DAYS - 1))
    import models.train_store

    def broken(*args, **kwargs):
        raise MemoryError("simulated")

    monkeypatch.setattr(models.train_store, "train_model_from_store", broken)
    messages: list[str] = []
    with pytest.raises(NightlyError, match="step train failed: MemoryError: simulated") as failure:
        run_nightly(str(data), opts, publish=log_publish, report=messages.append)
    assert "scored the fleet" in str(failure.value)
    latest = pl.from_arrow(Store.open(str(data)).read_owned("predictions")).filter(pl.col("ts") == pl.col("ts").max())
    assert latest["model_version"].unique().to_list() == [champion]
    assert len(runs_of(url, opts.experiment)) == 1


def test_a_window_without_failures_trains_nothing_and_says_why(mlflow_server, tmp_path_factory, tmp_path):
    url, _ = mlflow_server
    quiet = simulated_fleet(tmp_path_factory.mktemp("quiet"), 0.0)
    data = tmp_path / "data"
    grow(quiet, data, first_day(quiet) + timedelta(days=FLEET_DAYS - 1))
    opts = options(tmp_path, url, f"nightly-{next(_names)}")
    with pytest.raises(NightlyError, match="step score failed: .*no version has the alias 'champion'") as failure:
        run_nightly(str(data), opts, publish=log_publish, report=lambda _: None)
    assert "no champion could score the fleet" not in str(failure.value)
    state = Store.open(str(data)).read_state("nightly")
    assert "has no failures; no model trained" in state["steps"]["train"]["reason"]
    assert state["steps"]["register"]["skipped"] and state["steps"]["gate"]["skipped"]
    assert runs_of(url, opts.experiment) == []


def test_two_runs_cannot_overlap(tmp_path, fleet):
    data = tmp_path / "data"
    grow(fleet, data, first_day(fleet))
    opts = options(tmp_path, "http://127.0.0.1:9", "unused")
    with job_lock(opts.work_dir), pytest.raises(NightlyError, match="another `gpufail nightly` holds the lock"):
        run_nightly(str(data), opts, publish=log_publish, report=lambda _: None)


def test_the_cli_runs_the_job_and_reports_a_failure_in_one_line(mlflow_server, fleet, tmp_path):
    url, _ = mlflow_server
    data = tmp_path / "data"
    grow(fleet, data, first_day(fleet) + timedelta(days=FLEET_DAYS - 1))
    env_base = {
        "GPUFAIL_MLFLOW__TRACKING_URI": url,
        "GPUFAIL_MLFLOW__MODEL_NAME": f"nightly-{next(_names)}",
        "GPUFAIL_MLFLOW__RETRIES": "0",
        "GPUFAIL_MODEL__TRAIN_WINDOW": "10d",
        "GPUFAIL_NIGHTLY__PRECISION_FLOOR": "0.0",
        "GPUFAIL_NIGHTLY__PARAMS": '{"n_estimators": 20}',
    }
    import os

    env = {**os.environ, **env_base}
    cmd = [sys.executable, "-c", "from gpufail.cli import main; main()", "nightly", "--data", str(data), "--quiet"]
    # The whole night in JSON log lines (a log pipeline's view): every line one object.
    done = subprocess.run([*cmd, "--log-format", "json"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = json_lines(done.stdout + done.stderr)
    summary = [line for line in lines if "facts" in line]
    assert len(summary) == 1 and summary[0]["facts"]["command"] == "nightly"
    assert "promoted" in summary[0]["message"] and "scored" in summary[0]["message"]
    actions = pl.from_arrow(Store.open(str(data)).read_owned("actions"))
    assert actions["dry_run"].all()

    grow(fleet, data, first_day(fleet) + timedelta(days=FLEET_DAYS))  # no new day: already complete
    assert "already complete" in subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600).stdout

    store = Store.open(str(data))
    last = store.dates("telemetry")[-1]
    since = datetime(last.year, last.month, last.day, tzinfo=UTC)
    rows = store.read("telemetry", since, since + timedelta(days=1)).slice(0, 10)
    shifted = pc.add(rows["ts"], pa.scalar(timedelta(days=1), pa.duration("us")))
    store.write("telemetry", rows.set_column(rows.schema.get_field_index("ts"), "ts", shifted))  # a new day
    down = {**env, "GPUFAIL_MLFLOW__TRACKING_URI": "http://127.0.0.1:9"}
    failed = subprocess.run(cmd, capture_output=True, text=True, env=down, timeout=600)
    assert failed.returncode == 2
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("gpufail: error: nightly ") and "unreachable" in last
    assert "the champion (version 1, from the cache) scored the fleet" in last


def json_lines(text: str) -> list[dict]:
    """Every line of `text` as a JSON object (an assertion names the first that is not)."""
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON log line: {line!r}") from None
    return out


_KILLED_WHILE_LOGGING_THE_MODEL = """
import os, signal, sys
import mlflow.pyfunc

def killed(*args, **kwargs):  # the model's files are being saved: its MLflow entry is PENDING
    os.kill(os.getpid(), signal.SIGKILL)

mlflow.pyfunc.save_model = killed
from gpufail.cli import main
sys.argv = ["gpufail", *sys.argv[1:]]
main()
"""


def test_a_kill_during_register_is_finished_in_the_same_mlflow_run(mlflow_server, fleet, tmp_path):
    import os

    from mlflow.entities import LoggedModelStatus

    url, _ = mlflow_server
    name = f"nightly-{next(_names)}"
    experiment = f"test-nightly-{name}"
    data = tmp_path / "data"
    grow(fleet, data, first_day(fleet) + timedelta(days=FLEET_DAYS - 1))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFAIL_")} | {
        "GPUFAIL_MLFLOW__TRACKING_URI": url,
        "GPUFAIL_MLFLOW__MODEL_NAME": name,
        "GPUFAIL_MLFLOW__EXPERIMENT": experiment,
        "GPUFAIL_MLFLOW__RETRIES": "0",
        "GPUFAIL_MODEL__TRAIN_WINDOW": "10d",
        "GPUFAIL_NIGHTLY__PRECISION_FLOOR": "0.0",
        "GPUFAIL_NIGHTLY__PARAMS": '{"n_estimators": 20}',
    }
    args = ["nightly", "--data", str(data), "--quiet"]
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_WHILE_LOGGING_THE_MODEL, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert killed.returncode == -9, killed.stderr
    (stuck,) = runs_of(url, experiment)
    assert stuck.info.status == "RUNNING"
    state = Store.open(str(data)).read_state("nightly")
    assert "register" not in state["steps"] and state["register_run_id"] == stuck.info.run_id
    # The evaluation kept a few rows for the model's signature; a run by a version that kept
    # none is resumed with rows read from the held-out window.
    (Path(state["steps"]["evaluate"]["report"]).parent / "example.parquet").unlink()

    cmd = [sys.executable, "-c", "from gpufail.cli import main; main()", *args]
    resumed = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert f"register: finished MLflow run {stuck.info.run_id}, left RUNNING by an interrupted run" in resumed.stdout

    (run,) = runs_of(url, experiment)  # one run for the night, finished
    assert run.info.run_id == stuck.info.run_id and run.info.status == "FINISHED"
    state = Store.open(str(data)).read_state("nightly")
    assert "register_run_id" not in state and state["steps"]["register"]["resumed_run"] == "RUNNING"
    registry = Registry(url, name, experiment=experiment)
    assert registry.client.get_model_version(name, state["steps"]["register"]["version"]).run_id == run.info.run_id
    models = registry.client.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'"
    )
    assert sorted(str(m.status) for m in models) == sorted(
        [str(LoggedModelStatus.FAILED), str(LoggedModelStatus.READY)]
    )


def test_a_corrupt_feature_file_is_named(mlflow_server, fleet, tmp_path):
    from features.aggregates import build_aggregates

    url, _ = mlflow_server
    data = tmp_path / "data"
    opts = options(tmp_path, url, f"nightly-{next(_names)}")
    grow(fleet, data, first_day(fleet) + timedelta(days=FLEET_DAYS - 2))
    store = Store.open(str(data))
    build_aggregates(store)
    # A day the night reads and does not rebuild, cut short (a copy that stopped).
    damaged = store.files("buckets", first_day(fleet) + timedelta(days=FLEET_DAYS - 8))[0]
    Path(damaged).write_bytes(Path(damaged).read_bytes()[:1000])
    grow(fleet, data, first_day(fleet) + timedelta(days=FLEET_DAYS - 1))

    with pytest.raises(NightlyError) as failure:
        run_nightly(str(data), opts, publish=log_publish, report=lambda _: None)
    # The features step counts the labels of the day it builds, reading the week before it.
    assert f"step features failed: {damaged}: corrupt file" in str(failure.value)
    assert "gpufail features --start" in str(failure.value)
