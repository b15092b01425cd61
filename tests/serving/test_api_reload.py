"""Hot reload against a real `gpufail serve` process: a new model in the served folder (or a new
champion in the registry) is served without a failed request; a broken or incompatible new
model is refused and the old one keeps serving; new features are picked up."""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta

import polars as pl
import pytest

from models.train import save_model, write_file_atomic
from tests.serving.api_server import (
    ADMIN_TOKEN,
    READ_TOKEN,
    fleet,
    start_server,
    trained_model,
    wait_for,
    write_store,
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reload")
    data = write_store(tmp / "data")
    folder = save_model(trained_model(0), tmp / "model")
    srv = start_server(
        tmp,
        data,
        model=folder,
        serve={"read_requires_token": True},
        env={"GPUFAIL_SERVE_ADMIN_TOKEN": ADMIN_TOKEN, "GPUFAIL_SERVE_READ_TOKEN": READ_TOKEN},
    )
    yield srv, folder, data
    srv.stop()


def version(client) -> str:
    return client.get("/v1/model").json()["version"]


def test_a_new_model_is_served_without_a_failed_request(served):
    srv, folder, _ = served
    old, new = trained_model(0), trained_model(1)
    assert old.version != new.version
    uuids = list(fleet()[2]["gpu_uuid"].unique()[:8])
    seen: list[tuple[int, str]] = []
    stop = threading.Event()

    def hammer() -> None:
        with srv.client(READ_TOKEN) as c:
            while not stop.is_set():
                r = c.post("/v1/predict", json={"gpu_uuids": uuids})
                seen.append((r.status_code, r.json().get("model_version", r.text)))
                r = c.get("/v1/gpus/at-risk", params={"top": 3})
                seen.append((r.status_code, r.json().get("model_version", r.text)))

    with srv.client(READ_TOKEN) as client:
        assert version(client) == old.version
        worker = threading.Thread(target=hammer)
        worker.start()
        try:
            wait_for(lambda: len(seen) >= 10, what="requests before the swap")
            save_model(new, folder)
            wait_for(lambda: version(client) == new.version, what="the new model")
            n = len(seen)
            wait_for(lambda: len(seen) >= n + 10, what="requests after the swap")
        finally:
            stop.set()
            worker.join()
    assert {status for status, _ in seen} == {200}
    versions = [v for _, v in seen]
    assert versions[0] == old.version and versions[-1] == new.version
    first_new = versions.index(new.version)
    assert set(versions[first_new:]) == {new.version}  # never back to the old one
    metrics = srv.client(READ_TOKEN).get("/metrics").text
    assert 'gpufail_model_reloads_total{result="loaded"}' in metrics


def _refused(client, current: str, needle: str) -> None:
    def refusal() -> dict | None:
        body = client.get("/v1/model").json()
        return body if needle in (body["last_reload_error"] or "") else None

    body = wait_for(refusal, what=f"a refusal naming {needle!r}")
    assert body["version"] == current
    assert "the previous one keeps serving" in body["last_reload_error"] and needle in body["last_reload_error"]
    r = client.post("/v1/predict", json={"gpu_uuids": [fleet()[2]["gpu_uuid"][0]]})
    assert r.status_code == 200 and r.json()["model_version"] == current
    # an admin reload tries again, is refused again, and says so
    forced = client.post(
        "/v1/admin/reload", params={"force": "true"}, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    assert forced.status_code == 409
    assert forced.json()["model_version"] == current and needle in forced.json()["error"]


def test_a_broken_model_file_keeps_the_old_model_serving(served):
    srv, folder, _ = served
    current = trained_model(1).version
    with srv.client(READ_TOKEN) as client:
        assert version(client) == current
        write_file_atomic(folder / "model.joblib", b"not a pickle at all")
        _refused(client, current, "model.joblib: cannot be read")
        assert 'gpufail_model_reloads_total{result="failed"}' in client.get("/metrics").text


def test_a_model_that_does_not_accept_the_features_keeps_the_old_model_serving(served):
    srv, folder, _ = served
    current = trained_model(1).version
    incompatible = dataclasses.replace(
        trained_model(0), feature_columns=[*trained_model(0).feature_columns, "no_such_feature"]
    )
    with srv.client(READ_TOKEN) as client:
        save_model(incompatible, folder)
        _refused(client, current, "no_such_feature")


def test_a_good_model_after_a_bad_one_is_served_and_clears_the_error(served):
    srv, folder, _ = served
    with srv.client(READ_TOKEN) as client:
        save_model(trained_model(0), folder)
        wait_for(lambda: version(client) == trained_model(0).version, what="the good model")
        assert client.get("/v1/model").json()["last_reload_error"] is None
        # the admin token reads too
        assert srv.client(ADMIN_TOKEN).get("/v1/model").status_code == 200


def test_new_features_are_picked_up(served):
    from features.dataset import write_features
    from ingest.store import Store

    srv, _, data = served
    features = fleet()[2]
    later = features.filter(pl.col("ts") == pl.col("ts").max()).with_columns(pl.col("ts") + timedelta(days=1))
    write_features(Store.open(str(data)), later)
    with srv.client(READ_TOKEN) as client:
        expected = later["ts"][0].isoformat()
        wait_for(lambda: client.get("/readyz").json()["features_ts"] == expected, what="the new features")
        assert client.get("/v1/gpus/at-risk", params={"top": 1}).json()["ts"] == expected
    assert "Traceback" not in srv.logs()
    assert ADMIN_TOKEN not in srv.logs() and READ_TOKEN not in srv.logs()


def test_the_registry_champion_is_served_and_followed_when_the_alias_moves(mlflow_server, tmp_path):
    from models.registry import CHAMPION, Registry, log_training_run, register

    url, _ = mlflow_server
    registry = Registry(url, "serve-test-model", experiment="test-serve")
    example = fleet()[2].to_pandas().head(20)

    def registered(model, precision: float) -> str:
        run = log_training_run(
            registry,
            model,
            example=example,
            metrics={"precision_at_k_mean": precision},
            report_dir=None,
            fingerprint={"features": model.version},
            data_window=(model.train_start, model.train_end),
        )
        return register(registry, run)

    first = registered(trained_model(0), 0.5)
    registry.client.set_registered_model_alias(registry.name, CHAMPION, first)
    data = write_store(tmp_path / "data")
    srv = start_server(
        tmp_path,
        data,
        model=None,
        extra_config=f'[mlflow]\ntracking_uri = "{url}"\nmodel_name = "{registry.name}"\nretries = 0\n',
    )
    try:
        with srv.client() as client:
            body = client.get("/v1/model").json()
            assert body["version"] == trained_model(0).version
            assert body["registry_version"] == first and body["alias"] == CHAMPION
            assert body["source"] == "registry:registry" and body["metrics"]["precision_at_k_mean"] == 0.5
            second = registered(trained_model(1), 0.6)
            registry.client.set_registered_model_alias(registry.name, CHAMPION, second)
            wait_for(lambda: client.get("/v1/model").json()["registry_version"] == second, 120, "the new champion")
            body = client.get("/v1/model").json()
            assert body["version"] == trained_model(1).version and body["metrics"]["precision_at_k_mean"] == 0.6
            assert (tmp_path / "data" / "_serve" / registry.name / "champion.json").is_file()  # the local cache
    finally:
        srv.stop()
