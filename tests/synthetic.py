"""Synthetic telemetry and XID events at any size, for tests and benchmarks.

The frame has every catalogue metric at a fixed interval, 8 GPUs a node (by default), a little
jitter, a few nulls and a few XIDs: it exercises the code, it does not model failures (the
simulator, `ingest.simulator`, is the product's fleet with failures and precursors).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import polars as pl

from features.schema import TS_DTYPE
from ingest.schema import metric_catalogue

START = datetime(2026, 1, 1, tzinfo=UTC)
_POLARS_TYPES: dict[str, type[pl.DataType]] = {"float": pl.Float32, "double": pl.Float64, "int64": pl.Int64}


def synthetic_telemetry(
    n_gpus: int,
    hours: float,
    *,
    interval: timedelta = timedelta(minutes=1),
    gpus_per_node: int = 8,
    start: datetime = START,
    seed: int = 0,
) -> pl.DataFrame:
    """A telemetry frame with every catalogue metric: n_gpus x (hours / interval) rows, sorted
    by (gpu_uuid, ts), a little jitter and a few nulls."""
    rng = np.random.default_rng(seed)
    step_us = int(interval.total_seconds() * 1_000_000)
    n_steps = int(hours * 3600 * 1_000_000 // step_us)
    n = n_gpus * n_steps
    start_us = int(start.timestamp() * 1_000_000)
    gpu = np.repeat(np.arange(n_gpus), n_steps)
    step = np.tile(np.arange(n_steps), n_gpus)
    ts = start_us + step * step_us + rng.integers(0, step_us // 10, n)
    cols: dict[str, object] = {
        "ts": pl.Series(ts).cast(TS_DTYPE),
        "cluster": pl.Series(["c0"] * n),
        "node": pl.Series([f"node{i // gpus_per_node:05d}" for i in range(n_gpus)])[gpu],
        "gpu_index": pl.Series((gpu % gpus_per_node).astype(np.int16)),
        "gpu_uuid": pl.Series([f"GPU-{i:08d}" for i in range(n_gpus)])[gpu],
        "pci_bus_id": pl.Series([f"0000:{0x10 + i % gpus_per_node:02x}:00" for i in range(n_gpus)])[gpu],
        "gpu_model": pl.Series(["H100"] * n),
        "driver": pl.Series(["550.54"] * n),
    }
    for m in metric_catalogue():
        if m.kind == "gauge":
            base = rng.uniform(30, 300, n_gpus)[gpu]
            values = (base + rng.normal(0, 2, n)).astype(np.float32)
            s = pl.Series(values)
        elif m.kind == "counter":
            rate = rng.exponential(0.01, n_gpus)[gpu]
            inc = rng.poisson(rate)
            s = pl.Series(np.cumsum(inc))  # cumulative across GPUs; resets are exercised by tests
        elif m.kind == "flag":
            s = pl.Series((rng.random(n) < 0.001).astype(np.int64))
        else:
            s = pl.Series(rng.choice(np.array([0, 1, 4, 8], dtype=np.int64), n, p=[0.7, 0.2, 0.09, 0.01]))
        if rng.random() < 0.5:
            s = s.scatter(rng.integers(0, n, max(n // 1000, 1)), None)
        cols[m.column] = s.cast(_POLARS_TYPES[str(m.arrow_type)])
    return pl.DataFrame(cols)


def synthetic_xids(telemetry: pl.DataFrame, *, per_gpu_day: float = 0.5, seed: int = 0) -> pl.DataFrame:
    """XID incidents on random GPUs at random sample times of `telemetry`."""
    rng = np.random.default_rng(seed)
    n_gpus = telemetry["gpu_uuid"].n_unique()
    epoch = telemetry["ts"].dt.epoch("us")
    days = (int(epoch.max()) - int(epoch.min())) / 86_400e6  # type: ignore[arg-type]
    k = max(int(n_gpus * days * per_gpu_day), 1)
    rows = telemetry.select("ts", "cluster", "node", "pci_bus_id", "gpu_index", "gpu_uuid").sample(k, seed=seed)
    codes = rng.choice(np.array([13, 31, 43, 45, 48, 63, 74, 79, 92, 94, 95, 119], dtype=np.int32), k)
    repeats = rng.integers(1, 50, k).astype(np.int32)
    return rows.with_columns(
        last_ts=pl.col("ts") + pl.duration(seconds=pl.lit(pl.Series(rng.integers(0, 600, k)))),
        xid=pl.Series(codes),
        pid=pl.lit(None, dtype=pl.Int64),
        process=pl.lit(None, dtype=pl.String),
        message=pl.lit("synthetic"),
        source=pl.lit("synthetic"),
        repeat_count=pl.Series(repeats),
    )
