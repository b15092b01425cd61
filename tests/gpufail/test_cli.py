"""The CLI as a user meets it: exit codes and one-line errors (`gpufail.cli.main` in this
process), and the command a shell runs (a child process)."""

import pytest

from tests.cli import gpufail, gpufail_process


def test_help_lists_the_commands():
    result = gpufail("--help")
    assert result.returncode == 0
    for command in ("simulate", "ingest"):
        assert command in result.stdout


def test_python_m_gpufail_cli_is_the_gpufail_command():
    result = gpufail_process("simulate", "--preset", "huge", "--out", "x")
    assert result.returncode == 2
    assert result.stderr.startswith("gpufail: error: simulator preset 'huge' does not exist")


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
    ],
)
def test_user_errors_are_one_line_with_exit_status_2_and_write_nothing(tmp_path, args, message):
    result = gpufail(*[a.replace("{tmp}", str(tmp_path)) for a in args])
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

    result = gpufail("simulate", "--out", str(tmp_path / "x"), "--preset", "demo", "--days", "2", "--quiet")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "x" / "simulation.json").read_text())
    assert summary["days"] == summary["preset_parameters"]["days"] == 2
    assert summary["nodes"] >= 48  # the demo fleet, not shrunk
    assert sorted(p.name for p in (tmp_path / "x" / "telemetry").iterdir()) == ["date=2026-01-05", "date=2026-01-06"]
