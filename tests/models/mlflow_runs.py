"""Runs logged to the session's MLflow server (`mlflow_server` in tests/conftest.py) for the
registry and gate tests: one model trained on the demo frame, and its held-out window."""

from __future__ import annotations

import itertools
from functools import cache
from pathlib import Path

import pandas as pd

from models.gate import holdout_metrics, write_holdout_report
from models.registry import Registry, log_training_run, register
from models.train import TrainedModel, TrainOptions, train_model
from tests.models import demo_frame

_names = itertools.count()


@cache
def model_and_holdout() -> tuple[TrainedModel, pd.DataFrame]:
    frame = demo_frame()
    holdout_start = frame["ts"].max() - pd.Timedelta(days=3)
    model = train_model(frame, TrainOptions(kind="logistic", train_window="5d", horizon="12h", as_of=holdout_start))
    return model, frame[frame["ts"] >= holdout_start]


def fresh_registry(url: str, **kwargs) -> Registry:
    # One registered name per test: tests share the session's server.
    return Registry(url, f"test-model-{next(_names)}", experiment="test-registry", **kwargs)


def logged_version(registry: Registry, tmp_path: Path, model: TrainedModel | None = None) -> tuple[str, str]:
    base, holdout = model_and_holdout()
    model = model or base
    metrics = holdout_metrics(model, holdout, top_k=5)
    report = tmp_path / "report"
    write_holdout_report(metrics, report, title="test")
    run = log_training_run(
        registry,
        model,
        example=holdout,
        metrics=metrics,
        report_dir=report,
        fingerprint={"features": "abc"},
        data_window=(model.train_start, holdout["ts"].max()),
    )
    return register(registry, run), run.run_id
