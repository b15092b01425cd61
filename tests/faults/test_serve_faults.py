"""`gpufail serve` at its edges, against a real server process on 127.0.0.1: a reload error
that must clear once the served model is back, control bytes of kernel-log messages on the
pages, the sign-in cookie, and request heads of any size."""

from __future__ import annotations

import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import polars as pl
import pytest

from ingest.store import Store
from models.train import save_model, write_file_atomic
from tests.serving.api_server import ADMIN_TOKEN, READ_TOKEN, Server, fleet, start_server, trained_model, wait_for
from tests.serving.api_server import write_store as write_features_store

pytestmark = pytest.mark.slow

MESSAGES = {
    "nul-run": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1\x00\x00\x00\x00 GPU has fallen off the bus",
    "terminal-escape": "NVRM: Xid 31 \x1b[31mred\x1b[0m \x1b]0;owned title\x07 fault",
    "other-controls": "NVRM: Xid 13 \x08\x08\x0c\x7f\x9b2J graphics exception",
}
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
KEY = "Xk29fLq8ZpR4wT7yUe3Nv1Ma"
LEGACY_RESULTS = {
    "slack-path": f"failed: webhook https://hooks.slack.com/services/T0A1B2C3D/B0A1B2C3D/{KEY}: refused with HTTP 403",
    "query": f"failed: webhook https://hooks.example.com/hook?token={KEY}: no answer after 3 tries (timed out)",
    "user-password": f"failed: webhook https://hooks:{KEY}@hooks.example.com/hook: refused with HTTP 401",
}
"""Audit results as gpufail wrote them before it masked URLs: the pages mask them."""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path, str]]:
    """A token-protected server over the test fleet, whose newest XID events of one node carry
    control bytes; (server, model folder, that node)."""
    tmp = tmp_path_factory.mktemp("serve-faults")
    data = write_features_store(tmp / "data")
    _, events, _ = fleet()
    newest = events.sort("ts").tail(len(MESSAGES))
    node = newest["node"][0]
    newest = newest.with_columns(node=pl.lit(node), message=pl.Series(list(MESSAGES.values())))
    store = Store.open(str(data))
    store.write("xid_events", newest.to_arrow())
    write_legacy_audit(store, newest["cluster"][0], node, newest["ts"].max())
    folder = save_model(trained_model(0), tmp / "model")
    srv = start_server(
        tmp,
        data,
        model=folder,
        serve={"read_requires_token": True},
        env={"GPUFAIL_SERVE_ADMIN_TOKEN": ADMIN_TOKEN, "GPUFAIL_SERVE_READ_TOKEN": READ_TOKEN},
    )
    yield srv, folder, node
    srv.stop()


def write_legacy_audit(store: Store, cluster: str, node: str, at: Any) -> None:
    from serving.publish import AuditRow, append_audit

    rows = [
        AuditRow(
            time=at,
            cluster=cluster,
            node=node,
            gpus=(),
            risk=0.9,
            previous_tier="none",
            tier="drain_now",
            action="raise",
            reason=f"node risk 0.900 ({kind})",
            top_features=(),
            model_version="old",
            target="webhook",
            mode="live",
            dry_run=False,
            result=result,
        )
        for kind, result in LEGACY_RESULTS.items()
    ]
    append_audit(rows, store.path("actions"), fs=store.fs)


def reload_error(client: httpx.Client) -> str | None:
    return client.get("/v1/model").json()["last_reload_error"]


@pytest.mark.parametrize("restore", ["copied-back", "renamed-back"])
def test_the_reload_error_clears_once_the_served_model_is_back(served, tmp_path, restore):
    srv, folder, _ = served
    kept = tmp_path / "kept"
    shutil.copytree(folder, kept)  # the served model's files, stamps and all
    version = trained_model(0).version
    with srv.client(READ_TOKEN) as client:
        write_file_atomic(folder / "model.joblib", b"not a pickle at all")
        wait_for(lambda: "cannot be read" in (reload_error(client) or ""), what="the refusal")
        if restore == "copied-back":  # a good copy of the same version, new file stamps
            save_model(trained_model(0), folder)
        else:  # the very files that were served (same stamps: the fingerprint served)
            for name in ("model.joblib", "metadata.json"):
                (kept / name).replace(folder / name)
        wait_for(lambda: reload_error(client) is None, timeout=20, what="the error to clear")
        assert client.get("/v1/model").json()["version"] == version
        assert client.get("/readyz").status_code == 200


