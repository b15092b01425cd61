"""What an operator meets first: `gpufail --version`, a command of an extra this install lacks
(one line naming the extra, not a traceback), and the daemons' JSON log lines
(`--log-format json`: every line of `collect`, `serve` and `nightly` is one JSON object)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from ingest.store import Store
from tests.cli import gpufail, gpufail_env, kernel_log_collector_env

_BLOCKED = """
import sys
from importlib.abc import MetaPathFinder

BLOCKED = set(sys.argv[1].split(","))


class NotInstalled(MetaPathFinder):
    # As in an install without the extra: importing the module fails as a missing one does.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
from gpufail.cli import main

sys.argv = ["gpufail", *sys.argv[2:]]
main()
"""


def without(modules: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`gpufail ARGS` in a child interpreter in which `modules` (comma-separated) are not installed."""
    return subprocess.run(
        [sys.executable, "-c", _BLOCKED, modules, *args], env=gpufail_env(), capture_output=True, text=True, timeout=120
    )


def json_lines(text: str) -> list[dict]:
    """Every line of `text` as a JSON object (an assertion error names the first that is not)."""
    out = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON log line: {line!r}") from None
        assert isinstance(value, dict) and {"time", "level", "logger", "message"} <= value.keys(), line
        out.append(value)
    return out


def test_version_is_the_installed_packages():
    result = gpufail("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"gpufail {metadata.version('gpufail')}"


def test_each_command_is_imported_by_its_name_in_the_table():
    import click

    from gpufail.cli import COMMANDS, cli

    ctx = click.Context(cli)
    assert cli.list_commands(ctx) == sorted(COMMANDS)
    for name in COMMANDS:
        command = cli.get_command(ctx, name)
        assert isinstance(command, click.Command) and command.name == name, name
    assert cli.get_command(ctx, "no-such-command") is None


def test_a_command_of_a_missing_extra_names_the_extra_in_one_line(tmp_path):
    data = tmp_path / "data"
    Store.create(str(data))
    result = without("polars,pandas,sklearn", "features", "--data", str(data), "--quiet")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [result.stderr.strip()], result.stderr  # one line, no traceback
    assert result.stderr.startswith("gpufail: error: gpufail features needs the Python module ")
    assert "pip install 'gpufail[train]'" in result.stderr

    served = without("fastapi", "serve", "--data", str(data), "--model", str(tmp_path / "model"), "--port", "9")
    assert served.returncode == 2, served.stderr
    assert "Traceback" not in served.stderr and len(served.stderr.splitlines()) == 1
    assert "needs the Python module 'fastapi'" in served.stderr and "pip install 'gpufail[serve]'" in served.stderr


def test_a_missing_module_of_gpufail_itself_keeps_its_traceback(tmp_path):
    # Not an extra to install: a broken install, which the traceback explains.
    result = without("serving", "score", "--data", str(tmp_path), "--model", str(tmp_path))
    assert result.returncode == 1 and "Traceback" in result.stderr and "pip install" not in result.stderr


def test_collect_in_json_writes_only_json_lines(tmp_path):
    env = kernel_log_collector_env(tmp_path)
    args = ["collect", "--once", "--source", "kernel-log", "--out", str(tmp_path / "d"), "--log-format", "json"]
    done = subprocess.run(
        [sys.executable, "-m", "gpufail.cli", *args], env=gpufail_env(env), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json_lines(done.stdout) == []  # everything is a log line, on stderr
    lines = json_lines(done.stderr)
    assert any("flush" in line["message"] for line in lines)
    (summary,) = [line for line in lines if "facts" in line]
    assert summary["facts"]["command"] == "collect" and summary["facts"]["node"] == "n7"
    assert summary["facts"]["rows_written"]["xid_events"] == Store.open(str(tmp_path / "d")).read("xid_events").num_rows
    assert summary["level"] == "info" and summary["message"].startswith("collect: stopped")


def test_a_failing_nightly_in_json_ends_with_its_error_as_a_json_line(tmp_path):
    data = tmp_path / "data"
    Store.create(str(data))
    env = {"GPUFAIL_MLFLOW__TRACKING_URI": "http://127.0.0.1:9", "GPUFAIL_NIGHTLY__WORK_DIR": str(tmp_path / "work")}
    done = subprocess.run(
        [sys.executable, "-m", "gpufail.cli", "nightly", "--data", str(data), "--log-format", "json"],
        env=gpufail_env(env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    lines = json_lines(done.stdout) + json_lines(done.stderr)
    assert lines and lines[-1]["level"] == "error" and "no telemetry" in lines[-1]["message"]


def test_serve_in_json_logs_each_request_as_a_json_line(tmp_path):
    from tests.serving.api_server import serve_test_fleet

    server = serve_test_fleet(tmp_path, serve_args=("--log-format", "json"))
    try:
        with server.client() as client:
            assert client.get("/healthz").status_code == 200
            assert client.get("/v1/gpus/at-risk", params={"top": 2}).status_code == 200
    finally:
        server.stop()
    lines = json_lines(server.logs())
    assert any(line["message"].startswith("serve: ") for line in lines)
    access = [line for line in lines if line["logger"] == "uvicorn.access"]
    assert any("/v1/gpus/at-risk" in line["message"] for line in access)
    assert any(line["logger"] == "uvicorn.error" for line in lines)
    assert not any("color_message" in line for line in lines)  # no terminal colours in the log


def test_json_log_lines_are_off_again_for_the_next_command_in_the_same_process(tmp_path):
    failed = gpufail("nightly", "--data", str(tmp_path / "absent"), "--log-format", "json")
    assert failed.returncode == 2 and json.loads(failed.stderr.splitlines()[-1])["level"] == "error"
    plain = gpufail("at-risk", "--data", str(tmp_path / "absent"))
    assert plain.returncode == 2 and plain.stderr.startswith("gpufail: error: ")


def test_the_log_format_is_checked(tmp_path):
    result = gpufail("collect", "--once", "--log-format", "xml", "--out", str(Path(tmp_path)))
    assert result.returncode == 2 and "--log-format" in result.stderr and "xml" in result.stderr


def test_at_risk_checks_only_the_settings_it_reads(tmp_path):
    # A quick look does not pay for checking the whole file (`gpufail.cli.QUICK_COMMANDS`): a
    # mistake in a table it does not read is left to the commands that read it.
    config = tmp_path / "gpufail.toml"
    config.write_text('[evaluate]\ntest_days = "two weeks"\n')
    absent = str(tmp_path / "absent")
    quick = gpufail("--config", str(config), "at-risk", "--data", absent)
    assert quick.returncode == 2 and "data root" in quick.stderr and "evaluate" not in quick.stderr
    other = gpufail("--config", str(config), "config", "show")
    assert other.returncode == 2 and "[evaluate] test_days" in other.stderr
    config.write_text('[publish]\ntarget = "fax"\n')
    refused = gpufail("--config", str(config), "at-risk", "--data", absent)
    assert refused.returncode == 2 and "[publish] target" in refused.stderr
