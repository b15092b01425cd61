"""deploy/systemd: every unit passes `systemd-analyze verify` without a warning (it runs without
systemd as PID 1), runs a gpufail command that exists, and the timer starts the nightly service."""

from __future__ import annotations

import configparser
import re
import shlex
import subprocess
import sys
from pathlib import Path

from gpufail.cli import COMMANDS
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
        assert argv[0] == INSTALLED and argv[1] in COMMANDS, name
        environment = [line for line in (SYSTEMD / name).read_text().splitlines() if line.startswith("Environment=")]
        assert "Environment=GPUFAIL_CONFIG=/etc/gpufail/gpufail.toml" in environment, name


def test_the_timer_starts_the_nightly_service_once_a_day():
    timer = unit("gpufail-nightly.timer")
    assert timer["Timer"]["OnCalendar"] == "*-*-* 02:30:00 UTC" and timer["Timer"]["Persistent"] == "true"
    assert "Unit" not in timer["Timer"], "the timer starts the service of its own name"
    assert unit("gpufail-nightly.service")["Service"]["Type"] == "oneshot"


SERVICES = [n for n in UNITS if n.endswith(".service")]
DATA_ROOT = "/var/lib/gpufail/data"
"""Where deploy/README.md's bare-metal install mounts the shared data root on every machine."""


def exposure(folder: Path, name: str) -> float:
    """`systemd-analyze security`'s overall exposure of a unit file (0 best, 10 worst), read
    from the file alone (--offline: no systemd needed)."""
    rated = subprocess.run(
        [require("systemd-analyze", "systemd"), "security", "--offline=yes", f"./{name}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=folder,
    )
    [level] = re.findall(r"Overall exposure level for \S+: (\d+\.\d+)", rated.stdout + rated.stderr)
    return float(level)


def test_every_service_is_confined_to_an_exposure_of_5_or_better(tmp_path):
    folder = installed_here(tmp_path)
    levels = {name: exposure(folder, name) for name in SERVICES}
    assert len(levels) >= 5 and all(level <= 5.0 for level in levels.values()), levels


def test_the_rating_tells_an_unconfined_service_apart(tmp_path):
    """The nightly unit as it was (root, no system call filter, devices, kernel logs): 8.9."""
    kept = ("[", "Description=", "ExecStart=", "Type=", "Environment=", "ProtectSystem=", "ProtectHome=", "PrivateTmp=")
    text = (SYSTEMD / "gpufail-nightly.service").read_text()
    bare = "\n".join(line for line in text.splitlines() if line.startswith(kept)) + "\nUser=root\n"
    (tmp_path / "bare.service").write_text(bare.replace(INSTALLED, str(Path(sys.executable).parent / "gpufail")))
    assert exposure(tmp_path, "bare.service") > 5.0


def test_no_service_runs_as_root_and_each_waits_for_its_data_root():
    for name in SERVICES:
        service, needs = unit(name)["Service"], unit(name)["Unit"]
        assert service["User"] == "gpufail" and service.get("Group") == "gpufail", name
        mounts = needs["RequiresMountsFor"].split()
        assert any(m == DATA_ROOT or DATA_ROOT.startswith(m.rstrip("/") + "/") for m in mounts), name


def test_the_collector_always_comes_back():
    assert unit("gpufail-collect.service")["Service"]["Restart"] == "always"


def environment(name: str) -> dict[str, str]:
    """The variables a unit's Environment= lines set."""
    found: dict[str, str] = {}
    for line in (SYSTEMD / name).read_text().splitlines():
        if line.startswith("Environment="):
            found.update(item.split("=", 1) for item in shlex.split(line.removeprefix("Environment=")))
    return found


def test_only_the_publish_unit_acts_and_a_timer_starts_it_every_hour():
    from gpufail.config import load_settings

    nightly = {k: v for k, v in environment("gpufail-nightly.service").items() if k.startswith("GPUFAIL_")}
    nightly.pop("GPUFAIL_CONFIG")
    settings = load_settings(environ=nightly, system=Path("/nonexistent"), cwd=Path("/nonexistent"))
    assert (settings.publish.target, settings.publish.dry_run) == ("log", True)
    assert not any(k.startswith("GPUFAIL_PUBLISH") for k in environment("gpufail-publish.service"))
    assert shlex.split(unit("gpufail-publish.service")["Service"]["ExecStart"])[1] == "publish"
    timer = unit("gpufail-publish.timer")["Timer"]
    assert timer["OnCalendar"] == "*-*-* *:45:00 UTC" and "Unit" not in timer
