"""`--json` on the commands that report results (docs/cli.md): stdout is exactly one JSON object
whose fields agree with what the command wrote; `gpufail at-risk` from a data root and from a
running server; `gpufail publish` naming why it left a node alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from gpufail.cli import cli
from ingest.store import Store
from tests.cli import kernel_log_collector_env, without_outside_config

FIXTURES = Path(__file__).parent.parent / "fixtures"
QUICK_EVALUATE = """
[model]
monotone_increasing = []
calibration_window = "1d"

[evaluate]
test_days = 2.0
train_window = "3d"
retrain_every = "2d"
negative_fraction = 0.2
bootstrap_samples = 20
jobs = 1

[[evaluate.contenders]]
name = "lightgbm static"
kind = "lightgbm"
mode = "static"
params = { n_estimators = 20, n_jobs = 1 }
"""


@pytest.fixture(autouse=True)
def no_outside_config(monkeypatch, tmp_path):
    without_outside_config(monkeypatch, tmp_path)


def gpufail(*args: str, env: dict[str, str] | None = None) -> str:
    result = CliRunner().invoke(cli, list(args), env=env)
    assert result.exit_code == 0, f"gpufail {' '.join(args)}: {result.output}\n{result.exception!r}"
    return result.stdout


def one_object(stdout: str) -> dict:
    """The command's JSON object: stdout is that object on one line and nothing else."""
    lines = stdout.splitlines()
    assert len(lines) == 1, stdout
    value = json.loads(lines[0])
    assert isinstance(value, dict)
    return value


# -- bringing data in ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> Path:
    from ingest.simulator.run import simulate

    data = tmp_path_factory.mktemp("sim") / "fleet"
    simulate(data, "demo", seed=1, progress=False, nodes=2, days=3, sample_interval_s=3600)
    return data


def test_ingest_kernel_log_json_counts_the_incidents_it_wrote(simulated, tmp_path):
    data = shutil.copytree(simulated, tmp_path / "fleet")
    facts = one_object(gpufail("ingest", "kernel-log", "--data", str(data), "--json"))
    assert facts["command"] == "ingest kernel-log"
    written = Store.open(str(data)).read("xid_events").num_rows
    assert facts["incidents"] == written > 0
    assert facts["files"] >= 1 and facts["lines"] >= facts["xid_lines"] > 0
    assert facts["skipped_files"] == []
    # Again: every file is unchanged, nothing is written, and the object says so.
    again = one_object(gpufail("ingest", "kernel-log", "--data", str(data), "--json"))
    assert again["incidents"] == 0 and len(again["skipped_files"]) == facts["files"]


def test_features_json_counts_the_rows_it_built(simulated, tmp_path):
    from features.dataset import read_features

    data = shutil.copytree(simulated, tmp_path / "fleet")
    facts = one_object(gpufail("features", "--data", str(data), "--quiet", "--json"))
    assert facts["command"] == "features"
    built = read_features(Store.open(str(data)))
    assert facts["rows"] == built.height > 0
    assert facts["gpus"] == built["gpu_uuid"].n_unique()
    assert len(facts["files_written"]) >= 1 and all(Path(f).exists() for f in facts["files_written"])
    assert facts["start"] < facts["end"]  # ISO times


def test_features_dictionary_json_names_the_file(tmp_path):
    out = tmp_path / "dict.md"
    facts = one_object(gpufail("features", "--dictionary", str(out), "--json"))
    assert facts == {"command": "features --dictionary", "path": str(out)}
    assert out.read_text().startswith("# Feature dictionary")


def test_ingest_dcgm_exporter_json_counts_the_samples(tmp_path):
    scrape = FIXTURES / "dcgm_exporter" / "kops_aws_L4_580.105.08.prom"
    data = tmp_path / "d"
    facts = one_object(gpufail("ingest", "dcgm-exporter", "--data", str(data), str(scrape), "--json"))
    assert facts["command"] == "ingest dcgm-exporter"
    assert facts["samples"] == Store.open(str(data)).read("telemetry").num_rows > 0
    assert facts["scrapes"] == 1 and facts["dataset"].endswith("telemetry")


