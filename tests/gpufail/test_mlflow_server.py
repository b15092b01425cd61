"""`gpufail mlflow` in the foreground: a service manager's stop (SIGTERM), a closed terminal
(SIGHUP) and Ctrl-C all stop the MLflow server it started, workers included."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gpufail.mlflow_server import free_port, is_healthy, tracking_url
from tests.cli import GPUFAIL, gpufail_env


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid`, with its start time (so a reused pid is not taken for it)."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            for child in children - found.keys():
                started = _stat(child)
                if started is not None:
                    found[child] = started[1]
                    todo.append(child)
    return found


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) from /proc/PID/stat, None when the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], fields[19]


def alive(pid: int, started: str) -> bool:
    """Still running, as opposed to gone, a zombie that nobody will reap, or a new process
    that got the pid."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and stat[1] == started


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from Linux's /proc")
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_ends_the_server_and_every_process_it_started(tmp_path, stop):
    port = free_port()
    env = gpufail_env()
    cmd = [*GPUFAIL, "mlflow", "--home", str(tmp_path / "mlflow"), "--port", str(port)]
    cli = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    started: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 120
        while not is_healthy(tracking_url("127.0.0.1", port)):
            assert cli.poll() is None, cli.stdout.read().decode() if cli.stdout else ""
            assert time.monotonic() < deadline, "the MLflow server did not become healthy"
            time.sleep(0.25)
        started = descendants(cli.pid)
        assert started, "the server runs as a child of `gpufail mlflow`"
        cli.send_signal(stop)
        status = cli.wait(timeout=60)
        deadline = time.monotonic() + 10  # workers may take a moment after their parent exits
        while [p for p, t in started.items() if alive(p, t)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p, t in started.items() if alive(p, t)] == []
        assert not is_healthy(tracking_url("127.0.0.1", port))
        assert status == 0, "a requested stop is a clean exit"
    finally:
        started |= descendants(cli.pid)
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        for pid, at in started.items():
            if alive(pid, at):
                os.kill(pid, signal.SIGKILL)
