"""A real Prometheus server for tests: history written as TSDB blocks by `promtool tsdb
create-blocks-from openmetrics`, the server (Debian's `prometheus`) on a free loopback port
with a long retention, stopped by the test; and a small HTTP proxy in front of it that can be
slow, answer 5xx, stop answering after some requests, or add warnings to its answers.

Where the binaries are missing the tests are skipped with the reason, except in CI (CI=true),
where .ci/run installs them and their absence is a failure (`tests.deploy.tools.require`).
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.deploy.tools import require


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Sample = tuple[str, dict[str, str], float, float]
"""metric name, labels, time (s), value."""


def openmetrics(samples: Iterable[Sample]) -> str:
    """OpenMetrics text of `samples`: families not interleaved, each series in time order."""
    families: dict[str, dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]] = {}
    for name, labels, ts, value in samples:
        families.setdefault(name, {}).setdefault(tuple(sorted(labels.items())), []).append((ts, value))
    lines = []
    for name, series in families.items():
        lines.append(f"# TYPE {name} gauge")
        for label_pairs, points in series.items():
            body = ",".join(f'{k}="{v}"' for k, v in label_pairs)
            for ts, value in sorted(points):
                lines.append(f"{name}{{{body}}} {_number(value)} {ts:.3f}")
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if value != value:
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def write_blocks(text: str, data_dir: Path) -> None:
    """TSDB blocks of the OpenMetrics `text` in `data_dir` (a server's storage path)."""
    source = data_dir.parent / f"{data_dir.name}.om"
    source.write_text(text)
    data_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [require("promtool", "prometheus"), "tsdb", "create-blocks-from", "openmetrics", str(source), str(data_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    source.unlink()


@dataclass
class PrometheusServer:
    """A running `prometheus`; `url` is its address."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextmanager
def prometheus(
    data_dir: Path, scrape_targets: Iterable[str] = (), scrape_interval: str = "1s"
) -> Iterator[PrometheusServer]:
    """`prometheus` on a free loopback port, serving `data_dir`, scraping `scrape_targets`
    (host:port of /metrics endpoints)."""
    binary = require("prometheus", "prometheus")
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir.parent / f"{data_dir.name}.yml"
    targets = list(scrape_targets)
    scrape = (
        f"scrape_configs:\n  - job_name: dcgm\n    scrape_interval: {scrape_interval}\n"
        f"    static_configs:\n      - targets: {json.dumps(targets)}\n"
        if targets
        else ""
    )
    config.write_text(f"global:\n  scrape_interval: {scrape_interval}\n{scrape}")
    port = free_port()
    log = data_dir.parent / f"{data_dir.name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={data_dir}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=20y",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = PrometheusServer(process, f"http://127.0.0.1:{port}", log)
    try:
        _wait_ready(server)
        yield server
    finally:
        server.stop()


def _wait_ready(server: PrometheusServer, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"prometheus exited: {server.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"prometheus not ready after {timeout_s}s: {server.log.read_text()[-2000:]}")


@dataclass
class Behaviour:
    """What the proxy does with the next requests."""

    fail_first: int = 0
    """Answer this many requests with 503 first."""
    fail_after: int | None = None
    """Answer 503 to every request after this many good ones."""
    delay_s: float = 0.0
    warning: str | None = None
    token: str | None = None
    """Answer 401 to a request without `Authorization: Bearer <token>`."""
    fail_if: Callable[[dict[str, str]], bool] | None = None
    """Answer 503 to a request whose parameters this says yes to."""
    requests: int = 0
    paths: list[str] = field(default_factory=list)


@contextmanager
def proxy(upstream: str, behaviour: Behaviour, tls: tuple[Path, Path] | None = None) -> Iterator[str]:
    """An HTTP server in front of `upstream` that behaves as `behaviour` says; yields its URL.
    With `tls` (certificate, key), it answers HTTPS."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with lock:
                behaviour.requests += 1
                n = behaviour.requests
                behaviour.paths.append(self.path)
            if behaviour.delay_s:
                time.sleep(behaviour.delay_s)
            if behaviour.token and self.headers.get("Authorization") != f"Bearer {behaviour.token}":
                self._send(401, b"Unauthorized\n")
                return
            params = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
            failing = (
                n <= behaviour.fail_first
                or (behaviour.fail_after is not None and n > behaviour.fail_first + behaviour.fail_after)
                or (behaviour.fail_if is not None and behaviour.fail_if(params))
            )
            if failing:
                self._send(503, b'{"status":"error","errorType":"unavailable","error":"overloaded"}')
                return
            try:
                with urllib.request.urlopen(upstream + self.path, timeout=60) as answer:
                    status, body = answer.status, answer.read()
            except urllib.error.HTTPError as exc:
                status, body = exc.code, exc.read()
            if behaviour.warning and status == 200:
                answer_json = json.loads(body)
                answer_json["warnings"] = [behaviour.warning]
                body = json.dumps(answer_json, separators=(",", ":")).encode()
            self._send(status, body)

        def _send(self, status: int, body: bytes) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (its timeout)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    server.daemon_threads = True
    scheme = "http"
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{scheme}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made by `openssl`."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [require("openssl", "openssl"), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key