def test_ingest_nvidia_smi_json_counts_the_samples(tmp_path):
    capture = FIXTURES / "nvidia_smi" / "query_h100_590.48.01_load.csv"
    data = tmp_path / "d"
    facts = one_object(
        gpufail("ingest", "nvidia-smi", "--data", str(data), "--node", "n1", "--quiet", str(capture), "--json")
    )
    assert facts["command"] == "ingest nvidia-smi"
    assert facts["samples"] == Store.open(str(data)).read("telemetry").num_rows > 0
    assert facts["files"] == 1 and isinstance(facts["skipped"], dict)


def test_ingest_table_json_counts_telemetry_failures_and_repairs(tmp_path):
    from tests.ingest.test_table_import_pipeline import write_export

    export = tmp_path / "export"
    write_export(export)
    data = tmp_path / "d"
    facts = one_object(
        gpufail(
            "ingest",
            "table",
            str(export / "telemetry.csv"),
            "--map",
            str(export / "mapping.toml"),
            "--data",
            str(data),
            "--json",
        )
    )
    assert facts["command"] == "ingest table"
    assert facts["telemetry_rows"] == Store.open(str(data)).read("telemetry").num_rows > 0
    assert (facts["failures"], facts["repairs"]) == (1, 1)


def test_collect_once_json_is_the_only_thing_on_stdout(tmp_path):
    env = kernel_log_collector_env(tmp_path)
    data = tmp_path / "d"
    result = CliRunner().invoke(
        cli, ["collect", "--once", "--source", "kernel-log", "--out", str(data), "--json"], env=env
    )
    assert result.exit_code == 0, result.output
    facts = one_object(result.stdout)  # the per-flush lines went to stderr
    assert "flush" in result.stderr
    assert facts["command"] == "collect" and facts["node"] == "n7" and facts["stop_reason"]
    assert facts["rows_written"]["xid_events"] == Store.open(str(data)).read("xid_events").num_rows > 0
    assert facts["by_collector"]["kernel-log"]["ok"] == 1
    assert facts["failed_sources"] == []


