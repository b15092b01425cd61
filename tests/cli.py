"""The `gpufail` command line for tests, one way to run it.

`gpufail(*args)` runs it in this process, as a user's shell would see it: the exit status, and
stdout and stderr apart (`gpufail.cli.main`: its one-line errors, its exit statuses). It costs
no interpreter start, so an argument-error test takes milliseconds, not seconds.
`gpufail_process(*args)` runs it in a child interpreter, for the tests that need a real process:
signals, kills, locks held across processes, a server left running. `GPUFAIL` is that child's
command line, for tests that start it themselves (`subprocess.Popen`).

Both drop the GPUFAIL_* variables of the environment the tests run in, so that only `env`
configures the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

GPUFAIL = [sys.executable, "-m", "gpufail.cli"]


@dataclass(frozen=True)
class Result:
    """What a run of the command line left: as `subprocess.CompletedProcess` names it."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def gpufail(*args: str, env: Mapping[str, str] | None = None, input: str | None = None) -> Result:
    """`gpufail ARGS` in this process, with `env` on top of the environment (module notes)."""
    from gpufail.cli import main

    overrides: dict[str, str | None] = {name: None for name in os.environ if name.startswith("GPUFAIL_")}
    overrides |= dict(env or {})
    with CliRunner().isolation(input=input, env=overrides) as (stdout, stderr, _):
        try:
            main(list(args))
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        return Result(args, status, stdout.getvalue().decode(), stderr.getvalue().decode())


def gpufail_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child `gpufail`: this one without GPUFAIL_* variables, `env` on top."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUFAIL_")} | dict(env or {})


def gpufail_process(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 300, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    """`gpufail ARGS` in a child interpreter (module notes); `kwargs` go to `subprocess.run`."""
    return subprocess.run(
        [*GPUFAIL, *args], env=gpufail_env(env), capture_output=True, text=True, timeout=timeout, **kwargs
    )


def without_outside_config(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """For tests that run the CLI through click's own runner: no GPUFAIL_* variable and no
    ./gpufail.toml of the machine running the tests reach the command."""
    for name in [n for n in os.environ if n.startswith("GPUFAIL_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(folder)


def kernel_log_collector_env(folder: Path) -> dict[str, str]:
    """The environment of a `gpufail collect --source kernel-log` on node n7 that reads one
    kernel log of five XID 79 lines (written in `folder`), with no metrics endpoint."""
    log = folder / "kern.log"
    log.write_text(
        "".join(
            f"2026-03-01T00:00:{s:02d}+00:00 n7 kernel: NVRM: Xid (PCI:0000:18:00): 79, pid={s}, name=train\n"
            for s in range(0, 50, 10)
        )
    )
    return {
        "GPUFAIL_COLLECT__KERNEL_LOG_SOURCE": "files",
        "GPUFAIL_COLLECT__KERNEL_LOG_PATHS": json.dumps([str(log)]),
        "GPUFAIL_COLLECT__NODE": "n7",
        "GPUFAIL_COLLECT__LISTEN": "",
    }
