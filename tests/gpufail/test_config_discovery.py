"""Config discovery (`--config`, then `$GPUFAIL_CONFIG`, then `./gpufail.toml`, then the system
file) and `gpufail config show`: where each setting came from, with secrets masked."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

import gpufail.config
from gpufail.cli import cli
from gpufail.config import find_config, load_settings, load_settings_and_origins
from gpufail.config_show import MASK, effective_settings


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A working directory and a system file of this test's own, each with a different cluster
    name, and no GPUFAIL_* variables from outside."""
    for name in [n for n in os.environ if n.startswith("GPUFAIL_")]:
        monkeypatch.delenv(name)
    work, etc = tmp_path / "work", tmp_path / "etc"
    work.mkdir()
    etc.mkdir()
    monkeypatch.chdir(work)
    system = etc / "gpufail.toml"
    monkeypatch.setattr(gpufail.config, "SYSTEM_CONFIG", system)
    files = {}
    for where, folder in (("given", tmp_path), ("env", tmp_path / "envdir"), ("local", work), ("system", etc)):
        folder.mkdir(exist_ok=True)
        path = folder / ("gpufail.toml" if where in ("local", "system") else f"{where}.toml")
        path.write_text(f'[ingest]\ncluster = "{where}"\n')
        files[where] = path
    return files


def cluster(**kwargs) -> str:
    return load_settings(system=gpufail.config.SYSTEM_CONFIG, **kwargs).ingest.cluster


def test_config_flag_comes_first(places):
    environ = {"GPUFAIL_CONFIG": str(places["env"])}
    assert cluster(path=places["given"], environ=environ) == "given"
    assert find_config(places["given"], environ, system=places["system"]) == (places["given"], "--config")


def test_then_the_environment_variable(places):
    environ = {"GPUFAIL_CONFIG": str(places["env"])}
    assert cluster(environ=environ) == "env"


def test_then_the_current_directory(places):
    assert cluster(environ={}) == "local"
    found, how = find_config(None, {}, system=places["system"])
    assert found is not None and found.resolve() == places["local"].resolve() and how == "current directory"


def test_then_the_system_file(places):
    places["local"].unlink()
    assert cluster(environ={}) == "system"
    assert find_config(None, {}, system=places["system"]) == (places["system"], "system")


def test_then_the_defaults(places):
    places["local"].unlink()
    places["system"].unlink()
    assert cluster(environ={}) == "default"
    assert find_config(None, {}, system=places["system"]) == (None, "defaults")


def test_a_named_file_that_is_missing_is_an_error_not_a_fall_through(places, tmp_path):
    with pytest.raises(gpufail.config.ConfigError, match="missing.toml .GPUFAIL_CONFIG.: not found"):
        load_settings(environ={"GPUFAIL_CONFIG": str(tmp_path / "missing.toml")})


def test_the_cli_finds_the_local_file(places):
    result = CliRunner().invoke(cli, ["config", "show", "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert facts["file"] == str(places["local"]) or os.path.samefile(facts["file"], places["local"])
    assert facts["found_by"] == "current directory"
    row = next(s for s in facts["settings"] if (s["table"], s["key"]) == ("ingest", "cluster"))
    assert row["value"] == "local" and row["source"].startswith("file ")


def test_config_show_names_each_source_and_masks_secrets(places, monkeypatch):
    monkeypatch.setenv("GPUFAIL_PUBLISH__WEBHOOK_URL", "https://hooks.example.com/services/T00/B00/s3cr3tkey")
    monkeypatch.setenv("GPUFAIL_MLFLOW__TRACKING_URI", "http://ml:hunter2@mlflow.internal:5000")
    monkeypatch.setenv("GPUFAIL_SERVE_READ_TOKEN", "read-token-value-123")
    result = CliRunner().invoke(cli, ["--config", str(places["given"]), "config", "show"])
    assert result.exit_code == 0, result.output
    text = result.stdout
    for secret in ("s3cr3tkey", "hunter2", "read-token-value-123"):
        assert secret not in text
    lines = text.splitlines()
    assert lines[0] == f"config file: {places['given']} (--config)"
    assert f'cluster = "given"  # file {places["given"]}' in lines
    assert (
        'webhook_url = "https://hooks.example.com/services/****"  # environment GPUFAIL_PUBLISH__WEBHOOK_URL' in lines
    )
    assert 'tracking_uri = "http://ml:****@mlflow.internal:5000"  # environment GPUFAIL_MLFLOW__TRACKING_URI' in lines
    assert any(
        line.startswith('read_token_env = "GPUFAIL_SERVE_READ_TOKEN"  # default') and "is set (****)" in line
        for line in lines
    )
    assert any(
        line.startswith('admin_token_env = "GPUFAIL_SERVE_ADMIN_TOKEN"') and "is not set" in line for line in lines
    )
    assert 'horizon = "P1D"  # default' in lines


def test_masking_covers_keys_that_hold_a_secret_by_name(places):
    settings, origins = load_settings_and_origins(environ={}, system=gpufail.config.SYSTEM_CONFIG)
    rows = {(r.table, r.key): r for r in effective_settings(settings, origins, {})}
    assert rows[("publish", "webhook_secret_env")].note == "GPUFAIL_WEBHOOK_SECRET is not set"
    from gpufail.config_show import masked

    assert masked("x", "api_token", "abc") == MASK
    assert masked("x", "password", "abc") == MASK
    assert masked("x", "endpoints", ["https://u:p@h/a"]) == [f"https://u:{MASK}@h/a"]
    assert masked("x", "url", "https://h/path") == "https://h/path"  # nothing secret in it
    assert masked("x", "url", "https://h/path?q=1") == f"https://h/path?q={MASK}"  # a query may hold a key


def test_the_cli_falls_back_to_the_system_file(places):
    places["local"].unlink()
    result = CliRunner().invoke(cli, ["config", "show"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"config file: {places['system']} (system)"
    assert f'cluster = "system"  # file {places["system"]}' in result.stdout.splitlines()


def test_a_url_that_cannot_be_parsed_is_masked_whole():
    from gpufail.config_show import masked

    assert masked("mlflow", "tracking_uri", "http://user:pw@[::1") == MASK
