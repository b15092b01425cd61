"""`make test` on a machine without the real components some tests run: the tests are skipped,
and the output ends with one line counting them by component and naming the command that
installs them, the step of .ci/run that CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tests.real_components import INSTALL, summary_line

ROOT = Path(__file__).parents[1]
PROMTOOL_TEST = "tests/deploy/test_observability.py::test_promtool_accepts_the_rules"


def pytest_run(*args: str, path: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"PATH": path}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    return [line for line in done.stdout.splitlines() if line.strip()]


def test_the_run_ends_with_the_skipped_real_component_tests_and_their_install_command():
    # Only the venv on PATH: promtool is missing, as on a newcomer's machine.
    lines = pytest_run("-n", "0", PROMTOOL_TEST, path=str(Path(sys.executable).parent))
    assert lines[-1] == "1 real-component test skipped (promtool 1): `.ci/run --tools` installs what they need"
    assert re.fullmatch(r"1 skipped in [\d.]+s", lines[-2])


def test_a_run_that_skipped_none_says_nothing_of_them():
    lines = pytest_run(
        "-n", "0", "tests/test_real_components.py::test_the_line_counts_every_component", path=os.environ["PATH"]
    )
    assert re.fullmatch(r"1 passed in [\d.]+s", lines[-1])


def test_the_line_counts_every_component():
    line = summary_line(Counter({"Slurm": 5, "Chromium": 20, "promtool": 4, "systemd-analyze": 3}))
    assert line == (
        "32 real-component tests skipped (Chromium 20, Slurm 5, promtool 4, systemd-analyze 3): "
        "`.ci/run --tools` installs what they need"
    )
    assert summary_line(Counter()) is None


def test_the_install_command_is_the_ci_step_that_installs_them():
    """`.ci/run --tools` installs every component (apt, the venv, kubectl) and stops before the
    tests."""
    script = (ROOT / ".ci" / "run").read_text()
    program, option = INSTALL.split()
    assert (ROOT / program).exists() and os.access(ROOT / program, os.X_OK)
    stop = script.index(f'if [ "${{1:-}}" = "{option}" ]; then exit 0; fi')
    for step in ("slurm-wlm munge", "promtool", "systemd", "chromium chromium-driver", "make install", "kubectl"):
        assert script.rindex(step) < stop, step
    assert script.rindex("\nmake test\n") > stop
