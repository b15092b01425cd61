"""The CLI as a user meets it: a real subprocess, exit codes and one-line errors."""

import subprocess
import sys

import pytest

GPUFAIL = [sys.executable, "-c", "from gpufail.cli import main; main()"]


def run(*args, env=None):
    return subprocess.run([*GPUFAIL, *args], capture_output=True, text=True, env=env, timeout=120)


def test_help_lists_the_commands():
    result = run("--help")
    assert result.returncode == 0
    for command in ("simulate", "ingest"):
        assert command in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["simulate", "--out", "{tmp}/x", "--preset", "huge"],
            "simulator preset 'huge' does not exist; expected one of ['demo', 'paper']",
        ),
        (["--config", "{tmp}/missing.toml", "simulate", "--out", "{tmp}/x"], "missing.toml: not found"),
        (["ingest", "kernel-log", "--data", "{tmp}"], "is not a gpufail dataset"),
        (["simulate", "--out", "{tmp}/x", "--days", "0"], "Invalid value for '--days'"),
        (["bench", "--out", "{tmp}/x", "--days", "30"], "--days and --work go with --paper"),
        (["bench", "--out", "{tmp}/x", "--paper", "--days", "3"], "Invalid value for '--days'"),
    ],
)
def test_user_errors_are_one_line_with_exit_status_2_and_write_nothing(tmp_path, args, message):
    result = run(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x").exists()


def test_a_cascade_model_gets_each_stage_its_own_parameters(tmp_path):
    from gpufail.config import load_settings
    from models.kinds import make_model

    path = tmp_path / "gpufail.toml"
    path.write_text(
        '[model]\nkind = "cascade"\ncascade_first = "lightgbm"\n'
        "cascade_first_params = { n_estimators = 20, num_leaves = 7 }\n"
        "cascade_second_params = { n_estimators = 50 }\n"
    )
    cascade = make_model("cascade", **load_settings(path, environ={}).model_params())
    first, second = cascade.first[-1], cascade.second[-1]
    assert (first.n_estimators, first.num_leaves) == (20, 7)
    assert second.n_estimators == 50 and second.num_leaves != 7


def test_simulate_days_shortens_the_preset_and_keeps_the_fleet(tmp_path):
    import json

    result = run("simulate", "--out", str(tmp_path / "x"), "--preset", "demo", "--days", "2", "--quiet")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "x" / "simulation.json").read_text())
    assert summary["days"] == summary["preset_parameters"]["days"] == 2
    assert summary["nodes"] >= 48  # the demo fleet, not shrunk
    assert sorted(p.name for p in (tmp_path / "x" / "telemetry").iterdir()) == ["date=2026-01-05", "date=2026-01-06"]
