"""Token-protected reads, an API without an admin token, readiness with stale features, and the
configuration of `gpufail serve`."""

from __future__ import annotations

import pytest

from gpufail.config import Settings, load_settings
from ingest.errors import ConfigError
from tests.cli import gpufail
from tests.serving.api_server import READ_TOKEN, serve_test_fleet, trained_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The fleet's features are from March 2026: older than an hour.
    srv = serve_test_fleet(
        tmp_path_factory.mktemp("auth"),
        serve={"read_requires_token": True, "features_max_age": "1h", "read_token_env": "MY_READ_TOKEN"},
        env={"MY_READ_TOKEN": READ_TOKEN},
    )
    yield srv
    srv.stop()


READS = [
    ("GET", "/v1/model", None),
    ("GET", "/v1/gpus/at-risk", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/predict", {"gpu_uuids": ["GPU-00000"]}),
]


@pytest.mark.parametrize(("method", "path", "body"), READS, ids=[p for _, p, _ in READS])
def test_reads_need_the_read_token_when_configured(server, method, path, body):
    with server.client() as anonymous:
        r = anonymous.request(method, path, json=body)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert "expected 'Bearer <token>'" in r.json()["detail"]
    with server.client("wrong-token-5d1") as wrong:
        r = wrong.request(method, path, json=body)
        assert r.status_code == 401 and "not a read or admin token" in r.json()["detail"]
    with server.client(READ_TOKEN) as reader:
        assert reader.request(method, path, json=body).status_code in (200, 404)  # 404: that GPU is unknown


def test_probes_stay_open_and_readiness_says_why_it_is_not_ready(server):
    with server.client() as anonymous:
        assert anonymous.get("/healthz").status_code == 200
        r = anonymous.get("/readyz")
    assert r.status_code == 503
    body = r.json()
    assert body["ready"] is False and body["model_version"] == trained_model().version
    assert len(body["reasons"]) == 1
    assert "features are stale: newest grid time 2026-03-04T11:00:00+00:00" in body["reasons"][0]
    assert "expected at most 1.0 h ([serve] features_max_age)" in body["reasons"][0]
    with server.client(READ_TOKEN) as reader:
        assert "gpufail_ready 0.0" in reader.get("/metrics").text


def test_without_an_admin_token_admin_endpoints_refuse_everyone(server):
    with server.client(READ_TOKEN) as reader:
        r = reader.post("/v1/admin/reload")
    assert r.status_code == 403
    assert (
        "admin endpoints are disabled: no admin token in the environment variable GPUFAIL_SERVE_ADMIN_TOKEN"
        in (r.json()["detail"])
    )
    assert READ_TOKEN not in server.logs() and "wrong-token-5d1" not in server.logs()


def test_serve_refuses_to_start_with_protected_reads_and_no_token(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[serve]\nread_requires_token = true\n")
    result = gpufail("--config", str(config), "serve", "--data", str(tmp_path), "--model", str(tmp_path))
    assert result.returncode == 2
    assert "read_requires_token is true, but neither GPUFAIL_SERVE_READ_TOKEN nor GPUFAIL_SERVE_ADMIN_TOKEN" in (
        result.stderr
    )


def test_token_and_secret_variables_are_not_taken_for_setting_overrides():
    environ = {"GPUFAIL_SERVE_ADMIN_TOKEN": "a", "GPUFAIL_SERVE_READ_TOKEN": "r", "GPUFAIL_WEBHOOK_SECRET": "s"}
    assert load_settings(environ=environ) == Settings()
    with pytest.raises(ConfigError, match="GPUFAIL_SERVE_PORT: expected GPUFAIL_<TABLE>__<KEY>"):
        load_settings(environ={"GPUFAIL_SERVE_PORT": "1"})
    assert load_settings(environ={"GPUFAIL_SERVE__PORT": "9000"}).serve.port == 9000