@pytest.mark.parametrize("kind", list(MESSAGES))
def test_control_bytes_of_xid_messages_are_escaped_on_the_node_page(served, kind):
    srv, _, node = served
    with srv.client(READ_TOKEN) as client:
        page = client.get(f"/nodes/{node}")
    assert page.status_code == 200
    assert not CONTROL.search(page.text)  # no raw control byte reaches the browser
    assert CONTROL.sub(lambda m: f"\\x{ord(m.group(0)):02x}", MESSAGES[kind]) in page.text


@pytest.mark.parametrize("page", ["/actions?days=90&action=all", "/nodes/{node}"])
def test_webhook_keys_in_audit_rows_of_an_older_gpufail_are_masked_on_the_pages(served, page):
    srv, _, node = served
    with srv.client(READ_TOKEN) as client:
        shown = client.get(page.format(node=node))
    assert shown.status_code == 200 and "hooks.slack.com/services/****" in shown.text
    assert "hooks.example.com/hook?token=****" in shown.text and "hooks:****@hooks.example.com" in shown.text
    assert KEY not in shown.text


@pytest.mark.parametrize("token", [READ_TOKEN, ADMIN_TOKEN])
def test_the_sign_in_cookie_holds_a_session_value_not_the_token(served, token):
    srv, _, _ = served
    with httpx.Client(base_url=srv.url, timeout=60) as browser:
        signed = browser.post("/login", data={"token": token, "next": "/"})
        assert signed.status_code == 303
        cookies = {c.name: c.value for c in browser.cookies.jar}
        assert cookies and all(token not in v for v in cookies.values())
        assert token not in signed.headers["set-cookie"]
        assert browser.get("/actions").status_code == 200  # the session opens the pages
        session = next(iter(cookies.values()))
        # ... and nothing else: not the API, not the admin endpoints, and not once changed.
        bearer = {"Authorization": f"Bearer {session}"}
        assert browser.get("/v1/gpus/at-risk", headers=bearer).status_code == 401
        assert browser.post("/v1/admin/reload", headers=bearer).status_code == 401
        browser.cookies.clear()
        browser.cookies.set("gpufail_session", session[:-1] + ("0" if session[-1] != "0" else "1"))
        assert browser.get("/actions").status_code == 401
        # The old cookie's raw token is not read any more.
        browser.cookies.clear()
        browser.cookies.set("gpufail_token", token)
        assert browser.get("/actions").status_code == 401


def raw_request(srv: Server, head: bytes, body: bytes = b"") -> bytes:
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head + body)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def get_with(extra: bytes) -> bytes:
    auth = f"Authorization: Bearer {READ_TOKEN}\r\n".encode()
    return b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + auth + extra + b"Connection: close\r\n\r\n"


@pytest.mark.parametrize(
    "head",
    [
        get_with(b"X-Big: " + b"a" * 200_000 + b"\r\n"),  # one long header line
        get_with(b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 100) for i in range(1000))),  # many headers
        get_with(b"Cookie: " + b"c=" + b"d" * 100_000 + b"\r\n"),
        b"GET /healthz?" + b"q" * 100_000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",  # the line
    ],
    ids=["long-header", "many-headers", "big-cookie", "long-request-line"],
)
def test_a_request_head_over_the_cap_is_refused_with_431(served, head):
    srv, _, _ = served
    answer = raw_request(srv, head)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"request head" in answer
    with srv.client(READ_TOKEN) as client:  # the server goes on serving
        assert client.get("/healthz").status_code == 200


def test_a_request_head_over_the_cap_that_never_ends_is_cut_off(served):
    srv, _, _ = served
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        answer = b""
        try:
            for _ in range(64):
                s.sendall(b"e" * 16_384)
        except OSError:
            pass  # the server closed the connection
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 431 ")


def test_a_large_body_under_a_small_head_is_not_taken_for_a_large_head(served):
    srv, _, _ = served
    uuids = list(fleet()[2]["gpu_uuid"].unique()[:4])
    # Sent in one write with its head: the server's first read holds both.
    body = ('{"gpu_uuids": ' + str(uuids).replace("'", '"') + ', "pad": "' + "p" * 100_000 + '"}').encode()
    head = (
        f"POST /v1/predict HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {READ_TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    status_line = raw_request(srv, head, body).split(b"\r\n", 1)[0]
    assert status_line in (b"HTTP/1.1 200 OK", b"HTTP/1.1 422 Unprocessable Entity"), status_line