# -- models ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A data root with features (200 GPUs on 25 nodes, 10 days) and a LightGBM model beside it."""
    from tests.models import data_root_with_model

    return data_root_with_model(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def scored(base, tmp_path_factory) -> Path:
    folder = Path(shutil.copytree(base, tmp_path_factory.mktemp("scored") / "f"))
    CliRunner().invoke(cli, ["score", "--data", str(folder / "data"), "--model", str(folder / "model")])
    return folder


def test_evaluate_json_gives_the_headline_figures_of_metrics_json(base, tmp_path):
    config = tmp_path / "quick.toml"
    config.write_text(QUICK_EVALUATE)
    report = tmp_path / "report"
    stdout = gpufail(
        "--config", str(config), "evaluate", "--data", str(base / "data"), "--report", str(report), "--quiet", "--json"
    )
    facts = one_object(stdout)
    metrics = json.loads((report / "metrics.json").read_text())
    assert facts["command"] == "evaluate"
    assert facts["metrics"] == str(report / "metrics.json") and Path(facts["report"]).exists()
    assert facts["top_k"] == metrics["top_k"]
    assert facts["best"] == metrics["claims"]["best"]
    assert facts["best_precision"] == metrics["claims"]["best_precision"]
    assert facts["oracle_precision"] == metrics["claims"]["oracle_precision"]
    k = str(metrics["top_k"])
    assert facts["random_precision"] == metrics["scores"]["random"]["by_k"][k]["precision_daily_mean"]
    budget = metrics["alarm_headline_budget"]
    quota = metrics["alarms"]["quota"][f"{budget:g}"]
    assert facts["alarms"]["budget_per_1000_gpus_per_day"] == budget
    assert facts["alarms"]["volume_ratio"] == quota["volume_ratio"]
    matched = metrics["alarms"]["matched"][f"{budget:g}"]["points"]
    assert {n: p["n_alarms"] for n, p in facts["alarms"]["at_matched_thresholds"].items()} == {
        n: p["n_alarms"] for n, p in matched.items()
    }
    for name, point in quota["points"].items():  # every scorer at the same volume
        mine = facts["alarms"]["at_equal_volume"][name]
        assert (mine["n_alarms"], mine["precision"], mine["recall_long"]) == (
            point["n_alarms"],
            point["precision"],
            point["recall_long"],
        )
    # The summary reads what evaluate wrote; its object holds the same figures.
    summary = one_object(gpufail("summary", "--data", str(simulated_xids(tmp_path)), "--report", str(report), "--json"))
    assert summary["command"] == "summary"
    assert summary["top_k"] == metrics["top_k"]
    assert summary["precision_at_k"] == {n: s["precision_at_k_pooled"] for n, s in metrics["scores"].items()}
    assert summary["episodes"] == metrics["scores"]["model"]["n_episodes"]
    assert summary["alarms"] == facts["alarms"]
    assert summary["xid_incidents"] == 2 and summary["xid_lines"] == 5
    assert summary["outputs"]["report"] == str(report / "report.md")
    assert summary["failures"] is None  # no ground truth in this store


def simulated_xids(tmp_path: Path) -> Path:
    """A store with two XID incidents (one of them repeated four times)."""
    from datetime import UTC, datetime

    from tests.conftest import make_rows

    data = tmp_path / "xids"
    store = Store.create(str(data))
    at = datetime(2026, 3, 1, tzinfo=UTC)
    store.write("xid_events", make_rows("xid_events", [at, at], repeat_count=[1, 4], xid=[79, 48]))
    return data


# -- serving --------------------------------------------------------------------------------------


def test_score_json_names_the_snapshot_and_the_riskiest(base, tmp_path):
    from serving.predictions import newest_snapshot

    folder = Path(shutil.copytree(base, tmp_path / "f"))
    data, model = str(folder / "data"), str(folder / "model")
    facts = one_object(gpufail("score", "--data", data, "--model", model, "--json"))
    snapshot = newest_snapshot(Store.open(data))
    assert snapshot is not None
    assert facts["command"] == "score" and facts["snapshot"] == snapshot.path and facts["replaced"] == 0
    assert facts["gpus"] == len(snapshot.frame)
    assert facts["model_version"] == snapshot.key.model_version
    top = snapshot.frame.sort_values("rank").head(3)
    assert [r["gpu_uuid"] for r in facts["riskiest"]] == top["gpu_uuid"].tolist()
    assert facts["riskiest"][0]["risk"] == pytest.approx(top["risk"].iloc[0])
    assert one_object(gpufail("score", "--data", data, "--model", model, "--json"))["replaced"] == 1


def test_publish_json_matches_the_audit(scored, tmp_path):
    from serving.publish import read_audit

    folder = Path(shutil.copytree(scored, tmp_path / "f"))
    facts = one_object(gpufail("publish", "--data", str(folder / "data"), "--dry-run", "--json"))
    audit = read_audit(str(folder / "data" / "actions"))
    assert facts["command"] == "publish" and facts["mode"] == "dry-run" and facts["target"] == "log"
    assert facts["nodes"] == len(audit)
    assert facts["actions"] == audit["action"].value_counts().to_dict()
    raised = audit[audit["action"] == "raise"]
    assert [d["node"] for d in facts["decisions"] if d["action"] == "raise"] == raised["node"].tolist()
    assert facts["breaker_open"] is False and facts["not_acted"] == []
    assert Path(facts["audit"]).exists()


def test_publish_says_why_it_left_each_node_alone_and_quiet_stays_short(scored, tmp_path):
    folder = Path(shutil.copytree(scored, tmp_path / "f"))
    data = str(folder / "data")
    # A breaker that allows no raise at all: every node the policy would raise is held.
    env = {"GPUFAIL_PUBLISH__BREAKER_MAX_NODES": "0", "GPUFAIL_PUBLISH__BREAKER_MAX_FRACTION": "0"}
    text = gpufail("publish", "--data", data, "--dry-run", env=env)
    held = [line for line in text.splitlines() if line.startswith("  ") and "breaker_held" in line]
    assert held, text
    assert all("but the circuit breaker tripped" in line for line in held), held
    assert "circuit breaker OPEN" in text.splitlines()[-1]

    facts = one_object(gpufail("publish", "--data", data, "--dry-run", "--json", env=env))
    assert facts["not_acted"] and facts["breaker_open"] is True
    for entry in facts["not_acted"]:
        assert entry["action"] == "breaker_held" and "circuit breaker" in entry["reason"]

    quiet = gpufail("publish", "--data", data, "--dry-run", "--quiet", env=env)
    assert len(quiet.splitlines()) == 1 and quiet.startswith("publish (dry run, log)")


def test_at_risk_from_the_data_root_lists_the_riskiest_with_their_feature_values(scored):
    from features.dataset import read_features
    from serving.predictions import newest_snapshot

    data = str(scored / "data")
    facts = one_object(gpufail("at-risk", "--data", data, "--limit", "4", "--json"))
    snapshot = newest_snapshot(Store.open(data))
    assert snapshot is not None
    top = snapshot.frame.sort_values("rank").head(4)
    assert facts["command"] == "at-risk" and facts["source"] == snapshot.path
    assert facts["n_gpus"] == len(snapshot.frame)
    assert [g["gpu_uuid"] for g in facts["gpus"]] == top["gpu_uuid"].tolist()
    assert [g["rank"] for g in facts["gpus"]] == [1, 2, 3, 4]
    first = facts["gpus"][0]
    # [publish] tiers by default: 0.5 enters drain_after_job (the riskiest GPU is above it).
    assert first["risk"] == pytest.approx(top["risk"].iloc[0]) and first["risk"] > 0.5
    assert first["tier"] == "drain_after_job"
    features = read_features(Store.open(data)).filter(
        (pl.col("gpu_uuid") == first["gpu_uuid"]) & (pl.col("ts") == snapshot.key.ts)
    )
    assert len(first["top_features"]) == 3
    for entry in first["top_features"]:
        stored = features[entry["feature"]][0]
        assert entry["value"] == (pytest.approx(stored) if isinstance(stored, float) else stored)

    table = gpufail("at-risk", "--data", data, "--limit", "4").splitlines()
    assert table[0].startswith("at-risk: the 4 riskiest of")
    assert table[1].split()[:6] == ["rank", "node", "gpu", "risk", "tier", "node"]
    assert len(table) == 6 and first["node"] in table[2] and first["top_features"][0]["feature"] in table[2]


def test_at_risk_shows_the_values_the_model_saw_where_the_store_has_no_features_table(scored, tmp_path):
    # A store whose features are computed on demand from aggregates has no features dataset:
    # the values come from the snapshot, as scored.
    from features.dataset import read_features
    from serving.predictions import newest_snapshot

    data = shutil.copytree(scored / "data", tmp_path / "data")
    features = read_features(Store.open(str(data)))
    shutil.rmtree(data / "features")
    facts = one_object(gpufail("at-risk", "--data", str(data), "--limit", "5", "--json"))
    snapshot = newest_snapshot(Store.open(str(data)))
    assert snapshot is not None
    for gpu in facts["gpus"]:
        row = features.filter((pl.col("gpu_uuid") == gpu["gpu_uuid"]) & (pl.col("ts") == snapshot.key.ts))
        assert len(gpu["top_features"]) == 3
        for entry in gpu["top_features"]:
            stored = row[entry["feature"]][0]
            assert entry["value"] == (pytest.approx(stored) if isinstance(stored, float) else stored)
    table = gpufail("at-risk", "--data", str(data), "--limit", "5")
    assert "—" not in table


def test_at_risk_from_the_data_root_loads_neither_pandas_nor_the_models_nor_the_web_app(scored):
    # What made it take seconds: it imported the web app (and with it scikit-learn, pandas) to
    # read one small file. Then, of a local root, what made it take most of a second: fsspec,
    # pyarrow's compute and dataset modules, and the modules of the commands it does not run.
    import subprocess
    import sys

    from tests.cli import gpufail_env

    code = (
        "import sys\nfrom gpufail.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "heavy = ('pandas', 'polars', 'sklearn', 'lightgbm', 'fastapi', 'models', 'serving.web', 'serving.score',\n"
        "         'fsspec', 'pyarrow.compute', 'pyarrow.dataset', 'gpufail.cli.data', 'gpufail.cli.models',\n"
        "         'gpufail.cli.features', 'gpufail.cli.storage', 'gpufail.cli.operations')\n"
        "print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "at-risk", "--data", str(scored / "data"), "--limit", "3"],
        env=gpufail_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "[]"
    assert done.stdout.startswith("at-risk: the 3 riskiest of")


def test_at_risk_without_predictions_says_what_to_run(base, tmp_path):
    result = CliRunner().invoke(cli, ["at-risk", "--data", str(base / "data")])
    assert result.exit_code != 0
    assert "no predictions; run `gpufail score` first" in str(result.exception)


def test_at_risk_from_a_server_uses_the_read_token(tmp_path):
    from tests.serving.api_server import READ_TOKEN, serve_test_fleet

    server = serve_test_fleet(
        tmp_path, serve={"read_requires_token": True}, env={"GPUFAIL_SERVE_READ_TOKEN": READ_TOKEN}
    )
    try:
        expected = server.client(READ_TOKEN).get("/v1/gpus/at-risk", params={"top": 3}).json()
        facts = one_object(
            gpufail(
                "at-risk", "--url", server.url, "--limit", "3", "--json", env={"GPUFAIL_SERVE_READ_TOKEN": READ_TOKEN}
            )
        )
        assert facts["source"] == server.url
        assert [g["gpu_uuid"] for g in facts["gpus"]] == [g["gpu_uuid"] for g in expected["gpus"]]
        assert facts["gpus"][0]["top_features"] == expected["gpus"][0]["top_features"]
        text = gpufail("at-risk", "--url", server.url, "--limit", "3", env={"GPUFAIL_SERVE_READ_TOKEN": READ_TOKEN})
        assert expected["gpus"][0]["node"] in text.splitlines()[2]

        refused = CliRunner().invoke(cli, ["at-risk", "--url", server.url])
        assert refused.exit_code != 0
        message = str(refused.exception)
        assert "answered HTTP 401" in message and "GPUFAIL_SERVE_READ_TOKEN" in message
    finally:
        server.stop()
    gone = CliRunner().invoke(cli, ["at-risk", "--url", server.url])
    assert "no answer from" in str(gone.exception)


def test_shell_completion_completes_the_new_commands():
    """docs/cli.md: `_GPUFAIL_COMPLETE=bash_source gpufail` gives the script; the script asks
    the same variable with `bash_complete` for the words."""
    import os
    import subprocess
    import sys

    gpufail_bin = Path(sys.executable).parent / "gpufail"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFAIL_")}
    script = subprocess.run(
        [gpufail_bin], env={**env, "_GPUFAIL_COMPLETE": "bash_source"}, capture_output=True, text=True, timeout=60
    )
    assert script.returncode == 0 and "_gpufail_completion()" in script.stdout
    words = subprocess.run(
        [gpufail_bin],
        env={**env, "_GPUFAIL_COMPLETE": "bash_complete", "COMP_WORDS": "gpufail config ", "COMP_CWORD": "2"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert words.stdout.split() == ["plain,show"]


def test_at_risk_refuses_a_url_with_a_data_root_and_a_server_that_is_not_gpufail(tmp_path):
    import http.server
    import threading

    both = CliRunner().invoke(cli, ["at-risk", "--url", "http://127.0.0.1:9", "--data", str(tmp_path)])
    assert both.exit_code == 2 and "--url and --data: give one" in both.output

    class NotGpufail(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotGpufail)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        result = CliRunner().invoke(cli, ["at-risk", "--url", url])
        assert "did not answer an at-risk object" in str(result.exception)
    finally:
        server.shutdown()
        server.server_close()


def test_snapshot_at_risk_wants_at_least_one_gpu(scored):
    from gpufail.config import PublishSettings
    from ingest.errors import InputError
    from serving.at_risk import snapshot_at_risk

    tiers = PublishSettings().policy_config()
    with pytest.raises(InputError, match="top: expected at least 1 GPU, got 0"):
        snapshot_at_risk(Store.open(str(scored / "data")), tiers, top=0)


def test_features_json_with_the_dictionary_on_stdout_is_refused():
    result = CliRunner().invoke(cli, ["features", "--dictionary", "-", "--json"])
    assert result.exit_code == 2 and "--json needs --dictionary FILE" in result.output
