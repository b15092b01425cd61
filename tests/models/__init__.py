"""Synthetic feature frames for the model and serving tests.

A frame follows the feature-frame contract (models/frame.py): one row per (gpu_uuid, ts) on an
hourly UTC grid, id columns, `label` (Int8-like, null = censored) and `time_to_failure_h`,
then numeric features. One feature, `pcie_replay_rate_6h`, rises during the day before a GPU
fails (the learnable precursor); `xid_count_24h` is only weakly elevated there (what the
heuristic baseline ranks by); the rest is noise with some missing values. A GPU stops reporting
when it fails.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pandas as pd

START = pd.Timestamp("2026-01-01", tz="UTC")
PRECURSOR = "pcie_replay_rate_6h"
ONE_THREAD = {"n_jobs": 1}
"""Training parameters for the tests. The test machines are shared 2-core boxes: there, with
the default two OpenMP threads, LightGBM trained ~10x slower (wall clock) than with one while
other processes kept the cores busy. Thread count does not change what is tested."""


def make_synthetic_frame(
    n_gpus: int = 200,
    n_hours: int = 240,
    horizon_h: int = 12,
    fail_fraction: float = 0.1,
    seed: int = 0,
    ramp_h: int = 24,
    signal: float = 3.0,
) -> pd.DataFrame:
    """`fail_fraction` of the GPUs fail once, at a uniform time after the first day; positives
    are about fail_fraction * horizon_h / n_hours of the rows."""
    rng = np.random.default_rng(seed)
    horizon = float(horizon_h)
    last = n_hours - 1
    fails = rng.random(n_gpus) < fail_fraction
    # Failures fall mid-hour, so time_to_failure_h is never a whole number of hours.
    fail_at = np.where(fails, rng.integers(24, n_hours, n_gpus) + 0.5, np.inf)
    parts = []
    hours = np.arange(n_hours, dtype=np.float64)
    for g in range(n_gpus):
        t = hours[hours < fail_at[g]]
        n = len(t)
        ttf = fail_at[g] - t
        ramp = np.clip(1.0 - ttf / ramp_h, 0.0, 1.0) if fails[g] else np.zeros(n)
        label = np.where(ttf <= horizon, 1.0, 0.0)
        censored = (t + horizon > last) & ~(fail_at[g] <= last)
        label[censored] = np.nan
        model = "H100" if g % 2 else "A100"
        power = rng.normal(400.0 if model == "H100" else 300.0, 30.0, n)
        power[rng.random(n) < 0.05] = np.nan
        parts.append(
            pd.DataFrame(
                {
                    "ts": START + pd.to_timedelta(t, unit="h"),
                    "cluster": "c1",
                    "node": f"node{g // 8:03d}",
                    "gpu_index": g % 8,
                    "gpu_uuid": f"GPU-{g:05d}",
                    "gpu_model": model,
                    "driver": "550.54" if g % 3 else "535.104",
                    "label": label,
                    "time_to_failure_h": ttf if fail_at[g] <= last else np.full(n, np.nan),
                    PRECURSOR: rng.normal(0.0, 1.0, n) + signal * ramp,
                    "xid_count_24h": rng.poisson(0.05 + 0.5 * ramp).astype(float),
                    "temp_gpu_c_mean_1h": rng.normal(65.0 if model == "H100" else 55.0, 5.0, n),
                    "power_w_mean_1h": power,
                    "util_gpu_pct_mean_1h": rng.uniform(0.0, 100.0, n),
                }
            )
        )
    frame = pd.concat(parts, ignore_index=True).sort_values(["ts", "gpu_uuid"], ignore_index=True)
    frame["gpu_index"] = frame["gpu_index"].astype("int32")
    frame["label"] = frame["label"].astype("Int8")
    for c in [
        "time_to_failure_h",
        PRECURSOR,
        "xid_count_24h",
        "temp_gpu_c_mean_1h",
        "power_w_mean_1h",
        "util_gpu_pct_mean_1h",
    ]:
        frame[c] = frame[c].astype("float32")
    return frame


@cache
def demo_frame() -> pd.DataFrame:
    """The shared default frame (build once per test session; treat as read-only)."""
    return make_synthetic_frame()


def demo_features_store(folder: str):
    """A store whose `features` dataset is `demo_frame()` in the stored types (10 dates)."""
    import polars as pl

    from features.dataset import write_features
    from features.schema import ID_COLUMNS, ID_DTYPES, LABEL_COLUMNS, LABEL_DTYPES
    from ingest.store import Store

    frame = pl.from_pandas(demo_frame())
    features = [c for c in frame.columns if c not in ID_COLUMNS + LABEL_COLUMNS]
    frame = frame.select(
        *[pl.col(c).cast(ID_DTYPES[c]) for c in ID_COLUMNS],
        *[pl.col(c).cast(pl.Float32) for c in features],
        *[pl.col(c).cast(LABEL_DTYPES[c]) for c in LABEL_COLUMNS],
    )
    store = Store.create(folder)
    write_features(store, frame.sort("gpu_uuid", "ts"))
    return store


def data_root_with_model(folder):  # type: ignore[no-untyped-def]
    """`folder` holding `data/` (the features of `demo_features_store`: 200 GPUs on 25 nodes,
    10 days) and `model/` (a one-thread LightGBM trained on them); returns `folder`."""
    from models.train import TrainOptions, save_model, train_model

    demo_features_store(str(folder / "data"))
    model = train_model(
        demo_frame(), TrainOptions(kind="lightgbm", train_window="3d", horizon="12h", params=ONE_THREAD)
    )
    save_model(model, folder / "model")
    return folder
