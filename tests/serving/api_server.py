"""A small fleet, a model trained on its features, and a real `gpufail serve` process on
127.0.0.1 for the REST endpoint tests.

The features are built from synthetic telemetry by `features.build.build_features` (the code
that builds training features), so the model's columns are exactly what the telemetry path of
`POST /v1/predict` builds. Labels are a rule on two features (learnable, so explanations are
not noise); the model is a real LightGBM with TreeSHAP explanations.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import polars as pl

from features.spec import FeatureSpec
from tests.cli import gpufail_env

START = datetime(2026, 3, 2, tzinfo=UTC)
HOURS = 60
N_GPUS = 24
ADMIN_TOKEN = "admin-7f3b9c1e5d"
READ_TOKEN = "read-2a8e4c6b0f"
SPEC = FeatureSpec(lost_after=None)
"""The feature spec of the fleet's features, which the model carries."""


@cache
def fleet() -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(telemetry, xid_events, features) of a 24-GPU, 60-hour fleet (5-minute samples)."""
    from features.build import build_features
    from tests.synthetic import synthetic_telemetry, synthetic_xids

    tel = synthetic_telemetry(N_GPUS, HOURS, interval=timedelta(minutes=5), start=START, seed=11)
    # Only XIDs that are not failures, so every GPU stays in service to the last grid time.
    events = synthetic_xids(tel, per_gpu_day=1.0, seed=11).filter(pl.col("xid").is_in([13, 31, 43, 45, 63, 92]))
    features = build_features(tel, events, SPEC)
    rng = np.random.default_rng(0)
    temp = features["temp_gpu_c_mean_1h"].fill_null(0).to_numpy()
    label = (temp > np.nanquantile(temp, 0.8)) | (rng.random(features.height) < 0.02)
    features = features.with_columns(pl.Series("label", label.astype(np.int8)).cast(features.schema["label"]))
    return tel, events, features


def trained_model(seed: int = 0) -> Any:
    """A LightGBM on the fleet's features; the seed changes its version (its parameters)."""
    return _trained(seed)


@cache
def _trained(seed: int) -> Any:
    from models.train import TrainOptions, train_model

    features = fleet()[2]
    return train_model(
        features,
        TrainOptions(
            kind="lightgbm",
            train_window="2d",
            horizon="1h",
            params={"n_jobs": 1, "n_estimators": 20, "random_state": seed},
            negative_fraction=1.0,
            seed=seed,
            calibration="platt",
            calibration_window="6h",
            feature_spec=SPEC,
        ),
    )


def write_store(root: Path) -> Path:
    from features.dataset import write_features
    from ingest.store import Store

    store = Store.create(str(root))
    write_features(store, fleet()[2])
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_CHILD = "import sys\nfrom gpufail.cli import main\nsys.argv = ['gpufail', *sys.argv[1:]]\nmain()\n"


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(
    tmp: Path,
    data: Path,
    *,
    model: Path | None,
    serve: dict[str, Any] | None = None,
    extra_config: str = "",
    env: dict[str, str] | None = None,
    timeout: float = 240.0,
    serve_args: tuple[str, ...] = (),
) -> Server:
    """`gpufail serve` in its own process (with `serve_args` after its own); returns once
    /healthz answers."""
    port = free_port()
    settings = {"reload_poll": "0.2s", "features_max_age": "0s", **(serve or {})}
    lines = ["[serve]"] + [f"{k} = {_toml(v)}" for k, v in settings.items()]
    config = tmp / f"serve-{port}.toml"
    config.write_text("\n".join(lines) + "\n" + extra_config)
    log = tmp / f"serve-{port}.log"
    args = [sys.executable, "-c", _CHILD, "--config", str(config), "serve", "--data", str(data), "--port", str(port)]
    if model is not None:
        args += ["--model", str(model)]
    args += serve_args
    child_env = gpufail_env(
        {
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "DO_NOT_TRACK": "1",
            **(env or {}),
        }
    )
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=child_env)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gpufail serve exited with {process.returncode}:\n{server.logs()[-3000:]}")
        try:
            if httpx.get(server.url + "/healthz", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"gpufail serve did not answer within {timeout} s:\n{server.logs()[-3000:]}")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def wait_for(predicate: Any, timeout: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def serve_test_fleet(tmp: Path, **options: Any) -> Server:
    """`gpufail serve` over the test fleet's store and `trained_model()`, both written under
    `tmp`; `options` go to `start_server` (serve settings, env, ...)."""
    from models.train import save_model

    data = write_store(tmp / "data")
    model = save_model(trained_model(), tmp / "model")
    return start_server(tmp, data, model=model, **options)
