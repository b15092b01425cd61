"""The embedded MLflow tracking server: SQLite backend store, local artifact folder, 127.0.0.1.

`gpufail mlflow` (and `make mlflow`) runs it in the foreground; the test suite starts one per
session with `start_server`. Any other tracking server is used by setting `[mlflow]
tracking_uri`; this module is then not involved.

MLflow's file store refuses to run unless explicitly allowed, so the embedded default is
SQLite. Usage telemetry is switched off in the server's environment: these machines
reach no network, and a user's machine should not report usage by surprise.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

from ingest.errors import ConfigError, GpufailError

LOOPBACK = "127.0.0.1"
DATABASE_FILE = "mlflow.db"
ARTIFACTS_FOLDER = "artifacts"
QUIET_ENVIRONMENT = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    # mlflow reads DO_NOT_TRACK as the string "true"; other tools accept it too.
    "DO_NOT_TRACK": "true",
    # The job runner (for GenAI jobs) costs memory and starts workers nobody uses here.
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}


class ServerError(GpufailError):
    """The MLflow server could not be started or did not become healthy."""


def quiet_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with MLflow's usage telemetry off."""
    env = dict(os.environ if base is None else base)
    env.update(QUIET_ENVIRONMENT)
    return env


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_command(home: Path, host: str, port: int, workers: int = 1) -> list[str]:
    """The `mlflow server` command line for a registry kept under `home`."""
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{(home / DATABASE_FILE).resolve()}",
        "--artifacts-destination",
        str((home / ARTIFACTS_FOLDER).resolve()),
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
    ]


def check_host(host: str) -> None:
    """The embedded server listens on loopback only: gpufail talks to nothing else by default."""
    if host not in (LOOPBACK, "localhost", "::1"):
        raise ConfigError(
            f"[mlflow] host: the embedded server binds to loopback (127.0.0.1, localhost or ::1), got {host!r}; "
            "run your own tracking server and set [mlflow] tracking_uri to use it from other machines"
        )


def tracking_url(host: str, port: int) -> str:
    return f"http://{host}:{port}"


def is_healthy(url: str, timeout: float = 2.0) -> bool:
    """True when `url`/health answers 200 OK."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(
    url: str,
    *,
    timeout: float,
    process: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Poll `url`/health until it answers, the server process exits, or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_healthy(url):
            return
        if process is not None and process.poll() is not None:
            raise ServerError(
                f"mlflow server for {url} exited with status {process.returncode} before it was healthy"
                + _log_tail(log)
            )
        sleep(0.25)
    raise ServerError(f"mlflow server at {url}: no answer on /health within {timeout:.0f}s" + _log_tail(log))


def _log_tail(log: Path | None, lines: int = 5) -> str:
    if log is None or not log.exists():
        return ""
    tail = log.read_text(errors="replace").strip().splitlines()[-lines:]
    return "; last lines of " + str(log) + ": " + " | ".join(tail)


def start_server(
    home: Path, *, host: str = LOOPBACK, port: int | None = None, timeout: float = 60.0
) -> tuple[subprocess.Popen[bytes], str]:
    """Start an MLflow server in the background for the registry under `home`, wait until it is
    healthy and return (process, tracking URL). Its output goes to `home/server.log`. The caller
    stops it (`stop_server`)."""
    check_host(host)
    home.mkdir(parents=True, exist_ok=True)
    port = free_port(host) if port is None else port
    url = tracking_url(host, port)
    log = home / "server.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            server_command(home, host, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=quiet_environment(),
            start_new_session=True,  # its workers are stopped with it, as one process group
        )
    try:
        wait_healthy(url, timeout=timeout, process=process, log=log)
    except BaseException:
        stop_server(process)
        raise
    return process, url


def stop_server(process: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Stop a server started by `start_server` and the workers it forked."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops `serve_forever`: Ctrl-C, a service manager's stop (systemd, a pod's termination)
and a closed terminal."""


class _Stopped(Exception):
    """One of STOP_SIGNALS arrived."""


def serve_forever(home: Path, *, host: str, port: int) -> int:
    """Run the server in the foreground until it exits or one of STOP_SIGNALS arrives; returns
    its exit status, or 0 after a requested stop.

    The server and the workers it forks run in a process group of their own, which a stop ends
    as a whole (`stop_server`); the signal's default action would end only this process and
    leave them running."""
    check_host(host)
    home.mkdir(parents=True, exist_ok=True)

    def stop(signum: int, frame: object) -> None:
        raise _Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    process: subprocess.Popen[bytes] | None = None
    try:
        process = subprocess.Popen(server_command(home, host, port), env=quiet_environment(), start_new_session=True)
        return process.wait()
    except _Stopped:
        for s in STOP_SIGNALS:  # a second signal must not cut the stop short
            signal.signal(s, signal.SIG_IGN)
        if process is not None:
            stop_server(process)
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
