"""The REST endpoint against a real `gpufail serve` process on 127.0.0.1 with a real HTTP
client: every endpoint, the admin token, bad inputs (4xx naming the field, never 5xx), and a
bounded schemathesis fuzz of the OpenAPI document."""

from __future__ import annotations

import json
import math
import os
from datetime import timedelta

import httpx
import pandas as pd
import pytest

from features.payload import fleet_fact_feature
from tests.serving.api_server import (
    ADMIN_TOKEN,
    N_GPUS,
    SPEC,
    fleet,
    serve_test_fleet,
    trained_model,
)

MAX_GPUS = 50
MAX_BODY = 1_000_000
METRICS_TOP = 5
FUZZ_EXAMPLES = int(os.environ.get("API_FUZZ_EXAMPLES", "20"))
"""Per operation and generation mode; raise it for a deeper run (the suite keeps it under a minute)."""


TODAYS_FEATURE_SETTINGS = '[features]\nwindows = ["1h", "6h"]\n[labels]\nhorizon = "12h"\nlost_after = "3h"\n'
"""The server's configuration today: other feature settings than the model was trained with."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = serve_test_fleet(
        tmp_path_factory.mktemp("serve"),
        serve={"max_gpus_per_request": MAX_GPUS, "max_body_bytes": MAX_BODY, "metrics_top": METRICS_TOP},
        extra_config=TODAYS_FEATURE_SETTINGS,
        env={"GPUFAIL_SERVE_ADMIN_TOKEN": ADMIN_TOKEN},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def latest_features() -> pd.DataFrame:
    features = fleet()[2].to_pandas()
    return features[features["ts"] == features["ts"].max()].reset_index(drop=True)


def expected_risks() -> dict[str, float]:
    latest = latest_features()
    return dict(zip(latest["gpu_uuid"], trained_model().predict_risk(latest), strict=True))


# -- health, model ----------------------------------------------------------------------------


def test_health_and_readiness(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    body = ready.json()
    assert body["ready"] is True and body["reasons"] == []
    assert body["model_version"] == trained_model().version
    assert pd.Timestamp(body["features_ts"]) == latest_features()["ts"].max()


def test_model_describes_the_served_model(client):
    body = client.get("/v1/model").json()
    model = trained_model()
    assert body["version"] == model.version and body["kind"] == "lightgbm"
    assert body["source"] == "path" and body["alias"] is None and body["registry_version"] is None
    assert pd.Timestamp(body["train_start"]) == model.train_start
    assert pd.Timestamp(body["train_end"]) == model.train_end
    assert body["horizon_h"] == 1.0
    assert body["feature_columns"] == model.feature_columns and body["n_features"] == len(model.feature_columns)
    assert body["library_versions"]["lightgbm"] == model.versions["lightgbm"]
    assert body["installed_versions"]["lightgbm"] == model.versions["lightgbm"]
    assert body["metrics"] is None  # a model folder carries no evaluation; the registry's runs do
    assert body["calibrated"] is True and body["calibration"] == model.calibration_info()
    assert body["calibration"]["method"] == "platt" and body["calibration"]["n_positives"] > 0
    assert body["last_reload_error"] is None


# -- predict -----------------------------------------------------------------------------------


def test_predict_by_id_scores_the_latest_features_with_the_model(client):
    risks = expected_risks()
    uuids = sorted(risks)[:4]
    body = client.post("/v1/predict", json={"gpu_uuids": uuids}).json()
    assert body["source"] == "latest_features" and body["model_version"] == trained_model().version
    got = {g["gpu_uuid"]: g for g in body["gpus"]}
    assert set(got) == set(uuids)
    for u in uuids:
        assert got[u]["risk"] == pytest.approx(risks[u], rel=1e-9)
    # riskiest first, ranked within the response, fleet rank from the whole fleet
    assert [g["rank"] for g in body["gpus"]] == [1, 2, 3, 4]
    assert [g["risk"] for g in body["gpus"]] == sorted((g["risk"] for g in body["gpus"]), reverse=True)
    fleet_order = sorted(risks, key=lambda u: (-risks[u], u))
    assert all(g["fleet_rank"] == fleet_order.index(g["gpu_uuid"]) + 1 for g in body["gpus"])
    assert all(len(g["top_features"]) == 3 for g in body["gpus"])


def test_explanations_name_features_with_the_gpus_values(client):
    latest = latest_features().set_index("gpu_uuid")
    uuid = latest.index[0]
    body = client.post("/v1/predict", json={"gpu_uuids": [uuid], "top_features": 5}).json()
    top = body["gpus"][0]["top_features"]
    assert len(top) == 5
    magnitudes = [abs(t["contribution"]) for t in top]
    assert magnitudes == sorted(magnitudes, reverse=True)
    for t in top:
        assert t["feature"] in trained_model().feature_columns
        value = latest.loc[uuid, t["feature"]]
        if isinstance(value, str):
            assert t["value"] == value
        elif value is None or pd.isna(value):
            assert t["value"] is None
        else:
            assert t["value"] == pytest.approx(float(value), rel=1e-6)
    none = client.post("/v1/predict", json={"gpu_uuids": [uuid], "top_features": 0}).json()
    assert none["gpus"][0]["top_features"] == []


def test_predict_from_feature_values_equals_the_id_path(client):
    latest = latest_features()
    model = trained_model()
    rows = []
    for _, r in latest.head(3).iterrows():
        values = {
            c: float(r[c]) for c in model.feature_columns if c not in ("gpu_model", "driver") and not pd.isna(r[c])
        }
        rows.append(
            {
                "gpu_uuid": r["gpu_uuid"],
                "cluster": r["cluster"],
                "node": r["node"],
                "gpu_index": int(r["gpu_index"]),
                "ts": r["ts"].isoformat(),
                "gpu_model": r["gpu_model"],
                "driver": r["driver"],
                "values": values,
            }
        )
    body = client.post("/v1/predict", json={"features": rows}).json()
    assert body["source"] == "features"
    risks = expected_risks()
    for g in body["gpus"]:
        assert g["risk"] == pytest.approx(risks[g["gpu_uuid"]], rel=1e-6)
        assert g["fleet_rank"] is None and len(g["top_features"]) == 3
    assert [g["rank"] for g in body["gpus"]] == [1, 2, 3]


def test_predict_from_raw_telemetry_featurises_like_training(client):
    """With the model's feature spec, not with the server's configuration of today (which
    has other windows, horizon and loss delay: `TODAYS_FEATURE_SETTINGS`)."""
    from features.build import build_features
    from serving.score import latest_rows

    tel, events, _ = fleet()
    node = tel["node"][0]
    last = tel["ts"].max()
    part = tel.filter((tel["node"] == node) & (tel["ts"] > last - timedelta(hours=4)))
    part = part.filter(part["ts"].dt.minute() % 15 == 0)
    sent_events = events.filter((events["node"] == node) & (events["ts"] > last - timedelta(hours=4)))
    telemetry = [{k: _jsonable(v) for k, v in row.items()} for row in part.to_dicts()]
    xids = [
        {
            k: _jsonable(row[k])
            for k in ("ts", "last_ts", "cluster", "node", "pci_bus_id", "gpu_index", "gpu_uuid", "xid")
        }
        for row in sent_events.to_dicts()
    ]
    response = client.post("/v1/predict", json={"telemetry": telemetry, "xid_events": xids, "top_features": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["source"] == "telemetry" and body["not_scored"] == []
    assert {g["gpu_uuid"] for g in body["gpus"]} == set(part["gpu_uuid"].unique())
    # the same rows through the training feature code, in this process, with the model's spec
    model = trained_model()
    assert model.feature_spec == SPEC and model.feature_spec.windows != (timedelta(hours=1), timedelta(hours=6))
    built = build_features(part, sent_events, model.feature_spec)
    rows = latest_rows(built.to_pandas())
    expected = dict(zip(rows["gpu_uuid"], model.predict_risk(rows), strict=True))
    # The server's store has no aggregates to take fleet facts from: the answer names the
    # features that came from the payload alone.
    fleet_facts = [c for c in built.columns if fleet_fact_feature(c)]
    assert "gpu_age_h" in fleet_facts and any(c.startswith("xid_") for c in fleet_facts)
    for g in body["gpus"]:
        assert g["risk"] == pytest.approx(expected[g["gpu_uuid"]], rel=1e-6)
        assert pd.Timestamp(g["ts"]) == rows["ts"].max()
        assert len(g["top_features"]) == 2
        assert g["payload_only_features"] == fleet_facts


def _jsonable(value):
    return value.isoformat() if hasattr(value, "isoformat") else value


# -- fleet views -------------------------------------------------------------------------------


def test_at_risk_lists_the_riskiest_gpus_first(client):
    risks = expected_risks()
    body = client.get("/v1/gpus/at-risk", params={"top": 5}).json()
    assert body["n_gpus"] == N_GPUS and len(body["gpus"]) == 5
    order = sorted(risks, key=lambda u: (-risks[u], u))
    assert [g["gpu_uuid"] for g in body["gpus"]] == order[:5]
    assert [g["rank"] for g in body["gpus"]] == [1, 2, 3, 4, 5]
    assert all(g["tier"] in ("none", "watch", "avoid", "drain_after_job", "drain_now") for g in body["gpus"])
    assert client.get("/v1/gpus/at-risk", params={"top": 3, "top_features": 0}).json()["gpus"][0]["top_features"] == []


def test_node_risk_is_the_chance_any_of_its_gpus_fails(client):
    latest = latest_features()
    risks = expected_risks()
    node = latest["node"].iloc[0]
    body = client.get(f"/v1/nodes/{node}").json()
    mine = [u for u, n in zip(latest["gpu_uuid"], latest["node"], strict=True) if n == node]
    assert body["node"] == node and body["n_gpus"] == len(mine) == 8
    assert body["node_risk"] == pytest.approx(1 - math.prod(1 - risks[u] for u in mine), rel=1e-9)
    assert [g["risk"] for g in body["gpus"]] == sorted((risks[u] for u in mine), reverse=True)
    ranks = sorted(client.get(f"/v1/nodes/{n}").json()["node_rank"] for n in latest["node"].unique())
    assert ranks == list(range(1, latest["node"].nunique() + 1))
    missing = client.get("/v1/nodes/no-such-node")
    assert missing.status_code == 404 and "node: unknown node 'no-such-node'" in missing.json()["detail"]


def test_metrics_expose_requests_model_and_bounded_risk_gauges(client):
    client.post("/v1/predict", json={"gpu_uuids": [latest_features()["gpu_uuid"][0]]})
    text = client.get("/metrics").text
    assert 'gpufail_http_requests_total{method="POST",route="/v1/predict",status="200"}' in text
    assert 'gpufail_http_request_duration_seconds_bucket{le="0.005",method="POST",route="/v1/predict"}' in text
    assert f'gpufail_model_info{{kind="lightgbm",source="path",version="{trained_model().version}"}} 1.0' in text
    assert "gpufail_ready 1.0" in text
    gpu_lines = [line for line in text.splitlines() if line.startswith("gpufail_gpu_risk{")]
    node_lines = [line for line in text.splitlines() if line.startswith("gpufail_node_risk{")]
    assert len(gpu_lines) == METRICS_TOP and len(node_lines) == 3  # 24 GPUs on 3 nodes
    tiers = [line for line in text.splitlines() if line.startswith("gpufail_gpus_by_tier{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in tiers) == N_GPUS
    # a path's parameters never become labels: one series for every node
    client.get("/v1/nodes/whatever-1")
    client.get("/v1/nodes/whatever-2")
    text = client.get("/metrics").text
    assert text.count('route="/v1/nodes/{node}",status="404"}') == 1


def test_openapi_documents_every_endpoint(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/healthz", "/readyz", "/v1/model", "/v1/predict", "/v1/gpus/at-risk", "/v1/nodes/{node}", "/metrics"):
        assert path in paths
    assert "/v1/admin/reload" in paths and paths["/v1/admin/reload"]["post"]["security"]


# -- auth --------------------------------------------------------------------------------------


def test_admin_reload_needs_the_admin_token(server, client):
    missing = client.post("/v1/admin/reload")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    wrong = client.post("/v1/admin/reload", headers={"Authorization": "Bearer not-the-token-93c1"})
    assert wrong.status_code == 401 and "not the admin token" in wrong.json()["detail"]
    ok = client.post("/v1/admin/reload", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert ok.status_code == 200
    assert ok.json() | {"features_ts": None} == {
        "changed": False,
        "model_version": trained_model().version,
        "previous_version": trained_model().version,
        "features_ts": None,
        "error": None,
    }
    # reads are open on this server
    assert client.get("/v1/model").status_code == 200
    logs = server.logs()
    assert "/v1/admin/reload" in logs  # the access log is on...
    assert ADMIN_TOKEN not in logs and "not-the-token-93c1" not in logs  # ...and never shows a token


# -- bad input: 4xx naming the field, never 5xx -------------------------------------------------


def _ids(n: int) -> list[str]:
    return list(latest_features()["gpu_uuid"][:n])


BAD_BODIES = [
    (b'{"gpu_uuids": [', 400, "body: malformed JSON"),
    (b"[1, 2]", 422, "body: Input should be a valid dictionary"),
    (b'{"gpu_uuids": "GPU-1"}', 422, "gpu_uuids: Input should be a valid list"),
    (b'{"gpu_uuids": [1]}', 422, "gpu_uuids[0]: Input should be a valid string"),
    (b"{}", 422, "body: expected exactly one of gpu_uuids, features or telemetry, got none"),
    (b'{"gpu_uuids": ["a"], "features": []}', 422, "expected exactly one of"),
    (b'{"gpu_uuids": []}', 422, f"gpu_uuids: expected 1 to {MAX_GPUS} GPUs"),
    (b'{"gpu_uuids": ["GPU-nope"]}', 404, "gpu_uuids[0] 'GPU-nope': unknown GPU"),
    (b'{"gpu_uuids": ["x"], "extra": 1}', 422, "extra: Extra inputs are not permitted"),
    (b'{"gpu_uuids": ["x"], "top_features": -1}', 422, "top_features: Input should be greater than or equal to 0"),
    (b'{"gpu_uuids": ["x"], "top_features": "many"}', 422, "top_features: Input should be a valid integer"),
    (b'{"features": [{"values": {}}]}', 422, "features[0].gpu_uuid: Field required"),
    (b'{"features": [{"gpu_uuid": "a"}]}', 422, "features[0].values: Field required"),
    (
        b'{"features": [{"gpu_uuid": "a", "values": {"temp_gpu_c_mean_1h": NaN}}]}',
        422,
        "temp_gpu_c_mean_1h: Input should be a finite number",
    ),
    (b'{"features": [{"gpu_uuid": "a", "values": {"temp_gpu_c_mean_1h": Infinity}}]}', 422, "finite number"),
    (b'{"features": [{"gpu_uuid": "a", "values": {"temp_gpu_c_mean_1h": 1e999}}]}', 422, "finite number"),
    (
        b'{"features": [{"gpu_uuid": "a", "values": {"temp_gpu_c_mean_1h": "hot"}}]}',
        422,
        "temp_gpu_c_mean_1h: Input should be a valid number",
    ),
    (
        b'{"features": [{"gpu_uuid": "a", "values": {"no_such_feature": 1}}]}',
        422,
        "features[0].values.no_such_feature: not a feature of model",
    ),
    (b'{"features": [{"gpu_uuid": "a", "values": {"gpu_model": 1}}]}', 422, "features[0].values.gpu_model"),
    (
        b'{"telemetry": [{"ts": "2026-03-04T00:00:00", "node": "n", "gpu_index": 0, "gpu_uuid": "g"}]}',
        422,
        "telemetry[0].ts: Input should have timezone info",
    ),
    (
        b'{"telemetry": [{"ts": "2026-03-04T00:00:00Z", "node": "n", "gpu_index": 0, "gpu_uuid": "g", "temp_gpu_c": NaN}]}',
        422,
        "telemetry[0].temp_gpu_c: Input should be a finite number",
    ),
    (
        b'{"telemetry": [{"ts": "2026-03-04T00:00:00Z", "node": "n", "gpu_index": 0, "gpu_uuid": "g", "temp_gpu": 1}]}',
        422,
        "telemetry[0].temp_gpu: Extra inputs are not permitted",
    ),
    (b'{"gpu_uuids": ["x"], "xid_events": []}', 422, "xid_events: expected only together with telemetry"),
    (
        b'{"telemetry": [{"ts": "2026-03-04T00:00:00Z", "node": "n", "gpu_index": 0, "gpu_uuid": "g", '
        b'"pcie_replay_total": 99999999999999999999}]}',
        422,
        "telemetry[0].pcie_replay_total: Input should be less than or equal to 9223372036854775807",
    ),
    (
        b'{"features": [{"gpu_uuid": "a", "values": {"temp_gpu_c_mean_1h": 1e300}}]}',
        422,
        "temp_gpu_c_mean_1h: expected a number within float32 range (at most 3.4e38 in size), got 1e+300",
    ),
    (
        b'{"features": [{"gpu_uuid": "a", "ts": "2500-01-01T00:00:00Z", "values": {}}]}',
        422,
        "features[0].ts: expected a time between 1970 and 2200, got 2500-01-01T00:00:00+00:00",
    ),
]


@pytest.mark.parametrize(("body", "status", "detail"), BAD_BODIES, ids=[d for _, _, d in BAD_BODIES])
def test_bad_predict_bodies_are_refused_naming_the_field(client, body, status, detail):
    response = client.post("/v1/predict", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    assert detail in response.json()["detail"]


def test_too_many_duplicate_and_over_explained_gpus_are_refused(client):
    ids = _ids(N_GPUS)
    too_many = ids + [f"GPU-extra-{i}" for i in range(MAX_GPUS + 1 - len(ids))]
    r = client.post("/v1/predict", json={"gpu_uuids": too_many})
    assert r.status_code == 422 and f"gpu_uuids: expected 1 to {MAX_GPUS} GPUs" in r.json()["detail"]
    assert f"got {MAX_GPUS + 1}" in r.json()["detail"]
    r = client.post("/v1/predict", json={"gpu_uuids": [ids[0], ids[1], ids[0]]})
    assert r.status_code == 422 and "gpu_uuids[2]" in r.json()["detail"] and "listed twice" in r.json()["detail"]
    r = client.post("/v1/predict", json={"gpu_uuids": ids[:1], "top_features": 11})
    assert r.status_code == 422 and "top_features: expected at most 10" in r.json()["detail"]
    r = client.post("/v1/predict", json={"gpu_uuids": [ids[0], "GPU-x", "GPU-y"]})
    assert r.status_code == 404 and "gpu_uuids[1] 'GPU-x', gpu_uuids[2] 'GPU-y'" in r.json()["detail"]


def test_bodies_over_the_limit_are_refused_before_parsing(client):
    big = json.dumps({"gpu_uuids": ["G" * 100] * (MAX_BODY // 100)}).encode()
    assert len(big) > MAX_BODY
    r = client.post("/v1/predict", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and f"expected at most {MAX_BODY} bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: streamed (chunked transfer encoding)
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    with httpx.Client(base_url=str(client.base_url), timeout=60) as fresh:
        r = fresh.post("/v1/predict", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    ("params", "detail"),
    [
        ({"top": 0}, "query parameter top: Input should be greater than or equal to 1"),
        ({"top": MAX_GPUS + 1}, f"query parameter top: Input should be less than or equal to {MAX_GPUS}"),
        ({"top": "ten"}, "query parameter top: Input should be a valid integer"),
        ({"top_features": 99}, "top_features: expected at most 10"),
    ],
)
def test_bad_at_risk_queries_are_refused_naming_the_parameter(client, params, detail):
    r = client.get("/v1/gpus/at-risk", params=params)
    assert r.status_code == 422 and detail in r.json()["detail"]


# -- fuzzing -----------------------------------------------------------------------------------


def test_fuzzing_the_openapi_document_finds_no_server_error(server):
    """Every operation with schemathesis-generated requests (valid and invalid), a bounded
    number of examples each: no 5xx, ever."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures, calls = [], []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in schemathesis.GenerationMode:  # requests that fit the schema, and ones that do not

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def run(case):
                response = case.call(base_url=server.url, timeout=60)
                calls.append(response.status_code)
                if response.status_code >= 500:
                    failures.append(f"{case.method} {case.formatted_path} {case.body!r:.200} -> {response.status_code}")

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (an operation without parameters)
                assert mode is schemathesis.GenerationMode.NEGATIVE
    assert not failures, failures[:5]
    assert len(calls) >= 100 and any(400 <= c < 500 for c in calls) and 200 in calls
    assert client_alive(server)


def client_alive(server) -> bool:
    return httpx.get(server.url + "/healthz", timeout=10).status_code == 200


def test_no_request_made_the_server_fail(server):
    """Runs last: nothing above (bad inputs, fuzzing included) raised inside the server."""
    assert "Traceback" not in server.logs() and " 500 " not in server.logs()
