"""Speed of `models.explain.explain` (a measurement, not a test).

    .venv/bin/python -m benchmarks.explain --rows 1000 --features 411

trains a LightGBM model with the default parameters on a synthetic feature frame as wide as
the demo's (random features, one of them a planted precursor, about 1% positives) and prints
rows per second of `explain(model, rows, top=5)`: the library-free TreeSHAP of
`models.treeshap` plus building the answer frame, best of `repeat` runs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

START = pd.Timestamp("2026-01-01", tz="UTC")


def synthetic_feature_frame(n_gpus: int, hours: int, n_features: int, seed: int = 0) -> pd.DataFrame:
    """n_gpus x hours rows of the feature-frame contract: ids, label, `n_features` float32
    features (5% missing); `f0` rises before the ~1% positive rows."""
    rng = np.random.default_rng(seed)
    n = n_gpus * hours
    label = (rng.random(n) < 0.01).astype(np.float64)
    data = {f"f{i}": rng.normal(size=n).astype(np.float32) for i in range(n_features)}
    data["f0"] = data["f0"] + 2.5 * label.astype(np.float32)
    for i in range(1, n_features, 7):
        data[f"f{i}"][rng.random(n) < 0.05] = np.nan
    ids = {
        "ts": START + pd.to_timedelta(np.repeat(np.arange(hours), n_gpus), unit="h"),
        "cluster": "c1",
        "node": [f"n{g // 8}" for g in np.tile(np.arange(n_gpus), hours)],
        "gpu_index": np.tile(np.arange(n_gpus) % 8, hours),
        "gpu_uuid": [f"GPU-{g}" for g in np.tile(np.arange(n_gpus), hours)],
        "gpu_model": np.where(np.tile(np.arange(n_gpus), hours) % 2, "H100", "A100"),
        "driver": "550.54",
        "label": label,
        "time_to_failure_h": np.where(label > 0, 6.0, np.nan),
    }
    return pd.DataFrame({**ids, **data})


def bench_explain(rows: int = 1000, n_features: int = 411, repeat: int = 3) -> dict[str, float]:
    """Rows per second of `explain(..., top=5)` on `rows` rows of a LightGBM model."""
    from models.explain import explain
    from models.train import TrainOptions, train_model

    frame = synthetic_feature_frame(n_gpus=max(rows, 400), hours=20, n_features=n_features)
    model = train_model(frame, TrainOptions(kind="lightgbm", train_window="30d", horizon="1h", params={"n_jobs": 1}))
    sample = frame.sample(rows, random_state=0)
    explain(model, sample.head(10))  # reads the trees once (cached with the model)
    best = np.inf
    for _ in range(repeat):
        started = time.perf_counter()
        explain(model, sample, top=5)
        best = min(best, time.perf_counter() - started)
    return {"rows": rows, "seconds": best, "rows_per_s": rows / best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--features", type=int, default=411)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    r = bench_explain(args.rows, args.features, args.repeat)
    print(
        f"explain, lightgbm, {args.features} features, top 5: {r['rows']} rows in {r['seconds'] * 1e3:.0f} ms = {r['rows_per_s']:,.0f} rows/s"
    )


if __name__ == "__main__":
    main()
