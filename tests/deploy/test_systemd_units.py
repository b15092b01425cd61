"""deploy/systemd: every unit passes `systemd-analyze verify` without a warning (it runs without
systemd as PID 1), runs a gpufail command that exists, and the timer starts the nightly service."""

from __future__ import annotations

import configparser
import shlex
import subprocess
import sys
from pathlib import Path

from gpufail.cli import cli
from tests.deploy.tools import require

SYSTEMD = Path(__file__).parents[2] / "deploy" / "systemd"
INSTALLED = "/opt/gpufail/.venv/bin/gpufail"
UNITS = sorted(p.name for p in SYSTEMD.iterdir() if p.suffix in (".service", ".timer"))


def verify(folder: Path, names: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require("systemd-analyze", "systemd"), "verify", *names],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=folder,
    )


def installed_here(tmp_path: Path, text_of=lambda name: (SYSTEMD / name).read_text()) -> Path:
    """The units with their ExecStart pointing at this venv's gpufail (verify checks that the
    program exists)."""
    here = str(Path(sys.executable).parent / "gpufail")
    for name in UNITS:
        (tmp_path / name).write_text(text_of(name).replace(INSTALLED, here))
    return tmp_path


def test_the_units_verify_without_a_warning(tmp_path):
    assert {
        "gpufail-collect.service",
        "gpufail-serve.service",
        "gpufail-nightly.service",
        "gpufail-nightly.timer",
    } <= set(UNITS)
    checked = verify(installed_here(tmp_path), UNITS)
    assert checked.returncode == 0 and checked.stdout + checked.stderr == ""


def test_verify_reports_a_mistake(tmp_path):
    def broken(name):
        text = (SYSTEMD / name).read_text()
        return text.replace("Restart=on-failure", "Restart=on-failur") if name == "gpufail-serve.service" else text

    checked = verify(installed_here(tmp_path, broken), ["gpufail-serve.service"])
    assert "restart specifier" in checked.stdout + checked.stderr


def unit(name: str) -> configparser.ConfigParser:
    """The unit's sections (a key given twice keeps its last value)."""
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment, method-assign]
    parser.read_string((SYSTEMD / name).read_text())
    return parser


def test_every_service_runs_an_existing_gpufail_command_with_the_shared_config():
    for name in (n for n in UNITS if n.endswith(".service")):
        service = unit(name)["Service"]
        argv = shlex.split(service["ExecStart"])
        assert argv[0] == INSTALLED and argv[1] in cli.commands, name
        environment = [line for line in (SYSTEMD / name).read_text().splitlines() if line.startswith("Environment=")]
        assert "Environment=GPUFAIL_CONFIG=/etc/gpufail/gpufail.toml" in environment, name


def test_the_timer_starts_the_nightly_service_once_a_day():
    timer = unit("gpufail-nightly.timer")
    assert timer["Timer"]["OnCalendar"] == "*-*-* 02:30:00 UTC" and timer["Timer"]["Persistent"] == "true"
    assert "Unit" not in timer["Timer"], "the timer starts the service of its own name"
    assert unit("gpufail-nightly.service")["Service"]["Type"] == "oneshot"
