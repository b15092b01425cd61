"""Keys in URLs never leave gpufail: a webhook URL with its key in the path (as chat services
issue them), the query or the user part, and an MLflow tracking URI with `?api_key=`, a
password or a key in its path, are masked in what `gpufail publish` prints, in the `actions/`
audit (which keeps a fingerprint of the URL instead), in `gpufail config show`, and in what
`gpufail serve` prints, logs and answers on /readyz and its pages."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from ingest.store import Store
from ingest.urls import url_fingerprint
from serving.predictions import write_snapshot
from serving.publish import read_audit
from tests.cli import gpufail
from tests.serving.api_server import start_server, wait_for, write_store
from tests.serving.test_predictions import scored

KEY = "Xk29fLq8ZpR4wT7yUe3Nv1Ma"
"""The secret in every URL below; it must appear nowhere."""
SECRET_POSITIONS = {
    "slack-path": "/services/T0A1B2C3D/B0A1B2C3D/" + KEY,
    "key-first-in-path": f"/{KEY}/notify",
    "query": f"/hook?channel=ops&token={KEY}",
    "user-password": "",  # in the user part, see `url`
    "user-token": "",
}


def url(origin: str, position: str) -> str:
    scheme, host = origin.split("://", 1)
    if position == "user-password":
        return f"{scheme}://hooks:{KEY}@{host}/hook"
    if position == "user-token":
        return f"{scheme}://{KEY}@{host}/hook"
    return origin + SECRET_POSITIONS[position]


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def refusing_receiver() -> Iterator[str]:
    """A webhook receiver that refuses every delivery (403), so the result names the URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def data_root(tmp_path: Path) -> Path:
    store = Store.create(str(tmp_path / "data"))
    frame = scored(risk=0.1)
    frame.loc[0, "risk"] = 0.9  # n0 is raised to drain_now
    write_snapshot(store, frame, now=datetime(2026, 1, 6, tzinfo=UTC))
    return tmp_path / "data"


def assert_no_key(*texts: str) -> None:
    for text in texts:
        assert KEY not in text, text


@pytest.mark.parametrize("receiver", ["refusing", "unreachable"])
@pytest.mark.parametrize("position", list(SECRET_POSITIONS))
def test_a_webhook_key_is_masked_in_output_logs_audit_and_config_show(
    tmp_path, refusing_receiver, position, receiver, caplog
):
    origin = refusing_receiver if receiver == "refusing" else f"http://127.0.0.1:{dead_port()}"
    hook = url(origin, position)
    data = data_root(tmp_path)
    env = {
        "GPUFAIL_PUBLISH__WEBHOOK_URL": hook,
        "GPUFAIL_WEBHOOK_SECRET": "hmac-secret",
        "GPUFAIL_PUBLISH__ATTEMPTS": "1",
        "GPUFAIL_PUBLISH__TIMEOUT": "2s",
    }
    with caplog.at_level(logging.DEBUG):
        published = gpufail("publish", "--data", str(data), "--to", "webhook", "--no-dry-run", env=env)
        shown = gpufail("config", "show", env=env)
        json_shown = gpufail("config", "show", "--json", env=env)
    assert published.returncode in (0, 1), published.stderr  # the run itself is fine
    assert shown.returncode == 0 and "webhook_url" in shown.stdout
    assert_no_key(published.stdout, published.stderr, shown.stdout, json_shown.stdout, caplog.text)
    audit = read_audit(str(data / "actions"))
    n0 = audit[audit["node"] == "n0"].iloc[0]
    assert n0["result"].startswith("failed: webhook") and url_fingerprint(hook) in n0["result"]
    assert_no_key(*audit["result"], *audit["reason"])
    for state in (data / "_state").glob("*.json"):
        assert_no_key(state.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "tracking_uri",
    [
        "http://127.0.0.1:{port}/?api_key=" + KEY,
        "http://mlflow:" + KEY + "@127.0.0.1:{port}",
        "http://127.0.0.1:{port}/" + KEY + "/",
    ],
    ids=["query-api-key", "user-password", "key-in-path"],
)
def test_a_tracking_uri_key_is_masked_by_config_show_and_serve(tmp_path, tracking_uri):
    uri = tracking_uri.format(port=dead_port())
    env = {"GPUFAIL_MLFLOW__TRACKING_URI": uri}
    shown = gpufail("config", "show", env=env)
    assert shown.returncode == 0 and "tracking_uri" in shown.stdout
    assert_no_key(shown.stdout, gpufail("config", "show", "--json", env=env).stdout)
    # serve from the registry's champion: unreachable, so /readyz and the pages say why.
    data = write_store(tmp_path / "data")
    server = start_server(tmp_path, data, model=None, extra_config='[mlflow]\nretries = 0\nbackoff = "0s"\n', env=env)
    try:
        ready = wait_for(
            lambda: (
                (r := httpx.get(server.url + "/readyz", timeout=10)).status_code == 503
                and "unreachable" in r.text
                and r
            ),
            what="/readyz naming the unreachable tracking server",
        )
        page = httpx.get(server.url + "/", timeout=60)
    finally:
        server.stop()
    assert "MLflow tracking server http://" in ready.text
    assert_no_key(ready.text, page.text, server.logs())
